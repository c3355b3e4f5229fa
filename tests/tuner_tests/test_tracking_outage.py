"""MLflow goes away mid-study: no trial fails, and every trial reaches MLflow once, logged late from
the study database. A real `mlflow server` process is killed and started again; trials run through
the stand-in trial process (tests/tuner_tests/fake_trial_runner.py: `fake_trials`)."""

from __future__ import annotations

import os
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import mlflow
import optuna
import pytest

from slotune.tuner.tracking import tracker
from slotune.tuner.run import run_command
from slotune.tuner.search.study import open_study
from slotune.tuner.spec.tuning_spec import TuningSpec
from slotune.tuner.tracking import MLflowTracker
from tests.faults import processes_left, study_losses
from tests.tuner_tests.conftest import write_spec


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_server(store: Path, port: int) -> subprocess.Popen:
    mlflow_cli = Path(sys.executable).parent / "mlflow"
    cmd = [str(mlflow_cli), "server", "--backend-store-uri", f"sqlite:///{store}", "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--workers", "1", "--default-artifact-root", str(store.parent / "artifacts")]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        assert proc.poll() is None, "mlflow server exited"
        time.sleep(0.3)
    _stop(proc)
    raise AssertionError("mlflow server did not start in 120 s")


def _stop(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the server and its uvicorn worker
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)


def _finished(study_db: Path) -> int:
    if not study_db.exists():
        return 0
    with sqlite3.connect(study_db, timeout=30) as db:
        try:
            return db.execute("SELECT COUNT(*) FROM trials WHERE state IN ('COMPLETE', 'FAIL', 'PRUNED')").fetchone()[0]
        except sqlite3.OperationalError:  # tables not made yet
            return 0


def _wait(predicate, what: str, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


@pytest.mark.fault("the MLflow server killed mid-study, started again")
def test_a_tracking_server_outage_loses_no_trial(tmp_path, fake_trials, monkeypatch, fault):
    port, store = _free_port(), tmp_path / "server" / "mlflow.db"
    store.parent.mkdir()
    servers = [_start_server(store, port)]
    gate = tmp_path / "gate"
    monkeypatch.setenv("FAKE_TRIAL_GATE", str(gate))
    monkeypatch.setenv("FAKE_TRIAL_SLEEP", "0.5")
    spec = write_spec(
        tmp_path,
        budget={"n_trials": 5},
        confirm={"candidates": 0},
        mlflow_tracking_uri=f"http://127.0.0.1:{port}",
    )
    study_db = tmp_path / "out" / "study.db"
    problems: list[BaseException] = []

    def outage() -> None:  # down after the first trial; back, with the next trial held, after the second
        try:
            _wait(lambda: _finished(study_db) >= 1, "the first trial")
            _stop(servers[0])
            _wait(lambda: _finished(study_db) >= 2, "a trial finished during the outage")
            gate.touch()
            servers.append(_start_server(store, port))
            gate.unlink()
        except BaseException as exc:  # noqa: BLE001 - reported by the test below
            problems.append(exc)
            gate.unlink(missing_ok=True)

    thread = threading.Thread(target=outage)
    thread.start()
    try:
        with pytest.warns(UserWarning, match="logged from the study database once MLflow answers"):
            run_command(spec, progress=False, trial_runner=fake_trials)
        thread.join(timeout=300)
        assert not problems, problems
        study = optuna.load_study(study_name="t", storage=f"sqlite:///{study_db}")
        client = mlflow.tracking.MlflowClient(f"http://127.0.0.1:{port}")
        runs = client.search_runs([client.get_experiment_by_name("t").experiment_id])
        children = Counter(r.data.tags["slotune.trial"] for r in runs if "mlflow.parentRunId" in r.data.tags)
        in_study = study_losses(study.trials, budget=5)
        fault.record(
            "no trial failed; the trials finished during the outage were logged to MLflow once it was back",
            lost=in_study["lost"] + len({str(t.number) for t in study.trials} - set(children)),
            duplicated=in_study["duplicated"] + sum(n - 1 for n in children.values()),
            stuck=in_study["stuck"],
            processes_left=len(processes_left(fault.tag)),
        ).assert_clean()
        assert {t.state.name for t in study.trials} == {"COMPLETE"}  # the outage failed no trial
        assert children == Counter(str(t.number) for t in study.trials)  # each trial once
        parent = next(r for r in runs if r.data.tags.get("slotune.role") == "study")
        assert parent.info.status == "FINISHED" and "report.html" in {
            a.path for a in client.list_artifacts(parent.info.run_id)
        }
    finally:
        gate.unlink(missing_ok=True)
        thread.join(timeout=300)
        for proc in servers:
            _stop(proc)


def test_a_resumed_study_logs_the_trials_mlflow_missed(tmp_path, fake_trials, monkeypatch):
    """A trial whose child run never reached MLflow (its process died, or MLflow was down at the
    study's end) is logged when the study is opened again."""
    spec_path = write_spec(tmp_path, budget={"n_trials": 2}, confirm={"candidates": 0})
    run_command(spec_path, progress=False, trial_runner=fake_trials)
    uri = f"sqlite:///{tmp_path / 'out' / 'mlflow.db'}"
    client = mlflow.tracking.MlflowClient(uri)
    eid = client.get_experiment_by_name("t").experiment_id
    lost = next(r for r in client.search_runs([eid]) if r.data.tags.get("slotune.trial") == "1")
    client.delete_run(lost.info.run_id)
    monkeypatch.setattr(tracker, "LOGGING_SETTLES_S", 0)
    spec = TuningSpec.from_yaml(spec_path)
    study, _ = open_study(spec)
    MLflowTracker(spec, study)
    trials = sorted(
        r.data.tags["slotune.trial"] for r in client.search_runs([eid]) if "mlflow.parentRunId" in r.data.tags
    )
    assert trials == ["0", "1"]


def test_a_study_started_while_mlflow_is_down_runs_and_is_logged_later(tmp_path, fake_trials, monkeypatch):
    port = _free_port()
    spec = write_spec(
        tmp_path,
        budget={"n_trials": 2},
        confirm={"candidates": 0},
        mlflow_tracking_uri=f"http://127.0.0.1:{port}",
    )
    with pytest.warns(UserWarning, match="did not answer .* the study runs without it"):
        run_command(spec, progress=False, trial_runner=fake_trials)
    study = optuna.load_study(study_name="t", storage=f"sqlite:///{tmp_path / 'out' / 'study.db'}")
    assert [t.state.name for t in study.trials] == ["COMPLETE", "COMPLETE"] and (
        tmp_path / "out" / "best.yaml"
    ).exists()
    store = tmp_path / "server" / "mlflow.db"
    store.parent.mkdir()
    server = _start_server(store, port)
    try:
        monkeypatch.setattr(tracker, "LOGGING_SETTLES_S", 0)
        run_command(spec, progress=False, trial_runner=fake_trials)  # the study is done: it only logs
        client = mlflow.tracking.MlflowClient(f"http://127.0.0.1:{port}")
        runs = client.search_runs([client.get_experiment_by_name("t").experiment_id])
        assert sorted(r.data.tags["slotune.trial"] for r in runs if "mlflow.parentRunId" in r.data.tags) == ["0", "1"]
    finally:
        _stop(server)
