"""SLO checks: measured metrics -> Optuna constraint values, and the cheap early-stop rule.

Constraint values follow Optuna's convention (<= 0 feasible, > 0 violated) and are relative to
each limit (0.5 = 50% over), so one scale serves TTFT, TPOT and throughput alike. Every trial
reports the same keys (0.0 where a limit is not set), which constraint-aware samplers expect.
Pure Python: imported by the trial process and the study without torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from slotune.tuner.metrics import RequestRecord, summarize

# One key per constraint; `early_stop` and `quality_gates` are 0/1 flags set by the trial.
CONSTRAINT_KEYS = ("ttft", "tpot", "throughput", "early_stop", "quality_gates")


def slo_violations(metrics: Mapping[str, float], objective: Mapping[str, Any]) -> dict[str, float]:
    """Relative violation of each SLO limit of `objective` (an Objective dumped to a dict).

    Args:
        metrics: flat metric dict (`ttft_p95`, `tpot_p95`, `output_tokens_per_s`, ...).
        objective: `percentile`, and optional `ttft_limit_s`, `tpot_limit_s`,
            `min_output_tokens_per_s`.

    Returns:
        `{ttft, tpot, throughput}`: value / limit - 1 for latency limits, 1 - value / minimum
        for the throughput floor; 0.0 for limits that are not set. A metric that was not
        measured (no request produced a first token) counts as a full violation.
    """
    p = objective["percentile"]
    out = {"ttft": 0.0, "tpot": 0.0, "throughput": 0.0}
    if objective.get("ttft_limit_s"):
        v = metrics.get(f"ttft_p{p}")
        out["ttft"] = 1.0 if v is None else v / objective["ttft_limit_s"] - 1
    if objective.get("tpot_limit_s"):
        v = metrics.get(f"tpot_p{p}")
        out["tpot"] = 0.0 if v is None else v / objective["tpot_limit_s"] - 1  # 1-token outputs have no TPOT
    if objective.get("min_output_tokens_per_s"):
        out["throughput"] = 1 - metrics.get("output_tokens_per_s", 0.0) / objective["min_output_tokens_per_s"]
    return out


def constraint_values(violations: Mapping[str, float]) -> dict[str, float]:
    """All CONSTRAINT_KEYS, in order, missing ones as 0.0 (feasible)."""
    return {k: float(violations.get(k, 0.0)) for k in CONSTRAINT_KEYS}


def is_feasible(violations: Mapping[str, float]) -> bool:
    return all(v <= 0 for v in violations.values())


def breaks_slo_early(partial_metrics: Mapping[str, float], objective: Mapping[str, Any], factor: float) -> bool:
    """True when the first requests already miss a latency limit by more than `factor` x.

    Only latency limits are judged: throughput over a handful of requests says little.
    """
    v = slo_violations(partial_metrics, {**objective, "min_output_tokens_per_s": None})
    return any(x > factor - 1 for x in v.values())


def certain_violations(in_flight, now: float, objective: Mapping[str, Any], factor: float) -> int:
    """How many unfinished requests will miss a latency limit by more than `factor` x, whatever
    happens next (their clocks only grow). Judges requests a completion-based check cannot see
    yet: queued behind a static batch, or stuck behind long prefills.

    Args:
        in_flight: objects with `.metrics` (arrival_time, first_token_time) and
            `.params.max_tokens` (the engine's Sequence).
        now: the current `time.perf_counter()`.
    """
    ttft_limit, tpot_limit = objective.get("ttft_limit_s"), objective.get("tpot_limit_s")
    n = 0
    for seq in in_flight:
        m = seq.metrics
        if m.first_token_time is None:
            if ttft_limit and now - m.arrival_time > factor * ttft_limit:
                n += 1
        elif tpot_limit:
            # TPOT at finish = (finish - first token) / (max_tokens - 1) >= this lower bound.
            if (now - m.first_token_time) / max(1, seq.params.max_tokens - 1) > factor * tpot_limit:
                n += 1
    return n


def breaks_slo_so_far(records: list[RequestRecord], objective: dict[str, Any], es: dict[str, Any]) -> bool:
    """The early-stop rule: at least `es.min_requests` requests have finished (aborted and broken
    ones do not count) and their pXX already misses a latency limit by `es.factor` x.

    Used by both replays: `run_benchmark`'s should_stop in tuner/trial_runner.py, the HTTP
    client's in tuner/http_bench.py `main`.
    """
    done = [r for r in records if r.finish_reason not in ("abort", "error")]
    return len(done) >= es["min_requests"] and breaks_slo_early(
        summarize(done, 1.0, percentiles=(objective["percentile"],)), objective, es["factor"])
