"""The confirmation round: the best trials measured again, together, before a winner is declared.

A trial's numbers come from one run on one workload seed, on a machine whose speed drifts (other
processes, caches, clocks), so the best of many noisy trials is partly the luckiest. `finalize`
(tuner/study.py) therefore re-measures the best `budget.confirm_top_k` feasible trials on a fresh
workload seed (`robustness_seed`) in one round with the default config, and the winner is the best
of them on those numbers, its SLO judged again (`slo.judge`; the quality gates do not depend on the
workload and are not run again).

Order: default, c1, c2, ..., ck, default (c1 the best by its own trial). Interleaved in one round,
one right after the other, so whatever drift there is reaches every candidate alike instead of
favouring the one measured in a quiet moment of the study, and candidates the winner is picked
between are neighbours in time. The default measured first and last brackets the round: the
difference between its two measurements is the drift over the round, and the winner is compared
with both together (mean value, an interval spanning both: `Confirmation.default_metrics`).
Alternating the default between every candidate would time drift more finely but costs k - 1
more measurements for a comparison the round already makes between adjacent candidates.

Declared numbers: the round picks the winner on its measurements, so the winner's own measurement
in the round is biased in its favour (of k noisy candidates the one that measured luckiest tends
to win). After the round the winner and the default config are measured on `budget.declare_repeats`
fresh workload seeds, one after the other on each (`run_declaration`), and the numbers declared
(best_metrics.json `remeasured`, the report's winner card) are the winner's mean there, with an
interval spanning its measurements, compared with the default's mean on the same seeds.

How many seeds is decided by the measurements themselves (`is_declared`), as a benchmark harness
samples until its estimate is tight: after `declare_repeats`, further seeds are measured while the
95% interval of the winner's mean (Student's t) is wider than +-`budget.declare_precision` of it,
up to `Budget.declare_cap`. A quiet machine stops at `declare_repeats`; on a shared one, where the
same replay varies by a third from one run to the next (bench/tuner/noise-floor-*.md), the
declaration measures until the mean is good to the precision asked or the cap is reached (the
report says which).

`confirm_top_k: 0` turns the round off: the best trial wins on its own measurement and is
re-measured once, alone, for the report (the study's behaviour before this round existed).

The round is stored in the study (user attribute `confirm`) once complete, so a resumed finalize
reuses it unless the candidates or the seed changed.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from slotune.engine.config import EngineConfig
from slotune.tuner.metrics import CI_RATES, ci_keys
from slotune.tuner.objective import DEFAULT_TRIAL_RUNNER, TrialFailure, measure, ranked_feasible
from slotune.tuner.references import DEFAULT_TAG
from slotune.tuner.report_html import ReportSection
from slotune.tuner.slo import COST_RATES, SLOLimits, judge
from slotune.tuner.units import format_value, interval, metric_label, overlaps, value_with_ci

CONFIRM_ATTR = "confirm"
DECLARE_ATTR = "declare"


def candidates(study, spec) -> list:
    """The feasible complete trials the round re-measures, best first by the first objective:
    `budget.confirm_top_k` of them (1 with the round off), one per distinct config."""
    picked, seen = [], []
    for t in ranked_feasible(study, spec):
        config = t.user_attrs.get("config")
        if config in seen:  # a sampler that proposed the same config twice: measured once
            continue
        seen.append(config)
        picked.append(t)
        if len(picked) == max(spec.budget.confirm_top_k, 1):
            break
    return picked


def plan(spec, trials: list) -> list[int | None]:
    """The round's order: trial numbers, None for the default config (see the module docstring)."""
    numbers = [t.number for t in trials]
    return [None, *numbers, None] if spec.budget.confirm_top_k else numbers


def run_round(spec, study, trials: list, *, runner: tuple[str, ...] = DEFAULT_TRIAL_RUNNER,
              say: Callable[[str], None] = print) -> dict[str, Any]:
    """Measure the round (or reuse the stored one for the same order and seed); store it in the study.

    Args:
        spec: the TuningSpec.
        study: the study (its `confirm` user attribute holds the round).
        trials: the candidates, best first (`candidates`).
        runner: the trial process's command (see `objective.run_trial_process`).
        say: where each measurement's line goes.

    Returns:
        The stored record: {"seed", "order", "measurements": [{"trial", "metrics"} or {"trial", "error"}]}.
    """
    order = plan(spec, trials)
    stored = study.user_attrs.get(CONFIRM_ATTR)
    if stored and stored.get("seed") == spec.robustness_seed and stored.get("order") == order:
        return stored
    configs = {t.number: EngineConfig.model_validate(t.user_attrs["config"]) for t in trials}
    key = spec.objective.metric_key()
    measurements = []
    for i, number in enumerate(order):
        label = DEFAULT_TAG if number is None else f"trial {number}"
        try:
            r = measure(spec, spec.base_config() if number is None else configs[number], seed=spec.robustness_seed,
                        early_stop=False, runner=runner, gates=False)
            measurements.append({"trial": number, "metrics": r["metrics"]})
            say(f"confirm {i + 1}/{len(order)}: {label} on workload seed {spec.robustness_seed}: "
                f"{key} = {format_value(key, r['metrics'].get(key))}")
        except TrialFailure as exc:
            measurements.append({"trial": number, "error": exc.reason})
            say(f"confirm {i + 1}/{len(order)}: {label} failed: {exc.reason}")
    record = {"seed": spec.robustness_seed, "order": order, "measurements": measurements}
    study.set_user_attr(CONFIRM_ATTR, record)
    return record


def declaration_seeds(spec) -> list[int]:
    """The workload seeds the declaration measurements may use, in order, as many as it may take
    (`Budget.declare_cap`): fresh ones after the round's, skipping the study's own workload seed
    (its trials' numbers favour their configs too)."""
    from slotune.tuner.workload import MAX_SEED

    seeds, seed = [], spec.robustness_seed
    while len(seeds) < spec.budget.declare_cap:
        seed = seed + 1 if seed < MAX_SEED else 0
        if seed not in (spec.workload.seed, spec.robustness_seed):
            seeds.append(seed)
    return seeds


def objective_values(measurements, trial: int | None, key: str) -> list[float]:
    """The objective `key` of `trial`'s (None: the default's) successful declaration measurements."""
    return [m["metrics"][key] for m in measurements if m.get("trial") == trial
            and isinstance((m.get("metrics") or {}).get(key), (int, float))]


def half_width(values: list[float]) -> float | None:
    """The half-width of the 95% interval of the mean of `values` (Student's t, n - 1 degrees of
    freedom) as a fraction of the mean; None under 2 values or at a zero mean. Student's t, not the
    standard error alone: two measurements that happen to agree say little about the spread (one
    degree of freedom, t = 12.7), so a mean of two counts as precise only when they agree closely."""
    mean = statistics.fmean(values) if len(values) >= 2 else 0.0
    if not mean:
        return None
    from scipy.stats import t

    n = len(values)
    return float(t.ppf(0.975, n - 1)) * statistics.stdev(values) / math.sqrt(n) / abs(mean)


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


def run_declaration(spec, study, trial, *, runner: tuple[str, ...] = DEFAULT_TRIAL_RUNNER,
                    say: Callable[[str], None] = print) -> dict[str, Any]:
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
    if (stored.get("trial") == trial.number and stored.get("seeds") == planned[:len(stored.get("seeds", []))]
            and any(m.get("metrics") for m in stored["measurements"] if m.get("trial") is not None)):
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
    why = ("the interval decides from 3 measurements on" if len(values) < 3 else
           f"the 95% interval of the winner's mean is ±{half_width(values):.1%} of it, wider than the "
           f"±{budget.declare_precision:.0%} asked")
    return f"declare {n} (at most {budget.declare_cap}: {why})"


def mean_metrics(got: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Several measurements of one config as one: the mean of each numeric metric, and an interval
    spanning all of theirs and their values (`_ci_low` the lowest, `_ci_high` the highest), for
    every metric that has intervals (`metrics.CI_RATES`, the costs, any with one measured). A
    measurement's own interval sees the spread across its requests only (none at all for a rate
    when every request added the same); the values of several measurements show the drift
    between runs. None when empty."""
    if not got:
        return None
    values: dict[str, list[float]] = {}
    for k in set().union(*got):
        vals = [m[k] for m in got if isinstance(m.get(k), (int, float)) and not isinstance(m.get(k), bool)]
        if len(vals) == len(got):
            values[k] = vals
    out: dict[str, Any] = {k: min(v) if k.endswith("_ci_low") else max(v) if k.endswith("_ci_high") else sum(v) / len(v)
                           for k, v in values.items()}
    for k, vals in values.items():
        lo, hi = ci_keys(k)
        if len(vals) > 1 and (k in CI_RATES or k in COST_RATES or any(lo in m for m in got)):
            out[lo] = min(vals + [m[lo] for m in got if isinstance(m.get(lo), (int, float))])
            out[hi] = max(vals + [m[hi] for m in got if isinstance(m.get(hi), (int, float))])
    return out


@dataclass(frozen=True)
class Measured:
    """One measurement of the round, judged."""

    position: int  # 1-based, in the order measured
    trial: int | None  # None: the default config
    metrics: dict[str, Any] | None
    error: str | None
    reasons: list[str]  # why it misses the SLO on this measurement ([] when it holds)

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

    def with_declaration(self, record: dict[str, Any]) -> "Confirmation":
        """This round with the winner's declaration measurements (`run_declaration`'s record)."""
        assert record["trial"] == self.winner, "the declaration measures the round's winner"
        return dataclasses.replace(self, declared=tuple(record["measurements"]))

    def of(self, trial: int | None) -> list[Measured]:
        return [m for m in self.measured if m.trial == trial]

    @property
    def default_metrics(self) -> dict[str, Any] | None:
        """The default config as the round measured it: the mean of its measurements, and an
        interval spanning both of theirs (drift over the round counts as noise)."""
        return mean_metrics([m.metrics for m in self.of(None) if m.metrics])

    def rivals(self) -> list[Measured]:
        """The round's other candidates that met the SLO with a re-measured interval overlapping the
        winner's: on this round's numbers they cannot be told apart from it. [] outside a confirmed round."""
        if not (self.is_round and self.is_confirmed):
            return []
        mine = interval(self.of(self.winner)[0].metrics, self.key)
        if mine is None:
            return []
        out = []
        for m in self.measured:
            theirs = interval(m.metrics, self.key) if m.trial not in (None, self.winner) and m.feasible else None
            if theirs is not None and overlaps(theirs, mine):
                out.append(m)
        return out

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
        on which workload seeds), round: the winner's own measurement in the round, reasons: why the
        declared metrics miss the SLO ([] when they hold)}. With declaration measurements (`seeds`:
        the seeds they used), the metrics are the winner's mean over them and the default's its mean
        on the same seeds; when every one of the winner's failed, the round's numbers, and
        `declare_error` says why."""
        mine = self.of(self.winner)[0]
        wins, defaults = self.declared_of(self.winner), self.declared_of(None)
        out: dict[str, Any] = {"seed": self.seed, "default": self.default_metrics, "default_seeds": [self.seed],
                               "round": mine.metrics}
        if wins:
            out.update(metrics=mean_metrics([d["metrics"] for d in wins]), seeds=[d["seed"] for d in wins],
                       half_width=half_width(objective_values(wins, self.winner, self.key)))
            same = [d for d in defaults if d["seed"] in out["seeds"]]
            if same:
                out.update(default=mean_metrics([d["metrics"] for d in same]), default_seeds=[d["seed"] for d in same])
        else:
            out.update({"metrics": mine.metrics} if mine.metrics is not None else {"error": mine.error})
            errors = [d["error"] for d in self.declared if d.get("trial") == self.winner and d.get("error")]
            if errors:
                out["declare_error"] = errors[0]
        metrics = out.get("metrics")
        out["reasons"] = judge(metrics, self.limits).reasons if metrics is not None else []
        return out

    def to_json(self) -> list[dict[str, Any]]:
        """best_metrics.json's `confirm` list: each measurement in order, judged; `within_noise_of_winner`
        marks the `rivals`."""
        rivals = self.rivals()
        return [{"position": m.position, "trial": m.trial, "tag": DEFAULT_TAG if m.trial is None else None,
                 "seed": self.seed, "value": (m.metrics or {}).get(self.key), "feasible": m.feasible,
                 "reasons": m.reasons, "winner": m.trial == self.winner and m.trial is not None,
                 "within_noise_of_winner": m in rivals,
                 **({"metrics": m.metrics} if m.metrics is not None else {"error": m.error})}
                for m in self.measured]

    def drift(self) -> str | None:
        """The default's two measurements in words, when both exist: how much the round drifted."""
        ends = [m.metrics.get(self.key) for m in self.of(None) if m.metrics]
        if len(ends) != 2 or not all(isinstance(v, (int, float)) for v in ends) or not ends[0]:
            return None
        return (f"the default measured {format_value(self.key, ends[0])} first and {format_value(self.key, ends[1])} "
                f"last ({ends[1] / ends[0] - 1:+.0%} over the round)")

    def section(self, trial_values: dict[int, float]) -> ReportSection:
        """The report's section: every measurement of the round with its interval, the winner marked."""
        label = metric_label(self.key)
        rank = {n: i for i, n in enumerate(self.by_trial)}
        if self.is_round:
            text = (f"The best {len(self.by_trial)} feasible trial{'s' if len(self.by_trial) > 1 else ''} were "
                    f"measured again on workload seed {self.seed}, one after the other, between two measurements "
                    f"of the default config, and the winner picked on these numbers (the SLO judged again).")
            drift = self.drift()
            if drift:
                text += f" Drift: {drift}."
        else:
            text = (f"No confirmation round (budget.confirm_top_k: 0): the best trial won on its own measurement "
                    f"and was measured once more, alone, on workload seed {self.seed}.")
        wins, declared = self.declared_of(self.winner), self.remeasure()
        if wins:
            vals = ", ".join(format_value(self.key, d["metrics"].get(self.key)) for d in wins)
            text += (f"\nThe winner was then measured {len(wins)} more time{'s' if len(wins) > 1 else ''} on fresh "
                     f"workload seeds ({vals}), each time beside the default; the numbers declared for it are their "
                     f"mean ({format_value(self.key, declared['metrics'].get(self.key))}), compared with the "
                     f"default's on the same seeds: the round picked it on its own numbers there, which favour it.")
            width = declared.get("half_width")
            if width is not None:
                text += f" The 95% interval of that mean (Student's t) is ±{width:.1%} of it"
                if self.declare_precision is None:
                    text += "."
                elif width <= self.declare_precision:
                    text += f", within the ±{self.declare_precision:.0%} asked (budget.declare_precision)."
                else:
                    text += (f", wider than the ±{self.declare_precision:.0%} asked (budget.declare_precision): the "
                             f"measurements stopped at budget.declare_max_repeats; the value is less certain than asked.")
            if declared["reasons"]:
                text += f" Its declared numbers miss the SLO: {'; '.join(declared['reasons'])}."
        elif self.declared:
            text += (f"\nThe declaration measurements of the winner failed ({declared.get('declare_error')}); "
                     f"its declared numbers are the round's.")
        rivals = self.rivals()
        if not self.is_confirmed:
            text += (f"\n{'No candidate' if self.is_round else 'The winner'} met the SLO when measured again: the "
                     f"winner is trial {self.winner}, the best on its own measurement, unconfirmed.")
        elif self.is_round and self.winner != self.by_trial[0]:
            first_is_rival = any(m.trial == self.by_trial[0] for m in rivals)
            text += (f"\nThe winner, trial {self.winner}, ranked {_ordinal(rank[self.winner] + 1)} on its own trial; "
                     f"trial {self.by_trial[0]}, first there, did worse when measured again"
                     f"{', but within noise (below)' if first_is_rival else ''}.")
        text += self._rivals_words(rivals)
        rows = [["#", "measured", f"own trial {label}", f"re-measured {label}", "meets the SLO", "winner"]]
        after = [(judged(len(self.measured) + i + 1, d, self.limits, self.key), f" (declaration, seed {d['seed']})")
                 for i, d in enumerate(self.declared)]
        for m, where in [(m, "") for m in self.measured] + after:
            own = "–" if m.trial is None else format_value(self.key, trial_values.get(m.trial))
            again = value_with_ci(m.metrics, self.key) if m.metrics is not None else f"failed: {m.error}"
            ok = "–" if m.metrics is None else ("yes" if m.feasible else "no: " + "; ".join(m.reasons))
            mark = "yes" if m.trial == self.winner else "within noise" if m in rivals else ""
            rows.append([str(m.position), m.label + where, own, again, ok, mark])
        return ReportSection("Confirmation round", text, table=rows, anchor="confirmation")

    def _rivals_words(self, rivals: list[Measured]) -> str:
        """Say plainly which candidates (`rivals`) the round could not tell from the winner, and how they differ."""
        if not rivals:
            return ""
        mine = value_with_ci(self.of(self.winner)[0].metrics, self.key)
        parts = []
        for m in rivals:
            diff = self.differences(m.trial)
            parts.append(f"trial {m.trial}, {metric_label(self.key)} {value_with_ci(m.metrics, self.key)} against the "
                         f"winner's {mine}" + (f", with {', '.join(diff)}" if diff else ""))
        return (f"\nWithin noise of the winner in this round (the intervals overlap, and the SLO held): "
                f"{'; '.join(parts)}. The round cannot tell {'it' if len(rivals) == 1 else 'them'} from the winner "
                f"on this machine: the winner's lead is within noise, and the differences listed are not "
                f"shown to matter.")


def judged(position: int, m: dict[str, Any], limits: SLOLimits, key: str) -> Measured:
    """One stored measurement ({trial, metrics or error}) judged against the SLO; `key` must be measured."""
    metrics = m.get("metrics")
    reasons = []
    if metrics is not None:
        reasons = judge(metrics, limits).reasons
        if metrics.get(key) is None:
            reasons.append(f"{metric_label(key)} not measured")
    return Measured(position, m.get("trial"), metrics, m.get("error"), reasons)


def confirm_round(spec, record: dict[str, Any], trials: list) -> Confirmation:
    """Judge a round (`run_round`'s record) and pick the winner.

    The winner is the candidate whose re-measurement met the SLO (`slo.judge`) with the best value
    of the first objective; the best by its own trial when none did (then `is_confirmed` is False).
    """
    obj = spec.objective
    key, direction = obj.metric_key(), obj.direction()
    limits = SLOLimits.from_objective(obj)
    measured = [judged(i + 1, m, limits, key) for i, m in enumerate(record["measurements"])]
    by_trial = [t.number for t in trials]
    sign = 1 if direction == "minimize" else -1
    held = [m for m in measured if m.trial is not None and m.feasible]
    best = min(held, key=lambda m: (sign * m.metrics[key], by_trial.index(m.trial))) if held else None
    return Confirmation(seed=record["seed"], key=key, direction=direction, measured=measured, by_trial=by_trial,
                        winner=best.trial if best is not None else by_trial[0], is_confirmed=best is not None,
                        is_round=bool(spec.budget.confirm_top_k), limits=limits,
                        params={t.number: dict(t.params) for t in trials},
                        declare_precision=spec.budget.declare_precision)


def _ordinal(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"
