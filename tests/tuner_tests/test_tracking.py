"""MLflow tracking against a real SQLite tracking store: the experiment opens on its runs table in
MLflow 3, the parent run carries the report and best.yaml, and each child run says in words why
its trial cannot win."""

from __future__ import annotations

import mlflow
import optuna
from slotune.tuner.run import run_command
from slotune.tuner.search.study import open_study
from slotune.tuner.spec.tuning_spec import TuningSpec
from slotune.tuner.tracking import MLflowTracker, tracking_summary
from slotune.tuner.tracking.tracker import EXPERIMENT_KIND, EXPERIMENT_KIND_TAG

from tests.tuner_tests.conftest import write_spec
from tests.tuner_tests.test_report import DISTRIBUTIONS, GATE, SPACE, gate_report, measured

GRID = {
    "name": "q",
    "knobs": [
        {"name": "max_num_seqs", "type": "categorical", "choices": [4]},
        {"name": "quantization", "type": "categorical", "choices": ["none", "int8"]},
    ],
}


def test_a_study_experiment_opens_on_runs_and_its_parent_run_holds_the_report(tmp_path, fake_trials):
    """A study (stand-in measurement: fake_trials) logging into an experiment an older slotune made
    without the kind tag: the tag is set on reopening; report.html and best.yaml are artifacts of
    the parent run, byte for byte; the infeasible trial's child run says why in words."""
    spec = write_spec(
        tmp_path,
        fresh_tracking_store=True,
        sampler="grid",
        budget={"n_trials": 2},
        objective={"ttft_limit_s": 0.08},
        search_space=GRID,
    )
    uri = f"sqlite:///{tmp_path / 'out' / 'mlflow.db'}"
    (tmp_path / "out").mkdir()
    client = mlflow.tracking.MlflowClient(uri)
    old = client.create_experiment("t", artifact_location=(tmp_path / "out" / "mlartifacts").as_uri())
    assert EXPERIMENT_KIND_TAG not in client.get_experiment(old).tags
    run_command(spec, progress=False, trial_runner=fake_trials)
    exp = client.get_experiment_by_name("t")
    assert exp.experiment_id == old
    assert exp.tags[EXPERIMENT_KIND_TAG] == EXPERIMENT_KIND == "custom_model_development"
    assert exp.tags["mlflow.experiment.primaryMetric.name"] == "tpot_p95"
    assert exp.tags["mlflow.experiment.primaryMetric.greaterIsBetter"] == "False"
    runs = tracking_summary(uri, "t")
    parent = next(r for r in runs if r["tags"].get("slotune.role") == "study")
    logged = {a.path for a in client.list_artifacts(parent["run_id"])}
    assert {"report.html", "report.md", "best.yaml", "best_metrics.json"} <= logged
    got = client.download_artifacts(parent["run_id"], "report.html", str(tmp_path / "dl"))
    assert open(got, "rb").read() == (tmp_path / "out" / "report.html").read_bytes()
    by_quant = {r["params"]["quantization"]: r["tags"] for r in runs if r["tags"].get("mlflow.parentRunId")}
    assert by_quant["none"]["slotune.infeasible_reason"] == "p95 TTFT 86.4 ms > limit 80 ms (+8%)"
    assert "slotune.infeasible_reason" not in by_quant["int8"]


def test_a_child_run_names_the_failed_gate_and_the_failure(tmp_path):
    """Trials as slotune/tuner/search/records.py stores them (added with create_trial: a gate that fails needs a
    quantized model the fake measurement does not have), logged by the real tracker."""
    spec = TuningSpec.from_yaml(write_spec(tmp_path, quality_gates=[GATE], search_space=SPACE))
    study, _ = open_study(spec)
    tracker = MLflowTracker(spec, study)
    params = {"quantization": "int8", "kv_dtype": "int8", "max_num_seqs": 1}
    gated = optuna.trial.create_trial(
        state=optuna.trial.TrialState.COMPLETE,
        params=params,
        distributions=DISTRIBUTIONS,
        values=[0.04],
        user_attrs={
            "metrics": measured(0.04, 1.1, 30.0),
            "feasible": False,
            "gates": gate_report(0.81),
            "violations": {"ttft": 0.0, "tpot": 0.0, "throughput": 0.0, "early_stop": 0.0, "quality_gates": 1.0},
        },
    )
    failed = optuna.trial.create_trial(
        state=optuna.trial.TrialState.FAIL,
        params=params,
        distributions=DISTRIBUTIONS,
        user_attrs={"fail_reason": "out of memory: trial exceeded budget.trial_memory_gb=8"},
    )
    for n, t in enumerate((gated, failed)):
        study.add_trial(t)
        tracker(study, study.trials[n])
    runs = [r for r in tracking_summary(spec.resolved_tracking_uri(), "t") if r["tags"].get("mlflow.parentRunId")]
    reasons = {r["tags"]["slotune.trial"]: r["tags"]["slotune.infeasible_reason"] for r in runs}
    assert reasons == {
        "0": "gate agreement: top-1 agreement 0.81 < 0.9; mean KL 0.02 <= 0.1 nats",
        "1": "out of memory: trial exceeded budget.trial_memory_gb=8",
    }


def test_the_printed_link_opens_the_runs_table(tmp_path, fake_trials, capsys):
    """MLflow 3.17 opens an experiment on its GenAI overview unless the link asks for the model-training
    view: `tune run` prints the link that does (checked by hand in `mlflow ui` in Chromium, 2026-11-25)."""
    summary = run_command(write_spec(tmp_path, budget={"n_trials": 2}), progress=False, trial_runner=fake_trials)
    out = capsys.readouterr().out
    assert summary is not None and "?workflowType=machine_learning" in out
    assert f"mlflow ui --backend-store-uri sqlite:///{tmp_path / 'out' / 'mlflow.db'}" in out


def test_no_tracking_runs_the_study_without_mlflow(tmp_path, fake_trials):
    """`tune run --no-tracking` (the GPU run, where MLflow is not installed): no tracking store is
    made, and the study database and best.yaml still hold the study."""
    from typer.testing import CliRunner

    from slotune.tuner.cli import app

    spec = write_spec(tmp_path, fresh_tracking_store=True, sampler="grid", budget={"n_trials": 2}, search_space=GRID)
    r = CliRunner().invoke(app, ["run", str(spec), "--no-progress", "--no-tracking", "--trial-runner", fake_trials[1]])
    assert r.exit_code == 0, r.output
    out = tmp_path / "out"
    assert (out / "best.yaml").exists() and (out / "study.db").exists()
    assert not (out / "mlflow.db").exists() and not (out / "mlartifacts").exists()
