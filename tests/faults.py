"""The fault suite's accounting: each fault test measures what the fault cost and records one row.

A test marked `@pytest.mark.fault("<the fault>")` (`pytest -m fault` runs them all) takes the `fault`
fixture (tests/conftest.py), which tags every process the test starts through the environment. After its fault, and
before any clean-up of its own, the test counts what was lost with the helpers here and records the
row; it then asserts the row is clean. The session prints the rows as a table; `--fault-table PATH`
also writes it as Markdown (docs/faults.md is that file, committed).
"""

from __future__ import annotations

import os
import time
import uuid
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psutil

TAG = "SLOTUNE_FAULT_RUN"  # environment variable that marks the processes of one fault test

COLUMNS = ("fault", "what happened", "trials lost", "duplicated", "stuck", "processes left", "requests lost")


@dataclass
class FaultRow:
    """One fault and what it cost; None where a column does not apply (no study, no requests)."""

    fault: str
    test: str
    happened: str = ""
    lost: int | None = None
    duplicated: int | None = None
    stuck: int | None = None
    processes_left: int | None = None
    requests_lost: int | None = None
    tag: str = field(default_factory=lambda: uuid.uuid4().hex)
    recorded: bool = False

    def record(self, happened: str, **counts: int | None) -> FaultRow:
        for key, value in counts.items():
            if not hasattr(self, key) or key in ("fault", "test", "tag", "recorded", "happened"):
                raise TypeError(f"no column {key!r}")
            setattr(self, key, value)
        self.happened, self.recorded = happened, True
        return self

    @property
    def counts(self) -> dict[str, int | None]:
        keys = ("lost", "duplicated", "stuck", "processes_left", "requests_lost")
        return {k: getattr(self, k) for k in keys}

    def assert_clean(self) -> None:
        bad = {k: v for k, v in self.counts.items() if v}
        assert self.recorded and not bad, f"{self.fault}: {bad or 'no row recorded'} ({self.happened})"

    def cells(self) -> list[str]:
        return [self.fault, self.happened, *("–" if v is None else str(v) for v in self.counts.values())]


def study_losses(trials: Sequence, budget: int | None = None) -> dict[str, int]:
    """Trials lost, duplicated and stuck in a study (Optuna FrozenTrials), as the fault table counts them.

    lost: a config that infrastructure failed and no trial measured (an attempt killed while it drew
    its knobs has only some: a measured config that holds them counts), plus, when `budget` is
    given, the rest of the budget's shortfall (fewer measured trials than it asks, none stuck);
    duplicated: a second retry of one attempt, a retry of an attempt that was itself measured, or a
    trial number held twice; stuck: a trial left RUNNING or WAITING.
    """
    from slotune.tuner.measure.failures import is_infrastructure
    from slotune.tuner.search.records import TrialRecord

    records = [TrialRecord.of(t) for t in trials]
    by_number = {r.number: r for r in records}
    retries = Counter(r.retry_of for r in records if r.retry_of is not None)
    measured = [set(_key(r.params)) for r in records if r.state.name == "COMPLETE"]
    lost = len(
        {
            _key(r.params)
            for r in records
            if r.state.name == "FAIL"
            and is_infrastructure(r.fail_reason)
            and not any(set(_key(r.params)) <= m for m in measured)  # killed before all its knobs were drawn
        }
    )
    stuck = sum(r.state.name in ("RUNNING", "WAITING") for r in records)
    if budget is not None:  # the shortfall not already counted as lost or stuck
        lost += max(0, budget - sum(r.state.name == "COMPLETE" and r.is_measured for r in records) - lost - stuck)
    duplicated = sum(n - 1 for n in retries.values() if n > 1)
    duplicated += sum(1 for n in retries if n in by_number and by_number[n].state.name == "COMPLETE")
    duplicated += len(records) - len(by_number)
    return {"lost": lost, "duplicated": duplicated, "stuck": stuck}


def _key(params: dict) -> tuple:
    return tuple(sorted(params.items()))


def _is_product(cmdline: Iterable[str]) -> bool:
    """A slotune process: `-m slotune.…`, the `tune` script, the stand-in trial process, or an external
    server a trial launched (llama-server)."""
    args = list(cmdline)
    return any(
        a.startswith("slotune.")
        or a.endswith("fake_trial_runner.py")
        or os.path.basename(a) in ("tune", "llama-server")
        for a in args
    )


def wait_until(predicate, timeout_s: float = 120.0, what: str = "condition", poll_s: float = 0.2):
    """`predicate()`'s first truthy value, polled every `poll_s` (AssertionError after `timeout_s`)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)
    raise AssertionError(f"timed out waiting for {what}")


def processes_left(tag: str) -> list[psutil.Process]:
    """Live slotune processes started under this fault test (its tag in their environment)."""
    left = []
    for p in psutil.process_iter(["pid", "cmdline", "status"]):
        if p.pid == os.getpid() or p.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        try:
            if _is_product(p.info["cmdline"] or ()) and p.environ().get(TAG) == tag:
                left.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return left


def markdown(rows: Sequence[FaultRow]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in rows:
        lines.append("| " + " | ".join(c.replace("|", "/") for c in row.cells()) + " |")
    return "\n".join(lines) + "\n"


def write_table(rows: Sequence[FaultRow], path: Path, outcome: str) -> None:
    """The suite's page: how it was run, where, and the table."""
    import platform
    import time

    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if "model name" in line
        ),
        platform.processor(),
    )
    path.write_text(
        "# Fault suite\n\n"
        "Each row is one test that injects a real fault into real processes and counts what it cost "
        "(tests/faults.py). Written by `.venv/bin/pytest -m fault --fault-table docs/faults.md` on "
        f"{time.strftime('%Y-%m-%d', time.gmtime())}, {cpu}, {os.cpu_count()} CPUs: {outcome}. "
        "CI runs the same tests, except any marked slow; the llama-server rows where it is on PATH (CI "
        "builds it).\n\n" + markdown(rows)
    )
