"""A process tied to its parent: SIGKILL when the parent dies, even by SIGKILL (Linux PR_SET_PDEATHSIG).

The trial process calls `die_with_parent` itself. An external engine's server is started as
`python -m slotune.tuner.measure.tied PARENT_PID ARGV...`, which ties and then execs ARGV (the
setting survives exec). Set in the child rather than in a Popen preexec_fn, which is unsafe in a
parent with threads (Optuna's heartbeat runs one); a parent that died before the call is caught by
the getppid check.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys


def die_with_parent(parent_pid: int | None) -> None:
    """Get SIGKILL when `parent_pid` (our parent) dies; exit now if it already has."""
    if parent_pid is None or not sys.platform.startswith("linux"):
        return
    PR_SET_PDEATHSIG = 1
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:
        os._exit(1)  # orphaned already: nobody would read the result


if __name__ == "__main__":  # pragma: no cover - exercised through subprocesses
    die_with_parent(int(sys.argv[1]))
    os.execvp(sys.argv[2], sys.argv[2:])
