"""Every value a space can sample is checked against EngineConfig when the space loads, and its
`when` / `forbidden` entries name knobs and values that exist."""

from __future__ import annotations

import optuna
import pytest

from slotune.tuner.spec.tuning_spec import TuningSpec
from pydantic import ValidationError

from slotune.search_spaces.schema import MAX_GRID_SIZE, SearchSpace, builtin_spaces
from slotune.tuner.spec.yaml_reader import SpecError


def space(*knobs: dict, forbidden: list | None = None) -> SearchSpace:
    return SearchSpace.model_validate({"knobs": list(knobs), "forbidden": forbidden or []})


BAD_KNOBS = {
    "later-choice": (
        {"name": "block_size", "type": "categorical", "choices": [16, 17]},
        "knob 'block_size': not a valid EngineConfig field/value: 17",
    ),
    "int-high": (
        {"name": "max_num_seqs", "type": "int", "low": 1, "high": 5000},
        "knob 'max_num_seqs': not a valid EngineConfig field/value: 5000",
    ),
    "int-range-on-literal": (
        {"name": "block_size", "type": "int", "low": 8, "high": 64},
        "knob 'block_size': not a valid EngineConfig field/value: 9",
    ),
    "literal-out-of-set": ({"name": "quantization", "type": "categorical", "choices": ["none", "int3"]}, "'int3'"),
    "float-on-int-field": (
        {"name": "max_num_seqs", "type": "float", "low": 1, "high": 8},
        "a float knob on a whole-number field; use type int",
    ),
    "float-on-literal-int-field": (
        {"name": "kernels.decode_attention.num_splits", "type": "float", "low": 2, "high": 2},
        "a float knob on a whole-number field",
    ),
    "log-with-step": (
        {"name": "max_num_seqs", "type": "int", "low": 1, "high": 15, "log": True, "step": 2},
        "log and step cannot be combined",
    ),
    "float-log-with-step": (
        {"name": "kv_cache_memory_gb", "type": "float", "low": 0.1, "high": 1, "log": True, "step": 0.1},
        "log and step cannot be combined",
    ),
    "log-from-zero": (
        {"name": "kv_cache_memory_gb", "type": "float", "low": 0, "high": 1, "log": True},
        "log scale needs low > 0",
    ),
    "int-fractional-bounds": (
        {"name": "max_num_seqs", "type": "int", "low": 1.5, "high": 4},
        "an int knob needs whole numbers (low=1.5)",
    ),
    "nan-low": ({"name": "kv_cache_memory_gb", "type": "float", "low": float("nan"), "high": 1}, "finite"),
    "inf-high": ({"name": "kv_cache_memory_gb", "type": "float", "low": 0.1, "high": float("inf")}, "finite"),
    "nan-choice": (
        {"name": "kv_cache_memory_gb", "type": "categorical", "choices": [0.5, float("nan")]},
        "NaN and inf are not accepted",
    ),
    "dict-choice": (
        {"name": "kernels", "type": "categorical", "choices": [{"backend": "torch"}]},
        "a value must be text, a number, true/false or null",
    ),
    "duplicate-choice": ({"name": "dtype", "type": "categorical", "choices": ["auto", "auto"]}, "choices listed twice"),
    "categorical-with-bounds": (
        {"name": "dtype", "type": "categorical", "choices": ["auto"], "low": 1},
        "takes 'choices' only",
    ),
    "int-with-choices": ({"name": "max_num_seqs", "type": "int", "low": 1, "high": 2, "choices": [1]}, "not 'choices'"),
    "step-not-dividing-range": (
        {"name": "kv_cache_memory_gb", "type": "float", "low": 0.1, "high": 0.5, "step": 0.3},
        "is not a multiple of step",
    ),
    "int-step-not-dividing-range": (
        {"name": "max_num_seqs", "type": "int", "low": 1, "high": 8, "step": 2},
        "is not a multiple of step",
    ),
    "unknown-field": ({"name": "speculative.nope", "type": "int", "low": 1, "high": 2}, "knob 'speculative.nope'"),
}


@pytest.mark.parametrize("case", sorted(BAD_KNOBS))
def test_every_knob_value_is_checked_against_engine_config(case):
    knob, needle = BAD_KNOBS[case]
    with pytest.raises(ValidationError) as exc:
        space(knob)
    assert needle in str(exc.value), str(exc.value)


def test_when_must_name_an_earlier_knob_and_values_it_can_take():
    method = {"name": "speculative.method", "type": "categorical", "choices": ["none", "ngram"]}
    tokens = {
        "name": "speculative.num_speculative_tokens",
        "type": "int",
        "low": 2,
        "high": 4,
        "when": {"speculative.method": ["ngram"]},
    }
    assert space(method, tokens)
    with pytest.raises(ValidationError, match="declared after it .* move 'speculative.method' above"):
        space(tokens, method)
    with pytest.raises(
        ValidationError,
        match=r"when.speculative.method: 'ngrm' is not a value knob 'speculative.method' "
        r"can take \(\['none', 'ngram'\]\)",
    ):
        space(method, {**tokens, "when": {"speculative.method": ["ngrm"]}})
    with pytest.raises(ValidationError, match="condition on 'quantization', which is not a knob"):
        space(method, {**tokens, "when": {"quantization": ["int8"]}})
    with pytest.raises(ValidationError, match="never be sampled"):
        space(method, {**tokens, "when": {"speculative.method": []}})
    seqs = {"name": "max_num_seqs", "type": "int", "low": 1, "high": 7, "step": 2}
    with pytest.raises(ValidationError, match=r"when.max_num_seqs: 2 is not a value"):
        space(seqs, {"name": "dtype", "type": "categorical", "choices": ["auto"], "when": {"max_num_seqs": [2]}})
    assert space(seqs, {"name": "dtype", "type": "categorical", "choices": ["auto"], "when": {"max_num_seqs": [3]}})


def test_forbidden_must_name_knobs_and_values_that_exist():
    dtype = {"name": "dtype", "type": "categorical", "choices": ["auto", "float32"]}
    seqs = {"name": "max_num_seqs", "type": "int", "low": 1, "high": 4}
    assert space(dtype, seqs, forbidden=[{"dtype": ["float32"], "max_num_seqs": [4]}])
    with pytest.raises(ValidationError, match=r"forbidden\[0\]: 'max_num_sqs' is not a knob of this space"):
        space(dtype, seqs, forbidden=[{"max_num_sqs": [1]}])
    with pytest.raises(ValidationError, match=r"forbidden\[1\].dtype: 'float64' is not a value knob 'dtype' can take"):
        space(dtype, seqs, forbidden=[{"dtype": ["auto"]}, {"dtype": ["float64"]}])
    with pytest.raises(ValidationError, match=r"forbidden\[0\]: an empty rule would forbid every config"):
        space(dtype, forbidden=[{}])
    with pytest.raises(ValidationError, match=r"forbidden\[0\].max_num_seqs: 9 is not a value"):
        space(dtype, seqs, forbidden=[{"max_num_seqs": [9]}])


def test_grids_are_bounded():
    big = {"name": "max_num_batched_tokens", "type": "int", "low": 16, "high": 2**24}  # EngineConfig's own bound
    with pytest.raises(ValueError, match="too many for a grid"):
        space(big).grid()
    many = [{"name": n, "type": "int", "low": 1, "high": 100} for n in ("max_num_seqs", "num_kv_blocks")] + [
        {"name": "speculative.num_speculative_tokens", "type": "int", "low": 1, "high": 16},
        {"name": "max_num_batched_tokens", "type": "int", "low": 16, "high": 79},
    ]
    many[1]["low"] = 2
    with pytest.raises(ValueError, match=f"at most {MAX_GRID_SIZE}"):
        space(*many).grid()


def test_a_grid_refuses_conditional_and_log_knobs_by_name(tmp_path):
    """Optuna's GridSampler sets every knob in every config and lists int ranges linearly: a `when`
    knob would be measured as duplicates, a log range as every integer. Refused, naming the knob
    and the fix, at load (`tune validate`) as well."""
    method = {"name": "speculative.method", "type": "categorical", "choices": ["none", "ngram"]}
    tokens = {"name": "speculative.num_speculative_tokens", "type": "int", "low": 1, "high": 4}
    with pytest.raises(
        ValueError,
        match=r"knob 'speculative.num_speculative_tokens': sampled only when "
        r"speculative.method in \['ngram'\].*use sampler: tpe or random",
    ):
        space(method, tokens | {"when": {"speculative.method": ["ngram"]}}).grid()
    with pytest.raises(ValueError, match=r"knob 'max_num_seqs': a log-scaled range .* choices: \[8, 16, 32, 64, 100\]"):
        space({"name": "max_num_seqs", "type": "int", "low": 8, "high": 100, "log": True}).grid()
    assert space(method, tokens).grid() == {
        "speculative.method": ["none", "ngram"],
        "speculative.num_speculative_tokens": [1, 2, 3, 4],
    }
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        "name: g\nobjective: {kind: latency, metric: tpot}\nsampler: grid\n"
        "search_space: {name: s, knobs: [{name: max_num_seqs, type: int, low: 2, high: 16, log: true}]}\n"
    )
    with pytest.raises(ValidationError, match=r"knob 'max_num_seqs': a log-scaled range"):
        TuningSpec.from_yaml(spec)


def test_space_file_problems_name_the_file(tmp_path):
    p = tmp_path / "s.yaml"
    p.write_text("knobs:\n  - {name: block_size, type: categorical, choices: [16, 17]}\n")
    with pytest.raises(SpecError) as exc:
        SearchSpace.load(p)
    assert str(exc.value).startswith(f"{p}: knob 'block_size': not a valid EngineConfig field/value: 17")


@pytest.mark.parametrize("name", sorted(builtin_spaces()))
def test_builtin_spaces_pass_and_every_grid_value_builds_a_config(name):
    s = SearchSpace.load(name)
    base = s.base_config()  # an EngineConfig, or a launch of the space's server engine
    for k in s.knobs:
        for v in k.probe_values():
            base.with_updates({k.name: v})
        assert k.distribution() is not None
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=1))
    for _ in range(5):
        t = study.ask()
        base.with_updates(s.sample(t))
        study.tell(t, 0.0)
