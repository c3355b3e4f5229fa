"""Llama-family variants from tiny random checkpoints built here with transformers' config classes
(no hub, no download): q/k/v biases (Qwen2), attention and MLP biases (Llama), rope scaling
(linear, llama3, yarn), Mistral within its window. Each must give transformers' logits in float32
and its greedy tokens through the paged cache, on the torch path and the native CPU step. What
the engine does not implement is refused with an error naming the field, never run differently.

transformers and the GGUF writer run in a child process (`_hf`): run inside the pytest process,
they left Triton's interpreter unable to patch `tl` for the kernel tests that follow (every
Triton test failed after this module in a full run, none in isolation).
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
from tests.engine_driver import IdsTokenizer, generate

transformers = pytest.importorskip("transformers")

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.15)  # large enough for rope to matter
ROPE = {"rope_theta": 10000.0}


_CHILD = r"""
import json, sys
import torch, transformers
spec = json.loads(sys.argv[1])
torch.manual_seed(0)
cfg = getattr(transformers, spec["config"])(**spec["kw"])
model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
with torch.no_grad():
    for name, p in model.named_parameters():
        if name.endswith(".bias"):
            p.normal_(0.0, 0.5)
        elif "norm" in name:
            p.copy_(1.0 + 0.2 * torch.randn_like(p))
model.save_pretrained(spec["dir"])
out = {"state_dict": {k: v.clone() for k, v in model.state_dict().items()}}
with torch.no_grad():
    if spec.get("ids"):
        out["logits"] = model(torch.tensor([spec["ids"]])).logits[0].float()
    out["greedy"] = [model.generate(torch.tensor([p]), max_new_tokens=12, min_new_tokens=12,
                                    do_sample=False)[0, len(p):].tolist() for p in spec.get("prompts", [])]
torch.save(out, spec["out"])
"""


def _hf(tmp_path, config: str, ids=None, prompts=(), **kw) -> dict:
    """In a child process: a random transformers model saved as an HF directory in tmp_path (biases and
    norms randomised so that they matter), its logits on `ids` and its greedy tokens for `prompts`."""
    import json
    import subprocess
    import sys

    spec = {"config": config, "kw": {**TINY, **kw}, "dir": str(tmp_path), "out": str(tmp_path / "ref.pt"),
            "ids": ids, "prompts": list(prompts)}
    subprocess.run([sys.executable, "-c", _CHILD, json.dumps(spec)], check=True, capture_output=True)
    return torch.load(tmp_path / "ref.pt")


def _config(path, backend: str = "torch", **kw) -> EngineConfig:
    return EngineConfig(model=str(path), device="cpu", num_kv_blocks=64, block_size=8, max_model_len=128,
                        kernels={"backend": backend}, **kw)


def _greedy(path, backend: str, prompts: list[list[int]], n: int) -> list[list[int]]:
    engine = LLMEngine(_config(path, backend), tokenizer=IdsTokenizer())
    assert engine.runner.backend == backend
    return generate(engine, prompts, n)


def _logits(path, ids: list[int]) -> torch.Tensor:
    """float32 logits at every position, the torch path (no cache)."""
    return ModelRunner(_config(path)).full_logits(ids)


FAMILIES = {
    "qwen2-biases-tied": ("Qwen2Config", {"tie_word_embeddings": True}),
    "llama-attention-mlp-bias": ("LlamaConfig", {"attention_bias": True, "mlp_bias": True}),
    "llama-rope-linear": ("LlamaConfig", {"rope_parameters": {**ROPE, "rope_type": "linear", "factor": 2.0}}),
    "llama-rope-llama3": ("LlamaConfig", {"rope_parameters": {
        **ROPE, "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32}}),
    "llama-rope-yarn": ("LlamaConfig", {"rope_parameters": {
        **ROPE, "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}}),
    "mistral-within-window": ("MistralConfig", {"sliding_window": 128}),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_matches_transformers(family, tmp_path):
    config, kw = FAMILIES[family]
    ids = [(11 * j + 5) % 128 for j in range(40)]
    prompts = [ids[:9], ids[:23]]
    ref = _hf(tmp_path, config, ids=ids, prompts=prompts, **kw)
    torch.testing.assert_close(_logits(tmp_path, ids), ref["logits"], atol=1e-4, rtol=1e-4)
    from slotune.kernels.cpu_decode import load_library

    backends = ["torch"] + ([] if isinstance(load_library(), str) else ["native"])  # native: AVX-512 + gcc
    for backend in backends:
        assert _greedy(tmp_path, backend, prompts, 12) == ref["greedy"], backend


@pytest.mark.parametrize(("config_cls", "kw", "match"), [
    ("LlamaConfig", {"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ("LlamaConfig", {"rope_parameters": {**ROPE, "rope_type": "dynamic", "factor": 2.0}},
     "rope_scaling type 'dynamic' is not implemented"),
], ids=["gelu", "dynamic-rope"])
def test_unimplemented_math_is_refused_by_name(config_cls, kw, match, tmp_path):
    _hf(tmp_path, config_cls, **kw)
    with pytest.raises(ValueError, match=match):
        load_model(str(tmp_path))


def test_mistral_past_its_window_is_refused(tmp_path):
    _hf(tmp_path, "MistralConfig", sliding_window=32)
    cfg = _config(tmp_path)
    with pytest.raises(ValueError, match=r"sliding_window \(32\).*set max_model_len <= 32"):
        ModelRunner(cfg)
    ModelRunner(cfg.with_updates({"max_model_len": 32}))  # within it: fine


def test_a_weight_the_model_does_not_use_is_refused(tmp_path):
    _hf(tmp_path, "LlamaConfig")
    f = tmp_path / "model.safetensors"
    sd = load_file(str(f))
    sd["model.layers.0.self_attn.q_norm.weight"] = torch.ones(16)  # e.g. Qwen3's q_norm
    save_file(sd, str(f))
    mcfg, sd, _ = load_model(str(tmp_path))
    with pytest.raises(ValueError, match="does not use.*q_norm"):
        LlamaModel(mcfg, sd, torch.float32, torch.device("cpu"))


def _permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's convert-time q/k row order (what engine/loader.py undoes)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_gguf(path, state_dict: dict[str, torch.Tensor], rope_freqs: torch.Tensor | None,
                extra: dict[str, torch.Tensor] | None = None) -> None:
    """A TINY Llama state dict as a llama.cpp-layout GGUF (float32 tensors), as convert_hf_to_gguf.py writes it."""
    from types import SimpleNamespace

    import gguf

    c = SimpleNamespace(**TINY, rms_norm_eps=1e-6)  # LlamaConfig's default eps
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    layer = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for k, v in state_dict.items():
        if k in names:
            w.add_tensor(names[k], v.float().numpy())
            continue
        _, _, i, rest = k.split(".", 3)
        mod, kind = rest.rsplit(".", 1)
        if mod == "self_attn.q_proj":
            v = _permute(v, c.num_attention_heads)
        elif mod == "self_attn.k_proj":
            v = _permute(v, c.num_key_value_heads)
        w.add_tensor(f"blk.{i}.{layer[mod]}.{kind}", v.float().contiguous().numpy())
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs.float().numpy())
    for k, v in (extra or {}).items():
        w.add_tensor(k, v.numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_llama3_gguf_with_rope_freqs_matches_transformers(tmp_path):
    """Llama 3.x GGUFs carry the llama3 rope scaling as `rope_freqs.weight` (per-dimension divisors)."""
    from slotune.engine.layers.ops import rope_frequencies

    _, kw = FAMILIES["llama-rope-llama3"]
    ids = [(11 * j + 5) % 128 for j in range(40)]
    ref = _hf(tmp_path, "LlamaConfig", ids=ids, attention_bias=True, **kw)
    plain, _ = rope_frequencies(16, 10000.0, None)
    scaled, _ = rope_frequencies(16, 10000.0, {"rope_type": "llama3", **kw["rope_parameters"]})
    path = tmp_path / "model.gguf"
    _write_gguf(path, ref["state_dict"], rope_freqs=plain / scaled)
    want = ref["logits"]
    torch.testing.assert_close(_logits(path, ids), want, atol=1e-4, rtol=1e-4)
    _write_gguf(tmp_path / "no-freqs.gguf", ref["state_dict"], rope_freqs=None)  # the scaling dropped
    assert (_logits(tmp_path / "no-freqs.gguf", ids) - want).abs().max() > 1e-2


def test_gguf_tensor_outside_the_llama_layout_is_refused(tmp_path):
    ref = _hf(tmp_path, "LlamaConfig")
    path = tmp_path / "model.gguf"
    _write_gguf(path, ref["state_dict"], rope_freqs=None, extra={"blk.0.attn_q_norm.weight": torch.ones(16)})
    with pytest.raises(ValueError, match="blk.0.attn_q_norm.weight' is not part of the llama layout"):
        load_model(str(path))
