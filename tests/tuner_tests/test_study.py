"""The study loop: outputs, MLflow, faults recorded as failed trials, resume after SIGKILL."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import optuna
import pytest
import yaml
from slotune.engine.config import EngineConfig
from slotune.tuner.measure import machine
from slotune.tuner.run import run_command
from slotune.tuner.search.records import TrialRecord
from slotune.tuner.search.retry import replaced_attempts
from slotune.tuner.search.trials import is_measured
from slotune.tuner.tracking import tracking_summary

from tests.tuner_tests.conftest import write_spec


def _study(out):
    return optuna.load_study(study_name="t", storage=f"sqlite:///{out / 'study.db'}")


def test_study_writes_best_report_and_mlflow_runs(tmp_path, fake_trials):
    """Study mechanics and outputs, with the fake measurement (fake_trials)."""
    summary = run_command(write_spec(tmp_path, budget={"n_trials": 4}), progress=False, trial_runner=fake_trials)
    out = tmp_path / "out"
    best = EngineConfig.from_yaml(out / "best.yaml")  # loadable as-is by bench/serve
    assert best.max_num_seqs == summary["params"]["max_num_seqs"]
    study = _study(out)
    # max_num_seqs=16 is outside this space's 1..8: the default is measured beside the study
    assert "tag" not in study.trials[0].user_attrs and "metrics" in study.user_attrs["default"]
    values = [t.values[0] for t in study.trials if t.state.name == "COMPLETE"]
    assert summary["value"] == min(values)
    assert "remeasured" in summary and "metrics" in summary["remeasured"]
    report = (out / "report.md").read_text()
    assert "improvement over default" in report and "| # |" in report
    assert "<table" in (out / "report.html").read_text()
    runs = tracking_summary(f"sqlite:///{out / 'mlflow.db'}", "t")
    trials = [r for r in runs if r["tags"].get("mlflow.parentRunId")]
    assert len(trials) == 4 and all("tpot_p95" in r["metrics"] for r in trials)
    parent = [r for r in runs if r["tags"].get("slotune.role") == "study"][0]
    assert parent["tags"]["slotune.best_trial"] == str(summary["trial"])
    # How trials measure (budget.measure, default served) is on every trial and run.
    assert parent["tags"]["slotune.measure"] == "served" and all(
        r["tags"]["slotune.measure"] == "served" for r in trials
    )
    assert all(t.user_attrs["measure"] == "served" for t in study.trials)
    # Which machine measured them (CPU, cores, ISA) is on every trial, the winner, the runs and the report.
    here = machine.words()
    assert "CPUs" in here and all(t.user_attrs["machine"] == here for t in study.trials)
    assert summary["machine"] == here and all(r["tags"]["slotune.machine"] == here for r in trials)
    assert f"Measured on {here}." in report and f"Measured on {here}." in (out / "report.html").read_text()


@pytest.mark.parametrize(
    ("fault", "budget", "reason"),
    [
        ("crash", {}, "exited with code 3"),
        ("raise", {}, "NotImplementedError: lever not implemented"),
        ("hang", {"trial_timeout_s": 3}, "timeout"),
        ("oom", {"trial_memory_gb": 0.6}, "out of memory"),
    ],
)
def test_faulty_trials_are_recorded_and_the_study_goes_on(tmp_path, fake_trials, monkeypatch, fault, budget, reason):
    """Fault hooks in the real trial process (crash, raise, hang, memory hog); the measurement
    itself is the test stand-in (fake_trials), since the fault fires before it."""
    monkeypatch.setenv("FAKE_TRIAL_FAULT", fault)
    summary = run_command(
        write_spec(tmp_path, budget={"n_trials": 2, **budget}), progress=False, trial_runner=fake_trials
    )
    assert summary is None  # nothing feasible
    study = _study(tmp_path / "out")
    assert len(study.trials) == 2
    assert all(t.state.name == "FAIL" and reason in t.user_attrs["fail_reason"] for t in study.trials)
    assert "No feasible trial" in (tmp_path / "out" / "report.md").read_text()


def test_sigkill_then_resume_keeps_completed_trials(tmp_path, fake_trials, monkeypatch):
    """SIGKILL of `tune run` while its third trial runs, then a rerun: the completed trials stay, the
    killed one is failed as an orphan and its config measured again, and the budget counts 5 trials
    (fake measurement: study mechanics only)."""
    monkeypatch.setenv("FAKE_TRIAL_SLEEP", "1.5")
    spec = write_spec(tmp_path, budget={"n_trials": 5})
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "slotune.tuner.cli_main",
            "run",
            str(spec),
            "--no-progress",
            "--trial-runner",
            fake_trials[-1],
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.time() + 120
    done, running = [], []
    while time.time() < deadline:
        if (out / "study.db").exists():
            try:
                trials = _study(out).trials
            except Exception:
                trials = []
            done = [t for t in trials if t.state.name == "COMPLETE"]
            running = [t.number for t in trials if t.state.name == "RUNNING"]
            if len(done) >= 2 and running:
                break
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert len(done) >= 2 and running
    before = {t.number: (t.params, t.values) for t in done}
    monkeypatch.setenv("FAKE_TRIAL_SLEEP", "0")
    run_command(spec, progress=False, trial_runner=fake_trials)
    study = _study(out)
    after = {t.number: (t.params, t.values) for t in study.trials if t.state.name == "COMPLETE"}
    assert all(after[n] == v for n, v in before.items())  # completed trials intact
    replaced = replaced_attempts(study.trials)
    finished = [t for t in study.trials if t.state.name in ("COMPLETE", "FAIL") and is_measured(t)]  # not repeats
    states = [(t.number, t.state.name, t.user_attrs.get("fail_reason")) for t in study.trials]
    assert len([t for t in finished if t.number not in replaced]) == 5, states
    assert not [t for t in study.trials if t.state.name == "RUNNING"], states
    failed = [t for t in study.trials if t.state.name == "FAIL"]
    assert [t.number for t in failed] == running == sorted(replaced), states
    assert all("orphaned" in t.user_attrs["fail_reason"] for t in failed)
    retries = [t for t in study.trials if set(TrialRecord.of(t).retry_history) & set(running)]
    assert [(t.state.name, t.params) for t in retries] == [("COMPLETE", t.params) for t in failed]


def test_grid_and_nsga2_samplers_run(tmp_path, fake_trials):
    """Sampler plumbing with the fake measurement (fake_trials)."""
    spec = write_spec(
        tmp_path,
        sampler="grid",
        budget={"n_trials": 3},
        search_space={"name": "g", "knobs": [{"name": "max_num_seqs", "type": "categorical", "choices": [1, 2, 4]}]},
    )
    run_command(spec, progress=False, trial_runner=fake_trials)
    assert sorted(t.params["max_num_seqs"] for t in _study(tmp_path / "out").trials) == [1, 2, 4]
    (tmp_path / "p").mkdir()
    spec2 = write_spec(
        tmp_path / "p",
        sampler="nsga2",
        objective={"pareto_with": ["output_tokens_per_s"]},
        output_dir=str(tmp_path / "out2"),
    )
    run_command(spec2, progress=False, trial_runner=fake_trials)
    assert 'id="pareto"' in (tmp_path / "out2" / "report.html").read_text()  # the front drawn in the report


def test_real_trial_end_to_end(tmp_path):
    """One real trial on the bundled model: engine, workload replay, SLO check, agreement gate."""
    spec = write_spec(
        tmp_path,
        budget={"n_trials": 1, "trial_timeout_s": 600},
        quality_gates=[{"name": "agree", "kind": "agreement", "min_top1": 0.9, "limit": 2}],
        search_space={"name": "one", "knobs": [{"name": "max_num_seqs", "type": "categorical", "choices": [2]}]},
    )
    summary = run_command(spec, progress=False)
    assert summary is not None
    m = summary["metrics"]
    assert m["num_completed"] == 3 and m["output_tokens"] == 12 and m["tpot_p95"] > 0
    assert m["client_cpu_s"] > 0 and m["num_engine_steps"] > 0  # served over HTTP; engine stats from the trial
    trial = _study(tmp_path / "out").trials[0]
    assert trial.user_attrs["gates"]["passed"] is True
    assert yaml.safe_load((tmp_path / "out" / "best.yaml").read_text())["max_num_seqs"] == 2


def test_plain_progress_lines_and_summary_table(tmp_path, fake_trials):
    """`tune run --no-progress`: one line per trial and the final summary (fake measurement), its
    numbers in the report's units (slotune/tuner/measure/units.py): a p95 TPOT in ms, not bare seconds."""
    from slotune.tuner.cli import app
    from typer.testing import CliRunner

    r = CliRunner().invoke(
        app,
        ["run", str(write_spec(tmp_path, budget={"n_trials": 3})), "--no-progress", "--trial-runner", fake_trials[-1]],
    )
    assert r.exit_code == 0, r.output
    assert "[1/3] trial 0 COMPLETE" in r.output and "[3/3] trial 2" in r.output
    assert "winner = trial" in r.output and "re-measured" in r.output and "best.yaml" in r.output
    tpot = next(line for line in r.output.splitlines() if line.lstrip("│ ").startswith("p95 TPOT"))
    assert re.search(r"p95 TPOT\W+[\d.]+ ms\W+[\d.]+ ms\W", tpot), tpot  # winner, re-measured
    assert re.search(r"\] trial 0 COMPLETE tpot_p95=[\d.]+ ms ", r.output), r.output


def test_config_the_engine_cannot_run_is_a_failed_trial(tmp_path):
    """Real trial process and engine: a knob value the engine rejects at build time (CUDA on a
    CPU-only machine, as an unimplemented lever would) fails that trial with the reason."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    spec = write_spec(
        tmp_path,
        budget={"n_trials": 1},
        search_space={"name": "dev", "knobs": [{"name": "device", "type": "categorical", "choices": ["cuda"]}]},
    )
    assert run_command(spec, progress=False) is None
    t = _study(tmp_path / "out").trials[0]
    assert t.state.name == "FAIL" and "no CUDA device" in t.user_attrs["fail_reason"]


def test_hopeless_trial_stops_early_and_is_infeasible(tmp_path):
    """Real engine: a TTFT limit no config can meet stops the replay after the first requests;
    the trial is complete but infeasible and marked early-stopped."""
    spec = write_spec(
        tmp_path,
        budget={"n_trials": 1, "trial_timeout_s": 600},
        objective={"ttft_limit_s": 0.001, "percentile": 80},
        workload={"num_requests": 12, "output_len": {"kind": "fixed", "value": 8}},
        search_space={"name": "one", "knobs": [{"name": "max_num_seqs", "type": "categorical", "choices": [2]}]},
    )
    run_command(spec, progress=False)
    t = _study(tmp_path / "out").trials[0]
    assert t.state.name == "COMPLETE" and t.user_attrs["early_stopped"] is True and t.user_attrs["feasible"] is False
    assert t.user_attrs["metrics"]["num_completed"] < 12
    assert "client_cpu_s" in t.user_attrs["metrics"]  # served (the default): the client's rule stopped it
    assert t.user_attrs["violations"]["early_stop"] == 1.0
    assert "early-stopped" in (tmp_path / "out" / "report.md").read_text()


def test_default_trial_is_enqueued_only_when_the_space_expresses_it(tmp_path, fake_trials):
    """Reference trials (fake measurement): the default config is trial 0 when the space can
    express it exactly; the static-batching naive config, not expressible here, is measured beside."""
    spec = write_spec(
        tmp_path,
        budget={"n_trials": 2},
        search_space={
            "name": "s",
            "knobs": [
                {"name": "max_num_seqs", "type": "int", "low": 1, "high": 16},
                {"name": "quantization", "type": "categorical", "choices": ["none", "int8"]},
            ],
        },
    )
    summary = run_command(spec, progress=False, trial_runner=fake_trials)
    study = _study(tmp_path / "out")
    t0 = study.trials[0]
    assert t0.user_attrs["tag"] == "default" and t0.params == {"max_num_seqs": 16, "quantization": "none"}
    assert EngineConfig.model_validate(t0.user_attrs["config"]) == EngineConfig()
    assert study.user_attrs["naive"]["config"]["scheduling"] == "static"
    assert summary["references"]["default"] == t0.user_attrs["metrics"]


def test_forbidden_combinations_do_not_use_up_the_budget(tmp_path, fake_trials):
    """Forbidden points are pruned before any measurement and not counted: the study still
    measures n_trials configs (fake measurement)."""
    knobs = [
        {"name": "max_num_seqs", "type": "categorical", "choices": [1, 2, 4, 8]},
        {"name": "quantization", "type": "categorical", "choices": ["none", "int8"]},
    ]
    spec = write_spec(
        tmp_path,
        budget={"n_trials": 4},
        search_space={"name": "f", "knobs": knobs, "forbidden": [{"max_num_seqs": [1, 2]}]},
    )
    run_command(spec, progress=False, trial_runner=fake_trials)
    trials = _study(tmp_path / "out").trials
    forbidden = [t for t in trials if t.user_attrs.get("forbidden")]
    measured = [t for t in trials if is_measured(t)]  # not forbidden, not a repeat of a measured config
    assert forbidden, "the seeded random sampler proposes forbidden points in this space"
    assert all(t.state == optuna.trial.TrialState.PRUNED and t.params["max_num_seqs"] in (1, 2) for t in forbidden)
    assert len(measured) == 4 and all(t.state == optuna.trial.TrialState.COMPLETE for t in measured)


def test_a_sampler_stuck_on_forbidden_points_still_stops(tmp_path, fake_trials):
    """Everything forbidden: the study ends after 5 x n_trials rejected points, with no winner."""
    spec = write_spec(
        tmp_path,
        budget={"n_trials": 2},
        search_space={
            "name": "f",
            "knobs": [{"name": "max_num_seqs", "type": "categorical", "choices": [1, 2]}],
            "forbidden": [{"max_num_seqs": [1, 2]}],
        },
    )
    assert run_command(spec, progress=False, trial_runner=fake_trials) is None
    trials = _study(tmp_path / "out").trials
    assert sum(bool(t.user_attrs.get("forbidden")) for t in trials) == 10


def test_reference_metrics_read_the_naive_config_of_studies_made_before_its_rename():
    """The naive reference config was tagged "baseline" (now the quality gates' word only): a
    resumed old study still finds it, and a new study's "naive" tag is read the same way."""
    import optuna
    from slotune.tuner.search.references import reference_metrics

    def trial(tag, tps):
        return optuna.trial.create_trial(value=tps, user_attrs={"tag": tag, "metrics": {"output_tokens_per_s": tps}})

    old = optuna.create_study()
    old.add_trials([trial("default", 10.0), trial("baseline", 4.0)])
    assert reference_metrics(old) == {"default": {"output_tokens_per_s": 10.0}, "naive": {"output_tokens_per_s": 4.0}}
    new = optuna.create_study()
    new.add_trial(trial("naive", 5.0))
    new.set_user_attr("default", {"metrics": {"output_tokens_per_s": 9.0}})  # measured beside the study
    assert reference_metrics(new) == {"default": {"output_tokens_per_s": 9.0}, "naive": {"output_tokens_per_s": 5.0}}


def test_starting_points_follow_the_references_for_their_objective_kind(tmp_path, fake_trials):
    """The space's starts are enqueued after the default and naive configs, each the base config with its
    params changed, and only for the objective kinds (and metrics, when named) they name."""
    space = {
        "name": "s",
        "knobs": [
            {"name": "max_num_seqs", "type": "int", "low": 1, "high": 16},
            {"name": "quantization", "type": "categorical", "choices": ["none", "int8"]},
        ],
        "starts": [
            {
                "name": "lat",
                "why": "one row per step",
                "objectives": ["latency"],
                "params": {"max_num_seqs": 1, "quantization": "int8"},
            },
            {
                "name": "ttft",
                "why": "admit at once",
                "objectives": ["latency"],
                "metrics": ["ttft"],
                "params": {"max_num_seqs": 8},
            },
            {"name": "tput", "why": "wide batches", "objectives": ["throughput"], "params": {"max_num_seqs": 16}},
        ],
    }
    run_command(
        write_spec(tmp_path, search_space=space, budget={"n_trials": 4}), progress=False, trial_runner=fake_trials
    )
    study = _study(tmp_path / "out")
    trials = study.trials  # the naive config (static batches) is outside this space: measured beside it
    assert [t.user_attrs.get("tag") or t.user_attrs.get("start") for t in trials[:2]] == ["default", "lat"]
    assert "metrics" in study.user_attrs["naive"]
    assert trials[1].params == {"max_num_seqs": 1, "quantization": "int8"}
    assert not any(t.user_attrs.get("start") in ("tput", "ttft") for t in trials)  # a TPOT study: not the TTFT corner


def test_a_start_that_misses_an_slo_limit_is_repaired_next(tmp_path, fake_trials, monkeypatch):
    """Start 'one' (1 sequence, int8) is slow on the study's seed (the stand-in trial process doubles
    its latencies): p95 TTFT 114 ms against a 100 ms limit. Its first repair (`then`) is enqueued at
    once and measured next after the starts already queued: (2, int8) meets the limit, so the second
    repair (4, int8) is never tried. Start 'plain' meets the limit and is not repaired; neither is a
    trial that failed its quality gates (`_missed_slo`)."""
    from slotune.tuner.search.records import TrialRecord
    from slotune.tuner.search.starts import _missed_slo

    monkeypatch.setenv("FAKE_TRIAL_LUCKY", "max_num_seqs=1,quantization=int8")
    monkeypatch.setenv("FAKE_TRIAL_LUCK", "2")
    space = {
        "name": "s",
        "knobs": [
            {"name": "max_num_seqs", "type": "int", "low": 1, "high": 8},
            {"name": "quantization", "type": "categorical", "choices": ["none", "int8"]},
        ],
        "starts": [
            {
                "name": "one",
                "why": "one row per step",
                "objectives": ["latency"],
                "params": {"max_num_seqs": 1, "quantization": "int8"},
                "then": [{"max_num_seqs": 2}, {"max_num_seqs": 4}],
            },
            {
                "name": "plain",
                "why": "the unquantized batch-1 corner",
                "objectives": ["latency"],
                "params": {"max_num_seqs": 1, "quantization": "none"},
                "then": [{"max_num_seqs": 3}],
            },
        ],
    }
    spec = write_spec(
        tmp_path,
        search_space=space,
        budget={"n_trials": 4},
        confirm={"candidates": 0},
        objective={"ttft_limit_s": 0.1},
    )
    run_command(spec, progress=False, trial_runner=fake_trials)
    trials = [t for t in _study(tmp_path / "out").trials if not t.user_attrs.get("tag")]
    assert [(t.user_attrs.get("start"), t.user_attrs.get("rung")) for t in trials[:3]] == [
        ("one", None),
        ("plain", None),
        ("one", 1),
    ]
    assert trials[0].user_attrs["violations"]["ttft"] > 0 and not trials[0].user_attrs["feasible"]
    assert trials[2].params == {"max_num_seqs": 2, "quantization": "int8"} and trials[2].user_attrs["feasible"]
    assert not any(t.user_attrs.get("rung") == 2 for t in trials) and trials[1].user_attrs["feasible"]
    assert not any(
        t.params == {"max_num_seqs": 3, "quantization": "none"} and t.user_attrs.get("start") for t in trials
    )
    assert not _missed_slo(TrialRecord(0, feasible=False, violations={"ttft": 0.2, "quality_gates": 1.0}))
    assert _missed_slo(TrialRecord(0, feasible=False, violations={"ttft": 0.0, "early_stop": 1.0}))


def test_a_new_study_starts_from_the_winner_of_an_earlier_one_of_the_same_model_and_objective(tmp_path, fake_trials):
    """Warm start: a second study in the same storage (another workload: another study, as a re-tune on
    new traffic is) enqueues the first study's winner; a study with another objective does not."""
    storage = f"sqlite:///{tmp_path / 'shared.db'}"
    first = run_command(
        write_spec(tmp_path, budget={"n_trials": 4}, storage=storage), progress=False, trial_runner=fake_trials
    )
    (tmp_path / "b").mkdir()
    run_command(
        write_spec(
            tmp_path / "b",
            name="t2",
            storage=storage,
            budget={"n_trials": 4},
            workload={"num_requests": 5},
            output_dir=str(tmp_path / "out2"),
        ),
        progress=False,
        trial_runner=fake_trials,
    )
    second = optuna.load_study(study_name="t2", storage=storage)
    warm = [t for t in second.trials if str(t.user_attrs.get("start", "")).startswith("warm: t trial")]
    assert len(warm) == 1 and warm[0].params == first["params"]
    (tmp_path / "c").mkdir()
    run_command(
        write_spec(
            tmp_path / "c",
            name="t3",
            storage=storage,
            budget={"n_trials": 2},
            objective={"kind": "throughput", "metric": "output_tokens_per_s"},
            output_dir=str(tmp_path / "out3"),
        ),
        progress=False,
        trial_runner=fake_trials,
    )
    third = optuna.load_study(study_name="t3", storage=storage)
    assert not any(str(t.user_attrs.get("start", "")).startswith("warm:") for t in third.trials)


def test_a_repeated_config_takes_the_earlier_measurement_and_the_budget_goes_to_new_ones(tmp_path, fake_trials):
    """A 4-config space, 4 trials, random sampler (fake measurement): the sampler proposes measured
    configs again; each repeat copies the earlier trial's values, costs no measurement and no budget
    slot, and enqueues an unexplored config, so the study ends having measured all four configs."""
    spec = write_spec(
        tmp_path,
        budget={"n_trials": 4},
        confirm={"candidates": 0},
        seed=3,
        search_space={
            "name": "r",
            "knobs": [
                {"name": "max_num_seqs", "type": "categorical", "choices": [1, 2]},
                {"name": "quantization", "type": "categorical", "choices": ["none", "int8"]},
            ],
        },
    )
    run_command(spec, progress=False, trial_runner=fake_trials)
    trials = _study(tmp_path / "out").trials
    repeats = [t for t in trials if t.user_attrs.get("unmeasured") == "repeat"]
    measured = [t for t in trials if not t.user_attrs.get("unmeasured")]
    assert repeats, "a seeded random sampler on 4 configs proposes one twice within 4 trials"
    by_number = {t.number: t for t in trials}
    for t in repeats:
        first = by_number[t.user_attrs["repeat_of"]]
        assert first.params == t.params and first.values == t.values and first.number < t.number
        assert t.user_attrs["metrics"] == first.user_attrs["metrics"] and "latencies" not in t.user_attrs
    assert len(measured) == 4
    assert sorted((t.params["max_num_seqs"], t.params["quantization"]) for t in measured) == [
        (1, "int8"),
        (1, "none"),
        (2, "int8"),
        (2, "none"),
    ]
    assert any(t.user_attrs.get("start") == "explore" for t in measured)
    report = (tmp_path / "out" / "report.md").read_text()
    assert f"repeat of {repeats[0].user_attrs['repeat_of']}" in report
