"""GGUFs written by llama.cpp's own converter (convert_hf_to_gguf.py from the sdist that
bench/peers/build_llama_cpp.sh unpacks) from tiny random transformers checkpoints, one per GGUF
architecture the engine loads: its float32 logits within 1e-4 of transformers' and the same greedy
tokens. The hand-written GGUFs of test_model_families.py follow the converter's layout as read in
its source; these check that reading against the converter itself. Only the converter's vocabulary
step is replaced (a random model has no tokenizer of its family)."""

from __future__ import annotations

import pytest
import torch

from slotune.engine import EngineConfig
from slotune.engine.checkpoint import check_model
from slotune.engine.llm_engine import LLMEngine
from slotune.engine.model_runner import ModelRunner
from tests.engine_driver import IdsTokenizer, generate
from tests.hf_checkpoints import LLAMA_CPP_CONVERTER, convert_with_llama_cpp, hf_checkpoint

pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(
    not LLAMA_CPP_CONVERTER.exists(), reason="needs llama.cpp's sdist: bash bench/peers/build_llama_cpp.sh"
)

LLAMA3_ROPE = {  # the converter writes it as a rope_freqs tensor
    "rope_theta": 10000.0,
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
PHI3_ROPE = {  # the converter writes longrope as two factor tensors and an attention factor
    "rope_theta": 10000.0,
    "rope_type": "longrope",
    "partial_rotary_factor": 0.5,
    "short_factor": [1.0, 1.5, 2.0, 3.0],
    "long_factor": [4.0] * 4,
}
NO_SPECIAL_IDS = {"pad_token_id": None, "bos_token_id": None, "eos_token_id": None}  # beyond the tiny vocabulary
FAMILIES = {
    "llama": ("LlamaConfig", {"rope_parameters": LLAMA3_ROPE}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {"head_dim": 32, "tie_word_embeddings": True}),
    "smollm3": ("SmolLM3Config", {"num_hidden_layers": 4, "pad_token_id": None}),
    "gemma3": (  # six layers: the pattern's full-attention layer is the sixth; the others' window is 8
        "Gemma3TextConfig",
        {
            "num_hidden_layers": 6,
            "head_dim": 16,
            "query_pre_attn_scalar": 16,
            "sliding_window": 8,
            "sliding_window_pattern": 6,
            "layer_types": None,
            "rope_parameters": {
                "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
        },
    ),
    "phi3": (
        "Phi3Config",
        {
            "rope_parameters": PHI3_ROPE,
            "partial_rotary_factor": 0.5,
            "original_max_position_embeddings": 128,
            **NO_SPECIAL_IDS,
        },
    ),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_a_gguf_from_llama_cpps_converter_matches_transformers(family, tmp_path):
    ids = [(11 * j + 5) % 128 for j in range(40)]
    prompts = [ids[:9], ids[:23]]
    config, kw = FAMILIES[family]
    ref = hf_checkpoint(tmp_path / "hf", config, ids=ids, prompts=prompts, **kw)
    gguf = tmp_path / f"{family}.gguf"
    convert_with_llama_cpp(tmp_path / "hf", gguf)
    assert check_model(str(gguf)).num_layers == ref["config"]["num_hidden_layers"]
    cfg = EngineConfig(
        model=str(gguf), device="cpu", num_kv_blocks=64, block_size=8, max_model_len=128, kernels={"backend": "torch"}
    )
    torch.testing.assert_close(ModelRunner(cfg).full_logits(ids), ref["logits"], atol=1e-4, rtol=1e-4)
    assert generate(LLMEngine(cfg, tokenizer=IdsTokenizer()), prompts, 12) == ref["greedy"]
