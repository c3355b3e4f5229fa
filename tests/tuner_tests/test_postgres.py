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

from tests.faults import processes_left, study_losses
from tests.tuner_tests.conftest import write_spec

pytestmark = pytest.mark.postgres


def _bin(name: str) -> str | None:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    return found[-1] if found else shutil.which(name)


class Postgres:
    """A PostgreSQL server in a temporary data folder, on a free port, that a test can restart."""

    def __init__(self) -> None:
        initdb, self.pg_ctl = _bin("initdb"), _bin("pg_ctl")
        if not initdb or not self.pg_ctl:
            pytest.skip("PostgreSQL server binaries not installed (run tests/setup_system.sh as root)")
        self.as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        self.data = tempfile.mkdtemp(prefix="slotune-pg-")
        os.chmod(self.data, 0o777)
        if os.geteuid() == 0:
            shutil.chown(self.data, "postgres")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        subprocess.run(
            [*self.as_user, initdb, "-D", self.data, "-A", "trust", "-U", "postgres"], check=True, capture_output=True
        )
        self.url = f"postgresql+psycopg2://postgres@127.0.0.1:{self.port}/postgres"

    def start(self) -> None:
        options = f"-p {self.port} -k {self.data} -c listen_addresses=127.0.0.1"
        cmd = [*self.as_user, self.pg_ctl, "-D", self.data, "-w", "-l", f"{self.data}/log", "-o", options, "start"]
        subprocess.run(cmd, check=True, capture_output=True)

    def stop(self) -> None:
        """As a crash would: no checkpoint, every connection cut."""
        subprocess.run([*self.as_user, self.pg_ctl, "-D", self.data, "-m", "immediate", "stop"], capture_output=True)


@pytest.fixture(scope="module")
def postgres():
    pg = Postgres()
    pg.start()
    try:
        yield pg
    finally:
        pg.stop()
        shutil.rmtree(pg.data, ignore_errors=True)


@pytest.fixture
def postgres_url(postgres):
    return postgres.url


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


@pytest.mark.fault("PostgreSQL restarted (`pg_ctl -m immediate`) under two workers")
def test_workers_ride_out_a_database_restart(tmp_path, postgres, fake_trials, monkeypatch, fault):
    """PostgreSQL stops as if it crashed (`pg_ctl -m immediate`) while two `tune run --worker`
    processes measure (the stand-in trial process, fake_trials), and starts again 5 s later: both
    reconnect and finish; no trial is lost, duplicated or left running. The restart lands at a
    different point of a trial's life on each run (a state write that committed as its connection
    dropped: `_committed_before`)."""
    import time

    from slotune.tuner.search.study import open_study
    from slotune.tuner.spec.tuning_spec import TuningSpec

    spec = write_spec(
        tmp_path,
        name="restart",
        budget={"n_trials": 8},
        storage=postgres.url,
        search_space={"name": "grid64", "knobs": [{"name": "max_num_seqs", "type": "int", "low": 1, "high": 64}]},
    )
    open_study(TuningSpec.from_yaml(spec))
    env = {**os.environ, "FAKE_TRIAL_SLEEP": "1", "SLOTUNE_DEBUG": "1"}  # a worker that dies prints its traceback
    cmd = [sys.executable, "-m", "slotune.tuner.cli_main", "run", str(spec), "--worker", "--no-progress"]
    cmd += ["--trial-runner", fake_trials[-1]]
    workers = [
        subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for _ in range(2)
    ]
    try:
        deadline = time.monotonic() + 120
        while (
            len(
                optuna.load_study(study_name="restart", storage=postgres.url).get_trials(
                    states=(optuna.trial.TrialState.COMPLETE,)
                )
            )
            < 2
        ):
            assert time.monotonic() < deadline and all(w.poll() is None for w in workers)
            time.sleep(0.2)
        postgres.stop()
        time.sleep(5)
        postgres.start()
        logs = [w.communicate(timeout=300)[0] for w in workers]
        left = len(processes_left(fault.tag))
    finally:
        for w in workers:
            w.kill()
    print(*logs, sep="\n")  # shown by pytest when an assertion below fails
    trials = optuna.load_study(study_name="restart", storage=postgres.url).get_trials()
    fault.record(
        "both workers reconnected with backoff and finished; no trial failed",
        **study_losses(trials, budget=8),
        processes_left=left,
    ).assert_clean()
    assert all(w.returncode == 0 for w in workers)
    assert not [t for t in trials if t.state.name in ("RUNNING", "WAITING")]
    assert len({t.number for t in trials}) == len(trials)
    done = [t for t in trials if t.state.name == "COMPLETE"]
    assert len(done) >= 8 and all("tpot_p95" in t.user_attrs["metrics"] for t in done)
    assert not [t for t in trials if t.state.name == "FAIL"], [t.user_attrs.get("fail_reason") for t in trials]


@pytest.mark.parametrize(
    "message",
    [
        "the database system is starting up",
        "the database system is not yet accepting connections",  # crash recovery, before a consistent state
        "the database system is in recovery mode",
    ],
)
def test_a_server_starting_or_recovering_is_an_outage_to_ride_out(message):
    """What PostgreSQL answers while it starts or recovers from a crash is waited out like a refused
    connection (the restart test above met the second on some runs: a worker died, its trial stuck)."""
    import psycopg2
    import sqlalchemy

    from slotune.tuner.search.study import _is_connection_error

    exc = sqlalchemy.exc.OperationalError("SELECT 1", {}, psycopg2.OperationalError(f"FATAL:  {message}"))
    assert _is_connection_error(exc)


def test_a_database_away_past_the_bound_stops_the_process_with_a_clear_message(tmp_path, postgres, monkeypatch):
    """Past DB_OUTAGE_S (shortened here to 2 s) without the database, a storage call raises
    StorageUnreachable, which the CLI prints as the reason and exit code 2."""
    from slotune.tuner.search import study as study_module
    from slotune.tuner.spec.tuning_spec import TuningSpec

    monkeypatch.setattr(study_module, "DB_OUTAGE_S", 2.0)
    spec = TuningSpec.from_yaml(write_spec(tmp_path, name="away", storage=postgres.url))
    study, _ = study_module.open_study(spec)
    postgres.stop()
    try:
        with pytest.raises(study_module.StorageUnreachable, match="did not answer for 2 s .* next `tune run`"):
            study.get_trials(deepcopy=False)
    finally:
        postgres.start()
    assert study.get_trials(deepcopy=False) == []  # and the same storage reconnects once it is back


# `tune run` with the database's bound shortened to 3 s, for the test below (argv as the `tune` command's).
_SHORT_BOUND = "import slotune.tuner.search.study as s; s.DB_OUTAGE_S = 3.0; from slotune.tuner.cli import app; app()"


@pytest.mark.fault("PostgreSQL away past the bound under a worker")
def test_a_worker_cut_off_past_the_bound_stops_and_its_trial_is_measured_on_resume(
    tmp_path, postgres, fake_trials, fault
):
    """The database stops mid-trial for longer than the bound (3 s here): the worker exits 2 naming
    the outage, and the next `tune run` of the spec measures the trial it left, within the budget.
    The trial process is the stand-in (fake_trials)."""
    import time

    from slotune.tuner.run import run_command
    from slotune.tuner.search.study import open_study
    from slotune.tuner.spec.tuning_spec import TuningSpec

    spec = write_spec(tmp_path, name="cutoff", budget={"n_trials": 3}, storage=postgres.url)
    open_study(TuningSpec.from_yaml(spec))
    cmd = [sys.executable, "-c", _SHORT_BOUND, "run", str(spec), "--worker", "--no-progress"]
    worker = subprocess.Popen(
        [*cmd, "--trial-runner", fake_trials[-1]],
        env={**os.environ, "FAKE_TRIAL_SLEEP": "4"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    restarted = False
    try:
        deadline = time.monotonic() + 120
        study = optuna.load_study(study_name="cutoff", storage=postgres.url)
        # mid-trial: running, and its process recorded (a trial cut off between Optuna creating it and
        # the objective writing its host and pid cannot be told from another machine's: the heartbeat's)
        while not any("pid" in t.user_attrs for t in study.get_trials(states=(optuna.trial.TrialState.RUNNING,))):
            assert time.monotonic() < deadline and worker.poll() is None
            time.sleep(0.2)
        postgres.stop()
        log = worker.communicate(timeout=120)[0]
        postgres.start()
        restarted = True
        left = len(processes_left(fault.tag))
    finally:
        worker.kill()
        if not restarted:
            postgres.start()
    assert worker.returncode == 2 and "did not answer for 3 s" in log, log
    run_command(spec, progress=False, trial_runner=fake_trials)  # whoever resumes
    trials = optuna.load_study(study_name="cutoff", storage=postgres.url).get_trials()
    fault.record(
        "the worker stopped after 3 s, exit 2, naming the outage; the next run measured its trial's config",
        **study_losses(trials, budget=3),
        processes_left=left,
    ).assert_clean()
    assert "orphaned" in trials[0].user_attrs["fail_reason"] and trials[0].params.items() <= trials[1].params.items()
