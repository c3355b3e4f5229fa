"""The winner's confirmation: the default config and the best trials measured again on fresh workload
seeds, and the winner chosen on those numbers.

A trial's own numbers come from the study's workload seed, and the best of many noisy trials is partly
the luckiest. So the default and the best `confirm.candidates` feasible trials are each started once, in
one trial process, and replayed on `confirm.seeds` fresh seeds; the winner is the candidate with the best
median that held the SLO on every seed, and its declared numbers are that median with its interval,
beside the default's on the same seeds. A config that misses the SLO on a seed is not replayed on the
next: a candidate cannot win then, and a default that misses is only the reference. A default whose own
trial was more than FAR_DEFAULT times worse than the best candidate's is replayed on the first seed only:
a gap that wide needs no second seed to be stated. Each process's measurements are stored in the study
(user attribute `confirm`) as it ends, so a resumed run measures only what is missing.
Rationale and measurements: docs/design/confirmation.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from slotune.tuner.decide.aggregate import median_metrics
from slotune.tuner.measure.measurement import Measurement
from slotune.tuner.measure.trial_process import DEFAULT_TRIAL_RUNNER, TrialFailure, TrialResult, measure_seeds
from slotune.tuner.measure.units import metric_label, overlaps
from slotune.tuner.search.records import TrialRecord, store_confirmation, stored_confirmation
from slotune.tuner.search.references import DEFAULT_TAG, reference_metrics
from slotune.tuner.search.trials import ranked_feasible
from slotune.tuner.spec.server import parse_config
from slotune.tuner.spec.slo import SLOLimits, judge
from slotune.tuner.spec.workload_spec import MAX_SEED

FAR_DEFAULT = 4.0  # a default this many times worse than the best candidate in the search: one seed


@dataclass(frozen=True)
class Run:
    """One measurement of the confirmation: a candidate (`trial`) or the default (None) on one seed."""

    trial: int | None
    seed: int
    metrics: Measurement | None  # None: it failed, or was skipped
    error: str | None = None
    missed: tuple[str, ...] = ()  # the SLO limits it missed on this seed, in words
    skipped: bool = False  # not replayed: the config missed the SLO on an earlier seed

    @property
    def held(self) -> bool:
        return self.metrics is not None and not self.missed


@dataclass(frozen=True)
class Confirmation:
    """The confirmation's measurements, judged (`judge_runs`)."""

    key: str  # the metric the winner is chosen on
    direction: str
    limits: SLOLimits
    seeds: tuple[int, ...]
    default_seeds: tuple[int, ...]  # the seeds the default was replayed on: the first only when it is far worse
    candidates: tuple[int, ...]  # best first by their own trials
    runs: tuple[Run, ...]  # in the order measured
    winner: int
    confirmed: bool  # the winner held the SLO on every seed; else the best trial by its own numbers
    params: dict[int, dict[str, Any]]

    def runs_of(self, trial: int | None) -> list[Run]:
        return [r for r in self.runs if r.trial == trial]

    def median(self, trial: int | None) -> Measurement | None:
        """`trial`'s (None: the default's) measurements as one (`median_metrics`)."""
        return median_metrics([r.metrics for r in self.runs_of(trial) if r.metrics])

    def held(self, trial: int) -> bool:
        """Measured on every seed, and held the SLO on each (False when nothing was measured)."""
        runs = self.runs_of(trial)
        return len(runs) == len(self.seeds) > 0 and all(r.held for r in runs)

    def within_noise(self) -> list[int]:
        """The other candidates that held the SLO with an interval overlapping the winner's."""
        mine = (self.median(self.winner) or Measurement()).interval(self.key)
        if not self.confirmed or mine is None:
            return []
        theirs = {n: (self.median(n) or Measurement()).interval(self.key) for n in self.candidates if n != self.winner}
        return [n for n, ci in theirs.items() if ci is not None and self.held(n) and overlaps(ci, mine)]

    def declared(self) -> dict[str, Any]:
        """The winner's declared numbers as best_metrics.json `remeasured` stores them: {seeds, metrics (its
        median) or error, default (the default's median), default_seeds, reasons: what the median
        misses of the SLO}; {} when nothing was measured."""
        if not self.runs:
            return {}
        metrics = self.median(self.winner)
        return {
            "seeds": [r.seed for r in self.runs_of(self.winner) if r.metrics],
            **({"metrics": metrics} if metrics else {"error": next(r.error for r in self.runs_of(self.winner))}),
            "default": self.median(None),
            "default_seeds": [r.seed for r in self.runs_of(None) if r.metrics],
            "reasons": judge(metrics, self.limits).reasons if metrics else [],
        }

    def to_json(self) -> list[dict[str, Any]]:
        """best_metrics.json's `confirm` list: each measurement in order, and whether it held the SLO."""
        return [
            {"trial": r.trial, "seed": r.seed, "held": r.held, "missed": list(r.missed)} | _outcome(r)
            for r in self.runs
        ]


def candidates(study, spec) -> list[TrialRecord]:
    """The best `confirm.candidates` feasible trials (at least 1), best first, one per distinct config;
    in a shoot-out also each server's best, so every server's is measured beside the others."""
    ranked, picked = ranked_feasible(study, spec), []
    for t in ranked:
        if all(t.config != p.config for p in picked):
            picked.append(t)
        if len(picked) == max(spec.confirm.candidates, 1):
            break
    for label in [s.label for s in spec.servers or []]:
        best = next((t for t in ranked if t.config.get("name") == label), None)
        if best is not None and all(best.config != p.config for p in picked):
            picked.append(best)
    return picked


def confirm_seeds(spec) -> list[int]:
    """`confirm.seeds` fresh workload seeds from robustness_seed on, skipping the study's own."""
    seeds, seed = [], spec.robustness_seed
    while len(seeds) < spec.confirm.seeds:
        if seed != spec.workload.seed:
            seeds.append(seed)
        seed = seed + 1 if seed < MAX_SEED else 0
    return seeds


def run_confirmation(
    spec,
    study,
    trials: list,
    *,
    runner: tuple[str, ...] = DEFAULT_TRIAL_RUNNER,
    on_run: Callable[[Run, int, int], None] = lambda run, i, n: None,
) -> Confirmation:
    """Measure the default, then each candidate, on every confirmation seed (one trial process per
    config), reusing the study's stored measurements; store them after each process; `on_run(run, i, n)`
    after each new one. With `confirm.candidates: 0`, nothing is measured: the best trial wins, unconfirmed."""
    trials = [TrialRecord.of(t) for t in trials]
    seeds = confirm_seeds(spec) if spec.confirm.candidates else []
    default = spec.base_config()
    configs = {None: default} | {t.number: c for t in trials if (c := parse_config(t.config)) != default}
    far = len(configs) > len(trials) and _far_worse(spec, study, trials)  # the default is no candidate
    planned = {n: seeds[:1] if n is None and far else seeds for n in configs}
    previous = (stored_confirmation(study) or {}).get("runs", [])
    stored = {(m["trial"], m["seed"]): m for m in previous if "metrics" in m or m.get("skipped")}
    key, limits, plan = spec.objective.metric_key(), SLOLimits.from_objective(spec.objective), []
    for number, config in configs.items():
        missing = [s for s in planned[number] if (number, s) not in stored]
        results = measure_seeds(spec, config, missing, runner=runner, stop_after_miss=True) if missing else []
        for seed, got in zip(missing, results):
            stored[number, seed] = m = _stored(number, seed, got)
            on_run(_run(m, key, limits), len(plan) + planned[number].index(seed) + 1, sum(map(len, planned.values())))
        plan += [(number, s) for s in planned[number]]
        if missing:
            store_confirmation(study, {"seeds": seeds, "runs": list(stored.values())})
    # A candidate that is the default config takes the default's measurements.
    as_default = [t.number for t in trials if t.number not in configs]
    runs = [stored[k] for k in plan] + [{**stored[None, s], "trial": n} for n in as_default for s in seeds]
    return judge_runs(spec, {"seeds": seeds, "default_seeds": planned[None], "runs": runs}, trials)


def _far_worse(spec, study, trials: list[TrialRecord]) -> bool:
    """The default's own trial is more than FAR_DEFAULT times worse than the best candidate's."""
    key, sign = spec.objective.metric_key(), 1 if spec.objective.direction() == "minimize" else -1
    own = (reference_metrics(study).get(DEFAULT_TAG) or {}).get(key)
    best = (trials[0].metrics or {}).get(key) if trials else None
    if own is None or best is None or own <= 0 or best <= 0:
        return False
    return (own / best) ** sign > FAR_DEFAULT


def judge_runs(spec, record: dict[str, Any], trials: list) -> Confirmation:
    """The stored measurements ({seeds, runs}) judged: the winner is the candidate that held the SLO
    on every seed with the best median; when none did, the best trial by its own numbers, unconfirmed."""
    obj, trials = spec.objective, [TrialRecord.of(t) for t in trials]
    key, limits = obj.metric_key(), SLOLimits.from_objective(obj)
    c = Confirmation(
        key=key,
        direction=obj.direction(),
        limits=limits,
        seeds=tuple(record["seeds"]),
        default_seeds=tuple(record.get("default_seeds", record["seeds"])),
        candidates=tuple(t.number for t in trials),
        runs=tuple(_run(m, key, limits) for m in record["runs"]),
        winner=trials[0].number,
        confirmed=False,
        params={t.number: dict(t.params) for t in trials},
    )
    sign = 1 if c.direction == "minimize" else -1
    held = [n for n in c.candidates if c.held(n)]
    if not held:
        return c
    best = min(held, key=lambda n: (sign * c.median(n)[key], c.candidates.index(n)))
    return dataclasses.replace(c, winner=best, confirmed=True)


def _outcome(r: Run) -> dict[str, Any]:
    if r.metrics is not None:
        return {"metrics": r.metrics.to_dict()}
    return {"skipped": True} if r.skipped else {"error": r.error}


def _stored(trial: int | None, seed: int, got: TrialResult | TrialFailure | None) -> dict[str, Any]:
    """One measurement as the study stores it: {trial, seed, metrics, error or skipped}."""
    out: dict[str, Any] = {"trial": trial, "seed": seed}
    if got is None:
        return out | {"skipped": True}
    return out | ({"error": got.reason} if isinstance(got, TrialFailure) else {"metrics": got.metrics.to_dict()})


def _run(m: dict[str, Any], key: str, limits: SLOLimits) -> Run:
    """One stored measurement ({trial, seed, metrics, error or skipped}) judged against the SLO; the
    objective `key` must be measured."""
    metrics = Measurement.from_dict(m["metrics"]) if m.get("metrics") is not None else None
    missed: list[str] = []
    if metrics is not None:
        missed = judge(metrics, limits).reasons
        if metrics.get(key) is None:
            missed.append(f"{metric_label(key)} not measured")
    return Run(m["trial"], m["seed"], metrics, m.get("error"), tuple(missed), bool(m.get("skipped")))
