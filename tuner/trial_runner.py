"""One trial in its own process: build the engine, replay the workload, check the SLO, run gates.

Run as `python -m slotune.tuner.trial_runner IN.json OUT.json`. A crash, an OOM kill or a
hang takes down only this process; the parent (`tuner/objective.py`) records the trial as
failed with the reason and the study goes on.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any


def slo_violations(metrics: dict[str, float], objective: dict[str, Any]) -> dict[str, float]:
    """Constraint values (> 0 = violated, Optuna's convention), relative to each limit."""
    p = objective["percentile"]
    out = {}
    if objective.get("ttft_limit_s"):
        out["ttft"] = metrics.get(f"ttft_p{p}", float("inf")) / objective["ttft_limit_s"] - 1
    if objective.get("tpot_limit_s"):
        out["tpot"] = metrics.get(f"tpot_p{p}", 0.0) / objective["tpot_limit_s"] - 1
    if objective.get("min_output_tokens_per_s"):
        out["throughput"] = 1 - metrics.get("output_tokens_per_s", 0.0) / objective["min_output_tokens_per_s"]
    return out


def _fake_metrics(cfg) -> dict[str, float]:
    """Test-only stand-in (SLOTUNE_FAKE_TRIAL=1): a cheap deterministic function of the config,
    so study mechanics (storage, resume, workers, samplers) are tested without a model."""
    seqs = cfg.max_num_seqs
    q = {"none": 1.0, "int8": 0.7, "int4": 0.55}.get(cfg.quantization, 1.0)
    tpot = 0.02 * q * (1 + 0.05 * seqs)
    tput = seqs / tpot
    return {"ttft_p50": 0.05 * q, "ttft_p95": 0.08 * q * (1 + 0.02 * seqs), "tpot_p50": tpot, "tpot_p95": tpot * 1.1,
            "output_tokens_per_s": tput, "goodput_rps": tput / 32, "requests_per_s": tput / 32,
            "num_completed": 8.0, "num_requests": 8.0}


def run_trial(req: dict[str, Any]) -> dict[str, Any]:
    from slotune.engine.config import EngineConfig
    from slotune.tuner.workload import WorkloadSpec

    cfg = EngineConfig.model_validate(req["config"])
    objective = req["objective"]
    hook = os.environ.get("SLOTUNE_TEST_TRIAL_FAULT", "")  # test hooks: crash | hang | oom
    if hook == "crash":
        os._exit(3)
    if hook == "hang":
        time.sleep(3600)
    if hook == "oom":
        hog = [bytearray(256 * 2**20) for _ in range(64)]  # noqa: F841 - grow until killed
    if os.environ.get("SLOTUNE_FAKE_TRIAL") == "1":
        time.sleep(float(os.environ.get("SLOTUNE_FAKE_TRIAL_SLEEP", "0")))
        metrics = _fake_metrics(cfg)
        return {"metrics": metrics, "violations": slo_violations(metrics, objective), "early_stopped": False, "gates": None}

    from slotune.engine import LLM
    from slotune.tuner.bench import run_benchmark

    t0 = time.perf_counter()
    llm = LLM(cfg)
    load_s = time.perf_counter() - t0
    wl = WorkloadSpec.model_validate(req["workload"])
    p = objective["percentile"]
    es = req.get("early_stop") or {}

    def should_stop(records) -> bool:
        if not es.get("enabled") or len(records) < es["min_requests"]:
            return False
        from slotune.tuner.metrics import summarize

        m = summarize(records, 1.0)
        v = slo_violations({**m, "output_tokens_per_s": float("inf")}, objective)
        return any(x > es["factor"] - 1 for x in v.values())

    res = run_benchmark(cfg, wl, llm=llm, ttft_limit_s=objective.get("ttft_limit_s"),
                        tpot_limit_s=objective.get("tpot_limit_s"), seed=req.get("seed"), should_stop=should_stop)
    metrics = {**res.metrics, "load_time_s": load_s}
    violations = slo_violations(metrics, objective)
    if res.early_stopped:
        violations["early_stop"] = 1.0
    gates = None
    if req.get("gates") and all(v <= 0 for v in violations.values()):  # cheap first: gates only for SLO-meeting trials
        from slotune.evals.gates import GateSpec, evaluate_gates

        report = evaluate_gates(cfg, [GateSpec.model_validate(g) for g in req["gates"]], llm=llm, cache_dir=req.get("cache_dir"))
        gates = report.to_dict()
        if not report.passed:
            violations["quality_gates"] = 1.0
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
