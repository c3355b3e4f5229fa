"""One trial in its own process: build the engine, warm up, replay the workload, check the SLO,
run the quality gates.

Run as `python -m slotune.tuner.trial_runner IN.json OUT.json`. A crash, an OOM kill or a
hang takes down only this process; the parent (`tuner/objective.py`) records the trial as
failed with the reason and the study goes on. Progress is written to the request's
`phase_file` so the parent can show the current phase.

Test hooks (environment variables, read only here):
- SLOTUNE_TEST_TRIAL_FAULT=crash|hang|oom|raise: simulate a crashing, hanging, memory-hungry
  or unimplemented trial (fault-handling tests).
- SLOTUNE_FAKE_TRIAL=1: replace the engine measurement with a cheap deterministic function of
  the config. ONLY for tests of study mechanics (storage, resume, workers, samplers); every
  test that uses it says so in its docstring.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from slotune.tuner.slo import breaks_slo_early, certain_violations, is_feasible, slo_violations


def _fake_metrics(cfg) -> dict[str, float]:
    """Test-only stand-in for a measurement (see the module docstring)."""
    seqs = cfg.max_num_seqs
    q = {"none": 1.0, "int8": 0.7, "int4": 0.55}.get(cfg.quantization, 1.0)
    tpot = 0.02 * q * (1 + 0.05 * seqs)
    tput = seqs / tpot
    return {"ttft_p50": 0.05 * q, "ttft_p95": 0.08 * q * (1 + 0.02 * seqs), "tpot_p50": tpot, "tpot_p95": tpot * 1.1,
            "output_tokens_per_s": tput, "goodput_rps": tput / 32, "requests_per_s": tput / 32,
            "slo_attainment": 1.0, "num_completed": 8.0, "num_requests": 8.0}


def _fault_hook() -> None:
    hook = os.environ.get("SLOTUNE_TEST_TRIAL_FAULT", "")
    if hook == "crash":
        os._exit(3)
    if hook == "hang":
        time.sleep(3600)
    if hook == "oom":
        hog = [bytearray(256 * 2**20) for _ in range(64)]  # noqa: F841 - grow until killed
    if hook == "raise":
        raise NotImplementedError("lever not implemented in this engine build (test hook)")


class _InFlightWatchdog:
    """Early stop for requests that have not finished yet.

    `run_benchmark` asks `should_stop` only when a request finishes; a static batch or a long
    prefill can keep that from happening for minutes while the SLO is already lost. This wraps
    `engine.step`: once `min_requests` in-flight requests are certain to miss a limit by
    `factor` x, it aborts everything in flight; the aborted outputs reach `should_stop`, which
    then ends the replay as early-stopped.
    """

    def __init__(self, engine, objective: dict[str, Any], es: dict[str, Any]) -> None:
        self.engine, self.objective, self.es = engine, objective, es
        self.is_hopeless = False
        self._step = engine.step

    def install(self) -> None:
        self.engine.step = self._checked_step

    def uninstall(self) -> None:
        self.engine.step = self._step

    def _checked_step(self):
        outputs = self._step()
        if self.is_hopeless or not (self.objective.get("ttft_limit_s") or self.objective.get("tpot_limit_s")):
            return outputs
        seqs = [q for q in self.engine.seqs.values() if not q.request_id.startswith("warmup-")]
        if certain_violations(seqs, time.perf_counter(), self.objective, self.es["factor"]) >= self.es["min_requests"]:
            self.is_hopeless = True
            done = {o.request_id for o in outputs if o.finished}
            outputs = list(outputs) + [o for rid in list(self.engine.seqs) if rid not in done
                                       for o in [self.engine.abort_request(rid)] if o is not None]
        return outputs


def run_trial(req: dict[str, Any]) -> dict[str, Any]:
    """Measure one config. Returns metrics, SLO violations, early_stopped, gates, latencies."""
    from slotune.engine.config import EngineConfig
    from slotune.tuner.workload import WorkloadSpec

    phase_file = req.get("phase_file")

    def phase(text: str) -> None:
        if phase_file:
            tmp = f"{phase_file}.tmp"
            Path(tmp).write_text(text)
            os.replace(tmp, phase_file)

    cfg = EngineConfig.model_validate(req["config"])
    objective = req["objective"]
    _fault_hook()
    if os.environ.get("SLOTUNE_FAKE_TRIAL") == "1":
        phase("fake measurement")
        time.sleep(float(os.environ.get("SLOTUNE_FAKE_TRIAL_SLEEP", "0")))
        metrics = _fake_metrics(cfg)
        return {"metrics": metrics, "violations": slo_violations(metrics, objective), "early_stopped": False, "gates": None}

    from slotune.engine import LLM
    from slotune.tuner.bench import run_benchmark
    from slotune.tuner.metrics import summarize

    phase("loading model")
    t0 = time.perf_counter()
    llm = LLM(cfg)
    load_s = time.perf_counter() - t0
    wl = WorkloadSpec.model_validate(req["workload"])
    es = req.get("early_stop") or {}
    pct = (objective["percentile"],)
    watchdog = _InFlightWatchdog(llm.engine, objective, es) if es.get("enabled") else None

    def should_stop(records) -> bool:
        if not es.get("enabled"):
            return False
        if watchdog is not None and watchdog.is_hopeless:
            return True
        done = [r for r in records if r.finish_reason != "abort"]
        return len(done) >= es["min_requests"] and breaks_slo_early(summarize(done, 1.0, percentiles=pct),
                                                                    objective, es["factor"])

    phase("warm-up + replay")
    if watchdog is not None:
        watchdog.install()
    res = run_benchmark(cfg, wl, llm=llm, ttft_limit_s=objective.get("ttft_limit_s"),
                        tpot_limit_s=objective.get("tpot_limit_s"), seed=req.get("seed"), percentiles=pct,
                        should_stop=should_stop, on_progress=lambda done, total: phase(f"replay {done}/{total}"))
    if watchdog is not None:
        watchdog.uninstall()
    metrics = {**res.metrics, "load_time_s": load_s}
    violations = slo_violations(metrics, objective)
    violations["early_stop"] = 1.0 if res.early_stopped else 0.0
    gates = None
    if req.get("gates") and is_feasible(violations):  # cheap first: gates only for SLO-meeting trials
        from slotune.evals.gates import GateSpec, evaluate_gates

        phase("quality gates")
        report = evaluate_gates(cfg, [GateSpec.model_validate(g) for g in req["gates"]], llm=llm,
                                cache_dir=req.get("cache_dir"))
        gates = report.to_dict()
        violations["quality_gates"] = 0.0 if report.passed else 1.0
    return {"metrics": metrics, "violations": violations, "early_stopped": res.early_stopped, "gates": gates,
            "latencies": {"ttft": [r.ttft for r in res.records if r.ttft is not None],
                          "tpot": [r.tpot for r in res.records if r.tpot is not None]}}


def main(argv: list[str]) -> int:
    src, dst = Path(argv[0]), Path(argv[1])
    req = json.loads(src.read_text())
    try:
        result = run_trial(req)
        result["status"] = "ok"
    except Exception as exc:  # recorded by the parent as the trial's failure reason
        result = {"status": "error", "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(limit=8)}
    dst.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":  # pragma: no cover - exercised through subprocesses
    sys.exit(main(sys.argv[1:]))
