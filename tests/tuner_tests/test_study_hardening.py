"""Studies lose no data: a changed spec is refused, trial processes die with `tune run`,
processes sharing a study share its budget, outputs are replaced whole, the winner waits for
running trials, invalid configs cost no budget.

Every test here is about study mechanics and runs the real trial process with the fake
measurement (`fake_trials`: tests/tuner_tests/fake_trial_runner.py, a stand-in said so here); no timing is asserted
(the waits are deadlines for something to happen at all).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import optuna
import psutil
import pytest
from slotune.engine.config import EngineConfig
from slotune.tuner.search.records import TrialRecord
from slotune.tuner.run import run_command
from slotune.tuner.search.budget import TrialBudget
from slotune.tuner.search.study import StudySpecChanged, open_study
from slotune.tuner.search.trials import is_measured
from slotune.tuner.spec.tuning_spec import TuningSpec
from slotune.tuner.tracking import tracking_summary

from tests.faults import processes_left, study_losses, wait_until
from tests.tuner_tests.conftest import write_spec
from tests.tuner_tests.fake_trial_runner import FAKE_RUNNER


def _study(out: Path, name: str = "t"):
    return optuna.load_study(study_name=name, storage=f"sqlite:///{out / 'study.db'}")


def _tune_run(spec: Path, *args: str, sleep_s: float = 0.0) -> subprocess.Popen:
    """`tune run SPEC --no-progress ARGS` in its own session, with the fake measurement."""
    env = {**os.environ, "FAKE_TRIAL_SLEEP": str(sleep_s)}
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "slotune.tuner.cli_main",
            "run",
            str(spec),
            "--no-progress",
            "--trial-runner",
            FAKE_RUNNER[-1],
            *args,
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def _trial_processes(pid: int) -> list[int]:
    """Descendants of `pid` once one of them is a trial process (else [])."""
    try:
        kids = psutil.Process(pid).children(recursive=True)
        is_trial = any("fake_trial_runner" in " ".join(k.cmdline()) for k in kids)
    except psutil.Error:
        return []
    return [k.pid for k in kids] if is_trial else []


def _is_gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _kill_all(proc: subprocess.Popen, pids: list[int]) -> None:
    """Test cleanup: leave no process behind, whatever the product code did."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.communicate(timeout=30)


def _trial_runs(out: Path) -> list[dict]:
    return [r for r in tracking_summary(f"sqlite:///{out / 'mlflow.db'}", "t") if r["tags"].get("mlflow.parentRunId")]


# --- 1. a study remembers its spec ---------------------------------------------------------


def test_a_changed_spec_is_refused_unless_forced_or_resumed(tmp_path, fake_trials):
    out = tmp_path / "out"
    run_command(write_spec(tmp_path, budget={"n_trials": 2}), progress=False, trial_runner=fake_trials)
    old = {t.number: t.values for t in _study(out).trials}
    # A new SLO changes what every trial's numbers mean: refused, naming what changed and the ways on.
    changed = write_spec(tmp_path, budget={"n_trials": 2}, objective={"ttft_limit_s": 0.5})
    with pytest.raises(StudySpecChanged) as exc:
        run_command(changed, progress=False, trial_runner=fake_trials)
    msg = str(exc.value)
    assert "objective changed" in msg and "--force-new" in msg and "--resume-anyway" in msg
    assert {t.number: t.values for t in _study(out).trials} == old  # untouched
    # The budget is not part of the objective: more trials continue the same study.
    study, is_new = open_study(TuningSpec.from_yaml(write_spec(tmp_path, budget={"n_trials": 5})))
    assert not is_new and len(study.trials) == 2
    # --resume-anyway adopts the new spec; the study then opens without it.
    study, _ = open_study(TuningSpec.from_yaml(changed), resume_anyway=True, say=lambda s: None)
    assert len(study.trials) == 2
    open_study(TuningSpec.from_yaml(changed))
    # A Pareto objective has two directions: a study with one cannot be resumed anyway.
    pareto = TuningSpec.from_yaml(write_spec(tmp_path, objective={"pareto_with": ["output_tokens_per_s"]}))
    with pytest.raises(StudySpecChanged, match="cannot continue it"):
        open_study(pareto, resume_anyway=True)
    # --force-new keeps the old study under another name and starts afresh.
    notes = []
    study, is_new = open_study(pareto, force_new=True, say=notes.append)
    assert is_new and study.trials == [] and len(study.directions) == 2
    names = optuna.get_all_study_names(f"sqlite:///{out / 'study.db'}")
    archive = [n for n in names if n.startswith("t.replaced-")]
    assert len(archive) == 1 and archive[0] in notes[0]
    assert {t.number: t.values for t in _study(out, archive[0]).trials} == old


# --- 2. trial processes die with their parent; orphans are failed and logged ----------------


@pytest.mark.fault("SIGTERM of `tune run` mid-trial")
def test_sigterm_of_tune_run_kills_its_trial_process(tmp_path, fake_trials, fault):
    spec = write_spec(tmp_path, budget={"n_trials": 2})
    proc = _tune_run(spec, sleep_s=600)
    pids: list[int] = []
    try:
        pids = wait_until(lambda: _trial_processes(proc.pid), what="the trial process")
        os.kill(proc.pid, signal.SIGTERM)  # tune run alone, not its process group
        proc.wait(timeout=60)
        wait_until(lambda: all(_is_gone(p) for p in pids), timeout_s=30, what="the trial process to die")
        left = len(processes_left(fault.tag))
    finally:
        _kill_all(proc, pids)
    t, retry = _study(tmp_path / "out").trials[:2]
    assert t.state.name == "FAIL" and "interrupted: tune run got SIGTERM" in t.user_attrs["fail_reason"]
    assert retry.state.name == "WAITING" and retry.params == t.params  # measured when the study resumes
    assert TrialRecord.of(retry).retry_of == 0
    runs = _trial_runs(tmp_path / "out")
    assert [(r["tags"]["slotune.trial"], r["tags"]["slotune.state"]) for r in runs] == [("0", "FAIL")]
    run_command(spec, progress=False, trial_runner=fake_trials)  # resume: the retry is measured first
    trials = _study(tmp_path / "out").trials
    fault.record(
        "tune run failed its trial (interrupted) and exited; the next run measured the config first",
        **study_losses(trials, budget=2),
        processes_left=left,
    ).assert_clean()
    assert trials[1].state.name == "COMPLETE" and trials[1].params == trials[0].params


@pytest.mark.fault("SIGKILL of `tune run` mid-trial")
def test_sigkill_of_tune_run_kills_its_trial_process_and_resume_measures_the_orphans_config(
    tmp_path, fake_trials, fault
):
    spec = write_spec(tmp_path, budget={"n_trials": 2})
    out = tmp_path / "out"
    proc = _tune_run(spec, sleep_s=600)
    pids: list[int] = []
    try:
        pids = wait_until(lambda: _trial_processes(proc.pid), what="the trial process")
        os.kill(proc.pid, signal.SIGKILL)  # no handler runs: the parent-death signal must
        proc.wait(timeout=60)
        wait_until(lambda: all(_is_gone(p) for p in pids), timeout_s=30, what="the trial process to die")
        left = len(processes_left(fault.tag))
    finally:
        _kill_all(proc, pids)
    assert _study(out).trials[0].state.name == "RUNNING"
    run_command(spec, progress=False, trial_runner=fake_trials)  # resume
    trials = _study(out).trials
    fault.record(
        "the trial process died with tune run; the next run failed the orphan and measured its config",
        **study_losses(trials, budget=2),
        processes_left=left,
    ).assert_clean()
    assert trials[0].state.name == "FAIL" and "orphaned" in trials[0].user_attrs["fail_reason"]
    # the orphan's config is measured again (trial 1), and the budget's 2 trials are still measured
    # (after a resume the seeded sampler may propose a measured config again: a repeat, not measured)
    assert TrialRecord.of(trials[1]).retry_of == 0 and trials[1].params == trials[0].params
    assert sum(t.state.name == "COMPLETE" and is_measured(t) for t in trials) == 2
    runs = {r["tags"]["slotune.trial"]: r for r in _trial_runs(out)}
    assert runs["0"]["tags"]["slotune.state"] == "FAIL" and "orphaned" in runs["0"]["tags"]["slotune.fail_reason"]
    assert runs["1"]["tags"]["slotune.state"] == "COMPLETE" and runs["1"]["tags"]["slotune.retry_of"] == "0"
    assert all(runs[str(t.number)]["tags"]["slotune.state"] == "COMPLETE" for t in trials[1:])


# --- 3. processes sharing one fresh storage ------------------------------------------------


def test_two_tune_runs_on_one_fresh_storage_share_the_study_and_its_budget(tmp_path):
    # The default config (max_num_seqs=16, no quantization) is in this space: one reference trial.
    spec = write_spec(
        tmp_path,
        fresh_tracking_store=True,  # the two processes create the MLflow store at once
        budget={"n_trials": 4},
        search_space={
            "name": "s",
            "knobs": [
                {"name": "max_num_seqs", "type": "int", "low": 1, "high": 16},
                {"name": "quantization", "type": "categorical", "choices": ["none", "int8"]},
            ],
        },
    )
    procs = [_tune_run(spec, sleep_s=0.5) for _ in range(2)]
    try:
        logs = [p.communicate(timeout=400)[0] for p in procs]
    finally:
        for p in procs:
            _kill_all(p, [])
    # the logs joined into one string: pytest prints a string message whole (a list's repr it cuts short)
    assert all(p.returncode == 0 for p in procs), "\n---\n".join(logs)
    assert not any("Error" in log or "Traceback" in log for log in logs), "\n---\n".join(logs)
    out = tmp_path / "out"
    trials = _study(out).trials
    # a config the random sampler proposes twice is a repeat: COMPLETE, but no measurement, no budget slot
    complete = [t for t in trials if t.state.name == "COMPLETE" and is_measured(t)]
    states = [
        (t.number, t.state.name, t.user_attrs.get("unmeasured") or t.user_attrs.get("fail_reason")) for t in trials
    ]
    assert len(complete) == 4, states  # never more than the budget, though two processes ran it
    assert [t.user_attrs.get("tag") for t in trials].count("default") == 1, states
    assert not [t for t in trials if t.state.name in ("RUNNING", "WAITING")], states
    surplus = [t for t in trials if t.state.name != "COMPLETE"]
    assert all(t.user_attrs.get("unmeasured") == "over_budget" for t in surplus), states
    EngineConfig.from_yaml(out / "best.yaml")
    assert json.loads((out / "best_metrics.json").read_text())["trial"] in {t.number for t in complete}
    runs = tracking_summary(f"sqlite:///{out / 'mlflow.db'}", "t")
    assert len([r for r in runs if r["tags"].get("slotune.role") == "study"]) == 1
    logged = sorted(int(r["tags"]["slotune.trial"]) for r in runs if r["tags"].get("slotune.state") == "COMPLETE")
    assert logged == sorted(t.number for t in trials if t.state.name == "COMPLETE")  # repeats are logged too


def test_budget_admits_a_trial_only_while_fewer_measured_trials_precede_it():
    study = optuna.create_study()
    trials = [study.ask() for _ in range(4)]  # RUNNING: each holds a slot until it ends
    budget = TrialBudget(total=3)
    assert [budget.admits(study, t.number) for t in trials] == [True, True, True, False]
    trials[1].set_user_attr("forbidden", True)  # a rejected point frees its slot
    study.tell(trials[1], state=optuna.trial.TrialState.PRUNED)
    assert budget.admits(study, 3)
    assert budget.exhausted(study)  # trials 0, 2, 3 running fill it: this process asks for no more
    trials[3].set_user_attr("unmeasured", "invalid_config")  # so does a config EngineConfig rejects
    study.tell(trials[3], state=optuna.trial.TrialState.FAIL)
    assert not budget.exhausted(study)
    study.tell(trials[0], 1.0)
    study.tell(trials[2], state=optuna.trial.TrialState.FAIL)  # a measured failure counts
    assert budget.counts(study) == (2, 2) and not budget.exhausted(study)


# --- 4. outputs replaced whole; a full disk named --------------------------------------------


@pytest.mark.parametrize("writer", ["finalize", "report"])
def test_a_failed_write_leaves_the_previous_outputs_whole(tmp_path, fake_trials, writer):
    """A write that fails part-way (RLIMIT_FSIZE: the kernel refuses bytes past 64, as a full
    disk refuses them) must leave every previous output intact, and say which file failed."""
    spec = write_spec(tmp_path, budget={"n_trials": 2})
    assert run_command(spec, progress=False, trial_runner=fake_trials) is not None
    out = tmp_path / "out"
    names = ("best.yaml", "best_metrics.json", "report.md", "report.html")
    before = {n: (out / n).read_bytes() for n in names}
    call = (
        "finalize(spec, study)"
        if writer == "finalize"
        else "trials = candidates(study, spec); c = judge_runs(spec, study.user_attrs['confirm'], trials); "
        "best = next(t for t in trials if t.number == c.winner); "
        "write_report(spec, study, best, c.declared(), spec.resolved_output_dir())"
    )
    script = (
        "import resource, signal\n"
        "from slotune.tuner.report.markdown import write_report\n"
        "from slotune.tuner.spec.tuning_spec import TuningSpec\n"
        "from slotune.tuner.decide.confirm import candidates, judge_runs\n"
        "from slotune.tuner.run import finalize\n"
        "from slotune.tuner.search.study import open_study\n"
        f"spec = TuningSpec.from_yaml({str(spec)!r})\n"
        "study, _ = open_study(spec)\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of death\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (64, 64))\n"
        f"{call}\n"
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert r.returncode != 0, r.stderr
    failed = "best.yaml" if writer == "finalize" else "report.md"
    assert f"could not write {out / failed}" in r.stderr, r.stderr[-2000:]
    assert {n: (out / n).read_bytes() for n in names} == before
    assert not [p.name for p in out.iterdir() if p.name.endswith(".tmp")]


def test_a_full_disk_while_writing_a_trial_input_fails_the_trial_naming_the_file(tmp_path, fake_trials, monkeypatch):
    real_write_text = Path.write_text

    def disk_full_for_inputs(self, *args, **kwargs):
        if self.name == "in.json":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write_text(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", disk_full_for_inputs)
    assert run_command(write_spec(tmp_path, budget={"n_trials": 2}), progress=False, trial_runner=fake_trials) is None
    trials = _study(tmp_path / "out").trials
    assert len(trials) == 2 and all(t.state.name == "FAIL" for t in trials)
    for t in trials:
        reason = t.user_attrs["fail_reason"]
        assert reason.startswith("could not write the trial input ") and "in.json: No space left on device" in reason


# --- 5. the winner waits for running trials -------------------------------------------------


def test_the_winner_is_declared_after_a_workers_running_trial_finished(tmp_path, fake_trials):
    """A worker's trial holds the only slot of the budget while the leader starts: the leader
    measures nothing itself and declares the winner once that trial has finished."""
    spec = write_spec(tmp_path, budget={"n_trials": 1})
    out = tmp_path / "out"
    open_study(TuningSpec.from_yaml(spec))  # created, as a leader would, for the worker to join
    worker = _tune_run(spec, "--worker", sleep_s=8)
    try:
        wait_until(
            lambda: [t for t in _study(out).trials if t.state.name == "RUNNING" and t.user_attrs.get("pid")],
            what="the worker's trial",
        )
        summary = run_command(spec, progress=False, trial_runner=fake_trials)
        log = worker.communicate(timeout=120)[0]
    finally:
        _kill_all(worker, [])
    assert worker.returncode == 0, log
    trials = _study(out).trials
    assert [t.state.name for t in trials] == ["COMPLETE"] and trials[0].user_attrs["pid"] == worker.pid
    assert summary is not None and summary["trial"] == 0
    report = (out / "report.md").read_text()
    assert "1 trials (1 complete" in report and "RUNNING" not in report


# --- 6. invalid configs cost no budget -------------------------------------------------------


def test_an_invalid_config_does_not_use_the_budget_and_its_reason_names_the_field(tmp_path, fake_trials):
    """Each knob value is valid alone (the spec checks that), but EngineConfig rejects a batch
    budget below max_model_len (2048) without chunked prefill: failed, named, and not counted."""
    knobs = [
        {"name": "enable_chunked_prefill", "type": "categorical", "choices": [True, False]},
        {"name": "max_num_batched_tokens", "type": "categorical", "choices": [512, 4096]},
    ]
    spec = write_spec(tmp_path, budget={"n_trials": 3}, search_space={"name": "inv", "knobs": knobs})
    run_command(spec, progress=False, trial_runner=fake_trials)
    trials = _study(tmp_path / "out").trials
    invalid = [t for t in trials if t.params == {"enable_chunked_prefill": False, "max_num_batched_tokens": 512}]
    assert invalid, "the seeded random sampler proposes the invalid combination in this space"
    for t in invalid:
        assert t.state.name == "FAIL" and t.user_attrs["unmeasured"] == "invalid_config"
        assert t.user_attrs["fail_reason"].startswith(
            "invalid config: max_num_batched_tokens (512) must be >= "
            "max_model_len (2048) when enable_chunked_prefill is false"
        )
    assert sum(t.state.name == "COMPLETE" and is_measured(t) for t in trials) == 3  # repeats take no measurement
