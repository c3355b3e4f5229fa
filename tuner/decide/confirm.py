"""The confirmation round: the best trials measured again, together, before a winner is declared.

The best `budget.confirm_top_k` feasible trials (and near misses: SLO limits missed within their own
interval) are re-measured on a fresh workload seed, in one round between two measurements of the
default config; the winner is the best re-measured candidate that holds the SLO. While candidates'
intervals overlap the winner's, they are measured again, up to `budget.confirm_passes` passes. The
round is stored in the study (user attribute `confirm`), so a resumed run reuses it.
Rationale and measured cases: docs/design/confirmation.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from slotune.engine.config import EngineConfig
from slotune.evals.gate_spec import GateSpec
from slotune.tuner.decide.aggregate import half_width, median_metrics, pooled_metrics
from slotune.tuner.decide.candidates import near_words
from slotune.tuner.decide.declare import objective_values
from slotune.tuner.measure.measurement import Measurement
from slotune.tuner.measure.reasons import failed_gates
from slotune.tuner.measure.trial_process import DEFAULT_TRIAL_RUNNER, TrialFailure, measure
from slotune.tuner.measure.units import format_value, metric_label, overlaps
from slotune.tuner.search.records import TrialRecord, store_round, stored_round
from slotune.tuner.search.references import DEFAULT_TAG
from slotune.tuner.spec.slo import SLOLimits, judge


def plan(spec, trials: list) -> list[int | None]:
    """The round's order: trial numbers, None for the default config (see the module docstring)."""
    numbers = [t.number for t in trials]
    return [None, *numbers, None] if spec.budget.confirm_top_k else numbers


def run_round(
    spec, study, trials: list, *, runner: tuple[str, ...] = DEFAULT_TRIAL_RUNNER, say: Callable[[str], None] = print
) -> dict[str, Any]:
    """Measure the round (or reuse the stored one for the same order and seed), then its further passes
    while the winner has rivals (module docstring); store it in the study after each pass.

    Args:
        spec: the TuningSpec.
        study: the study (its `confirm` user attribute holds the round).
        trials: the candidates, best first (`candidates`).
        runner: the trial process's command (see `trial_process.run_trial_process`).
        say: where each measurement's line goes.

    Returns:
        The stored record: {"seed", "order", "measurements": [{"trial", "metrics"} or {"trial", "error"}]};
        a near miss's measurement also has "gates": its gate report, None when the SLO missed again;
        a measurement of a later pass has "pass": 2, 3, ... (the first pass's have none).
    """
    trials = [TrialRecord.of(t) for t in trials]
    order = plan(spec, trials)
    stored = stored_round(study)
    configs = {t.number: EngineConfig.model_validate(t.config) for t in trials}
    near = {t.number for t in trials if not t.feasible}  # their gates run here (module docstring)
    key = spec.objective.metric_key()

    def measured(label: str, number: int | None, gates: bool) -> dict[str, Any]:
        try:
            r = measure(
                spec,
                spec.base_config() if number is None else configs[number],
                seed=spec.robustness_seed,
                early_stop=False,
                runner=runner,
                gates=gates,
            )
        except TrialFailure as exc:
            say(f"{label}: {DEFAULT_TAG if number is None else f'trial {number}'} failed: {exc.reason}")
            return {"trial": number, "error": exc.reason}
        say(
            f"{label}: {DEFAULT_TAG if number is None else f'trial {number}'} on workload seed {spec.robustness_seed}: "
            f"{key} = {format_value(key, r.metrics.get(key))}"
            + (f"; quality gates {'passed' if r.gates['passed'] else 'failed'}" if r.gates else "")
        )
        return {"trial": number, "metrics": r.metrics.to_dict(), **({"gates": r.gates} if gates else {})}

    if stored and stored.get("seed") == spec.robustness_seed and stored.get("order") == order:
        record = stored
    else:
        record = {
            "seed": spec.robustness_seed,
            "order": order,
            "measurements": [measured(f"confirm {i + 1}/{len(order)}", n, n in near) for i, n in enumerate(order)],
        }
        store_round(study, record)
    while True:  # further passes (module docstring); a resumed round carries on from its last stored pass
        c = confirm_round(spec, record, trials)
        again = c.contenders()
        if not again or c.passes >= spec.budget.confirm_passes:
            return record
        last = [m.trial for m in c.measured if m.pass_no == c.passes and m.trial in again]
        order = [*reversed(last), *(t for t in again if t not in last)]  # a new rival (the winner changed) last
        n = c.passes + 1
        why = (
            f"within noise of trial {c.winner}"
            if len(again) == 2
            else f"{len(again) - 1} candidates within noise of trial {c.winner}"
        )
        record = {
            **record,
            "measurements": record["measurements"]
            + [
                {**measured(f"confirm pass {n}/{spec.budget.confirm_passes} ({why})", t, False), "pass": n}
                for t in order
            ],
        }
        store_round(study, record)


@dataclass(frozen=True)
class Measured:
    """One measurement of the round, judged."""

    position: int  # 1-based, in the order measured
    trial: int | None  # None: the default config
    metrics: Measurement | None
    error: str | None
    reasons: list[str]  # why it misses the SLO (or a near miss its gates) on this measurement ([] when it holds)
    gates: dict[str, Any] | None = None  # a near miss's gate report from the round
    pass_no: int = 1  # which pass of the round measured it

    @property
    def label(self) -> str:
        return DEFAULT_TAG if self.trial is None else f"trial {self.trial}"

    @property
    def feasible(self) -> bool:
        return self.metrics is not None and not self.reasons


@dataclass(frozen=True)
class Confirmation:
    """The round, judged: who won on the re-measured numbers, and what the report and
    best_metrics.json say about it (`confirm_round` builds it)."""

    seed: int
    key: str  # the metric the winner is picked on
    direction: str
    measured: list[Measured]
    by_trial: list[int]  # the candidates, best first by their own trials
    winner: int  # the declared winner's trial number
    is_confirmed: bool  # the winner held the SLO on re-measurement
    is_round: bool  # False: confirm_top_k 0 (the best trial re-measured alone)
    limits: SLOLimits  # the SLO the measurements are judged against
    declared: tuple[dict[str, Any], ...] = ()  # the declaration measurements ({trial, seed, metrics or error})
    declare_precision: float | None = None  # budget.declare_precision: the 95% half-width the declaration aimed at
    params: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict)  # each candidate's sampled params
    near: dict[int, list[str]] = dataclasses.field(default_factory=dict)  # near misses: what their own trial missed
    gated: bool = False  # the spec has quality gates (a near miss must pass them in the round)

    @property
    def best_by_trial(self) -> int:
        """The best feasible candidate on its own trial (a near miss is not feasible there)."""
        return next(n for n in self.by_trial if n not in self.near)

    def with_declaration(self, record: dict[str, Any]) -> "Confirmation":
        """This round with the winner's declaration measurements (`run_declaration`'s record)."""
        assert record["trial"] == self.winner, "the declaration measures the round's winner"
        return dataclasses.replace(self, declared=tuple(record["measurements"]))

    def of(self, trial: int | None) -> list[Measured]:
        return [m for m in self.measured if m.trial == trial]

    @property
    def default_metrics(self) -> Measurement | None:
        """The default config as the round measured it: its two measurements (first and last) as
        one (their mean), and an interval spanning both of theirs (drift over the round counts as noise)."""
        return median_metrics([m.metrics for m in self.of(None) if m.metrics])

    @property
    def passes(self) -> int:
        """How many passes the round measured (module docstring)."""
        return max(m.pass_no for m in self.measured)

    def standing(self, trial: int) -> Measured:
        """A candidate's measurements in the round as one (`standing`)."""
        return standing(self.measured, trial)

    def rivals(self) -> list[Measured]:
        """The round's other candidates (their `standing`) that met the SLO with a re-measured interval
        overlapping the winner's: on this round's numbers they cannot be told apart from it. [] outside
        a confirmed round."""
        if not (self.is_round and self.is_confirmed):
            return []
        mine = (self.standing(self.winner).metrics or Measurement()).interval(self.key)
        if mine is None:
            return []
        out = []
        for n in self.by_trial:
            m = self.standing(n)
            theirs = m.metrics.interval(self.key) if n != self.winner and m.feasible else None
            if theirs is not None and overlaps(theirs, mine):
                out.append(m)
        return out

    def contenders(self) -> list[int]:
        """The trials a further pass measures: the winner and its `rivals`; [] when it has none."""
        rivals = self.rivals()
        return [self.winner, *(m.trial for m in rivals)] if rivals else []

    def differences(self, trial: int) -> list[str]:
        """How `trial`'s params differ from the winner's, in words: ["quantization int8 (the winner: int4)"];
        a knob only one of them samples (a conditional one) is left out: the knob it depends on differs."""
        mine, theirs = self.params.get(self.winner, {}), self.params.get(trial, {})
        return [f"{k} {theirs[k]} (the winner: {mine[k]})" for k in mine if k in theirs and theirs[k] != mine[k]]

    def declared_of(self, trial: int | None) -> list[dict[str, Any]]:
        """The declaration measurements of `trial` (None: the default) that succeeded."""
        return [d for d in self.declared if d.get("trial") == trial and d.get("metrics") is not None]

    def remeasure(self) -> dict[str, Any]:
        """The winner's declared re-measurement for the report and best.yaml: {seed, metrics or error,
        default: the default's metrics measured beside it (None when not measured; default_seeds:
        on which workload seeds), round: the winner's `standing` in the round, reasons: why the
        declared metrics miss the SLO ([] when they hold)}. With declaration measurements (`seeds`:
        the seeds they used; `missed`: [{seed, reasons}] for those on which the winner missed the
        SLO), the metrics are the winner's median over them (`median_metrics`) and the default's its
        median on the same seeds; when every one of the winner's failed, the round's numbers, and
        `declare_error` says why. A near miss that won also has `near` (what its own trial missed, in
        words) and `gates` (its gate report from the round)."""
        mine = self.standing(self.winner)
        wins, defaults = self.declared_of(self.winner), self.declared_of(None)
        out: dict[str, Any] = {
            "seed": self.seed,
            "default": self.default_metrics,
            "default_seeds": [self.seed],
            "round": mine.metrics,
        }
        if self.winner in self.near:  # it qualified in the round: its own trial missed the SLO, within noise
            out.update(near=self.near[self.winner], gates=mine.gates)
        if wins:
            out.update(
                metrics=median_metrics([Measurement.from_dict(d["metrics"]) for d in wins]),
                seeds=[d["seed"] for d in wins],
                half_width=half_width(objective_values(wins, self.winner, self.key)),
                missed=[
                    {"seed": d["seed"], "reasons": why}
                    for d in wins
                    if (why := judge(d["metrics"], self.limits).reasons)
                ],
            )
            same = [d for d in defaults if d["seed"] in out["seeds"]]
            if same:
                out.update(
                    default=median_metrics([Measurement.from_dict(d["metrics"]) for d in same]),
                    default_seeds=[d["seed"] for d in same],
                )
        else:
            out.update({"metrics": mine.metrics} if mine.metrics is not None else {"error": mine.error})
            errors = [d["error"] for d in self.declared if d.get("trial") == self.winner and d.get("error")]
            if errors:
                out["declare_error"] = errors[0]
        metrics = out.get("metrics")
        out["reasons"] = judge(metrics, self.limits).reasons if metrics is not None else []
        return out

    def to_json(self) -> list[dict[str, Any]]:
        """best_metrics.json's `confirm` list: each measurement in order (`pass`: of which pass), judged
        on its own; `within_noise_of_winner` marks the `rivals`' measurements, `near_miss` those of the
        candidates whose own trial missed the SLO within noise."""
        rivals = {m.trial for m in self.rivals()}
        return [
            {
                "position": m.position,
                "pass": m.pass_no,
                "trial": m.trial,
                "tag": DEFAULT_TAG if m.trial is None else None,
                "seed": self.seed,
                "value": (m.metrics or {}).get(self.key),
                "feasible": m.feasible,
                "reasons": m.reasons,
                "winner": m.trial == self.winner and m.trial is not None,
                "within_noise_of_winner": m.trial in rivals,
                "near_miss": m.trial in self.near,
                **({"metrics": m.metrics.to_dict()} if m.metrics is not None else {"error": m.error}),
            }
            for m in self.measured
        ]


def judged(
    position: int,
    m: dict[str, Any],
    limits: SLOLimits,
    key: str,
    gate_specs: Sequence[GateSpec] = (),
    needs_gates: bool = False,
) -> Measured:
    """One stored measurement ({trial, metrics or error, gates}) judged against the SLO; `key` must be
    measured. With `needs_gates` (a near miss, whose gates only the round ran) its `gate_specs` must
    have passed too: they are run only when the SLO held, so a report is missing only then."""
    metrics = Measurement.from_dict(m["metrics"]) if m.get("metrics") is not None else None
    reasons = []
    if metrics is not None:
        reasons = judge(metrics, limits).reasons
        if metrics.get(key) is None:
            reasons.append(f"{metric_label(key)} not measured")
        if needs_gates and gate_specs and not reasons:
            gates = m.get("gates")
            reasons += (
                ["quality gates not run"]
                if gates is None
                else (failed_gates(gates, gate_specs) or ([] if gates.get("passed") else ["quality gates failed"]))
            )
    return Measured(position, m.get("trial"), metrics, m.get("error"), reasons, m.get("gates"), m.get("pass", 1))


def standing(measured: list[Measured], trial: int) -> Measured:
    """`trial`'s measurements in the round as one: with one pass its measurement; with several, their
    `pooled_metrics` (none when any failed), every pass's reasons (it must hold the SLO in each), and
    the first pass's gates (the only ones run)."""
    ms = [m for m in measured if m.trial == trial]
    if len(ms) == 1:
        return ms[0]
    whole = all(m.metrics is not None for m in ms)
    return Measured(
        ms[0].position,
        trial,
        pooled_metrics([m.metrics for m in ms]) if whole else None,
        next((m.error for m in ms if m.error), None),
        list(dict.fromkeys(r for m in ms for r in m.reasons)),
        ms[0].gates,
        ms[-1].pass_no,
    )


def confirm_round(spec, record: dict[str, Any], trials: list) -> Confirmation:
    """Judge a round (`run_round`'s record) and pick the winner.

    The winner is the candidate whose re-measurement (its `standing` over the passes) met the SLO
    (`slo.judge`; a near miss's gates too) with the best value of the first objective; the best feasible one by its own trial when
    none did (then `is_confirmed` is False).
    """
    obj = spec.objective
    key, direction = obj.metric_key(), obj.direction()
    limits = SLOLimits.from_objective(obj)
    trials = [TrialRecord.of(t) for t in trials]
    near = {t.number: near_words(t, limits) for t in trials if not t.feasible}
    measured = [
        judged(i + 1, m, limits, key, spec.quality_gates, needs_gates=m.get("trial") in near and "pass" not in m)
        for i, m in enumerate(record["measurements"])
    ]
    by_trial = [t.number for t in trials]
    sign = 1 if direction == "minimize" else -1
    held = [m for m in (standing(measured, n) for n in by_trial) if m.feasible]
    best = min(held, key=lambda m: (sign * m.metrics[key], by_trial.index(m.trial))) if held else None
    fallback = next(n for n in by_trial if n not in near)
    return Confirmation(
        seed=record["seed"],
        key=key,
        direction=direction,
        measured=measured,
        by_trial=by_trial,
        winner=best.trial if best is not None else fallback,
        is_confirmed=best is not None,
        is_round=bool(spec.budget.confirm_top_k),
        limits=limits,
        params={t.number: dict(t.params) for t in trials},
        near=near,
        gated=bool(spec.quality_gates),
        declare_precision=spec.budget.declare_precision,
    )
