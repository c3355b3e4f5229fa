"""A trial the infrastructure failed is measured again once, within the budget; a config's own failure
is not. Trials run through the stand-in trial process (tests/tuner_tests/fake_trial_runner.py:
`fake_trials`), killed by a real SIGKILL where a test says so."""

from __future__ import annotations

import optuna
import pytest

from slotune.tuner.measure import failures
from slotune.tuner.run import run_command
from slotune.tuner.search.budget import TrialBudget
from slotune.tuner.search.records import TrialRecord
from slotune.tuner.search.retry import replaced_attempts, retry_if_infrastructure
from slotune.tuner.tracking import tracking_summary
from tests.faults import processes_left, study_losses
from tests.tuner_tests.conftest import write_spec


def _records(out) -> list[TrialRecord]:
    study = optuna.load_study(study_name="t", storage=f"sqlite:///{out / 'study.db'}")
    return [TrialRecord.of(t) for t in study.trials]


@pytest.mark.parametrize(
    ("reason", "retried"),
    [
        (failures.ORPHANED, True),
        (failures.interrupted("SIGTERM"), True),
        (failures.process_ended(-9, "loading model"), True),
        (failures.process_ended(3, "Traceback ..."), False),
        (failures.timeout(120) + " (during: replay 5/8)", False),
        (failures.out_of_memory(8), False),
        ("ValueError: kv_cache_memory_gb holds fewer than 2 blocks", False),
        (failures.server_ended(-9, "srv  update_slots: ...", serving=True), False),
        (failures.server_ended(1, "error: invalid argument: --n-slots", serving=False), False),
        (failures.not_ready(120), False),
        (None, False),
    ],
)
def test_only_the_infrastructures_failures_are_retried(reason, retried):
    assert failures.is_infrastructure(reason) is retried


@pytest.mark.parametrize(
    ("code", "log", "serving", "reason"),
    [
        (
            1,
            "build: 1 (abc)\nerror: invalid argument: --n-slots\n\nusage: ...",
            False,
            "bad flag: exit code 1: error: invalid argument: --n-slots",
        ),
        (
            -6,
            "ggml_backend_cpu_buffer_type_alloc_buffer: failed to allocate buffer of size 9 GiB\nAborted",
            False,
            "out of memory: killed by signal 6: ggml_backend_cpu_buffer_type_alloc_buffer: failed to allocate",
        ),
        (
            1,
            "llama_model_load: error loading model: tensor 'x' has wrong shape\nmain: exiting",
            False,
            "failed to start: exit code 1: main: exiting",
        ),
        (-9, "srv  update_slots: all slots are idle", True, "crashed under load: killed by signal 9: srv"),
        (-11, "", True, "crashed under load: killed by signal 11"),
    ],
)
def test_an_external_servers_exit_is_worded_by_its_cause(code, log, serving, reason):
    assert failures.server_ended(code, log, serving=serving).startswith(reason)


@pytest.mark.fault("SIGKILL of a trial process")
def test_a_trial_killed_by_a_signal_is_measured_again_within_the_budget(tmp_path, fake_trials, monkeypatch, fault):
    """The first trial process dies by SIGKILL (nobody's limit): its config is measured by a retry that
    links to it, the failed attempt holds no budget slot, and the report and MLflow name the retry."""
    monkeypatch.setenv("FAKE_TRIAL_FAULT", "sigkill")
    monkeypatch.setenv("FAKE_TRIAL_FAULT_ONCE", str(tmp_path / "killed-once"))
    out = tmp_path / "out"
    run_command(write_spec(tmp_path, budget={"n_trials": 3}), progress=False, trial_runner=fake_trials)
    study = optuna.load_study(study_name="t", storage=f"sqlite:///{out / 'study.db'}")
    fault.record(
        "the trial failed (killed by signal 9) and was retried once with its config, in the same run",
        **study_losses(study.trials, budget=3),
        processes_left=len(processes_left(fault.tag)),
    ).assert_clean()
    trials = _records(out)
    failed = [t for t in trials if t.state.name == "FAIL"]
    assert len(failed) == 1 and failed[0].fail_reason.startswith("trial process killed by signal 9")
    retry = next(t for t in trials if t.retry_of is not None)
    assert (retry.retry_of, retry.retry_history, retry.state.name) == (
        failed[0].number,
        (failed[0].number,),
        "COMPLETE",
    )
    assert retry.params == failed[0].params
    assert sum(t.state.name == "COMPLETE" for t in trials) == 3  # n_trials measured; the failed attempt is not one
    summary = tracking_summary(f"sqlite:///{out / 'mlflow.db'}", "t")
    runs = {r["tags"]["slotune.trial"]: r["tags"] for r in summary if r["tags"].get("mlflow.parentRunId")}
    assert runs[str(retry.number)]["slotune.retry_of"] == str(failed[0].number)
    assert f"retry of {failed[0].number}" in (out / "report.md").read_text()


def test_a_retry_that_fails_again_is_not_retried(tmp_path, fake_trials, monkeypatch):
    """Every trial process dies by SIGKILL: each config is tried twice, no more, and the budget ends
    the study after n_trials retries failed."""
    monkeypatch.setenv("FAKE_TRIAL_FAULT", "sigkill")
    run_command(write_spec(tmp_path, budget={"n_trials": 2}), progress=False, trial_runner=fake_trials)
    trials = _records(tmp_path / "out")
    assert [t.state.name for t in trials] == ["FAIL"] * 4
    assert [t.retry_of for t in trials] == [None, 0, None, 2]


def test_a_configs_own_crash_is_not_retried(tmp_path, fake_trials, monkeypatch):
    monkeypatch.setenv("FAKE_TRIAL_FAULT", "crash")  # exit code 3: the config's
    run_command(write_spec(tmp_path, budget={"n_trials": 2}), progress=False, trial_runner=fake_trials)
    trials = _records(tmp_path / "out")
    assert [(t.state.name, t.retry_of) for t in trials] == [("FAIL", None), ("FAIL", None)]


def test_the_budget_counts_a_replaced_attempt_once_its_retry_exists(tmp_path):
    """Optuna trials made by hand: a FAIL attempt with an infrastructure reason, then its retry."""
    study = optuna.create_study(storage=f"sqlite:///{tmp_path / 's.db'}", study_name="t")
    dist = {"x": optuna.distributions.IntDistribution(0, 9)}
    for x, reason in ((1, failures.ORPHANED), (2, failures.timeout(60))):
        study.add_trial(
            optuna.trial.create_trial(
                state=optuna.trial.TrialState.FAIL,
                params={"x": x},
                distributions=dist,
                user_attrs={"fail_reason": reason},
            )
        )
    budget = TrialBudget(3)
    assert budget.counts(study) == (2, 0) and budget.admits(study, 2)
    number = retry_if_infrastructure(study, study.trials[0])
    assert number == 2 and retry_if_infrastructure(study, study.trials[0]) is None  # once
    assert retry_if_infrastructure(study, study.trials[1]) is None  # the config's timeout
    assert replaced_attempts(study.trials) == {0}
    assert budget.counts(study) == (1, 0)
    waiting = TrialRecord.of(study.trials[2])
    assert (waiting.state.name, waiting.params, waiting.retry_of) == ("WAITING", {"x": 1}, 0)


def test_a_trial_failed_by_optunas_heartbeat_is_retried(tmp_path, monkeypatch):
    """The path of a trial whose process died on another machine: its heartbeat goes stale, the next
    process fails it (`fail_stale_trials`) and the storage's callback enqueues the retry. The grace
    period is shortened to a second for the test."""
    import time

    from slotune.tuner.search import study as study_module
    from slotune.tuner.spec.tuning_spec import TuningSpec

    monkeypatch.setattr(study_module, "HEARTBEAT_INTERVAL_S", 1)
    monkeypatch.setattr(study_module, "HEARTBEAT_GRACE_S", 1)
    retried: list[int | None] = []
    spec = TuningSpec.from_yaml(write_spec(tmp_path))
    study, _ = study_module.open_study(
        spec, failed_trial_callback=lambda s, t: retried.append(retry_if_infrastructure(s, t))
    )
    trial = study.ask()
    trial.suggest_int("max_num_seqs", 1, 8)
    trial.set_user_attr("fail_reason", failures.ORPHANED)  # as TrialObjective writes it when a trial starts
    trial.set_user_attr("host", "another-machine")
    study._storage.record_heartbeat(trial._trial_id)
    time.sleep(2.5)
    optuna.storages.fail_stale_trials(study)
    assert retried == [1]
    retry = TrialRecord.of(study.trials[1])
    assert (retry.state.name, retry.retry_of, retry.params) == ("WAITING", 0, study.trials[0].params)
