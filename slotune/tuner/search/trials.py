"""Questions about a study's trials: whether one was measured, its budget share, the ranking of feasible
trials, and a config proposed twice (the earlier measurement reused). Trials are read through `TrialRecord`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from slotune.tuner.search.records import TrialRecord, enqueue

# The `start` label of a config enqueued because the sampler repeated itself (see `unexplored_params`).
EXPLORE_START = "explore"


def is_measured(trial) -> bool:
    """Whether a trial (a FrozenTrial or a TrialRecord) holds a slot of the budget (`TrialRecord.is_measured`)."""
    return TrialRecord.of(trial).is_measured


def budget_share(trial) -> float:
    """How much of a budget slot `trial` holds: 0 unmeasured, its short replay's share when it was
    screened out (`Screening.share`), else 1 (a running trial too: it may go on to the full replay)."""
    return TrialRecord.of(trial).budget_share


def is_screened_out(trial) -> bool:
    """A trial ended on its short replay (`TrialObjective._screen`)."""
    return TrialRecord.of(trial).screened_out


def earlier_measurement(
    study, params: dict[str, Any], before: int | None = None, screened_out: bool = False
) -> TrialRecord | None:
    """The first measured trial of `study` (numbered below `before`) with exactly these params,
    complete (or, with `screened_out`, screened out: the study screens now), or None. Samplers
    re-propose configs on small spaces (TPE on a 30-config grid proposed a measured config in about
    one trial of three): a repeat takes this trial's outcome instead of a measurement, and does not
    count against the budget."""
    from optuna.trial import TrialState  # optuna: the [tune] extra, imported where a study exists

    for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED)):
        r = TrialRecord.of(t)
        if (
            (before is None or r.number < before)
            and r.is_measured
            and r.params == params
            and (r.state == TrialState.COMPLETE or (screened_out and r.screened_out))
        ):
            return r
    return None


def unexplored_params(space, study, seed: int | None = None, tries: int = 64) -> dict[str, Any] | None:
    """Params of a random config of `space` that no trial of `study` has taken and no `forbidden`
    rule refuses, or None (after `tries` draws: the space is about exhausted). Enqueued after a
    sampler repeats itself, so the next trial measures something new."""
    import optuna

    taken = [t.params for t in study.get_trials(deepcopy=False)]
    draw = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=seed))
    for _ in range(tries):
        params = space.sample(draw.ask())
        if params not in taken and space.forbidden_reason(params) is None:
            return params
    return None


def enqueue_unexplored(space, study, seed: int | None = None) -> dict[str, Any] | None:
    """After a repeat: enqueue `unexplored_params` (labelled `EXPLORE_START`); returns them, or None."""
    params = unexplored_params(space, study, seed)
    if params is not None:
        enqueue(study, params, start=EXPLORE_START)
    return params


def by_first_objective(spec) -> Callable[[Any], tuple[float, int]]:
    """The sort key that puts completed trials best first on the first objective (ties: the earlier trial)."""
    sign = 1 if spec.objective.direction() == "minimize" else -1
    return lambda t: (sign * t.values[0], t.number)


def ranked_feasible(study, spec) -> list[TrialRecord]:
    """The feasible completed trials, best first on the first objective (`by_first_objective`)."""
    from optuna.trial import TrialState  # optuna: the [tune] extra, imported where a study exists

    records = (TrialRecord.of(t) for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)))
    return sorted((r for r in records if r.feasible), key=by_first_objective(spec))


def best_trial(study, spec) -> TrialRecord | None:
    """Best feasible completed trial (first objective), or None."""
    ranked = ranked_feasible(study, spec)
    return ranked[0] if ranked else None
