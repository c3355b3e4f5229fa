"""Parent side of a trial: run the trial process under a timeout and a memory cap.

The memory cap is enforced by watching the child's resident set (RLIMIT_AS would also count
torch's large virtual reservations and kill healthy trials).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


class TrialFailure(Exception):
    """A trial that produced no measurement; `reason` is recorded on the trial."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _rss_bytes(pid: int) -> int:
    try:
        import psutil

        p = psutil.Process(pid)
        return p.memory_info().rss + sum(c.memory_info().rss for c in p.children(recursive=True))
    except Exception:
        return 0


def run_trial_process(request: dict[str, Any], *, timeout_s: float, memory_gb: float,
                      on_phase=None) -> dict[str, Any]:
    """Run `slotune.tuner.trial_runner` in a child process; raise TrialFailure on any fault."""
    with tempfile.TemporaryDirectory(prefix="slotune-trial-") as d:
        src, dst = Path(d) / "in.json", Path(d) / "out.json"
        src.write_text(json.dumps(request))
        log = open(Path(d) / "log.txt", "w+")
        proc = subprocess.Popen([sys.executable, "-m", "slotune.tuner.trial_runner", str(src), str(dst)],
                                stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        deadline = time.monotonic() + timeout_s
        limit = memory_gb * 2**30
        reason = None
        while proc.poll() is None:
            if time.monotonic() > deadline:
                reason = f"timeout: trial exceeded budget.trial_timeout_s={timeout_s:g}"
            elif _rss_bytes(proc.pid) > limit:
                reason = f"out of memory: trial exceeded budget.trial_memory_gb={memory_gb:g}"
            if reason:
                proc.kill()
                proc.wait()
                break
            time.sleep(0.2)
        if reason:
            raise TrialFailure(reason)
        if proc.returncode != 0 or not dst.exists():
            log.seek(0)
            tail = log.read()[-800:].strip()
            raise TrialFailure(f"trial process exited with code {proc.returncode}" + (f": {tail}" if tail else ""))
        result = json.loads(dst.read_text())
        if result.get("status") != "ok":
            raise TrialFailure(result.get("error", "unknown error"))
        return result
