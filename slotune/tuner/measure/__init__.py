"""One config measured, as a client of `tune serve` would see it.

- `measurement.Measurement`: metric values with their intervals, typed; `trial_process.TrialResult`.
- `trial_process.measure`: a trial in its own process group, under a timeout and a memory cap;
  `trial_runner` is that process, `server.TrialServer` what it serves (`BundledServer`: our engine).
- Replays: `http_replay.run_http_replay` (any OpenAI-compatible server; `replay_client` is a
  served trial's client process) and `in_process_replay.run_in_process_replay` (the engine driven directly).
- `metrics`: per-request records -> percentiles, tokens/s, goodput; `intervals`: their bootstrap
  intervals; `units`: every number's unit and format; `reasons`: gate results in words.
- `load_sweep.run_sweep`: latency against offered load up to saturation.
"""
