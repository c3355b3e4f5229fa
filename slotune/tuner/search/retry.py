"""A trial the infrastructure failed is measured again, once, and does not use the budget twice.

`retry_if_infrastructure` is called for every trial that ends FAIL, on every path that fails one: as
an Optuna callback after a trial of this process, for a trial this process failed on its heartbeat
or as an orphan (`_Relay` in slotune/tuner/run.py), and when `tune run` is interrupted. Which failures count
as the infrastructure's is `failures.is_infrastructure`. The retry is Optuna's own
(`RetryHeartbeatStaleTrialCallback`): a WAITING copy of the trial with its params and user
attributes, linked to the attempt it replaces by system attributes; the budget counts the newest
attempt only (`replaced_attempts`).
"""

from __future__ import annotations

from collections.abc import Iterable

from slotune.tuner.measure import failures
from slotune.tuner.search.records import TrialRecord

MAX_RETRIES = 1


def _retry_callback():
    import optuna

    cls = getattr(optuna.storages, "RetryHeartbeatStaleTrialCallback", None)  # Optuna >= 4.9
    cls = cls or optuna.storages.RetryFailedTrialCallback
    return cls(max_retry=MAX_RETRIES)


def retry_if_infrastructure(study, trial) -> int | None:
    """Enqueue FAIL `trial` again when the infrastructure failed it and it was not retried before.

    Returns:
        The retry's trial number, or None when none was enqueued (a config's failure, a retry's
        own failure, not FAIL, or a retry already waiting for it).
    """
    record = TrialRecord.of(trial)
    if record.state is None or record.state.name != "FAIL" or not failures.is_infrastructure(record.fail_reason):
        return None
    if len(record.retry_history) >= MAX_RETRIES:
        return None
    others = study.get_trials(deepcopy=False)
    if any(trial.number in TrialRecord.of(t).retry_history for t in others):
        return None  # another path retried it first
    _retry_callback()(study, trial)
    return max(t.number for t in study.get_trials(deepcopy=False))


def replaced_attempts(trials: Iterable) -> set[int]:
    """The numbers of failed attempts a later retry measures again: they hold no budget slot."""
    return {n for t in trials for n in TrialRecord.of(t).retry_history}
