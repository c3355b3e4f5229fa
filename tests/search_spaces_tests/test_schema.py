import optuna
import pytest
from pydantic import ValidationError

from slotune.engine.config import EngineConfig
from slotune.search_spaces.schema import SearchSpace, builtin_spaces


@pytest.mark.parametrize("name", sorted(builtin_spaces()))
def test_builtin_space_samples_valid_configs(name):
    space = SearchSpace.load(name)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    for _ in range(20):
        t = study.ask()
        params = space.sample(t)
        space.base_config().with_updates(params)  # every sample is a valid config of its engine
        for k in space.knobs:  # conditional knobs appear only when their condition holds
            cond = all(params.get(f) in v for f, v in k.when.items())
            assert (k.name in params) == cond
        study.tell(t, 0.0)


def test_forbidden_combinations_and_grid():
    space = SearchSpace.model_validate(
        {
            "knobs": [
                {"name": "scheduling", "type": "categorical", "choices": ["continuous", "static"]},
                {"name": "max_num_seqs", "type": "int", "low": 1, "high": 4, "step": 1},
            ],
            "forbidden": [{"scheduling": ["static"], "max_num_seqs": [1]}],
        }
    )
    assert space.forbidden_reason({"scheduling": "static", "max_num_seqs": 1})
    assert space.forbidden_reason({"scheduling": "static", "max_num_seqs": 2}) is None
    assert space.grid() == {"scheduling": ["continuous", "static"], "max_num_seqs": [1, 2, 3, 4]}


def test_bad_knobs_are_named():
    with pytest.raises(ValidationError, match="knob 'max_num_seqs': not a valid"):
        SearchSpace.model_validate({"knobs": [{"name": "max_num_seqs", "type": "int", "low": 0, "high": 4}]})
    with pytest.raises(ValidationError, match="condition on 'quantization'"):
        SearchSpace.model_validate(
            {
                "knobs": [
                    {
                        "name": "quant_group_size",
                        "type": "categorical",
                        "choices": [32],
                        "when": {"quantization": ["int4"]},
                    }
                ]
            }
        )


@pytest.mark.parametrize(
    ("knob", "values", "offered"),
    [
        ("kernels.decode_attention.num_stages", [2, 4], "1, 2 or 3"),
        ("kernels.decode_attention.num_splits", [8, 3], "1, 2, 4, 8 or 16"),
        ("kernels.matmul.num_warps", [4, 1], "2, 4 or 8"),
        ("kernels.prefill_attention.block_m", [64, 256], "16, 32, 64 or 128"),
    ],
)
def test_a_tile_choice_the_kernel_does_not_offer_is_refused_naming_the_offered_values(knob, values, offered):
    """Tile knobs are checked against the kernel's own tile type (slotune/kernels/tiles.py, what its configs()
    enumerates): a value no configs() would produce is refused when the space loads, not in a trial."""
    bad = values[-1]
    with pytest.raises(
        ValidationError,
        match=rf"knob '{knob}': not a valid EngineConfig field/value: {bad} "
        rf"\(Input should be {offered}\)",
    ):
        SearchSpace.model_validate({"knobs": [{"name": knob, "type": "categorical", "choices": values}]})
    SearchSpace.model_validate({"knobs": [{"name": knob, "type": "categorical", "choices": values[:-1]}]})


def test_builtin_tile_knobs_are_values_the_kernels_offer():
    """The gpu space's tile choices are among the kernel type's values (what configs() draws from)."""
    from typing import get_args

    from slotune.kernels import tiles

    types = {
        "decode_attention": tiles.DecodeAttentionConfig,
        "prefill_attention": tiles.PrefillAttentionConfig,
        "matmul": tiles.MatmulConfig,
    }
    knobs = [k for k in SearchSpace.load("gpu").knobs if k.name.startswith("kernels.") and k.choices]
    assert len(knobs) >= 9
    for k in knobs:
        _, kernel, field = k.name.split(".")
        assert set(k.choices) <= set(get_args(types[kernel].model_fields[field].annotation)), k.name


@pytest.mark.parametrize(
    "params,needle",
    [
        ({"max_num_seq": 2}, "'max_num_seq' is not a knob of this space"),
        ({"max_num_seqs": 99}, "starts[0] 'x'.params.max_num_seqs: 99 is not a value"),
        (
            {"kernels.int8_activations": True},
            "sampled only when quantization is one of ['int8', 'int4']; set quantization",
        ),
        ({"quantization": "int4", "max_num_seqs": 2}, "forbidden combination"),
        (
            {"quantization": "int4", "max_num_seqs": 1, "then": [{"max_num_seqs": 2}]},
            "starts[0] 'x'.then[0]: a forbidden combination",
        ),
        ({"max_num_seqs": 1, "then": [{"max_num_seqs": 9}]}, "starts[0] 'x'.then[0].max_num_seqs: 9 is not a value"),
        ({"max_num_seqs": 1, "then": [{}]}, "starts[0] 'x'.then[0]: an empty repair changes nothing"),
    ],
)
def test_bad_starting_points_are_named(params, needle):
    """A starting point is checked like the knobs: every value one its knob can take, conditions met, not a
    forbidden combination; so is each of its repairs (`then`), over its params."""
    params = dict(params)
    then = params.pop("then", [])
    space = {
        "name": "s",
        "knobs": [
            {"name": "quantization", "type": "categorical", "choices": ["none", "int8", "int4"]},
            {
                "name": "kernels.int8_activations",
                "type": "categorical",
                "choices": [False, True],
                "when": {"quantization": ["int8", "int4"]},
            },
            {"name": "max_num_seqs", "type": "int", "low": 1, "high": 8},
        ],
        "forbidden": [{"quantization": ["int4"], "max_num_seqs": [2]}],
        "starts": [{"name": "x", "why": "because", "params": params, "then": then}],
    }
    with pytest.raises(ValidationError, match=None) as exc:
        SearchSpace.model_validate(space)
    assert needle in str(exc.value), str(exc.value)


def test_builtin_starting_points_say_why_and_make_valid_configs():
    for name in ("latency", "throughput"):
        space = SearchSpace.load(name)
        assert space.starts, name
        for start in space.starts:
            assert len(start.why.split()) >= 10, start.name  # the reasoning is written down
            for i in range(len(start.then) + 1):
                EngineConfig().with_updates(start.rung(i))


def test_a_start_names_metrics_of_its_own_objective_kinds():
    """`metrics` narrows a start to some metrics of its kinds; a metric of another kind is refused by name."""
    start = {
        "name": "x",
        "why": "because",
        "objectives": ["latency"],
        "metrics": ["ttft"],
        "params": {"max_num_seqs": 8},
    }
    space = SearchSpace.model_validate(
        {"knobs": [{"name": "max_num_seqs", "type": "int", "low": 1, "high": 16}], "starts": [start]}
    )
    assert space.starts[0].suits("latency", "ttft") and not space.starts[0].suits("latency", "tpot")
    assert not space.starts[0].suits("throughput", "ttft")
    with pytest.raises(ValueError, match=r"start 'x': metrics \['goodput_rps'\] are not metrics of its objectives"):
        SearchSpace.model_validate(
            {
                "knobs": [{"name": "max_num_seqs", "type": "int", "low": 1, "high": 16}],
                "starts": [{**start, "metrics": ["goodput_rps"]}],
            }
        )
