"""Llama-family variants from tiny random checkpoints built here with transformers' config classes
(no hub, no download): q/k/v biases (Qwen2), attention and MLP biases (Llama), rope scaling
(linear, llama3, yarn, dynamic, longrope), Mistral within and past its sliding window, Qwen3 (q/k
norm, explicit head_dim), SmolLM3 (NoPE layers), Phi-3 (fused projections, partial rotary), Gemma 3,
and GGUF files of the llama, qwen2, qwen3, smollm3, gemma3 and phi3 architectures. Each must give
transformers' logits in float32 and its greedy tokens through the paged cache, on the torch path and,
where it runs the model, the native CPU step. What the engine does not implement is refused with an
error naming the field, never run differently.

transformers runs in a child process (tests/hf_checkpoints.py says why).
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from slotune.engine import EngineConfig
from slotune.engine.llm_engine import LLMEngine
from slotune.engine.loader import load_model
from slotune.engine.model_runner import ModelRunner
from slotune.engine.models.llama import LlamaModel
from slotune.tuner.spec.preflight import preflight
from slotune.tuner.spec.tuning_spec import TuningSpec
from slotune.tuner.spec.yaml_reader import SpecError
from tests.engine_driver import IdsTokenizer, generate
from tests.hf_checkpoints import hf_checkpoint, write_gguf

transformers = pytest.importorskip("transformers")

ROPE = {"rope_theta": 10000.0}


def _hf(tmp_path, config: str, ids=None, prompts=(), **kw) -> dict:
    """A random transformers model of class `config` saved in tmp_path, its logits on `ids` and greedy
    tokens for `prompts` (tests/hf_checkpoints.py: transformers runs in a child process)."""
    return hf_checkpoint(tmp_path, config, ids=ids, prompts=prompts, **kw)


def _config(path, backend: str = "torch", **kw) -> EngineConfig:
    return EngineConfig(
        model=str(path),
        device="cpu",
        num_kv_blocks=64,
        block_size=8,
        max_model_len=128,
        kernels={"backend": backend},
        **kw,
    )


def _greedy(path, backend: str, prompts: list[list[int]], n: int) -> list[list[int]]:
    engine = LLMEngine(_config(path, backend), tokenizer=IdsTokenizer())
    assert engine.runner.backend == backend
    return generate(engine, prompts, n)


def _backends() -> list[str]:
    from slotune.kernels.cpu_decode import load_library

    return ["torch"] + ([] if isinstance(load_library(), str) else ["native"])  # native: AVX2/AVX-512 + gcc


def _assert_matches(path, ref: dict, ids: list[int], prompts: list[list[int]]) -> None:
    """transformers' float32 logits on `ids` (torch path) and its greedy tokens on every backend."""
    torch.testing.assert_close(_logits(path, ids), ref["logits"], atol=1e-4, rtol=1e-4)
    for backend in _backends():
        assert _greedy(path, backend, prompts, 12) == ref["greedy"], (path, backend)


def _logits(path, ids: list[int]) -> torch.Tensor:
    """float32 logits at every position, the torch path (no cache)."""
    return ModelRunner(_config(path)).full_logits(ids)


FAMILIES = {
    "qwen2-biases-tied": ("Qwen2Config", {"tie_word_embeddings": True}),
    "llama-attention-mlp-bias": ("LlamaConfig", {"attention_bias": True, "mlp_bias": True}),
    "llama-rope-linear": ("LlamaConfig", {"rope_parameters": {**ROPE, "rope_type": "linear", "factor": 2.0}}),
    "llama-rope-llama3": (
        "LlamaConfig",
        {
            "rope_parameters": {
                **ROPE,
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            }
        },
    ),
    "llama-rope-yarn": (
        "LlamaConfig",
        {"rope_parameters": {**ROPE, "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}},
    ),
    # dynamic NTK within the original context (the runner refuses max_model_len past it: next test)
    "llama-rope-dynamic": (
        "LlamaConfig",
        {"rope_parameters": {**ROPE, "rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 128}},
    ),
    # longrope within the original context: the short factors, and the attention factor of 256 / 128
    "llama-rope-longrope": (
        "LlamaConfig",
        {
            "rope_parameters": {
                **ROPE,
                "rope_type": "longrope",
                "short_factor": [1.0, 1.2, 1.5, 2.0, 2.5, 3.0, 4.0, 6.0],
                "long_factor": [8.0] * 8,
                "original_max_position_embeddings": 128,
            }
        },
    ),
    "mistral-within-window": ("MistralConfig", {"sliding_window": 128}),
    "mistral-past-window": ("MistralConfig", {"sliding_window": 16}),  # prompts of 23 + 12 decoded: past it
    "qwen3-qk-norm-head-dim": ("Qwen3Config", {"head_dim": 32, "tie_word_embeddings": True}),  # 32 != 64 / 4
}
PHI3 = {  # RoPE on half of each head, longrope within its original context
    "rope_parameters": {
        **ROPE,
        "rope_type": "longrope",
        "partial_rotary_factor": 0.5,
        "short_factor": [1.0, 1.5, 2.0, 3.0],
        "long_factor": [4.0] * 4,
    },
    "partial_rotary_factor": 0.5,
    "original_max_position_embeddings": 128,
    "pad_token_id": None,  # Phi3Config's special ids (32000) lie outside TINY's vocabulary
    "bos_token_id": None,
    "eos_token_id": None,
}
CACHED_FAMILIES = {  # through prefix caching, self-drafting and int8 KV (the next-but-one test)
    **{f: FAMILIES[f] for f in ("qwen2-biases-tied", "mistral-past-window", "qwen3-qk-norm-head-dim")},
    "smollm3-nope": ("SmolLM3Config", {"num_hidden_layers": 4, "pad_token_id": None}),
    "phi3-partial-longrope": ("Phi3Config", PHI3),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_matches_transformers(family, tmp_path):
    config, kw = FAMILIES[family]
    ids = [(11 * j + 5) % 128 for j in range(40)]
    prompts = [ids[:9], ids[:23]]
    ref = _hf(tmp_path, config, ids=ids, prompts=prompts, **kw)
    _assert_matches(tmp_path, ref, ids, prompts)


@pytest.mark.parametrize(
    ("config_cls", "kw", "match"),
    [
        ("LlamaConfig", {"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ],
    ids=["gelu"],
)
def test_unimplemented_math_is_refused_by_name(config_cls, kw, match, tmp_path):
    _hf(tmp_path, config_cls, **kw)
    with pytest.raises(ValueError, match=match):
        load_model(str(tmp_path))


def test_an_unknown_rope_type_is_refused_by_name(tmp_path):
    """Every rope type transformers builds a Llama with is implemented; a config.json naming another
    one (as a newer transformers might write) is refused."""
    import json

    _hf(tmp_path, "LlamaConfig")
    f = tmp_path / "config.json"
    cfg = json.loads(f.read_text())
    cfg["rope_parameters"] = {**ROPE, "rope_type": "mrope"}
    f.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="rope_scaling type 'mrope' is not implemented"):
        load_model(str(tmp_path))


def test_dynamic_rope_past_its_original_context_is_refused(tmp_path):
    _hf(
        tmp_path,
        "LlamaConfig",
        rope_parameters={**ROPE, "rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 64},
    )
    with pytest.raises(
        ValueError,
        match=r"rope_scaling dynamic: max_model_len \(128\) exceeds "
        r"original_max_position_embeddings \(64\)",
    ):
        ModelRunner(_config(tmp_path))
    ModelRunner(_config(tmp_path).with_updates({"max_model_len": 64}))  # within it: fine


def test_a_weight_the_model_does_not_use_is_refused(tmp_path):
    _hf(tmp_path, "LlamaConfig")
    mcfg, sd, _ = load_model(str(tmp_path))
    f = tmp_path / "model.safetensors"
    extra = load_file(str(f)) | {"model.layers.0.self_attn.q_norm.weight": torch.ones(16)}  # e.g. Qwen3's q_norm
    save_file(extra, str(f))
    with pytest.raises(ValueError, match=r"q_norm.weight' \(not part of the llama layout"):
        load_model(str(tmp_path))  # from the safetensors header, before a weight is read
    with pytest.raises(ValueError, match="does not use.*q_norm"):  # the model's own check behind it
        LlamaModel(
            mcfg, sd | {"model.layers.0.self_attn.q_norm.weight": torch.ones(16)}, torch.float32, torch.device("cpu")
        )


def test_llama3_gguf_with_rope_freqs_matches_transformers(tmp_path):
    """Llama 3.x GGUFs carry the llama3 rope scaling as `rope_freqs.weight` (per-dimension divisors)."""
    from slotune.engine.layers.ops import rope_frequencies

    _, kw = FAMILIES["llama-rope-llama3"]
    ids = [(11 * j + 5) % 128 for j in range(40)]
    ref = _hf(tmp_path, "LlamaConfig", ids=ids, attention_bias=True, **kw)
    plain, _ = rope_frequencies(16, 10000.0, None)
    scaled, _ = rope_frequencies(16, 10000.0, {"rope_type": "llama3", **kw["rope_parameters"]})
    path = tmp_path / "model.gguf"
    write_gguf(path, ref, "llama", rope_freqs=plain / scaled)
    want = ref["logits"]
    torch.testing.assert_close(_logits(path, ids), want, atol=1e-4, rtol=1e-4)
    write_gguf(tmp_path / "no-freqs.gguf", ref, "llama")  # the scaling dropped
    assert (_logits(tmp_path / "no-freqs.gguf", ids) - want).abs().max() > 1e-2


def test_gguf_tensor_outside_the_llama_layout_is_refused(tmp_path):
    ref = _hf(tmp_path, "LlamaConfig")
    path = tmp_path / "model.gguf"
    write_gguf(path, ref, "llama", extra={"blk.0.attn_q_norm.weight": torch.ones(16)})
    with pytest.raises(ValueError, match="blk.0.attn_q_norm.weight' is not part of the llama layout"):
        load_model(str(path))


@pytest.mark.parametrize(
    ("arch", "config", "kw"),
    [
        ("qwen2", "Qwen2Config", {}),  # q/k/v biases, rows not permuted (NEOX rope)
        ("qwen3", "Qwen3Config", {"head_dim": 32}),  # q/k norm, key_length/value_length
    ],
)
def test_qwen_gguf_matches_transformers(arch, config, kw, tmp_path):
    """GGUF files of llama.cpp's qwen2 / qwen3 architectures, written as convert_hf_to_gguf.py
    writes them: transformers' logits and greedy tokens through the paged cache."""
    ids = [(11 * j + 5) % 128 for j in range(40)]
    prompts = [ids[:9], ids[:23]]
    ref = _hf(tmp_path, config, ids=ids, prompts=prompts, **kw)
    path = tmp_path / "model.gguf"
    write_gguf(path, ref, arch)
    torch.testing.assert_close(_logits(path, ids), ref["logits"], atol=1e-4, rtol=1e-4)
    assert _greedy(path, "torch", prompts, 12) == ref["greedy"]


def test_unknown_gguf_architecture_is_refused_by_name(tmp_path):
    ref = _hf(tmp_path, "LlamaConfig")
    path = tmp_path / "model.gguf"
    write_gguf(path, ref, "gemma2")
    with pytest.raises(
        ValueError,
        match="unsupported GGUF architecture 'gemma2' \\(supported: llama, qwen2, qwen3, smollm3, gemma3, phi3\\)",
    ):
        load_model(str(path))
    # `tune validate` says so before a study, from the header alone
    spec = TuningSpec.model_validate(
        {
            "name": "g",
            "model": str(path),
            "objective": {"kind": "latency", "metric": "tpot"},
            "output_dir": str(tmp_path),
        }
    )
    with pytest.raises(SpecError, match="model: .*unsupported GGUF architecture 'gemma2'"):
        preflight(spec)


@pytest.mark.parametrize("family", CACHED_FAMILIES)
def test_family_with_prefix_caching_speculation_and_int8_kv(family, tmp_path):
    """Prefix caching: a request sharing a 16-token (2-block) prefix with an earlier one hits the cache
    and still gives transformers' greedy tokens. Speculative decoding (self-drafting from the first
    layer, verified by the whole model over the variant's attention) gives them too; on random
    weights how many drafts are accepted is chance, so only verification having run is asserted. int8 KV: quantizing the cache moves logits a little,
    and on random weights one flipped near-tie changes every later token, so whole-sequence equality
    is not a sound requirement; the first 4 tokens (3 decode steps reading the int8 cache) must
    equal transformers' (a layout or scale error in the cache garbles them at once)."""
    config, kw = CACHED_FAMILIES[family]
    ids = [(11 * j + 5) % 128 for j in range(40)]
    prompts = [ids[:23], ids[:16] + [3, 1, 4, 1, 5, 9, 2]]
    ref = _hf(tmp_path, config, prompts=prompts, **kw)
    engine = LLMEngine(_config(tmp_path, "torch", enable_prefix_caching=True), tokenizer=IdsTokenizer())
    assert [generate(engine, [p], 12)[0] for p in prompts] == ref["greedy"]  # one after the other
    assert engine.stats().prefix_cache_hits >= 2  # the two shared blocks
    spec = LLMEngine(
        _config(
            tmp_path, "torch", speculative={"method": "early_exit", "early_exit_layers": 1, "num_speculative_tokens": 3}
        ),
        tokenizer=IdsTokenizer(),
    )
    assert generate(spec, prompts, 12) == ref["greedy"]
    assert spec.stats().num_spec_verifications > 0  # drafts went through verification
    int8 = LLMEngine(_config(tmp_path, "torch", kv_dtype="int8"), tokenizer=IdsTokenizer())
    got = generate(int8, prompts, 12)
    assert [g[:4] for g in got] == [r[:4] for r in ref["greedy"]], (got, ref["greedy"])


GEMMA3 = {  # one windowed layer (window 8: the prompts run past it) and one full-attention layer
    "head_dim": 16,
    "query_pre_attn_scalar": 24,
    "sliding_window": 8,
    "layer_types": ["sliding_attention", "full_attention"],
}


def test_gemma3_matches_transformers(tmp_path):
    """Gemma 3 (text): four norms per layer stored as (1 + w), GeGLU, q/k norms, scaled embeddings,
    query_pre_attn_scalar, a windowed layer with the local RoPE base beside a full-attention one with
    the global base; on the torch path and the native step."""
    ids = [(11 * j + 5) % 128 for j in range(40)]
    prompts = [ids[:9], ids[:23]]
    ref = _hf(tmp_path, "Gemma3TextConfig", ids=ids, prompts=prompts, **GEMMA3)
    _assert_matches(tmp_path, ref, ids, prompts)


def test_gemma3_gguf_matches_transformers(tmp_path):
    """A gemma3 GGUF written as convert_hf_to_gguf.py writes one (norms as 1 + w, the window but
    neither the layer pattern nor the local RoPE base: llama.cpp's constants, 6 and 10000). Six layers
    so that the pattern's one full-attention layer (the sixth) is there."""
    ids = [(11 * j + 5) % 128 for j in range(40)]
    prompts = [ids[:9], ids[:23]]
    kw = GEMMA3 | {"num_hidden_layers": 6, "layer_types": None, "sliding_window_pattern": 6}
    kw["rope_parameters"] = {
        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
    }
    kw["query_pre_attn_scalar"] = GEMMA3["head_dim"]  # llama.cpp: head_dim (27B aside)
    ref = _hf(tmp_path, "Gemma3TextConfig", ids=ids, prompts=prompts, **kw)
    assert ref["config"]["layer_types"][5] == "full_attention"
    path = tmp_path / "model.gguf"
    write_gguf(path, ref, "gemma3")
    _assert_matches(path, ref, ids, prompts)


def test_gemma3_with_prefix_caching_speculation_and_int8_kv(tmp_path):
    """As test_family_with_prefix_caching_speculation_and_int8_kv, for Gemma 3."""
    ids = [(11 * j + 5) % 128 for j in range(40)]
    prompts = [ids[:23], ids[:16] + [3, 1, 4, 1, 5, 9, 2]]
    ref = _hf(tmp_path, "Gemma3TextConfig", prompts=prompts, **GEMMA3)
    engine = LLMEngine(_config(tmp_path, "torch", enable_prefix_caching=True), tokenizer=IdsTokenizer())
    assert [generate(engine, [p], 12)[0] for p in prompts] == ref["greedy"]
    assert engine.stats().prefix_cache_hits >= 2
    spec = LLMEngine(
        _config(
            tmp_path, "torch", speculative={"method": "early_exit", "early_exit_layers": 1, "num_speculative_tokens": 3}
        ),
        tokenizer=IdsTokenizer(),
    )
    assert generate(spec, prompts, 12) == ref["greedy"]
    int8 = LLMEngine(_config(tmp_path, "torch", kv_dtype="int8"), tokenizer=IdsTokenizer())
    got = generate(int8, prompts, 12)
    assert [g[:4] for g in got] == [r[:4] for r in ref["greedy"]], (got, ref["greedy"])


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"final_logit_softcapping": 30.0}, "final_logit_softcapping 30.0"),
        ({"hidden_activation": "gelu"}, "hidden_activation 'gelu'"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention True"),
    ],
    ids=["softcap", "gelu", "bidirectional"],
)
def test_gemma3_math_it_does_not_implement_is_refused(kw, match, tmp_path):
    _hf(tmp_path, "Gemma3TextConfig", **GEMMA3, **kw)
    with pytest.raises(ValueError, match=match):
        load_model(str(tmp_path))


def test_smollm3_matches_transformers_hf_and_gguf(tmp_path):
    """SmolLM3: Llama layers, every 4th without RoPE (`no_rope_layers`). The HF directory's list is
    read as it stands; a smollm3 GGUF carries none, so llama.cpp's rule (every 4th layer) applies:
    four layers, the last one NoPE, in both; on the torch path and the native step."""
    ids = [(11 * j + 5) % 128 for j in range(40)]
    prompts = [ids[:9], ids[:23]]
    ref = _hf(tmp_path, "SmolLM3Config", ids=ids, prompts=prompts, num_hidden_layers=4, pad_token_id=None)
    assert ref["config"]["no_rope_layers"] == [1, 1, 1, 0]
    path = tmp_path / "gguf" / "model.gguf"
    path.parent.mkdir()
    write_gguf(path, ref, "smollm3")
    for model in (tmp_path, path):
        _assert_matches(model, ref, ids, prompts)


def test_phi3_matches_transformers(tmp_path):
    """Phi-3: fused qkv_proj and gate_up_proj (split at load, fused again by the model), RoPE on half
    of each head (partial_rotary_factor 0.5), longrope within the original context (short factors,
    attention factor sqrt(1 + ln 2 / ln 128)); on the torch path and the native step."""
    ids = [(11 * j + 5) % 128 for j in range(40)]
    prompts = [ids[:9], ids[:23]]
    ref = _hf(tmp_path, "Phi3Config", ids=ids, prompts=prompts, **PHI3)
    assert any(k.endswith("qkv_proj.weight") for k in ref["state_dict"])
    gguf = tmp_path / "gguf" / "phi3.gguf"  # fused tensors, rotary dims and longrope factor tensors
    gguf.parent.mkdir()
    write_gguf(gguf, ref, "phi3")
    for path in (tmp_path, gguf):
        _assert_matches(path, ref, ids, prompts)
    with pytest.raises(ValueError, match="rope_scaling longrope: max_model_len \\(256\\) exceeds"):
        ModelRunner(_config(tmp_path).with_updates({"max_model_len": 256}))
