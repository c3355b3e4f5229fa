import pytest
from pydantic import ValidationError

from slotune.engine.config import EngineConfig
from slotune.tuner.spec.yaml_reader import format_error


def test_yaml_roundtrip(tmp_path):
    cfg = EngineConfig(
        max_num_seqs=4, quantization="int8", speculative={"method": "ngram", "num_speculative_tokens": 3}
    )
    path = tmp_path / "c.yaml"
    path.write_text(cfg.to_yaml())
    assert EngineConfig.from_yaml(path) == cfg


def test_unknown_field_is_an_error_naming_the_path():
    with pytest.raises(ValidationError) as exc:
        EngineConfig.from_dict({"max_num_seq": 4, "speculative": {"methd": "ngram"}})
    msg = format_error(exc.value)
    assert "max_num_seq: unknown field" in msg and "speculative.methd: unknown field" in msg


def test_invalid_values_name_field_and_allowed_values():
    with pytest.raises(ValidationError) as exc:
        EngineConfig.from_dict({"quantization": "int3", "max_num_seqs": 0})
    msg = format_error(exc.value)
    assert "quantization:" in msg and "'int8'" in msg and "max_num_seqs:" in msg


def test_cross_field_rules():
    with pytest.raises(ValidationError, match="draft_model is required"):
        EngineConfig(speculative={"method": "model"})
    with pytest.raises(ValidationError, match="enable_chunked_prefill"):
        EngineConfig(enable_chunked_prefill=False, max_num_batched_tokens=256, max_model_len=1024)


def test_with_updates_dotted_paths_validate():
    cfg = EngineConfig().with_updates({"kernels.decode_attention.block_n": 32, "kv_dtype": "int8"})
    assert cfg.kernels.decode_attention.block_n == 32 and cfg.kv_dtype == "int8"
    with pytest.raises(ValueError, match="unknown config field"):
        EngineConfig().with_updates({"nope.x": 1})
    with pytest.raises(ValidationError):
        EngineConfig().with_updates({"kernels.decode_attention.block_n": 7})


def test_best_yaml_wrapper_is_accepted():
    cfg = EngineConfig.from_dict({"engine": {"max_num_seqs": 3}, "metrics": {"ttft_p95": 0.1}})
    assert cfg.max_num_seqs == 3


def test_missing_file_is_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="config file not found"):
        EngineConfig.from_yaml(tmp_path / "nope.yaml")


@pytest.mark.parametrize(
    "bad",
    [
        {"kv_cache_memory_gb": float("inf")},
        {"kv_cache_memory_gb": float("nan")},
        {"seed": -1},
        {"seed": 2**40},
        {"max_model_len": 2**30},
        {"max_num_batched_tokens": 2**30},
    ],
)
def test_non_finite_and_out_of_range_numbers_are_refused(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        EngineConfig.from_dict(bad)
