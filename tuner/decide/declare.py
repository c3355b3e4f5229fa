"""The declaration: the winner and the default measured on fresh workload seeds until the winner's mean is
precise enough (`budget.declare_*`); the record is stored in the study (user attribute `declare`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from slotune.engine.config import EngineConfig
from slotune.tuner.decide.aggregate import half_width
from slotune.tuner.measure.trial_process import DEFAULT_TRIAL_RUNNER, TrialFailure, measure
from slotune.tuner.measure.units import format_value
from slotune.tuner.search.records import TrialRecord, store_declaration, stored_declaration
from slotune.tuner.search.references import DEFAULT_TAG
from slotune.tuner.spec.workload_spec import MAX_SEED


def declaration_seeds(spec) -> list[int]:
    """The workload seeds the declaration measurements may use, in order, as many as it may take
    (`Budget.declare_cap`): fresh ones after the round's, skipping the study's own workload seed
    (its trials' numbers favour their configs too)."""
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


def is_declared(budget, values: list[float], seeds_measured: int) -> bool:
    """Has the declaration measured enough? At least `declare_repeats` seeds; then, with
    `declare_precision` set, until the 95% interval of the mean of the winner's `values` (its
    successful measurements of the objective) is within that fraction of it (`half_width`), or
    `declare_cap` seeds.

    The interval decides from 3 values on: two that happen to agree understate the spread (a
    measured case: docs/design/confirmation.md). With fewer than 2 values after `declare_repeats`
    seeds it stops: one seed was asked for (`declare_repeats: 1`), or the winner fails on fresh
    seeds and more of them would not make a mean."""
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
    trial = TrialRecord.of(trial)
    stored = stored_declaration(study)
    seeds, measurements = [], []
    if (
        stored.get("trial") == trial.number
        and stored.get("seeds") == planned[: len(stored.get("seeds", []))]
        and any(m.get("metrics") for m in stored["measurements"] if m.get("trial") is not None)
    ):
        seeds, measurements = list(stored["seeds"]), list(stored["measurements"])
    configs = {trial.number: EngineConfig.model_validate(trial.config), None: spec.base_config()}
    record = {"trial": trial.number, "seeds": seeds, "measurements": measurements}
    while not is_declared(spec.budget, values := objective_values(measurements, trial.number, key), len(seeds)):
        seed, step = planned[len(seeds)], _step_words(spec.budget, len(seeds) + 1, values)
        for number in (trial.number, None):
            label = DEFAULT_TAG if number is None else f"trial {number}"
            try:
                r = measure(spec, configs[number], seed=seed, early_stop=False, runner=runner, gates=False)
                measurements.append({"trial": number, "seed": seed, "metrics": r.metrics.to_dict()})
                say(f"{step}: {label} on workload seed {seed}: {key} = {format_value(key, r.metrics.get(key))}")
            except TrialFailure as exc:
                measurements.append({"trial": number, "seed": seed, "error": exc.reason})
                say(f"{step}: {label} failed: {exc.reason}")
        seeds.append(seed)
        store_declaration(study, record)  # an interrupted declaration resumes from here
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
