"""Reading a trial's stored state: whether it was measured, its budget share, the ranking of feasible trials,
and a config proposed twice (the earlier measurement reused)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# Why a trial with no outcome ended: set when the trial starts, replaced by the real outcome.
# A trial left RUNNING by a killed process is failed later by another (`fail_orphaned_trials`,
# Optuna's heartbeat), and Optuna has no public API to set a user attribute on another
# process's trial, so the reason is written in advance.
ORPHANED_REASON = "orphaned: its tune run process stopped before the trial finished"


# A config the sampler proposed again: it gets the earlier measurement's values, not a new one.
UNMEASURED_REPEAT = "repeat"


# The `start` label of a config enqueued because the sampler repeated itself (see `unexplored_params`).
EXPLORE_START = "explore"


# What a repeat trial copies from the trial that measured its config (not `latencies`: per-request
# arrays, kept once, on the trial that measured them).
REPEAT_ATTRS = ("config", "metrics", "violations", "feasible", "early_stopped", "gates", "screen", "screened_out")


def is_measured(trial) -> bool:
    """Whether a trial holds a slot of the budget (forbidden, invalid and surplus trials do not)."""
    ua = trial.user_attrs
    return not (ua.get("forbidden") or ua.get("unmeasured"))


def budget_share(trial) -> float:
    """How much of a budget slot `trial` holds: 0 unmeasured, its short replay's share when it was
    screened out (`Screening.share`), else 1 (a running trial too: it may go on to the full replay)."""
    if not is_measured(trial):
        return 0.0
    return float(trial.user_attrs.get("screen", {}).get("share", 1.0)) if is_screened_out(trial) else 1.0


def is_screened_out(trial) -> bool:
    """A trial ended on its short replay (`TrialObjective._screen`)."""
    return bool(trial.user_attrs.get("screened_out"))


def earlier_measurement(study, params: dict[str, Any], before: int | None = None, screened_out: bool = False):
    """The first measured trial of `study` (numbered below `before`) with exactly these params,
    complete (or, with `screened_out`, screened out: the study screens now), or None. Samplers
    re-propose configs on small spaces (TPE on a 30-config grid proposed a measured config in about
    one trial of three): a repeat takes this trial's outcome instead of a measurement, and does not
    count against the budget."""
    from optuna.trial import TrialState  # optuna: the [tune] extra, imported where a study exists

    for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED)):
        if (
            (before is None or t.number < before)
            and is_measured(t)
            and t.params == params
            and (t.state == TrialState.COMPLETE or (screened_out and is_screened_out(t)))
        ):
            return t
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
        study.enqueue_trial(params, user_attrs={"start": EXPLORE_START}, skip_if_exists=True)
    return params


def by_first_objective(spec) -> Callable[[Any], tuple[float, int]]:
    """The sort key that puts completed trials best first on the first objective (ties: the earlier trial)."""
    sign = 1 if spec.objective.direction() == "minimize" else -1
    return lambda t: (sign * t.values[0], t.number)


def ranked_feasible(study, spec) -> list:
    """The feasible completed trials, best first on the first objective (`by_first_objective`)."""
    from optuna.trial import TrialState  # optuna: the [tune] extra, imported where a study exists

    return sorted(
        (t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)) if t.user_attrs.get("feasible")),
        key=by_first_objective(spec),
    )


def best_trial(study, spec):
    """Best feasible completed trial (first objective), or None."""
    ranked = ranked_feasible(study, spec)
    return ranked[0] if ranked else None
