"""The fault suite's own accounting (tests/faults.py) counts what it claims to."""

from __future__ import annotations

import os
import subprocess
import sys

import optuna

from slotune.tuner.measure import failures
from slotune.tuner.search.records import RETRY_OF_ATTR
from tests.faults import TAG, FaultRow, markdown, processes_left, study_losses


def _trial(x: int, state: str, reason: str | None = None, retry_of: int | None = None):
    return optuna.trial.create_trial(
        state=optuna.trial.TrialState[state],
        params={"x": x},
        distributions={"x": optuna.distributions.IntDistribution(0, 9)},
        values=[1.0] if state == "COMPLETE" else None,
        user_attrs={"fail_reason": reason} if reason else {},
        system_attrs={RETRY_OF_ATTR: retry_of} if retry_of is not None else {},
    )


def _numbered(trials):
    for i, t in enumerate(trials):
        t.number = i
    return trials


def test_study_losses_counts_lost_duplicated_and_stuck():
    clean = _numbered([_trial(1, "FAIL", failures.ORPHANED), _trial(1, "COMPLETE", retry_of=0), _trial(2, "COMPLETE")])
    assert study_losses(clean, budget=2) == {"lost": 0, "duplicated": 0, "stuck": 0}
    lost = _numbered([_trial(1, "FAIL", failures.ORPHANED), _trial(2, "COMPLETE"), _trial(3, "RUNNING")])
    assert study_losses(lost, budget=3) == {"lost": 1, "duplicated": 0, "stuck": 1}
    assert study_losses(lost[1:2], budget=3) == {"lost": 2, "duplicated": 0, "stuck": 0}  # two short
    partial = _numbered([_trial(1, "FAIL", failures.ORPHANED), _trial(1, "COMPLETE", retry_of=0)])
    partial[0].params, partial[0].distributions = {}, {}  # killed before it drew a knob
    assert study_losses(partial, budget=1) == {"lost": 0, "duplicated": 0, "stuck": 0}
    own = _numbered([_trial(1, "FAIL", failures.timeout(60)), _trial(2, "COMPLETE")])
    assert study_losses(own) == {"lost": 0, "duplicated": 0, "stuck": 0}  # the config's own failure
    twice = _numbered(
        [_trial(1, "COMPLETE"), _trial(1, "COMPLETE", retry_of=0), _trial(2, "FAIL", failures.ORPHANED)]
        + [_trial(2, "COMPLETE", retry_of=2), _trial(2, "WAITING", retry_of=2)]
    )
    assert study_losses(twice) == {"lost": 0, "duplicated": 2, "stuck": 1}


def test_processes_left_finds_the_tests_own_slotune_processes_only():
    sleeper = "import time; time.sleep(60)"
    procs = {
        name: subprocess.Popen([sys.executable, "-c", sleeper, *args], env={**os.environ, **env})
        for name, args, env in (
            ("tagged", ["slotune.stand_in"], {TAG: "mine"}),
            ("other tag", ["slotune.stand_in"], {TAG: "theirs"}),
            ("not ours", ["something-else"], {TAG: "mine"}),
        )
    }
    try:
        assert [p.pid for p in processes_left("mine")] == [procs["tagged"].pid]
    finally:
        for p in procs.values():
            p.kill()
            p.wait()
    assert processes_left("mine") == []


def test_a_row_with_a_loss_is_not_clean_and_the_table_shows_it():
    row = FaultRow("a fault", "t").record("it lost one", lost=1, duplicated=0, stuck=0, processes_left=0)
    try:
        row.assert_clean()
    except AssertionError as exc:
        assert "'lost': 1" in str(exc)
    else:
        raise AssertionError("a row with a loss passed")
    assert "| a fault | it lost one | 1 | 0 | 0 | 0 | – |" in markdown([row])
