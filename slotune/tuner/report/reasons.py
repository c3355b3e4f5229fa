"""Why a trial cannot win, in words: the report's trial table and the MLflow tags."""

from __future__ import annotations

from collections.abc import Iterable

from slotune.evals.gate_spec import GateSpec
from slotune.tuner.measure.reasons import failed_gates
from slotune.tuner.search.records import TrialRecord
from slotune.tuner.spec.slo import SLO_KEYS, SLOLimits, judge


def infeasible_reasons(record: TrialRecord, limits: SLOLimits, gate_specs: Iterable[GateSpec] = ()) -> list[str]:
    """Why a trial cannot win, in words; [] for a feasible trial.

    Args:
        record: the trial (its `fail_reason`, `violations`, `metrics` and `gates`).
        limits: the study's SLO limits (`SLOLimits.from_objective(spec.objective)`).
        gate_specs: the spec's `quality_gates`, for the gates' limits.

    Returns:
        The failure reason for a trial that measured nothing; otherwise, in order: stopped early,
        each missed SLO limit, each failed gate.
    """
    if record.fail_reason:
        return [str(record.fail_reason)]
    v = record.violations or {}
    words = []
    if v.get("early_stop", 0) > 0:
        words.append("stopped early: the first requests already missed a limit by far")
    if any(v.get(k, 0) > 0 for k in SLO_KEYS):
        # Judged again from the stored metrics for the words; the stored numbers if those are gone.
        words += judge(record.metrics or {}, limits).reasons or [
            f"{k} {v[k]:+.0%} beyond its limit" for k in SLO_KEYS if v.get(k, 0) > 0
        ]
    if v.get("quality_gates", 0) > 0:
        words += failed_gates(record.gates, gate_specs) or ["quality gates failed"]
    return words
