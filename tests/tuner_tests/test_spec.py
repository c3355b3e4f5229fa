import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from slotune.tuner.cli import app
from slotune.tuner.errors import format_error
from slotune.tuner.spec import TuningSpec


def test_errors_name_every_field(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("name: x\nobjective: {kind: latency, metric: goodput_rps, percentil: 95}\n"
                 "engine: {max_num_seqs: 0}\nbudget: {n_trial: 3}\nwat: 1\n")
    with pytest.raises(ValidationError) as exc:
        TuningSpec.from_yaml(p)
    msg = format_error(exc.value)
    for needle in ("objective.percentil: unknown field", "budget.n_trial: unknown field", "wat: unknown field", "engine"):
        assert needle in msg, msg


def test_metric_must_match_objective_kind():
    with pytest.raises(ValidationError, match="not a latency metric"):
        TuningSpec.model_validate({"name": "x", "objective": {"kind": "latency", "metric": "goodput_rps"}})
    with pytest.raises(ValidationError, match="goodput_rps needs"):
        TuningSpec.model_validate({"name": "x", "objective": {"kind": "throughput", "metric": "goodput_rps"}})


def test_unknown_knob_is_rejected_with_its_name():
    with pytest.raises(ValidationError, match="knob 'speculative.nope'"):
        TuningSpec.model_validate({"name": "x", "objective": {"kind": "latency", "metric": "tpot"},
                                   "search_space": {"knobs": [{"name": "speculative.nope", "type": "int", "low": 1, "high": 2}]}})


def test_validate_cli_exit_codes(tmp_path):
    good = tmp_path / "g.yaml"
    good.write_text("name: ok\nobjective: {kind: latency, metric: ttft}\n")
    r = CliRunner().invoke(app, ["validate", str(good)])
    assert r.exit_code == 0 and "ok" in r.output
    # the resolved spec: built-in workload and space expanded, default storage and tracking paths
    assert "chat-small" in r.output and "knobs:" in r.output and "study.db" in r.output and "mlflow.db" in r.output
    assert "measured served" in r.output and "measure: served" in r.output  # budget.measure, the default
    bad = tmp_path / "b.yaml"
    bad.write_text("name: ok\nobjective: {kind: latency, metric: ttft}\nsampler: annealing\n")
    r = CliRunner().invoke(app, ["validate", str(bad)])
    assert r.exit_code == 2 and "sampler" in r.output
    r = CliRunner().invoke(app, ["validate", str(tmp_path / "missing.yaml")])
    assert r.exit_code == 2 and "not found" in r.output


def test_budget_measure_defaults_to_served_and_names_the_field():
    base = {"name": "x", "objective": {"kind": "latency", "metric": "tpot"}}
    assert TuningSpec.model_validate(base).budget.measure == "served"
    assert TuningSpec.model_validate({**base, "budget": {"measure": "in_process"}}).budget.measure == "in_process"
    with pytest.raises(ValidationError) as exc:
        TuningSpec.model_validate({**base, "budget": {"measure": "http"}})
    assert "budget.measure" in format_error(exc.value)
