import pytest
from pydantic import ValidationError
from slotune.tuner.cli import app
from slotune.tuner.spec.tuning_spec import TuningSpec
from slotune.tuner.spec.yaml_reader import format_error
from typer.testing import CliRunner


def test_errors_name_every_field(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text(
        "name: x\nobjective: {kind: latency, metric: goodput_rps, percentil: 95}\n"
        "engine: {max_num_seqs: 0}\nbudget: {n_trial: 3}\nwat: 1\n"
    )
    with pytest.raises(ValidationError) as exc:
        TuningSpec.from_yaml(p)
    msg = format_error(exc.value)
    for needle in (
        "objective.percentil: unknown field",
        "budget.n_trial: unknown field",
        "wat: unknown field",
        "engine",
    ):
        assert needle in msg, msg


def test_metric_must_match_objective_kind():
    with pytest.raises(ValidationError, match="not a latency metric"):
        TuningSpec.model_validate({"name": "x", "objective": {"kind": "latency", "metric": "goodput_rps"}})
    with pytest.raises(ValidationError, match="goodput_rps needs"):
        TuningSpec.model_validate({"name": "x", "objective": {"kind": "throughput", "metric": "goodput_rps"}})


def test_unknown_knob_is_rejected_with_its_name():
    with pytest.raises(ValidationError, match="knob 'speculative.nope'"):
        TuningSpec.model_validate(
            {
                "name": "x",
                "objective": {"kind": "latency", "metric": "tpot"},
                "search_space": {"knobs": [{"name": "speculative.nope", "type": "int", "low": 1, "high": 2}]},
            }
        )


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


def test_references_are_resolved_once_into_typed_parts(tmp_path):
    """The rest of the code gets resolved objects: a workload file, a built-in search space and gate
    mappings arrive as WorkloadSpec, SearchSpace and GateSpec, and a spec built from those objects
    (as the operator and tests do) is the same spec."""
    from slotune.evals.gate_spec import GateSpec
    from slotune.search_spaces.schema import SearchSpace
    from slotune.tuner.spec.workload_spec import WorkloadSpec

    (tmp_path / "wl.yaml").write_text("name: mine\nnum_requests: 5\nconcurrency: 2\n")
    spec = TuningSpec.from_yaml(
        _write(
            tmp_path / "s.yaml",
            "name: x\nworkload: wl.yaml\nsearch_space: latency\n"
            "objective: {kind: latency, metric: tpot}\n"
            "quality_gates: [{name: agree, kind: agreement, min_top1: 0.9}]\n",
        )
    )
    assert isinstance(spec.workload, WorkloadSpec) and spec.workload.name == "mine" and spec.workload.num_requests == 5
    assert isinstance(spec.search_space, SearchSpace) and spec.search_space.name == "latency"
    assert [type(g) for g in spec.quality_gates] == [GateSpec] and spec.quality_gates[0].min_top1 == 0.9
    again = TuningSpec(
        name="x",
        workload=spec.workload,
        search_space=spec.search_space,
        objective=spec.objective,
        quality_gates=spec.quality_gates,
    )
    assert again.model_dump() == spec.model_dump()
    with pytest.raises(ValidationError, match="workload"):
        TuningSpec.model_validate({"name": "x", "workload": 3, "objective": {"kind": "latency", "metric": "tpot"}})


def test_study_fingerprints_survive_the_typed_spec():
    """A study remembers its spec's fingerprint and refuses to resume under another (slotune/tuner/search/study.py):
    these are the built-in quickstart's and examples 01/02's fingerprints as written before the spec
    was typed (commit faf0a4e), so a refactor that changes them would refuse every existing study."""
    from pathlib import Path

    from slotune.tuner.search.study import spec_fingerprint
    from slotune.tuner.spec.tuning_spec import default_spec_path

    root = Path(__file__).resolve().parents[2] / "examples"
    pinned = {
        default_spec_path(): "160a6d045c2b7ff75b43c3684b337aad69c166fedc1067e282d5deef1c3d885c",
        root / "01-chat-latency" / "spec.yaml": "aecc6eadff027d98dfb8e93aaebedd231fa879ecf01f23b37e409cdc5e51dc64",
        root / "02-batch-throughput" / "spec.yaml": "457c01125e128cf696ff4a29f75a4f2837a9706633def41493ede12fcfe972ea",
    }
    for path, sha in pinned.items():
        assert spec_fingerprint(TuningSpec.from_yaml(path))["sha256"] == sha, path


COST = {"name": "x", "objective": {"kind": "cost", "metric": "usd_per_1m_output_tokens", "tpot_limit_s": 0.1}}


def test_a_cost_objective_needs_a_price_and_names_both_fields():
    with pytest.raises(ValidationError) as exc:
        TuningSpec.model_validate(COST)
    msg = format_error(exc.value)
    assert "objective.kind 'cost'" in msg and "cost.usd_per_hour" in msg, msg
    spec = TuningSpec.model_validate({**COST, "cost": {"usd_per_hour": 2.5}})
    obj = spec.objective
    assert (obj.direction(), obj.metric_key()) == ("minimize", "usd_per_1m_output_tokens")
    assert spec.cost.usd_per_hour == 2.5
    # a cost metric beside another objective needs the price too; the price must be a price
    with pytest.raises(ValidationError, match="pareto_with 'usd_per_1m_total_tokens' needs cost.usd_per_hour"):
        TuningSpec.model_validate(
            {
                "name": "x",
                "objective": {"kind": "latency", "metric": "tpot", "pareto_with": ["usd_per_1m_total_tokens"]},
            }
        )
    for bad in (0, -1.0, "free"):
        with pytest.raises(ValidationError) as exc:
            TuningSpec.model_validate({**COST, "cost": {"usd_per_hour": bad}})
        assert "cost.usd_per_hour" in format_error(exc.value)
    with pytest.raises(ValidationError, match="not a cost metric"):
        TuningSpec.model_validate(
            {**COST, "objective": {"kind": "cost", "metric": "tpot"}, "cost": {"usd_per_hour": 1}}
        )


def test_new_fields_at_their_defaults_keep_the_fingerprint():
    """confirm.candidates is not part of what a trial's numbers mean; a price is, once set."""
    from slotune.tuner.search.study import spec_fingerprint

    base = {"name": "x", "objective": {"kind": "throughput", "metric": "output_tokens_per_s"}}
    plain = spec_fingerprint(TuningSpec.model_validate(base))
    assert spec_fingerprint(TuningSpec.model_validate({**base, "confirm": {"candidates": 0}})) == plain
    priced = spec_fingerprint(TuningSpec.model_validate({**base, "cost": {"usd_per_hour": 2.0}}))
    assert priced["sha256"] != plain["sha256"] and "cost" in priced["parts"] and "cost" not in plain["parts"]
    with pytest.raises(ValidationError) as exc:
        TuningSpec.model_validate({**base, "confirm": {"candidates": -1}})
    assert "confirm.candidates" in format_error(exc.value)


def _write(path, text):
    path.write_text(text)
    return path
