"""Why a trial produced no measurement, in words, and which of those reasons the infrastructure caused.

Every failure reason the tuner records is made here. A failure our own limits or the trial itself
classified (the timeout, the memory cap, an exit code, an error the trial reported, a crash under
load, a refusal) belongs to the config; a trial whose `tune run` stopped (orphaned, interrupted) or
whose process died by a signal nobody classified was failed by what ran it, and is measured again
once (slotune/tuner/search/retry.py).
"""

from __future__ import annotations

import re

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


# An external engine's server (slotune/tuner/measure/external_server.py). Each is the config's doing and
# deterministic: none is measured again.
CRASHED_UNDER_LOAD = "crashed under load: "
_BAD_FLAG = re.compile(r"invalid argument|unknown argument|error while handling argument", re.IGNORECASE)
_NO_MEMORY = re.compile(r"out of memory|failed to allocate|cannot allocate|bad_alloc", re.IGNORECASE)


def server_ended(returncode: int, log_tail: str, *, serving: bool) -> str:
    """An external server that exited, in words: a bad flag, out of memory or failed to start (before
    it was ready), crashed under load (after); the log line that says why, when one does."""
    how = f"killed by signal {-returncode}" if returncode < 0 else f"exit code {returncode}"
    lines = [ln.strip() for ln in log_tail.splitlines() if ln.strip()]
    said = next((ln for ln in reversed(lines) if _BAD_FLAG.search(ln) or _NO_MEMORY.search(ln)), None)
    said = said or (lines[-1] if lines else "")
    if serving:
        kind = CRASHED_UNDER_LOAD
    elif _BAD_FLAG.search(log_tail):
        kind = "bad flag: "
    elif _NO_MEMORY.search(log_tail):
        kind = "out of memory: "
    else:
        kind = "failed to start: "
    return f"{kind}{how}" + (f": {said}" if said else "")


def not_ready(timeout_s: float) -> str:
    return f"timed out: the server was not ready within {timeout_s:g} s"
