"""GateSpec validation, gate files (built-in and examples), the baseline cache."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from slotune.evals.baseline import Baseline, model_identity
from slotune.evals.gate_spec import GateSpec
from slotune.evals.gates import builtin_gates_path, load_gates
from slotune.evals.tasks import bundled_tasks


def test_defaults_and_margin():
    g = GateSpec(name="p", kind="perplexity", max_rel_drop=0.05, max_abs_drop=2.0)
    assert g.task == "slotune_kjv_perplexity" and g.metric_name == "word_perplexity"
    assert g.margin(20.0) == pytest.approx(1.0)  # the tighter of 5% of 20 and 2.0
    assert g.margin(100.0) == pytest.approx(2.0)
    a = GateSpec(name="a", kind="agreement", min_top1=0.9)
    assert a.metric_name == "top1" and a.mode == "threshold" and a.confidence == 0.95


@pytest.mark.parametrize(
    "bad, match",
    [
        ({"kind": "agreement"}, "needs min_top1"),
        ({"kind": "agreement", "min_top1": 0.9, "task": "slotune_general_knowledge"}, "takes no task"),
        ({"kind": "lm_eval", "max_abs_drop": 0.1}, "needs a task"),
        ({"kind": "lm_eval", "task": "hellaswag", "max_abs_drop": 0.1}, "unknown task 'hellaswag'"),
        ({"kind": "lm_eval", "task": "slotune_general_knowledge"}, "max_abs_drop"),
        (
            {"kind": "lm_eval", "task": "slotune_general_knowledge", "max_abs_drop": 0.1, "min_top1": 0.9},
            "agreement gates only",
        ),
        ({"kind": "lm_eval", "task": "slotune_general_knowledge", "max_abs_drop": 0.1, "mode": "strict"}, "mode"),
        (
            {"kind": "lm_eval", "task": "slotune_general_knowledge", "max_abs_drop": 0.1, "confidence": 0.4},
            "confidence",
        ),
        ({"kind": "lm_eval", "task": "slotune_general_knowledge", "max_abs_drop": 0.1, "limt": 5}, "limt"),
    ],
)
def test_invalid_specs_name_the_problem(bad, match):
    with pytest.raises(ValidationError, match=match):
        GateSpec(name="g", **bad)


def test_builtin_gates_load_and_are_cheap():
    gates = load_gates(None)
    assert builtin_gates_path().exists()
    kinds = {g.kind for g in gates}
    assert "agreement" in kinds and "lm_eval" in kinds
    for g in gates:
        assert g.kind == "agreement" or (g.limit is not None and g.limit <= 100), g


def test_load_gates_accepts_list_mapping_and_spec(tmp_path):
    one = {"name": "a", "kind": "agreement", "min_top1": 0.9}
    for data in ([one], {"quality_gates": [one]}, {"gates": [one]}):
        p = tmp_path / "g.yaml"
        p.write_text(json.dumps(data))
        assert load_gates(p)[0].name == "a"
    p.write_text("name: a\n")
    with pytest.raises(ValueError, match="expected a list"):
        load_gates(p)


def test_every_bundled_task_is_accepted():
    for t in bundled_tasks():
        GateSpec(name=t, kind="perplexity" if "perplexity" in t else "lm_eval", task=t, max_abs_drop=0.1)


def test_model_identity_changes_with_content(tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"a" * 100)
    a = model_identity(f)
    assert model_identity(f) == a
    f.write_bytes(b"b" * 100)
    assert model_identity(f) != a


def test_baseline_cache_computes_once(tmp_path):
    b = Baseline.__new__(Baseline)  # the cache alone: no engine needed
    b.cache_dir, b.identity = tmp_path, {"model": "m", "device": "cpu", "dtype": "float32", "scorer": 0}
    calls = []
    compute = lambda: calls.append(1) or {"x": [1, 2]}  # noqa: E731
    assert b.cached({"kind": "t", "limit": 5}, compute) == {"x": [1, 2]}
    assert b.cached({"kind": "t", "limit": 5}, compute) == {"x": [1, 2]}
    assert len(calls) == 1
    b.cached({"kind": "t", "limit": 6}, compute)  # another key: recomputed
    b.identity = {**b.identity, "model": "other"}
    b.cached({"kind": "t", "limit": 5}, compute)  # another model: recomputed
    assert len(calls) == 3
    assert len(list(tmp_path.glob("t-*.json"))) == 3
