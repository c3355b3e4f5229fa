"""Faults of a study that tunes llama.cpp's llama-server (the real binary, skipped where it is not on
PATH): `kill -9` of the server in the middle of its replay is a trial failed as "crashed under load"
and the study goes on; SIGKILL of `tune run` during a server's trial leaves no server running, and
the study resumes."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import optuna
import psutil
import pytest
import yaml

from slotune.tuner.run import run_command
from slotune.tuner.search.records import TrialRecord

from tests.faults import processes_left, study_losses, wait_until

LLAMA_SERVER = shutil.which("llama-server")
pytestmark = pytest.mark.skipif(LLAMA_SERVER is None, reason="needs llama.cpp's llama-server on PATH")
# long enough for a kill to land in the measured replay: 8 requests of 48 tokens, two at a time
WORKLOAD = {
    "num_requests": 8,
    "warmup_requests": 1,
    "concurrency": 2,
    "prompt_len": {"kind": "fixed", "value": 16},
    "output_len": {"kind": "fixed", "value": 48},
}


def _spec(tmp_path, n_trials: int = 2):
    data = {
        "name": "ls",
        "server": {"engine": "llama-server", "knobs": {"threads": 2, "ctx_per_slot": 256}},
        "workload": WORKLOAD,
        "objective": {"kind": "latency", "metric": "tpot", "percentile": 95, "ttft_limit_s": 30.0},
        "search_space": {
            "name": "slots",
            "engine": "llama-server",
            "knobs": [{"name": "parallel", "type": "categorical", "choices": [1, 2]}],
        },
        "sampler": "random",
        "budget": {"n_trials": n_trials, "trial_timeout_s": 300},
        "confirm": {"candidates": 1, "seeds": 1},
        "output_dir": str(tmp_path / "out"),
    }
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _study(tmp_path):
    return optuna.load_study(study_name="ls", storage=f"sqlite:///{tmp_path / 'out' / 'study.db'}")


def _descendants(pid: int, needle: str) -> list[psutil.Process]:
    """Descendants of `pid` whose command line holds `needle`; for a path, whose executable it is
    serving on a port (not the `--help` that validation runs)."""
    with contextlib.suppress(psutil.Error):
        return [
            p
            for p in psutil.Process(pid).children(recursive=True)
            if (
                p.cmdline()[:1] == [needle] and "--port" in p.cmdline()
                if "/" in needle
                else needle in " ".join(p.cmdline())
            )
        ]
    return []


def _wait_for(predicate, timeout_s: float = 180.0, what: str = "condition"):
    return wait_until(predicate, timeout_s, what, poll_s=0.1)


@pytest.mark.fault("`kill -9` of llama-server mid-replay")
def test_kill_9_of_the_server_mid_replay_fails_its_trial_as_a_crash_and_the_study_goes_on(tmp_path, fault):
    spec = _spec(tmp_path)
    killed: list[int] = []

    def kill_first_server_once_its_replay_runs() -> None:
        # the replay client is measuring: it has finished its warm-up request
        measuring = _wait_for(lambda: _descendants(os.getpid(), "replay_client"), what="the replay client")
        server = _wait_for(lambda: _descendants(os.getpid(), LLAMA_SERVER), what="the server")[0]
        time.sleep(1.0)
        if measuring[0].is_running():
            server.kill()
            killed.append(server.pid)

    killer = threading.Thread(target=kill_first_server_once_its_replay_runs, daemon=True)
    killer.start()
    run_command(spec, progress=False)
    killer.join(timeout=5)
    trials = _study(tmp_path).trials
    left = len(processes_left(fault.tag))
    reason = trials[0].user_attrs.get("fail_reason", "")
    fault.record(
        f"trial 0 failed: {' ('.join(reason.split(': ')[:2])}); trial 1 measured",
        **study_losses(trials),
        processes_left=left,
    ).assert_clean()
    assert killed and trials[0].state.name == "FAIL" and reason.startswith("crashed under load: killed by signal 9")
    assert TrialRecord.of(trials[1]).retry_of is None  # the config's own doing: not measured again
    assert trials[1].state.name == "COMPLETE" and not psutil.pid_exists(killed[0])


@pytest.mark.fault("SIGKILL of `tune run` during a llama-server trial")
def test_sigkill_of_tune_run_leaves_no_server_and_the_study_resumes(tmp_path, fault):
    spec = _spec(tmp_path)
    proc = subprocess.Popen(
        [sys.executable, "-m", "slotune.tuner.cli_main", "run", str(spec), "--no-progress"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        server = _wait_for(lambda: _descendants(proc.pid, LLAMA_SERVER), what="a trial's llama-server")[0]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
        gone = _wait_for(lambda: not server.is_running() or server.status() == psutil.STATUS_ZOMBIE, 30, "no server")
        left = len(processes_left(fault.tag))
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    run_command(spec, progress=False)  # resume
    trials = _study(tmp_path).trials
    fault.record(
        "the server died with tune run's trial process; the next run failed the orphan and measured its config",
        **study_losses(trials, budget=2),
        processes_left=left,
    ).assert_clean()
    assert gone and trials[0].state.name == "FAIL" and "orphaned" in trials[0].user_attrs["fail_reason"]
    assert TrialRecord.of(trials[1]).retry_of == 0 and trials[1].state.name == "COMPLETE"
