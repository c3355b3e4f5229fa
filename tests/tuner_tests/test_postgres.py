"""Distributed study: two `tune run --worker` processes share one study in a REAL PostgreSQL
server that this test starts (Debian's postgresql package; `tests/setup_system.sh` installs it)."""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import sys
import tempfile

import optuna
import pytest

from tests.tuner_tests.conftest import write_spec

pytestmark = pytest.mark.postgres


def _bin(name: str) -> str | None:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    return found[-1] if found else shutil.which(name)


@pytest.fixture(scope="module")
def postgres_url():
    initdb, pg_ctl = _bin("initdb"), _bin("pg_ctl")
    if not initdb or not pg_ctl:
        pytest.skip("PostgreSQL server binaries not installed (run tests/setup_system.sh as root)")
    as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
    data = tempfile.mkdtemp(prefix="slotune-pg-")
    os.chmod(data, 0o777)
    if os.geteuid() == 0:
        shutil.chown(data, "postgres")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    subprocess.run([*as_user, initdb, "-D", data, "-A", "trust", "-U", "postgres"], check=True, capture_output=True)
    subprocess.run(
        [
            *as_user,
            pg_ctl,
            "-D",
            data,
            "-w",
            "-l",
            f"{data}/log",
            "-o",
            f"-p {port} -k {data} -c listen_addresses=127.0.0.1",
            "start",
        ],
        check=True,
        capture_output=True,
    )
    try:
        yield f"postgresql+psycopg2://postgres@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run([*as_user, pg_ctl, "-D", data, "-m", "immediate", "stop"], capture_output=True)
        shutil.rmtree(data, ignore_errors=True)


def test_two_workers_share_one_study_without_loss_or_duplicates(tmp_path, postgres_url, fake_trials, monkeypatch):
    """Two `tune run --worker` processes on one PostgreSQL study, with the stand-in trial process
    (fake_trials: study mechanics only)."""
    monkeypatch.setenv("FAKE_TRIAL_SLEEP", "0.3")
    spec = write_spec(
        tmp_path,
        budget={"n_trials": 10},
        storage=postgres_url,
        search_space={"name": "grid8", "knobs": [{"name": "max_num_seqs", "type": "int", "low": 1, "high": 64}]},
    )
    from slotune.tuner.search.study import open_study
    from slotune.tuner.spec.tuning_spec import TuningSpec

    open_study(TuningSpec.from_yaml(spec))  # create it once, as the leader would
    env = {**os.environ, "FAKE_TRIAL_SLEEP": "0.3"}
    cmd = [
        sys.executable,
        "-m",
        "slotune.tuner.cli_main",
        "run",
        str(spec),
        "--worker",
        "--no-progress",
        "--trial-runner",
        fake_trials[-1],
    ]
    workers = [
        subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for _ in range(2)
    ]
    logs = [w.communicate(timeout=300)[0] for w in workers]
    assert all(w.returncode == 0 for w in workers), logs
    study = optuna.load_study(study_name="t", storage=postgres_url)
    trials = study.get_trials()
    done = [t for t in trials if t.state.name == "COMPLETE"]
    assert len(done) >= 10 and not [t for t in trials if t.state.name in ("RUNNING", "WAITING")]
    assert len({t.number for t in trials}) == len(trials)  # no duplicated trial numbers
    pids = {t.user_attrs["pid"] for t in done}
    assert len(pids) == 2, "both workers must have contributed trials"
    assert all("tpot_p95" in t.user_attrs["metrics"] for t in done)  # nothing lost: every trial has its record
