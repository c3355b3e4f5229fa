"""What an MLflow run holds for a trial and for its study: metrics and tags from typed records.

Pure functions; `tracker.py` sends them. Metrics keep their stored form (`Measurement.to_dict`);
a value that is not a finite number is left out.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from slotune.tuner.report.reasons import infeasible_reasons
from slotune.tuner.search.records import TrialRecord
from slotune.tuner.search.references import trial_label
from slotune.tuner.spec.slo import SLOLimits, judge

MAX_TAG_CHARS = 5000


@dataclass
class RunValues:
    metrics: dict[str, float] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)


def trial_values(r: TrialRecord, state: str, spec) -> RunValues:
    """A trial's child run: its metrics, violations, screening value and gate values; tags for SLO
    and gates (the report's words for why it is infeasible), its label, retry, machine, failure."""
    metrics: dict[str, float] = {}
    tags: dict[str, str] = {}
    for k, v in (r.metrics.to_dict() if r.metrics is not None else {}).items():
        if loggable(v):
            metrics[k] = float(v)
    for k, v in (r.violations or {}).items():
        metrics[f"violation_{k}"] = float(v)
    screen = r.screen  # the short replay's objective value (screening)
    if screen and loggable(screen.get("value")):
        metrics[f"screen_{spec.objective.metric_key()}"] = float(screen["value"])
    limits = SLOLimits.from_objective(spec.objective)
    tags["slotune.feasible"] = str(r.feasible)
    if not r.feasible:  # the same words as the report's trials table
        why = infeasible_reasons(r, limits, spec.quality_gates)
        if state == "PRUNED" and not why:
            why = ["pruned"]
        if why:
            tags["slotune.infeasible_reason"] = "; ".join(why)[:MAX_TAG_CHARS]
    if r.violations is not None:
        slo = judge(r.metrics or {}, limits)
        early = r.violations.get("early_stop", 0) > 0  # judged on the first requests only
        tags["slotune.slo_pass"] = str(slo.passed and not early)
        if not slo.passed or early:
            tags["slotune.slo_reasons"] = "; ".join((["stopped early"] if early else []) + slo.reasons)
    tags["slotune.early_stopped"] = str(bool(r.early_stopped))
    if r.screened_out:  # its metrics are the short replay's (screening)
        tags["slotune.screened_out"] = "True"
    if label := trial_label(r):  # default, naive, a start's name, "repeat of N", "retry of N"
        tags["slotune.tag"] = label
    if r.retry_of is not None:  # the failed attempt this trial measures again
        tags["slotune.retry_of"] = str(r.retry_history[-1] if r.retry_history else r.retry_of)
    if r.measure:
        tags["slotune.measure"] = r.measure
    if r.machine:
        tags["slotune.machine"] = r.machine
    if r.fail_reason:
        tags["slotune.fail_reason"] = r.fail_reason[:MAX_TAG_CHARS]
    gates = r.gates
    if gates:
        tags["slotune.gates_pass"] = str(gates.get("passed"))
        for g in gates.get("gates", []):
            if g.get("candidate") is not None:
                metrics[f"gate_{g['name']}"] = float(g["candidate"])
    return RunValues(metrics, tags)


def study_end_values(best, confirmation=None, servers=()) -> RunValues:
    """The parent run at the study's end: with a `confirmation` (decide/confirm.py) the declared value
    and whether the winner held, its seeds, the seeds where it missed the SLO, the candidates within
    noise of it; with a shoot-out each server's median and ratio; the best trial's metrics and params."""
    metrics: dict[str, float] = {}
    tags: dict[str, str] = {}
    for s in servers:  # a shoot-out (decide/standings.py): the best server, each one's median and ratio
        if s.held and s is servers[0]:
            tags["slotune.best_server"] = s.server
        if loggable(s.value):
            metrics[f"server_{s.server}_{confirmation.key}"] = float(s.value)
        if loggable(s.vs_winner):
            metrics[f"server_{s.server}_vs_winner"] = float(s.vs_winner)
    if confirmation is not None:
        tags["slotune.confirmed"] = str(confirmation.confirmed)
        tags["slotune.best_by_trial"] = str(confirmation.candidates[0])
        declared = confirmation.declared()
        value = (declared.get("metrics") or {}).get(confirmation.key)
        if loggable(value):
            metrics[f"declared_{confirmation.key}"] = float(value)
        tags["slotune.declared_seeds"] = str(len(declared.get("seeds") or []))
        missed = sorted({r.seed for r in confirmation.runs_of(confirmation.winner) if r.missed})
        tags["slotune.declared_slo_missed_on"] = ",".join(map(str, missed))
        tags["slotune.within_noise_of_winner"] = ",".join(map(str, confirmation.within_noise()))
    if best is not None:
        tags["slotune.best_trial"] = str(best.number)
        best_metrics = TrialRecord.of(best).metrics
        for k, v in (best_metrics.to_dict() if best_metrics is not None else {}).items():
            if loggable(v):
                metrics[f"best_{k}"] = float(v)
        for k, v in best.params.items():
            tags[f"best.{k}"] = str(v)
    else:
        tags["slotune.best_trial"] = "none"
    return RunValues(metrics, tags)


def loggable(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and abs(v) != float("inf")
