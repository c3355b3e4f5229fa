"""The environment trial processes run in: OpenMP wait policy and threads."""

from __future__ import annotations

import pytest
from slotune.tuner.measure import trial_process
from slotune.tuner.measure.trial_process import omp_wait_policy, trial_env


def test_explicit_policy_and_threads_reach_the_child(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    env = trial_env(threads=3, wait_policy="passive")
    assert env["OMP_WAIT_POLICY"] == "PASSIVE" and env["OMP_NUM_THREADS"] == "3"
    assert trial_env(wait_policy="active")["OMP_WAIT_POLICY"] == "ACTIVE"


def test_the_users_own_setting_wins(monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    assert trial_env(wait_policy="active")["OMP_WAIT_POLICY"] == "PASSIVE"


@pytest.mark.parametrize(("busy", "expected"), [(0.1, "active"), (0.9, "passive")])
def test_auto_follows_the_cpu_use_once_per_process(monkeypatch, busy, expected):
    """The CPU reading is patched: a test cannot make the machine idle or busy on demand."""
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.setattr(trial_process, "_AUTO_POLICY", None)
    monkeypatch.setattr(trial_process, "machine_busy_fraction", lambda: busy)
    assert omp_wait_policy("auto") == expected
    # decided once: a later change of load does not split one run's trials across policies
    monkeypatch.setattr(trial_process, "machine_busy_fraction", lambda: 1 - busy)
    assert omp_wait_policy("auto") == expected
    assert omp_wait_policy("active") == "active"
