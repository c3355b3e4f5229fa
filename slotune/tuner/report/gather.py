"""Collect a finished study into `ReportData`: every trial, the winner, the references, parameter importances."""

from __future__ import annotations

import warnings

from slotune.tuner.measure.measurement import Measurement
from slotune.tuner.measure.units import (
    format_params,
    metric_label,
    number,
)
from slotune.tuner.report.facts import ReportData, TrialFacts
from slotune.tuner.report.reasons import infeasible_reasons
from slotune.tuner.report.winner import winner_facts
from slotune.tuner.search.records import TrialRecord
from slotune.tuner.search.references import DEFAULT_TAG, reference_metrics, reference_results, trial_label
from slotune.tuner.spec.slo import SLOLimits, metric_key
from slotune.tuner.workload.requests import describe_replay

MIN_TRIALS_FOR_IMPORTANCE = 4  # fANOVA on fewer complete trials says nothing


def _importances(study, trials: list[TrialFacts]) -> tuple[dict[str, float] | None, str]:
    done = [t for t in trials if t.state == "COMPLETE" and t.values]
    if len(done) < MIN_TRIALS_FOR_IMPORTANCE:
        return None, (
            f"Parameter importances need at least {MIN_TRIALS_FOR_IMPORTANCE} complete trials; "
            f"this study has {len(done)}."
        )
    import optuna  # heavy: the tuner's own dependency, imported only where a report is written

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            imp = optuna.importance.get_param_importances(study, target=lambda t: t.values[0])
    except Exception as exc:  # a constant space, a single distinct value: no importance to report
        return None, f"Parameter importances could not be computed: {type(exc).__name__}: {exc}"
    if not imp:
        return None, "Parameter importances: no parameter varied across the complete trials."
    return dict(imp), (
        "How much of the variation of the first objective each parameter explains "
        "(Optuna's fANOVA over the complete trials)."
    )


def gather(spec, study, best, remeasure) -> ReportData:
    """The report's facts, read once from the study.

    Args:
        spec: the TuningSpec.
        study: the finished Optuna study (trials with their user attributes).
        best: the winning FrozenTrial, or None when no trial was feasible.
        remeasure: the winner's declared numbers (`Confirmation.declared`: `metrics` or `error`, and
            `default`, the default config's measured beside it: the winner card compares those).
    """
    obj = spec.objective
    limits = SLOLimits.from_objective(obj)
    keys = [obj.metric_key(m) for m in obj.metrics]
    records = [TrialRecord.of(t) for t in study.trials]
    trials = []
    for t in records:
        trials.append(
            TrialFacts(
                number=t.number,
                tag=trial_label(t),
                state=t.state.name,
                values=t.values or None,
                feasible=t.feasible,
                params=dict(t.params),
                reasons=[] if t.feasible else infeasible_reasons(t, limits, spec.quality_gates),
                early_stopped=bool(t.early_stopped),
                metrics=t.metrics or Measurement(),
                latencies=t.latencies or None,
            )
        )
    states = [t.state for t in trials]
    gates = ", ".join(g.name for g in spec.quality_gates) or "none"
    summary = [
        f"Objective: {obj.direction()} {metric_label(keys[0])}"
        + (f", Pareto with {', '.join(metric_label(k) for k in keys[1:])}" if keys[1:] else "")
        + ".",
        f"SLO: {limits.describe()}; quality gates: {gates}.",
        f"Sampler {spec.sampler}; {len(states)} trials ({states.count('COMPLETE')} complete, "
        f"{states.count('FAIL')} failed, {states.count('PRUNED')} pruned).",
    ]
    if spec.screening.enabled:
        from slotune.tuner.search.screening import screened_in  # optuna: only where a study exists

        out = [t for t in records if t.screened_out and t.repeat_of is None]
        summary.append(
            f"Screening: each searched trial replayed {spec.screening.describe(spec.workload)} first; "
            f"{len(out)} were screened out there (each holding {number(spec.screening.share(spec.workload))} "
            f"of a budget slot), {len(screened_in(study))} passed and were measured in full."
        )
    machines = sorted({t.machine for t in records if t.machine})
    if machines:  # a latency is a fact about the machine that measured it
        summary.append(
            f"Measured on {machines[0]}."
            if len(machines) == 1
            else f"Measured on {len(machines)} machines: {'; '.join(machines)}."
        )
    replay = describe_replay(spec.workload)
    if replay is not None:  # a trace workload: which traffic window the numbers are about
        summary.append(f"Traffic: tuned on {replay}.")
    refs = reference_metrics(study)
    winner = (
        winner_facts(spec, best, remeasure, refs, reference_results(study, "latencies")[DEFAULT_TAG], limits)
        if best is not None
        else None
    )
    front: set[int] = set()
    if len(keys) > 1:
        front = {t.number for t in study.best_trials if TrialRecord.of(t).feasible}
    importances, note = _importances(study, trials)
    closest = _closest(records, trials) if winner is None else ""
    return ReportData(
        name=spec.name,
        objective_keys=keys,
        directions=[obj.direction(m) for m in obj.metrics],
        summary=summary,
        winner=winner,
        trials=trials,
        pareto_front=front,
        importances=importances,
        importance_note=note,
        closest=closest,
        context_keys=[metric_key("ttft", obj.percentile), "output_tokens_per_s"],
    )


def _closest(records: list[TrialRecord], trials: list[TrialFacts]) -> str:
    """The measured trial that missed least (the sum of its relative misses: 0.15 = 15% beyond a limit;
    a failed gate or an early stop counts 1), with its misses in words; "" when nothing was measured."""
    missed = {
        t.number: sum(max(float(v), 0.0) for v in (t.violations or {}).values())
        for t in records
        if t.is_complete and t.violations
    }
    if not missed:
        return ""
    number = min(missed, key=lambda n: (missed[n], n))
    facts = next(t for t in trials if t.number == number)
    params = format_params(facts.params) or "the base config"
    return f"Closest to feasible: trial {number} ({params}): " + "; ".join(facts.reasons or ["no reason stored"]) + "."
