"""Multi-fidelity screening's decision (spec `screening`); the short replay itself is
`TrialObjective._screen` (slotune/tuner/search/objective.py), what it replays `Screening.short_workload` (slotune/tuner/spec/sections.py).

A searched trial reports its short replay's objective value to Optuna as step 0. `ScreeningPruner`,
the study's pruner, lets it go on to the full replay when that value is as good as the
`percentile` of its peers' (step 0 as well): the trials numbered before it that passed screening,
were measured in full and met the SLO. Optuna's PercentilePruner compares with every complete trial
instead, so a fast config that misses the SLO (or a trial of a parallel worker numbered later)
would move the bar; the report's reason names the same peers and bar that decided.
"""

from __future__ import annotations

import numpy as np
import optuna
from optuna.trial import TrialState
from slotune.tuner.search.records import TrialRecord
from slotune.tuner.search.trials import is_measured


def screened_in(study, before: int | None = None) -> list:
    """Complete, measured trials (numbered below `before`) that passed screening: a short-replay
    value (step 0) and the full measurement."""
    return [
        t
        for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        if (before is None or t.number < before) and is_measured(t) and 0 in t.intermediate_values
    ]


def peers(study, number: int) -> list:
    """What trial `number`'s short replay is compared with: the feasible `screened_in` trials before it."""
    return [t for t in screened_in(study, before=number) if TrialRecord.of(t).feasible]


class ScreeningPruner(optuna.pruners.BasePruner):
    """Prune (screen out) a trial whose step-0 value is worse than its `bar`."""

    def __init__(self, percentile: float, n_startup_trials: int) -> None:
        self.percentile, self.n_startup_trials = percentile, n_startup_trials

    def bar(self, study, number: int) -> tuple[float | None, int]:
        """(the short-replay value trial `number` must match: the `percentile` best of its `peers`'
        (50: the median), how many peers); None while it has fewer than `n_startup_trials` peers."""
        group = peers(study, number)
        if not group or len(group) < self.n_startup_trials:
            return None, len(group)
        q = self.percentile if study.direction == optuna.study.StudyDirection.MINIMIZE else 100 - self.percentile
        return float(np.percentile([t.intermediate_values[0] for t in group], q)), len(group)

    def prune(self, study, trial) -> bool:
        value = trial.intermediate_values.get(0)
        b, _ = self.bar(study, trial.number)
        if value is None or b is None:
            return False
        return value > b if study.direction == optuna.study.StudyDirection.MINIMIZE else value < b
