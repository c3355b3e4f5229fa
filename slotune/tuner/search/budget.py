"""The study's budget of measured trials, shared by every process of a distributed study."""

from __future__ import annotations

from slotune.tuner.search.records import UNMEASURED_OVER_BUDGET, TrialRecord
from slotune.tuner.search.retry import replaced_attempts
from slotune.tuner.search.trials import budget_share


class TrialBudget:
    """The study's trial budget, shared by every process that runs the study.

    Counts measured trials, each by its `budget_share` (a trial screened out on its short replay
    holds that share of a slot). Trials pruned as forbidden combinations or failed as invalid configs
    are not counted (TPE proposes them again and again on small spaces; they cost no
    measurement); a sampler stuck on them still stops, after `unmeasured_factor` x total. A failed
    attempt that a retry measures again is not counted either (slotune/tuner/search/retry.py).

    Two uses. `admits` is the rule: the TrialObjective asks it once Optuna has numbered a new trial,
    and trial n is measured only if fewer than `total` measured trials precede it, so processes
    racing for the last slot cannot both take it (trial numbers are unique in the storage).
    As an Optuna callback it stops this process's loop once finished and running trials fill
    the budget, so a process rarely asks for a trial it will not measure.
    """

    def __init__(self, total: int, unmeasured_factor: int = 5) -> None:
        self.total, self.unmeasured_factor = total, unmeasured_factor

    def counts(self, study) -> tuple[float, int]:
        """(budget slots held by measured trials finished, forbidden or invalid trials)."""
        from optuna.trial import TrialState

        trials = study.get_trials(deepcopy=False)
        replaced = replaced_attempts(trials)
        done = (TrialState.COMPLETE, TrialState.FAIL, TrialState.PRUNED)
        records = [TrialRecord.of(t) for t in trials if t.state in done and t.number not in replaced]
        rejected = sum(not r.is_measured and r.unmeasured != UNMEASURED_OVER_BUDGET for r in records)
        return round(sum(r.budget_share for r in records), 9), rejected

    def exhausted(self, study) -> bool:
        from optuna.trial import TrialState

        measured, rejected = self.counts(study)
        running = sum(budget_share(t) for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)))  # 1 each
        return measured + running >= self.total or rejected >= self.unmeasured_factor * self.total

    def admits(self, study, number: int) -> bool:
        """Whether trial `number` may be measured: the trials before it hold fewer than `total` slots."""
        trials = study.get_trials(deepcopy=False)
        replaced = replaced_attempts(trials)
        held = sum(budget_share(t) for t in trials if t.number < number and t.number not in replaced)
        return held < self.total - 1e-9

    def __call__(self, study, trial) -> None:
        if self.exhausted(study):
            study.stop()
