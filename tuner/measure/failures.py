"""Why a trial produced no measurement, in words, and which of those reasons the infrastructure caused.

Every failure reason the tuner records is made here. A failure our own limits or the trial itself
classified (the timeout, the memory cap, an exit code, an error the trial reported, a crash under
load, a refusal) belongs to the config; a trial whose `tune run` stopped (orphaned, interrupted) or
whose process died by a signal nobody classified was failed by what ran it, and is measured again
once (tuner/search/retry.py).
"""

from __future__ import annotations

# Written when a trial starts and replaced by its real outcome: a trial left RUNNING by a killed
# process is failed later by another (`fail_orphaned_trials`, Optuna's heartbeat), which cannot set
# a user attribute on another process's trial.
ORPHANED = "orphaned: its tune run process stopped before the trial finished"
INTERRUPTED = "interrupted: tune run got "
KILLED_BY_SIGNAL = "trial process killed by signal "


def interrupted(signal_name: str) -> str:
    return f"{INTERRUPTED}{signal_name}"


def timeout(limit_s: float) -> str:
    return f"timeout: trial exceeded budget.trial_timeout_s={limit_s:g}"


def out_of_memory(limit_gb: float) -> str:
    return f"out of memory: trial exceeded budget.trial_memory_gb={limit_gb:g}"


def process_ended(returncode: int, tail: str) -> str:
    """The trial process ended without a result: by a signal (negative code) or with an exit code."""
    how = f"{KILLED_BY_SIGNAL}{-returncode}" if returncode < 0 else f"trial process exited with code {returncode}"
    return how + (f": {tail}" if tail else "")


def is_infrastructure(reason: str | None) -> bool:
    """Whether a failed trial was failed by what ran it rather than by its config: its `tune run`
    stopped (orphaned, interrupted) or its process died by a signal our limits did not send (the
    node's OOM killer, a drain, someone's kill -9). Such a trial is measured again, once."""
    return bool(reason) and reason.startswith((ORPHANED, INTERRUPTED, KILLED_BY_SIGNAL))
