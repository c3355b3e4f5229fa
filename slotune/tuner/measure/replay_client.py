"""`python -m slotune.tuner.measure.replay_client IN.json OUT.json`: a served trial's HTTP client, in its
own process, as a real client runs."""

from __future__ import annotations

import json
import os
import pickle
import sys
import threading
import traceback
from pathlib import Path

from slotune.tuner.measure.http_replay import run_http_replay
from slotune.tuner.measure.metrics import RequestRecord, breaks_slo_so_far
from slotune.tuner.spec.workload_spec import WorkloadSpec


def main(argv: list[str]) -> int:
    """`python -m slotune.tuner.measure.replay_client IN.json OUT.json`: a trial's client, in its own process.

    A served trial (slotune/tuner/measure/trial_runner.py) serves the config under test as `tune serve` does
    and runs this as its client, as a real client runs: another process, loopback HTTP.

    IN.json: url; workload (a WorkloadSpec dict); tokenizer_file (the served engine's Tokenizer,
    pickled by the trial: prompts are tokenized exactly as the server does, and unpickling is much
    quicker than loading it from the GGUF, docs/design/tuner-measure.md); seed; objective
    (percentile and limits, as in a trial request); early_stop ({enabled, min_requests, factor});
    optional phase_file (progress, 'replay 5/48') and warm_file. With warm_file, the client creates
    that file once its warm-up has finished and waits for a line on stdin before it starts the
    clock, so the trial can snapshot the engine's counters in between; stdin closing (the trial
    died) ends this process.
    OUT.json: {"status": "ok", "result": ReplayResult dict} or {"status": "error", "error": ...}.

    Early stop: the trial's rule on the requests finished so far (`breaks_slo_so_far`), and at
    the first request that broke (finish_reason "error"): over loopback to our own server that
    is the trial's in-flight watchdog aborting hopeless requests, or the engine dying; the
    trial, which sees the engine, tells the two apart.
    """
    src, dst = Path(argv[0]), Path(argv[1])
    req = json.loads(src.read_text())
    phase_file, warm_file = req.get("phase_file"), req.get("warm_file")
    objective, es = req["objective"], req.get("early_stop") or {}

    def phase(text: str) -> None:
        if phase_file:
            tmp = f"{phase_file}.{os.getpid()}.tmp"  # the trial writes the same file with its own tmp
            Path(tmp).write_text(text)
            os.replace(tmp, phase_file)

    def exit_when_stdin_closes() -> None:
        sys.stdin.readline()  # the trial never writes again: this returns only at EOF
        os._exit(2)  # the trial is gone; nobody will read our result

    def wait_for_go() -> None:
        Path(warm_file).touch()
        if not sys.stdin.readline():
            os._exit(2)  # the trial died during our warm-up
        threading.Thread(target=exit_when_stdin_closes, daemon=True).start()

    def should_stop(records: list[RequestRecord]) -> bool:
        if records[-1].finish_reason == "error":
            return True
        return bool(es.get("enabled")) and breaks_slo_so_far(records, objective, es)

    try:
        tokenizer = pickle.loads(Path(req["tokenizer_file"]).read_bytes())
        phase("client: warm-up")
        res = run_http_replay(
            req["url"],
            WorkloadSpec.model_validate(req["workload"]),
            tokenizer=tokenizer,
            ttft_limit_s=objective.get("ttft_limit_s"),
            tpot_limit_s=objective.get("tpot_limit_s"),
            seed=req.get("seed"),
            percentiles=(objective["percentile"],),
            on_progress=lambda done, total: phase(f"replay {done}/{total}"),
            should_stop=should_stop,
            after_warm_up=wait_for_go if warm_file else None,
        )
        out = {"status": "ok", "result": res.to_dict()}
    except Exception as exc:  # reported by the trial as its failure reason
        out = {"status": "error", "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(limit=8)}
    dst.write_text(json.dumps(out))
    return 0


if __name__ == "__main__":  # pragma: no cover - exercised through subprocesses
    sys.exit(main(sys.argv[1:]))
