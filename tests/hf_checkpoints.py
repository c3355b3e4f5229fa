"""Tiny random-weight checkpoints for model-family tests, built with transformers' own config
classes (no hub, no download), and the same weights written as GGUF in llama.cpp's layout.

transformers runs in a child process (`hf_checkpoint`): run inside the pytest process, it left
Triton's interpreter unable to patch `tl` for the kernel tests that follow (every Triton test
failed after the family tests in a full run, none in isolation).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import torch

TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.15,
)  # large enough for rope to matter

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
out = {"state_dict": {k: v.clone() for k, v in model.state_dict().items()}, "config": cfg.to_dict()}
with torch.no_grad():
    if spec.get("ids"):
        out["logits"] = model(torch.tensor([spec["ids"]])).logits[0].float()
    out["greedy"] = [model.generate(torch.tensor([p]), max_new_tokens=spec["max_new_tokens"],
                                    min_new_tokens=spec["max_new_tokens"], do_sample=False)[0, len(p):].tolist()
                     for p in spec.get("prompts", [])]
torch.save(out, spec["out"])
"""


def hf_checkpoint(path: Path, config: str, ids=None, prompts=(), max_new_tokens: int = 12, **kw) -> dict:
    """In a child process: a random transformers model of config class `config` (TINY + kw) saved as
    an HF directory in `path` (biases and norms randomised so that they matter). Returns its
    state_dict, config dict, float32 logits on `ids` and greedy tokens for each of `prompts`."""
    spec = {
        "config": config,
        "kw": {**TINY, **kw},
        "dir": str(path),
        "out": str(path / "ref.pt"),
        "ids": ids,
        "prompts": [list(p) for p in prompts],
        "max_new_tokens": max_new_tokens,
    }
    r = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(spec)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    return torch.load(path / "ref.pt")


def permute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's convert-time q/k row order for the llama architecture (what slotune/engine/loader.py undoes)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "self_attn.qkv_proj": "attn_qkv",  # Phi-3's fused projections
    "mlp.gate_up_proj": "ffn_up",
}
_GEMMA3_LAYER_NAMES = _LAYER_NAMES | {
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}


def write_gguf(
    path: Path,
    ref: dict,
    arch: str,
    rope_freqs: torch.Tensor | None = None,
    extra: dict[str, torch.Tensor] | None = None,
    metadata: dict | None = None,
    drop: tuple[str, ...] = (),
) -> None:
    """`hf_checkpoint`'s weights as a float32 GGUF of llama.cpp architecture `arch`, as
    convert_hf_to_gguf.py writes it: q/k rows permuted for `llama` and `smollm3` (LlamaModel permutes,
    Qwen2Model/Qwen3Model/Gemma3Model only rename), key_length/value_length when the config has
    head_dim, no output.weight when the embeddings are tied; for gemma3, norms stored as 1 + w and
    the window but not the layer pattern or the local RoPE base (Gemma3Model.set_gguf_parameters);
    for phi3, the fused projections as they are, the rotary dims, and longrope as two factor tensors
    with its attention factor (Phi3MiniModel).
    To test refusals: `metadata` adds or replaces keys (None removes one), `extra` adds tensors and
    `drop` leaves out the tensors of these GGUF names."""
    import gguf

    c = ref["config"]
    heads, kv_heads = c["num_attention_heads"], c["num_key_value_heads"]
    rope = c.get("rope_parameters") or {}
    theta = c.get("rope_theta") or rope.get("full_attention", rope).get("rope_theta", 10000.0)
    names = _GEMMA3_LAYER_NAMES if arch == "gemma3" else _LAYER_NAMES
    kv = {
        "block_count": c["num_hidden_layers"],
        "context_length": c["max_position_embeddings"],
        "embedding_length": c["hidden_size"],
        "feed_forward_length": c["intermediate_size"],
        "attention.head_count": heads,
        "attention.head_count_kv": kv_heads,
        "rope.freq_base": float(theta),
        "attention.layer_norm_rms_epsilon": float(c["rms_norm_eps"]),
    }
    if c.get("head_dim"):
        kv |= {"attention.key_length": c["head_dim"], "attention.value_length": c["head_dim"]}
    if arch == "gemma3":
        kv["attention.sliding_window"] = c["sliding_window"]
    tensors = {}
    if arch == "phi3":  # Phi3MiniModel.set_gguf_parameters and generate_extra_tensors
        orig = rope.get("original_max_position_embeddings") or c["original_max_position_embeddings"]
        partial = rope.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0))
        kv |= {
            "rope.scaling.original_context_length": orig,
            "rope.dimension_count": int(partial * c["hidden_size"]) // heads,
            "attention.sliding_window": c.get("sliding_window") or 0,
        }
        if rope.get("long_factor"):
            scale = c["max_position_embeddings"] / orig
            kv["rope.scaling.attn_factor"] = math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1 else 1.0
            tensors["rope_factors_long.weight"] = torch.tensor(rope["long_factor"]).numpy()
            tensors["rope_factors_short.weight"] = torch.tensor(rope["short_factor"]).numpy()
    kv = {f"{arch}.{k}": v for k, v in kv.items()} | (metadata or {})
    w = gguf.GGUFWriter(str(path), kv.pop("general.architecture", arch))
    for key, value in kv.items():
        if value is None:
            continue
        if isinstance(value, list):
            w.add_array(key, value)
        else:
            {bool: w.add_bool, str: w.add_string, int: w.add_uint32, float: w.add_float32}[type(value)](key, value)
    for k, v in ref["state_dict"].items():
        if k == "lm_head.weight" and c.get("tie_word_embeddings"):
            continue
        if arch == "gemma3" and k.endswith("norm.weight"):
            v = v + 1.0
        if k in _NAMES:
            tensors[_NAMES[k]] = v.float().numpy()
            continue
        _, _, i, rest = k.split(".", 3)
        mod, kind = rest.rsplit(".", 1)
        if arch in ("llama", "smollm3") and mod == "self_attn.q_proj":
            v = permute_qk(v, heads)
        elif arch in ("llama", "smollm3") and mod == "self_attn.k_proj":
            v = permute_qk(v, kv_heads)
        tensors[f"blk.{i}.{names[mod]}.{kind}"] = v.float().contiguous().numpy()
    if rope_freqs is not None:
        tensors["rope_freqs.weight"] = rope_freqs.float().numpy()
    tensors |= {k: v.numpy() for k, v in (extra or {}).items()}
    for name, array in tensors.items():
        if name not in drop:
            w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


LLAMA_CPP_CONVERTER = (
    Path(os.environ.get("SLOTUNE_PEERS_CACHE") or Path.home() / ".cache" / "slotune")
    / "llama.cpp-src"
    / "convert_hf_to_gguf.py"
)  # the sdist bench/peers/build_llama_cpp.sh unpacks

_CONVERT = r"""
import json, sys
from pathlib import Path
converter, model_dir, out = sys.argv[1:4]
sys.path.insert(0, str(Path(converter).parent))
sys.argv = [converter, model_dir, "--outfile", out, "--outtype", "f32"]
cfg = json.loads((Path(model_dir) / "config.json").read_text())
n = cfg["vocab_size"]
tok = Path(model_dir) / "tokenizer.json"  # Gemma3Model reads the vocabulary's size from it
if not tok.exists():
    tok.write_text(json.dumps({"model": {"vocab": {f"t{i}": i for i in range(n)}}, "added_tokens": []}))
import convert_hf_to_gguf as c

def set_vocab(self):  # a random model has no tokenizer of its family: a plain byte-level BPE one
    w = self.gguf_writer
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list([f"t{i}" for i in range(n)])
    w.add_token_types([1] * n)
    w.add_token_merges(["t 1"])

get = c.get_model_class
def get_model_class(*args, **kwargs):
    cls = get(*args, **kwargs)
    cls.set_vocab = set_vocab
    return cls
c.get_model_class = get_model_class
c.main()
"""


def convert_with_llama_cpp(model_dir: Path, out: Path) -> None:
    """`model_dir` (an HF directory) as a float32 GGUF written by llama.cpp's own converter, in a
    child process; only its vocabulary step is replaced (random models have no real tokenizer)."""
    r = subprocess.run(
        [sys.executable, "-c", _CONVERT, str(LLAMA_CPP_CONVERTER), str(model_dir), str(out)],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr[-3000:]
