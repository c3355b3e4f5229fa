"""Who enters the confirmation round: the best feasible trials, and near misses (SLO limits missed within
the trial's own interval)."""

from __future__ import annotations

from slotune.tuner.measure.measurement import Measurement
from slotune.tuner.measure.units import format_value
from slotune.tuner.search.records import TrialRecord
from slotune.tuner.search.trials import by_first_objective, ranked_feasible
from slotune.tuner.spec.slo import Check, SLOLimits, judge


def candidates(study, spec) -> list[TrialRecord]:
    """The trials the round re-measures, best first by their own value of the first objective, one
    per distinct config: the best `budget.confirm_top_k` feasible ones (1 with the round off), then
    up to as many near misses (`near_misses`) that rank above the last of those (none when no trial
    is feasible: the round needs a feasible trial to fall back on)."""
    from optuna.trial import TrialState  # optuna: the [tune] extra, imported where a study exists

    k, seen = max(spec.budget.confirm_top_k, 1), []

    def distinct(ranked) -> list:
        out = []
        for t in ranked:
            config = t.config
            if config in seen:  # a sampler that proposed the same config twice: measured once
                continue
            seen.append(config)
            out.append(t)
            if len(out) == k:
                break
        return out

    picked = distinct(ranked_feasible(study, spec))
    if not picked or not spec.budget.confirm_top_k:
        return picked
    limits, rank = SLOLimits.from_objective(spec.objective), by_first_objective(spec)
    near = [
        t
        for t in map(TrialRecord.of, study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)))
        if not t.feasible and _missed_only_within_noise(t, limits) and rank(t) < rank(picked[-1])
    ]
    return sorted(picked + distinct(sorted(near, key=rank)), key=rank)


def near_misses(metrics: Measurement | None, limits: SLOLimits) -> list[Check]:
    """The SLO limits `metrics` missed, when each lies inside its metric's interval (a latency's low
    end at or under its limit, a throughput's high end at or over its floor): the measurement cannot
    tell whether the config meets them. [] when nothing is missed, or anything is missed by more than
    that (or has no interval)."""
    m = metrics if metrics is not None else Measurement()
    missed = [c for c in judge(m, limits).checks if not c.passed]
    for c in missed:
        ci = m.interval(c.key)
        if c.value is None or ci is None or (ci[1] < c.limit if c.name == "throughput" else ci[0] > c.limit):
            return []
    return missed


def _missed_only_within_noise(record: TrialRecord, limits: SLOLimits) -> bool:
    """A measured trial (no failure, not stopped early, its gates not failed) whose only fault is SLO
    limits missed within noise (`near_misses`)."""
    v = record.violations or {}
    return (
        not record.fail_reason
        and not v.get("early_stop")
        and not v.get("quality_gates")
        and bool(near_misses(record.metrics, limits))
    )


def near_words(record: TrialRecord, limits: SLOLimits) -> list[str]:
    """A near miss's missed limits in words, each with the interval that holds the limit:
    'p95 TTFT 1.6 s > limit 1.5 s (+7%); its interval 1.35 s-1.71 s'."""
    m = record.metrics or Measurement()
    return [
        f"{c.text}; its interval {format_value(c.key, m.interval(c.key)[0])}-{format_value(c.key, m.interval(c.key)[1])}"
        for c in near_misses(m, limits)
    ]
