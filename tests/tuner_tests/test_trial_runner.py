"""One real trial process on the bundled model, per way of measuring (`budget.measure`).

served: the trial serves the engine as `tune serve` does and replays from a client process over
loopback HTTP; latency comes from the client, engine counters from the trial. in_process: the
engine driven directly. Workloads are tiny (3 requests of 4 tokens); no timing is asserted.
"""

from __future__ import annotations

from slotune.tuner.measure.trial_process import TrialFailure, TrialResult, measure, measure_seeds
from slotune.tuner.spec.tuning_spec import TuningSpec

from tests.tuner_tests.conftest import TINY_WORKLOAD
from tests.tuner_tests.fake_trial_runner import FAKE_RUNNER

ENGINE_KEYS = (
    "num_engine_steps",
    "peak_kv_blocks",
    "prefix_cache_hit_rate",
    "spec_acceptance_rate",
    "num_preemptions",
    "weight_bytes",
    "kv_bytes_per_token",
    "peak_memory_mb",
)


def _spec(tmp_path, measure_: str, *, workload: dict | None = None, objective: dict | None = None) -> TuningSpec:
    return TuningSpec.model_validate(
        {
            "name": "t",
            "output_dir": str(tmp_path / "out"),
            "budget": {"measure": measure_},
            "workload": {**TINY_WORKLOAD, **(workload or {})},
            "objective": {
                "kind": "latency",
                "metric": "tpot",
                "percentile": 95,
                "ttft_limit_s": 30.0,
                **(objective or {}),
            },
        }
    )


def test_served_trial_measures_over_http_and_keeps_engine_stats(tmp_path):
    spec = _spec(tmp_path, "served", workload={"warmup_requests": 1})
    phases = []
    r = measure(spec, spec.base_config().with_updates({"max_num_seqs": 2}), on_phase=phases.append)
    m = r.metrics
    assert r.measure == "served" and not r.early_stopped
    # Measured by the HTTP client: its own CPU cost, failure counts, exact token counts from usage.
    assert m["client_cpu_s"] > 0 and m["num_failed"] == 0 and m["num_short_outputs"] == 0
    assert m["num_completed"] == 3 and m["output_tokens"] == 12 and m["prompt_tokens"] == 36
    assert "queue_time_p50" not in m  # the server's queue is not visible over HTTP
    assert len(r.latencies["ttft"]) == 3 and len(r.latencies["tpot"]) == 3
    # Engine-side numbers HTTP cannot show, from the trial process.
    assert all(k in m for k in ENGINE_KEYS), sorted(set(ENGINE_KEYS) - set(m))
    assert m["num_engine_steps"] > 0 and m["peak_kv_blocks"] >= 1 and m["weight_bytes"] > 0 and m["load_time_s"] > 0
    assert "starting server" in phases and "replay 3/3" in phases


def test_served_watchdog_abort_ends_the_trial_early_stopped_not_failed(tmp_path):
    """One sequence at a time, four in flight, a 1 ms TTFT limit: the three queued requests are
    certain to miss it long before any finishes, so the server-side watchdog aborts everything in
    flight; the client sees aborted streams and the trial ends early-stopped."""
    spec = _spec(
        tmp_path,
        "served",
        workload={"num_requests": 12, "concurrency": 4, "output_len": {"kind": "fixed", "value": 8}},
        objective={"ttft_limit_s": 0.001},
    )
    r = measure(spec, spec.base_config().with_updates({"max_num_seqs": 1}))
    m = r.metrics
    assert r.measure == "served" and r.early_stopped is True and r.violations["early_stop"] == 1.0
    assert m["num_failed_abort"] >= 1 and m["num_completed"] < 12  # aborted by the server, seen over HTTP
    assert "num_engine_steps" in m and "client_cpu_s" in m


def test_in_process_trial_drives_the_engine_directly(tmp_path):
    spec = _spec(tmp_path, "in_process")
    r = measure(spec, spec.base_config().with_updates({"max_num_seqs": 2}))
    m = r.metrics
    assert r.measure == "in_process" and not r.early_stopped
    assert m["num_completed"] == 3 and m["output_tokens"] == 12
    assert "client_cpu_s" not in m and "queue_time_p50" in m  # no client; the engine's own queue clock
    assert all(k in m for k in ENGINE_KEYS)


def test_one_process_replays_several_seeds_each_in_its_own_window(tmp_path):
    """The confirmation's measurements: the config started once and replayed on each seed; each seed is
    measured as a trial of its own (its requests, its engine counters), not added to the one before."""
    spec = _spec(tmp_path, "served", workload={"warmup_requests": 1})
    cfg = spec.base_config().with_updates({"max_num_seqs": 2})
    rs = measure_seeds(spec, cfg, [1000, 1001, 1002])
    assert [type(r) for r in rs] == [TrialResult] * 3
    assert all(r.metrics["num_completed"] == 3 and r.metrics["output_tokens"] == 12 for r in rs)
    steps = [r.metrics["num_engine_steps"] for r in rs]
    assert all(0 < s < 2 * min(steps) for s in steps)  # a window per seed: the counts do not add up
    assert all(len(r.latencies["ttft"]) == 3 for r in rs)


def test_the_seeds_after_a_missed_slo_are_not_replayed(tmp_path):
    """With stop_after_miss (the confirmation's), a 0.1 ms TTFT limit that no replay can meet: the first
    seed is measured and misses, the next two are skipped (None) in the same process."""
    spec = _spec(tmp_path, "served", objective={"ttft_limit_s": 0.0001})
    rs = measure_seeds(spec, spec.base_config(), [1000, 1001, 1002], stop_after_miss=True)
    assert isinstance(rs[0], TrialResult) and rs[0].violations["ttft"] > 0 and rs[1:] == [None, None]
    assert rs[0].metrics["num_completed"] == 3


def test_a_failed_process_fails_every_seed_it_was_asked(tmp_path, monkeypatch):
    """A trial process that crashes (the stand-in runner, tests/tuner_tests/fake_trial_runner.py) fails
    each of its seeds with the same reason; one that raises on one seed fails that seed only."""
    spec = _spec(tmp_path, "served")
    monkeypatch.setenv("FAKE_TRIAL_FAULT", "crash")
    rs = measure_seeds(spec, spec.base_config(), [1000, 1001], runner=FAKE_RUNNER)
    assert all(isinstance(r, TrialFailure) for r in rs) and rs[0].reason == rs[1].reason
    monkeypatch.setenv("FAKE_TRIAL_FAULT", "raise")
    monkeypatch.setenv("FAKE_TRIAL_FAULT_SEEDS", "1001")
    ok, failed = measure_seeds(spec, spec.base_config(), [1000, 1001], runner=FAKE_RUNNER)
    assert isinstance(ok, TrialResult) and "NotImplementedError" in failed.reason
