"""The confirmation round: the best trials measured again, together, before a winner is declared.

A trial's numbers come from one run on one workload seed, on a machine whose speed drifts (other
processes, caches, clocks), so the best of many noisy trials is partly the luckiest. `finalize`
(tuner/study.py) therefore re-measures the best `budget.confirm_top_k` feasible trials on a fresh
workload seed (`robustness_seed`) in one round with the default config, and the winner is the best
of them on those numbers, its SLO judged again (`slo.judge`; the quality gates do not depend on the
workload and are not run again, except a near miss's, below).

Near misses: a trial that missed an SLO limit, but by less than its own measurement's noise (each
missed limit lies inside the metric's interval, `near_misses`), may meet it as well as not. Left out,
a config that is best on the objective is never measured again because of one unlucky replay (on
example 01, 2026-11-27, seed 3's int4 start measured p95 TTFT 1.60 s, interval 1.35-1.71 s, against
a 1.5 s limit: the round chose int8, which re-measured 10% slower). So the round also measures up to
`confirm_top_k` such trials that rank above the last feasible candidate on their own value
(`candidates`). Their quality gates were never run (a trial process runs them only when the SLO
held), so the round runs them, on the same engine after the replay, and such a candidate can win
only if its re-measurement meets the SLO and its gates pass (`judged`). When no candidate holds,
the winner falls back to the best feasible trial by its own numbers, never to a near miss. (An hour
later, on a slower host, both batch-1 starts of two studies entered as near misses and missed the
limit again in the round, 1.54-1.60 s: then the SLO decides, as it should.)

Order: default, c1, c2, ..., ck, default (c1 the best by its own trial). Interleaved in one round,
one right after the other, so whatever drift there is reaches every candidate alike instead of
favouring the one measured in a quiet moment of the study, and candidates the winner is picked
between are neighbours in time. The default measured first and last brackets the round: the
difference between its two measurements is the drift over the round, and the winner is compared
with both together (mean value, an interval spanning both: `Confirmation.default_metrics`).
Alternating the default between every candidate would time drift more finely but costs k - 1
more measurements for a comparison the round already makes between adjacent candidates.

Passes: one measurement per candidate often cannot tell the best two apart (their intervals
overlap: on example 01, 2026-11-27, int8 7.96 ms +-0.55 against int4 7.97 +-0.56, while the
declarations measured int4 10-21% faster). So while the winner's interval overlaps a feasible
candidate's (`Confirmation.rivals`), those contenders are measured again on the same seed, in
reverse order each pass (drift that grows through a pass then favours none of them), up to
`budget.confirm_passes` passes; each is then judged on its measurements together
(`Confirmation.standing`: their mean, and `pooled_metrics`' interval, which narrows as passes
agree and widens when they do not), and must have held the SLO in every pass.

Declared numbers: the round picks the winner on its measurements, so the winner's own measurement
in the round is biased in its favour (of k noisy candidates the one that measured luckiest tends
to win). After the round the winner and the default config are measured on `budget.declare_repeats`
fresh workload seeds, one after the other on each (`run_declaration`), and the numbers declared
(best_metrics.json `remeasured`, the report's winner card) are the winner's median there (with two
seeds, their mean), with an interval spanning its measurements, compared with the default's median
on the same seeds. The median, because one measurement taken while the whole host slowed would
move a mean by a quarter (`median_metrics`).

How many seeds is decided by the measurements themselves (`is_declared`), as a benchmark harness
samples until its estimate is tight: after `declare_repeats`, further seeds are measured while the
95% interval of the winner's mean (Student's t) is wider than +-`budget.declare_precision` of it,
up to `Budget.declare_cap`. A quiet machine stops at `declare_repeats`; on a shared one, where the
same replay varies by a third from one run to the next (bench/tuner/noise-floor-*.md), the
declaration measures until the mean is good to the precision asked or the cap is reached (the
report says which). The mean's interval decides, not a robust one of the median's: a measurement far
from the others widens it, so the declaration measures on, and the median it declares then sets
that one aside; a spread estimated robustly from three values would call two close ones and a far
one precise.

`confirm_top_k: 0` turns the round off: the best trial wins on its own measurement and is
re-measured once, alone, for the report (the study's behaviour before this round existed).

The round is stored in the study (user attribute `confirm`) after its first pass and after each
further one, so a resumed finalize reuses it, and carries on with its passes, unless the candidates
or the seed changed.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from slotune.engine.config import EngineConfig
from slotune.evals.gate_spec import GateSpec
from slotune.tuner.measure.metrics import CI_RATES, ci_keys, mean_half_width
from slotune.tuner.search.objective import DEFAULT_TRIAL_RUNNER, TrialFailure, by_first_objective, measure, ranked_feasible
from slotune.tuner.report.reasons import failed_gates
from slotune.tuner.search.references import DEFAULT_TAG
from slotune.tuner.report.html import ReportSection
from slotune.tuner.spec.slo import COST_RATES, Check, SLOLimits, judge
from slotune.tuner.measure.units import format_value, interval, metric_label, overlaps, value_with_ci

CONFIRM_ATTR = "confirm"
DECLARE_ATTR = "declare"


def candidates(study, spec) -> list:
    """The trials the round re-measures, best first by their own value of the first objective, one
    per distinct config: the best `budget.confirm_top_k` feasible ones (1 with the round off), then
    up to as many near misses (`near_misses`) that rank above the last of those (none when no trial
    is feasible: the round needs a feasible trial to fall back on)."""
    from optuna.trial import TrialState  # optuna: the [tune] extra, imported where a study exists

    k, seen = max(spec.budget.confirm_top_k, 1), []

    def distinct(ranked) -> list:
        out = []
        for t in ranked:
            config = t.user_attrs.get("config")
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
        for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        if not t.user_attrs.get("feasible")
        and _missed_only_within_noise(t.user_attrs, limits)
        and rank(t) < rank(picked[-1])
    ]
    return sorted(picked + distinct(sorted(near, key=rank)), key=rank)


def near_misses(metrics: dict[str, Any] | None, limits: SLOLimits) -> list[Check]:
    """The SLO limits `metrics` missed, when each lies inside its metric's interval (a latency's low
    end at or under its limit, a throughput's high end at or over its floor): the measurement cannot
    tell whether the config meets them. [] when nothing is missed, or anything is missed by more than
    that (or has no interval)."""
    missed = [c for c in judge(metrics or {}, limits).checks if not c.passed]
    for c in missed:
        ci = interval(metrics, c.key)
        if c.value is None or ci is None or (ci[1] < c.limit if c.name == "throughput" else ci[0] > c.limit):
            return []
    return missed


def _missed_only_within_noise(user_attrs: dict[str, Any], limits: SLOLimits) -> bool:
    """A measured trial (no failure, not stopped early, its gates not failed) whose only fault is SLO
    limits missed within noise (`near_misses`)."""
    v = user_attrs.get("violations") or {}
    return (
        not user_attrs.get("fail_reason")
        and not v.get("early_stop")
        and not v.get("quality_gates")
        and bool(near_misses(user_attrs.get("metrics"), limits))
    )


def near_words(user_attrs: dict[str, Any], limits: SLOLimits) -> list[str]:
    """A near miss's missed limits in words, each with the interval that holds the limit:
    'p95 TTFT 1.6 s > limit 1.5 s (+7%); its interval 1.35 s-1.71 s'."""
    m = user_attrs.get("metrics") or {}
    return [
        f"{c.text}; its interval {format_value(c.key, interval(m, c.key)[0])}-"
        f"{format_value(c.key, interval(m, c.key)[1])}"
        for c in near_misses(m, limits)
    ]


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
        runner: the trial process's command (see `objective.run_trial_process`).
        say: where each measurement's line goes.

    Returns:
        The stored record: {"seed", "order", "measurements": [{"trial", "metrics"} or {"trial", "error"}]};
        a near miss's measurement also has "gates": its gate report, None when the SLO missed again;
        a measurement of a later pass has "pass": 2, 3, ... (the first pass's have none).
    """
    order = plan(spec, trials)
    stored = study.user_attrs.get(CONFIRM_ATTR)
    configs = {t.number: EngineConfig.model_validate(t.user_attrs["config"]) for t in trials}
    near = {t.number for t in trials if not t.user_attrs.get("feasible")}  # their gates run here (module docstring)
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
            f"{key} = {format_value(key, r['metrics'].get(key))}"
            + (f"; quality gates {'passed' if r['gates']['passed'] else 'failed'}" if r.get("gates") else "")
        )
        return {"trial": number, "metrics": r["metrics"], **({"gates": r.get("gates")} if gates else {})}

    if stored and stored.get("seed") == spec.robustness_seed and stored.get("order") == order:
        record = stored
    else:
        record = {
            "seed": spec.robustness_seed,
            "order": order,
            "measurements": [measured(f"confirm {i + 1}/{len(order)}", n, n in near) for i, n in enumerate(order)],
        }
        study.set_user_attr(CONFIRM_ATTR, record)
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
        study.set_user_attr(CONFIRM_ATTR, record)


def declaration_seeds(spec) -> list[int]:
    """The workload seeds the declaration measurements may use, in order, as many as it may take
    (`Budget.declare_cap`): fresh ones after the round's, skipping the study's own workload seed
    (its trials' numbers favour their configs too)."""
    from slotune.tuner.spec.workload_spec import MAX_SEED

    seeds, seed = [], spec.robustness_seed
    while len(seeds) < spec.budget.declare_cap:
        seed = seed + 1 if seed < MAX_SEED else 0
        if seed not in (spec.workload.seed, spec.robustness_seed):
            seeds.append(seed)
    return seeds


def objective_values(measurements, trial: int | None, key: str) -> list[float]:
    """The objective `key` of `trial`'s (None: the default's) successful declaration measurements."""
    return [
        m["metrics"][key]
        for m in measurements
        if m.get("trial") == trial and isinstance((m.get("metrics") or {}).get(key), (int, float))
    ]


def half_width(values: list[float]) -> float | None:
    """The half-width of the 95% interval of the mean of `values` (Student's t, n - 1 degrees of
    freedom) as a fraction of the mean; None under 2 values or at a zero mean. Student's t, not the
    standard error alone: two measurements that happen to agree say little about the spread (one
    degree of freedom, t = 12.7), so a mean of two counts as precise only when they agree closely."""
    mean = statistics.fmean(values) if len(values) >= 2 else 0.0
    return mean_half_width(values) / abs(mean) if mean else None


def is_declared(budget, values: list[float], seeds_measured: int) -> bool:
    """Has the declaration measured enough? At least `declare_repeats` seeds; then, with
    `declare_precision` set, until the 95% interval of the mean of the winner's `values` (its
    successful measurements of the objective) is within that fraction of it (`half_width`), or
    `declare_cap` seeds.

    The interval decides from 3 values on. Stopping when the spread looks small favours samples
    whose spread is underestimated, and two values are the worst case: on the Xeon (2026-11-26,
    example 02) a winner measured 4.49 and 4.42 req/s on its two seeds, an interval of +-9.3%, and
    re-measured 5.30 on five others. With fewer than 2 values after `declare_repeats` seeds it
    stops: one seed was asked for (`declare_repeats: 1`), or the winner fails on fresh seeds and
    more of them would not make a mean."""
    if seeds_measured < budget.declare_repeats:
        return False
    if budget.declare_precision is None or seeds_measured >= budget.declare_cap or len(values) < 2:
        return True
    if len(values) < 3:
        return False
    width = half_width(values)
    return width is None or width <= budget.declare_precision  # None: a zero mean, no relative precision to reach


def run_declaration(
    spec, study, trial, *, runner: tuple[str, ...] = DEFAULT_TRIAL_RUNNER, say: Callable[[str], None] = print
) -> dict[str, Any]:
    """Measure the declared winner `trial` and the default config on `declaration_seeds`, winner
    first on each, until `is_declared`; store the record in the study after every seed.

    A stored record for the same trial whose seeds begin the same sequence is carried on from
    (a finished one, under the same budget, is returned as it is), unless every winner
    measurement in it failed: then it is measured again from the start.

    Returns:
        {"trial", "seeds", "measurements": [{"trial" (None: the default), "seed", "metrics" or "error"}]}.
    """
    planned = declaration_seeds(spec)
    key = spec.objective.metric_key()
    stored = study.user_attrs.get(DECLARE_ATTR) or {}
    seeds, measurements = [], []
    if (
        stored.get("trial") == trial.number
        and stored.get("seeds") == planned[: len(stored.get("seeds", []))]
        and any(m.get("metrics") for m in stored["measurements"] if m.get("trial") is not None)
    ):
        seeds, measurements = list(stored["seeds"]), list(stored["measurements"])
    configs = {trial.number: EngineConfig.model_validate(trial.user_attrs["config"]), None: spec.base_config()}
    record = {"trial": trial.number, "seeds": seeds, "measurements": measurements}
    while not is_declared(spec.budget, values := objective_values(measurements, trial.number, key), len(seeds)):
        seed, step = planned[len(seeds)], _step_words(spec.budget, len(seeds) + 1, values)
        for number in (trial.number, None):
            label = DEFAULT_TAG if number is None else f"trial {number}"
            try:
                r = measure(spec, configs[number], seed=seed, early_stop=False, runner=runner, gates=False)
                measurements.append({"trial": number, "seed": seed, "metrics": r["metrics"]})
                say(f"{step}: {label} on workload seed {seed}: {key} = {format_value(key, r['metrics'].get(key))}")
            except TrialFailure as exc:
                measurements.append({"trial": number, "seed": seed, "error": exc.reason})
                say(f"{step}: {label} failed: {exc.reason}")
        seeds.append(seed)
        study.set_user_attr(DECLARE_ATTR, record)  # an interrupted declaration resumes from here
    return record


def _step_words(budget, n: int, values: list[float]) -> str:
    """The progress line's head for the n-th declaration seed, saying why it is measured."""
    if n <= budget.declare_repeats:
        return f"declare {n}/{budget.declare_repeats}"
    why = (
        "the interval decides from 3 measurements on"
        if len(values) < 3
        else f"the 95% interval of the winner's mean is ±{half_width(values):.1%} of it, wider than the "
        f"±{budget.declare_precision:.0%} asked"
    )
    return f"declare {n} (at most {budget.declare_cap}: {why})"


def median_metrics(got: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Several measurements of one config on different seeds as one: the median of each numeric
    metric (with two, their mean), and an interval spanning all of theirs and their values
    (`_ci_low` the lowest, `_ci_high` the highest), for every metric that has intervals
    (`metrics.CI_RATES`, the costs, any with one measured). The median, as benchmark harnesses
    report (pyperf, asv): on a shared host one measurement in a moment when everything slowed
    (example 01 on the Xeon, 2026-11-27: 13.9, 15.8, 16.8, 39.4, 16.9, 17.6 ms p95 TPOT; the default
    beside the 39.4 ran 1.3x its usual) would move a mean by a quarter and moves the median by
    nothing. A measurement's own interval sees the spread across its requests only (none at all for
    a rate when every request added the same); the values of several measurements show the drift
    between runs. None when empty."""
    if not got:
        return None
    values = _common_numbers(got)
    out: dict[str, Any] = {
        k: min(v) if k.endswith("_ci_low") else max(v) if k.endswith("_ci_high") else statistics.median(v)
        for k, v in values.items()
    }
    for k, vals in values.items():
        lo, hi = ci_keys(k)
        if len(vals) > 1 and (k in CI_RATES or k in COST_RATES or any(lo in m for m in got)):
            out[lo] = min(vals + [m[lo] for m in got if isinstance(m.get(lo), (int, float))])
            out[hi] = max(vals + [m[hi] for m in got if isinstance(m.get(hi), (int, float))])
    return out


def declared_as(n: int) -> str:
    """What `median_metrics` makes of n measurements, in a word for the report."""
    return "median" if n > 2 else "mean"


def _common_numbers(got: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Each metric that every measurement in `got` has as a number: its values, in order."""
    values: dict[str, list[float]] = {}
    for k in set().union(*got):
        vals = [m[k] for m in got if isinstance(m.get(k), (int, float)) and not isinstance(m.get(k), bool)]
        if len(vals) == len(got):
            values[k] = vals
    return values


@dataclass(frozen=True)
class Measured:
    """One measurement of the round, judged."""

    position: int  # 1-based, in the order measured
    trial: int | None  # None: the default config
    metrics: dict[str, Any] | None
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
    def default_metrics(self) -> dict[str, Any] | None:
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
        mine = interval(self.standing(self.winner).metrics, self.key)
        if mine is None:
            return []
        out = []
        for n in self.by_trial:
            m = self.standing(n)
            theirs = interval(m.metrics, self.key) if n != self.winner and m.feasible else None
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
                metrics=median_metrics([d["metrics"] for d in wins]),
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
                    default=median_metrics([d["metrics"] for d in same]), default_seeds=[d["seed"] for d in same]
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
                **({"metrics": m.metrics} if m.metrics is not None else {"error": m.error}),
            }
            for m in self.measured
        ]

    def drift(self) -> str | None:
        """The default's two measurements in words, when both exist: how much the round drifted."""
        ends = [m.metrics.get(self.key) for m in self.of(None) if m.metrics]
        if len(ends) != 2 or not all(isinstance(v, (int, float)) for v in ends) or not ends[0]:
            return None
        return (
            f"the default measured {format_value(self.key, ends[0])} first and {format_value(self.key, ends[1])} "
            f"last ({ends[1] / ends[0] - 1:+.0%} over the round)"
        )

    def section(self, trial_values: dict[int, float]) -> ReportSection:
        """The report's section: every measurement of the round with its interval, the winner marked."""
        label = metric_label(self.key)
        rank = {n: i for i, n in enumerate(self.by_trial)}
        if self.is_round:
            feasible = len(self.by_trial) - len(self.near)
            text = (
                f"The best {feasible} feasible trial{'s' if feasible > 1 else ''}"
                + (
                    f", and {len(self.near)} that missed the SLO by less than {'its' if len(self.near) == 1 else 'their'} "
                    f"own measurement's noise,"
                    if self.near
                    else ""
                )
                + f" were measured again on workload seed {self.seed}, one after the other, between two "
                f"measurements of the default config, and the winner picked on these numbers (the SLO judged again)."
            )
            text += self._near_words()
            drift = self.drift()
            if drift:
                text += f" Drift: {drift}."
            if self.passes > 1:
                text += self._passes_words()
        else:
            text = (
                f"No confirmation round (budget.confirm_top_k: 0): the best trial won on its own measurement "
                f"and was measured once more, alone, on workload seed {self.seed}."
            )
        wins, declared = self.declared_of(self.winner), self.remeasure()
        if wins:
            vals = ", ".join(format_value(self.key, d["metrics"].get(self.key)) for d in wins)
            text += (
                f"\nThe winner was then measured {len(wins)} more time{'s' if len(wins) > 1 else ''} on fresh "
                f"workload seeds ({vals}), each time beside the default; the numbers declared for it are their "
                f"{declared_as(len(wins))} ({format_value(self.key, declared['metrics'].get(self.key))}), "
                f"compared with the default's on the same seeds: the round picked it on its own numbers there, "
                f"which favour it."
            )
            width = declared.get("half_width")
            if width is not None:
                text += f" The 95% interval of their mean (Student's t) is ±{width:.1%} of it"
                if self.declare_precision is None:
                    text += "."
                elif width <= self.declare_precision:
                    text += f", within the ±{self.declare_precision:.0%} asked (budget.declare_precision)."
                else:
                    text += (
                        f", wider than the ±{self.declare_precision:.0%} asked (budget.declare_precision): the "
                        f"measurements stopped at budget.declare_max_repeats; the value is less certain than asked."
                    )
            missed = declared.get("missed") or []
            if missed:
                text += (
                    f" It missed the SLO on {len(missed)} of those {len(wins)} seeds ("
                    + "; ".join(f"seed {m['seed']}: {', '.join(m['reasons'])}" for m in missed)
                    + ")."
                )
            if declared["reasons"]:
                text += f" Its declared numbers miss the SLO: {'; '.join(declared['reasons'])}."
        elif self.declared:
            text += (
                f"\nThe declaration measurements of the winner failed ({declared.get('declare_error')}); "
                f"its declared numbers are the round's."
            )
        rivals = self.rivals()
        rival_trials = {m.trial for m in rivals}
        if not self.is_confirmed:
            text += (
                f"\n{'No candidate' if self.is_round else 'The winner'} met the SLO when measured again: the "
                f"winner is trial {self.winner}, the best on its own measurement, unconfirmed."
            )
        elif self.is_round and self.winner != self.by_trial[0]:
            first = self.standing(self.by_trial[0])
            how = (
                "did worse when measured again" + (", but within noise (below)" if first.trial in rival_trials else "")
                if first.feasible
                else "did not qualify when measured again: " + "; ".join(first.reasons)
                if first.metrics is not None
                else f"failed when measured again: {first.error}"
            )
            text += (
                f"\nThe winner, trial {self.winner}, ranked {_ordinal(rank[self.winner] + 1)} on its own trial; "
                f"trial {self.by_trial[0]}, first there, {how}."
            )
        text += self._rivals_words(rivals)
        rows = [["#", "measured", f"own trial {label}", f"re-measured {label}", "meets the SLO", "winner"]]
        after = [
            (judged(len(self.measured) + i + 1, d, self.limits, self.key), f" (declaration, seed {d['seed']})")
            for i, d in enumerate(self.declared)
        ]
        for m, where in [(m, f" (pass {m.pass_no})" if m.pass_no > 1 else "") for m in self.measured] + after:
            own = (
                "–"
                if m.trial is None
                else format_value(self.key, trial_values.get(m.trial))
                + (" (missed the SLO within noise)" if m.trial in self.near else "")
            )
            again = value_with_ci(m.metrics, self.key) if m.metrics is not None else f"failed: {m.error}"
            ok = "–" if m.metrics is None else ("yes" if m.feasible else "no: " + "; ".join(m.reasons))
            mark = "yes" if m.trial == self.winner else "within noise" if m.trial in rival_trials else ""
            rows.append([str(m.position), m.label + where, own, again, ok, mark])
        return ReportSection("Confirmation round", text, table=rows, anchor="confirmation")

    def _near_words(self) -> str:
        """Which candidates entered as near misses, what their own trials missed, and what the round
        asked of them (module docstring)."""
        if not self.near:
            return ""
        parts = [f"trial {n} ({'; '.join(words)})" for n, words in self.near.items()]
        return f" Near misses: {', '.join(parts)}: the interval holds the limit, so the config may meet it. " + (
            "Such a candidate's quality gates were not run on its trial (only SLO-meeting trials run them); "
            "the round ran them, and it can win only if its re-measurement meets the SLO and its gates pass."
            if self.gated
            else "It can win only if its re-measurement meets the SLO."
        )

    def _passes_words(self) -> str:
        """What the further passes measured, and each contender's standing over them."""
        again = [n for n in self.by_trial if len(self.of(n)) > 1]
        parts = [
            f"trial {n} {value_with_ci(self.standing(n).metrics, self.key)} over {len(self.of(n))} passes "
            f"({', '.join(format_value(self.key, (m.metrics or {}).get(self.key)) for m in self.of(n))})"
            for n in again
        ]
        return (
            f"\nThe winner's interval overlapped another candidate's, so the winner and the candidates within "
            f"noise of it were measured again on the same seed, in reverse order each pass, {self.passes} passes "
            f"in all (at most budget.confirm_passes), and judged on their mean: {'; '.join(parts)}."
        )

    def _rivals_words(self, rivals: list[Measured]) -> str:
        """Say plainly which candidates (`rivals`) the round could not tell from the winner, and how they differ."""
        if not rivals:
            return ""
        mine = value_with_ci(self.standing(self.winner).metrics, self.key)
        parts = []
        for m in rivals:
            diff = self.differences(m.trial)
            parts.append(
                f"trial {m.trial}, {metric_label(self.key)} {value_with_ci(m.metrics, self.key)} against the "
                f"winner's {mine}" + (f", with {', '.join(diff)}" if diff else "")
            )
        over = f" after {self.passes} passes" if self.passes > 1 else ""
        return (
            f"\nWithin noise of the winner in this round{over} (the intervals overlap, and the SLO held): "
            f"{'; '.join(parts)}. The round cannot tell {'it' if len(rivals) == 1 else 'them'} from the winner "
            f"on this machine: the winner's lead is within noise, and the differences listed are not "
            f"shown to matter."
        )


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
    metrics = m.get("metrics")
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


def pooled_metrics(got: list[dict[str, Any]]) -> dict[str, Any]:
    """Several passes' measurements of one config on one seed as one: the mean of each numeric metric,
    and for each with an interval in every pass, an interval around that mean with the wider of two
    half-widths on each side: the passes' own half-widths pooled as for a mean of independent
    measurements (sqrt(sum h^2) / n, narrowing as passes add requests), and 1.96 standard errors of
    the passes' values (drift between passes, when they disagree by more than their intervals say)."""
    n = len(got)
    out: dict[str, Any] = {
        k: sum(vals) / n for k, vals in _common_numbers(got).items() if not k.endswith(("_ci_low", "_ci_high"))
    }
    for k in list(out):
        lo, hi = ci_keys(k)
        if not all(isinstance(m.get(lo), (int, float)) and isinstance(m.get(hi), (int, float)) for m in got):
            continue
        spread = 1.96 * statistics.stdev([m[k] for m in got]) / math.sqrt(n)
        below = math.sqrt(sum((m[k] - m[lo]) ** 2 for m in got)) / n
        above = math.sqrt(sum((m[hi] - m[k]) ** 2 for m in got)) / n
        out[lo], out[hi] = out[k] - max(below, spread), out[k] + max(above, spread)
    return out


def confirm_round(spec, record: dict[str, Any], trials: list) -> Confirmation:
    """Judge a round (`run_round`'s record) and pick the winner.

    The winner is the candidate whose re-measurement (its `standing` over the passes) met the SLO
    (`slo.judge`; a near miss's gates too) with the best value of the first objective; the best feasible one by its own trial when
    none did (then `is_confirmed` is False).
    """
    obj = spec.objective
    key, direction = obj.metric_key(), obj.direction()
    limits = SLOLimits.from_objective(obj)
    near = {t.number: near_words(t.user_attrs, limits) for t in trials if not t.user_attrs.get("feasible")}
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


def _ordinal(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"
