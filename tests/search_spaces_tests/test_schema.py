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
        EngineConfig().with_updates(params)  # every sample is a valid EngineConfig
        for k in space.knobs:  # conditional knobs appear only when their condition holds
            cond = all(params.get(f) in v for f, v in k.when.items())
            assert (k.name in params) == cond
        study.tell(t, 0.0)


def test_forbidden_combinations_and_grid():
    space = SearchSpace.model_validate({"knobs": [
        {"name": "scheduling", "type": "categorical", "choices": ["continuous", "static"]},
        {"name": "max_num_seqs", "type": "int", "low": 1, "high": 4, "step": 1}],
        "forbidden": [{"scheduling": ["static"], "max_num_seqs": [1]}]})
    assert space.forbidden_reason({"scheduling": "static", "max_num_seqs": 1})
    assert space.forbidden_reason({"scheduling": "static", "max_num_seqs": 2}) is None
    assert space.grid() == {"scheduling": ["continuous", "static"], "max_num_seqs": [1, 2, 3, 4]}


def test_bad_knobs_are_named():
    with pytest.raises(ValidationError, match="knob 'max_num_seqs': not a valid"):
        SearchSpace.model_validate({"knobs": [{"name": "max_num_seqs", "type": "int", "low": 0, "high": 4}]})
    with pytest.raises(ValidationError, match="condition on 'quantization'"):
        SearchSpace.model_validate({"knobs": [{"name": "quant_group_size", "type": "categorical", "choices": [32],
                                               "when": {"quantization": ["int4"]}}]})
