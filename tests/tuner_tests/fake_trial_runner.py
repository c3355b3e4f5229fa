"""A stand-in trial process for tests of study mechanics (storage, resume, workers, samplers,
fault handling): the real trial process's contract (`IN.json OUT.json`, slotune/tuner/measure/trial_runner.py:
`main`) with a cheap deterministic function of the config instead of a measurement. Tests pass it
explicitly (`tune run --trial-runner tests/tuner_tests/fake_trial_runner.py`, or
`runner=FAKE_RUNNER`); every test that does says so in its docstring.

Its behaviour is set by the test through the environment of the process it runs in:
- FAKE_TRIAL_SLEEP=seconds: how long the stand-in measurement takes (default 0);
- FAKE_TRIAL_FAULT=crash|hang|oom|raise|sigkill: a crashing, hanging, memory-hungry or unimplemented
  trial, or one killed by SIGKILL from outside (as the OOM killer or a node drain would)
  (with FAKE_TRIAL_FAULT_SEEDS=seed[,seed...]: only on those workload seeds; with
  FAKE_TRIAL_FAULT_ONCE=path: only in the first trial process, which creates that file);
- FAKE_TRIAL_GATE=path: while that file exists, a trial process waits before it measures;
- FAKE_TRIAL_LUCKY=knob=value[,knob=value...]: configs with these values were lucky in the study:
  measured on the study's workload seed, their latencies are halved and their throughput doubled
  (FAKE_TRIAL_LUCK=factor: latencies times that factor instead, rates divided by it; over 1, unlucky);
  on another seed (the confirmation round) they measure as their config says, like every other;
- FAKE_TRIAL_TOP1=quantization=value[,...]: with quality gates in the request (and the SLO met, as
  the real trial process runs them), every gate is an agreement gate scoring this top-1 agreement
  for configs of that quantization (1.0 for the others), passing when it reaches the gate's min_top1;
- FAKE_TRIAL_SEED_SCALE=seed=factor[,seed=factor...]: every config measured on that workload seed
  has its latencies multiplied by the factor and its rates divided by it (a seed that flatters all).

Its metrics carry intervals (`<key>_ci_low`/`_ci_high`, +-3%) for the latency percentiles and rates,
and `workload_requests`: the number of requests it was asked to replay (a screening replay asks fewer).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from slotune.engine.config import EngineConfig
from slotune.tuner.measure import trial_runner
from slotune.tuner.spec.slo import is_feasible, slo_violations

FAKE_RUNNER = (sys.executable, str(Path(__file__).resolve()))


LATENCY_KEYS = ("ttft_p50", "ttft_p95", "tpot_p50", "tpot_p95")
RATE_KEYS = ("output_tokens_per_s", "total_tokens_per_s", "goodput_rps", "requests_per_s")


def fake_metrics(cfg: EngineConfig, is_lucky: bool = False, scale: float = 1.0) -> dict[str, float]:
    seqs = cfg.max_num_seqs
    q = {"none": 1.0, "int8": 0.7, "int4": 0.55}.get(cfg.quantization, 1.0)
    tpot = 0.02 * q * (1 + 0.05 * seqs)
    tput = seqs / tpot
    m = {
        "ttft_p50": 0.05 * q,
        "ttft_p95": 0.08 * q * (1 + 0.02 * seqs),
        "tpot_p50": tpot,
        "tpot_p95": tpot * 1.1,
        "output_tokens_per_s": tput,
        "total_tokens_per_s": tput * 4,
        "goodput_rps": tput / 32,
        "requests_per_s": tput / 32,
        "slo_attainment": 1.0,
        "num_completed": 8.0,
        "num_requests": 8.0,
    }
    luck = float(os.environ.get("FAKE_TRIAL_LUCK", "0.5"))
    for k in LATENCY_KEYS + RATE_KEYS:
        if is_lucky:
            m[k] *= luck if k in LATENCY_KEYS else 1 / luck
        m[k] *= scale if k in LATENCY_KEYS else 1 / scale
        m[f"{k}_ci_low"], m[f"{k}_ci_high"] = m[k] * 0.97, m[k] * 1.03
    return m


def is_lucky(cfg: EngineConfig, seed: int | None) -> bool:
    """FAKE_TRIAL_LUCKY names the config, and this is the study's own workload seed (None)."""
    spec = os.environ.get("FAKE_TRIAL_LUCKY", "")
    if not spec or seed is not None:
        return False
    values = cfg.model_dump(mode="json")
    return all(str(values.get(k)) == v for k, _, v in (item.partition("=") for item in spec.split(",")))


def seed_scale(seed: int | None) -> float:
    """FAKE_TRIAL_SEED_SCALE's factor for this workload seed (1 when it names none)."""
    items = (item.partition("=") for item in os.environ.get("FAKE_TRIAL_SEED_SCALE", "").split(",") if item)
    return next((float(f) for s, _, f in items if seed is not None and int(s) == seed), 1.0)


def _fault() -> None:
    fault = os.environ.get("FAKE_TRIAL_FAULT", "")
    once = os.environ.get("FAKE_TRIAL_FAULT_ONCE")
    if once:
        try:
            Path(once).touch(exist_ok=False)
        except FileExistsError:  # an earlier trial process had the fault
            return
    if fault == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if fault == "crash":
        os._exit(3)
    if fault == "hang":
        time.sleep(3600)
    if fault == "oom":
        hog = [bytearray(256 * 2**20) for _ in range(64)]  # noqa: F841 - grow until killed
    if fault == "raise":
        raise NotImplementedError("lever not implemented in this engine build (test hook)")


def fake_trial(req: dict[str, Any]) -> dict[str, Any]:
    """With `seeds`, each seed in turn as the real trial process does: a seed that raises is that seed's
    error, a crash ends them all; with `stop_after_miss`, the seeds after a miss are skipped."""
    if req.get("seeds") is not None:
        by_seed: list[dict[str, Any]] = []
        for seed in req["seeds"]:
            if req.get("stop_after_miss") and any(not is_feasible(r.get("violations", {})) for r in by_seed):
                by_seed.append({"skipped": True})
                continue
            try:
                by_seed.append(_fake_once({**req, "seed": seed}))
            except Exception as exc:  # noqa: BLE001 - as trial_runner records a seed's failure
                by_seed.append({"error": trial_runner.error_text(exc)})
        return {"by_seed": by_seed}
    return _fake_once(req)


def _fake_once(req: dict[str, Any]) -> dict[str, Any]:
    cfg = EngineConfig.model_validate(req["config"])
    if req.get("phase_file"):
        Path(req["phase_file"]).write_text("fake measurement")
    gate = os.environ.get("FAKE_TRIAL_GATE")
    while gate and Path(gate).exists():
        time.sleep(0.05)
    fault_seeds = os.environ.get("FAKE_TRIAL_FAULT_SEEDS")
    if not fault_seeds or str(req.get("seed")) in fault_seeds.split(","):
        _fault()
    time.sleep(float(os.environ.get("FAKE_TRIAL_SLEEP", "0")))
    metrics = fake_metrics(cfg, is_lucky(cfg, req.get("seed")), seed_scale(req.get("seed")))
    metrics["workload_requests"] = float(req["workload"].get("num_requests") or 0)
    violations = slo_violations(metrics, req["objective"])
    gates = fake_gates(cfg, req["gates"]) if req.get("gates") and is_feasible(violations) else None
    if gates is not None:
        violations["quality_gates"] = 0.0 if gates["passed"] else 1.0
    return {
        "metrics": metrics,
        "violations": violations,
        "early_stopped": False,
        "gates": gates,
        "measure": req.get("measure", "served"),
    }


def fake_gates(cfg: EngineConfig, gates: list[dict[str, Any]]) -> dict[str, Any]:
    """A gate report (slotune/evals/gate_spec.py `GateReport.to_dict`) scoring FAKE_TRIAL_TOP1's agreement."""
    items = (item.partition("=") for item in os.environ.get("FAKE_TRIAL_TOP1", "").split(",") if item)
    top1 = next((float(v) for q, _, v in items if q == cfg.quantization), 1.0)
    results = [
        {
            "name": g["name"],
            "kind": "agreement",
            "passed": top1 >= g["min_top1"],
            "baseline": 1.0,
            "candidate": top1,
            "stderr": None,
            "drop": 1.0 - top1,
            "metric": "top1",
            "margin": 1 - g["min_top1"],
            "reason": "ok" if top1 >= g["min_top1"] else "failed",
            "num_items": 8,
            "seconds": 0.0,
            "details": {},
        }
        for g in gates
    ]
    return {"passed": all(r["passed"] for r in results), "gates": results}


if __name__ == "__main__":
    sys.exit(trial_runner.main(sys.argv[1:], run=fake_trial))
