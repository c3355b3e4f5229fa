"""Find and read model weights: the bundled SmolLM2 GGUF, a llama/qwen2/qwen3 GGUF, or an HF checkpoint dir.

Both paths produce the same thing: a `ModelConfig` plus a state dict in Hugging Face naming
and layout, so one model implementation serves every source.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from slotune.engine.gguf_header import read_gguf_header
from slotune.engine.layers.ops import ROPE_TYPES
from slotune.engine.paths import BUNDLED_MODELS, cache_root, resolve_model_path  # noqa: F401 (re-exported)


@dataclass(slots=True, frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_id: int | None
    # None = plain RoPE; else {"rope_type": linear | llama3 | yarn | freq_factors, ...} (layers/ops.py)
    rope_scaling: dict | None = None
    # a query at position q attends keys q - sliding_window < k <= q (Mistral); None = all keys <= q
    sliding_window: int | None = None
    qk_norm: bool = False  # Qwen3, Gemma 3: RMSNorm over head_dim on each q and k head, before RoPE
    # Gemma 3: the layers that attend every key (the rest: sliding_window), and the RoPE base of
    # the windowed layers (None: rope_theta on all; rope_scaling applies to the others only)
    full_attention_layers: tuple[int, ...] = ()
    local_rope_theta: float | None = None
    sandwich_norms: bool = False  # Gemma 3: each sublayer's output normed too (four norms per layer)
    hidden_act: str = "silu"  # the MLP's gate: silu (SwiGLU) or gelu_tanh (GeGLU, Gemma)
    embed_scale: float | None = None  # Gemma: embeddings times sqrt(hidden_size)
    attn_scale: float | None = None  # softmax scale; None: head_dim ** -0.5
    no_rope_layers: tuple[int, ...] = ()  # SmolLM3: layers whose q and k are not rotated (NoPE)
    rotary_dim: int | None = None  # Phi-3 partial_rotary_factor: RoPE on each head's first dims; None: all

    def __post_init__(self) -> None:
        for name in ("full_attention_layers", "no_rope_layers"):  # from JSON: lists
            object.__setattr__(self, name, tuple(getattr(self, name)))

    def window_of(self, layer: int) -> int | None:
        """The sliding window layer `layer` attends over (None: every key)."""
        return None if layer in self.full_attention_layers else self.sliding_window


def load_model(model: str) -> tuple[ModelConfig, dict[str, torch.Tensor], Path]:
    """Returns (config, float32 state dict in HF naming, resolved path)."""
    path = resolve_model_path(model)
    if path.is_dir():
        cfg, sd = _load_hf_dir(path)
    else:
        cfg, sd = _load_gguf_cached(path)
    return cfg, sd, path


def check_loadable(model: str) -> None:
    """Raise the error `load_model` would for a model this engine does not implement, from its
    metadata alone (a GGUF's header, an HF config.json), without reading weights."""
    path = resolve_model_path(model)
    if path.is_dir():
        try:
            _hf_config(path, json.loads((path / "config.json").read_text()))
        except KeyError as exc:
            raise ValueError(f"{path / 'config.json'}: no {exc.args[0]!r}, which the model needs") from None
        return
    name = read_gguf_header(path, ("general.architecture",)).get("general.architecture")
    if name not in GGUF_ARCHS:
        raise ValueError(_unsupported_arch(path, name))
    _gguf_hparams(path, read_gguf_header(path, (), prefix=f"{name}."), name)


def _unsupported_arch(path: Path, name: Any) -> str:
    return (
        f"{path}: unsupported GGUF architecture '{name}' (supported: {', '.join(GGUF_ARCHS)}); "
        "a Hugging Face directory of a supported family loads instead"
    )


def _load_gguf_cached(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """GGUF dequantization costs seconds; every trial process loads the model, so keep the
    float32 result as safetensors keyed by the file's identity (path, size, mtime)."""
    from safetensors.torch import load_file, save_file

    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}:v3".encode()).hexdigest()[:16]
    d = cache_root() / "weights"
    weights, meta = d / f"{path.stem}-{key}.safetensors", d / f"{path.stem}-{key}.json"
    if weights.exists() and meta.exists():
        try:
            return ModelConfig(**json.loads(meta.read_text())), load_file(str(weights))
        except Exception:  # a torn or stale cache entry: rebuild it below
            pass
    cfg, sd = _load_gguf(path)
    try:
        d.mkdir(parents=True, exist_ok=True)
        tmp = weights.with_suffix(f".tmp{os.getpid()}")
        save_file(sd, str(tmp))
        os.replace(tmp, weights)  # atomic: concurrent trial processes never see half a file
        meta.write_text(json.dumps(asdict(cfg)))
    except OSError:
        pass  # read-only home: just don't cache
    return cfg, sd


# --- GGUF -------------------------------------------------------------------------------

_GGUF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.bias": "self_attn.o_proj.bias",
}
_GGUF_QK_NORM_NAMES = {"attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight"}
_GGUF_GEMMA3_NAMES = _GGUF_QK_NORM_NAMES | {  # ffn_norm is the MLP's input norm here too
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}


@dataclass(frozen=True, slots=True)
class _GgufArch:
    """How one llama.cpp architecture differs from the llama layout."""

    # llama.cpp's converter permutes q/k rows only for its llama-style models (rope type NORM,
    # interleaved pairs; convert_hf_to_gguf.py LlamaModel.modify_tensors); Qwen2/Qwen3 keep HF's
    # row order and run NEOX (rotate-half) rope on it (Qwen2Model/Qwen3Model rename tensors only).
    is_qk_permuted: bool
    names: dict[str, str] | None = None  # layer tensors besides and over _GGUF_LAYER_NAMES

    @property
    def is_qk_norm(self) -> bool:  # Qwen3, Gemma 3: blk.N.attn_q_norm / attn_k_norm
        return "attn_q_norm.weight" in (self.names or {})


GGUF_ARCHS = {
    "llama": _GgufArch(is_qk_permuted=True),
    "qwen2": _GgufArch(is_qk_permuted=False),
    "qwen3": _GgufArch(is_qk_permuted=False, names=_GGUF_QK_NORM_NAMES),
    "smollm3": _GgufArch(is_qk_permuted=True),  # every 4th layer without RoPE: _gguf_hparams
    # NEOX rope (rows as HF's); norms stored as 1 + w by the converter (Gemma3Model.norm_shift)
    "gemma3": _GgufArch(is_qk_permuted=False, names=_GGUF_GEMMA3_NAMES),
}


def gguf_metadata(path: Path) -> dict[str, Any]:
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    return {k: _field_value(f) for k, f in reader.fields.items()}


def _field_value(field: Any) -> Any:
    try:
        return field.contents()
    except Exception:  # pragma: no cover - exotic field types
        return None


def _unpermute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's convert-time row permutation of q/k so HF's rotate-half rotary applies.

    llama.cpp stores rows as (head, dim/2, 2) interleaved pairs; HF keeps (head, 2, dim/2).
    """
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _load_gguf(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(path))
    meta = {k: _field_value(f) for k, f in reader.fields.items()}
    name = meta.get("general.architecture")
    if name not in GGUF_ARCHS:
        raise ValueError(_unsupported_arch(path, name))
    arch = GGUF_ARCHS[name]
    hp = _gguf_hparams(path, meta, name)  # every metadata check before any tensor is read
    layer_names = _GGUF_LAYER_NAMES | (arch.names or {})
    sd: dict[str, torch.Tensor] = {}
    rope_scaling = hp.pop("rope_scaling")
    for t in reader.tensors:
        arr = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        # GGUF lists dims fastest-first; numpy data is already [rows, cols] = HF [out, in].
        arr = arr.reshape([int(d) for d in reversed(t.shape)])
        if t.name == "rope_freqs.weight":  # Llama 3.x: per-dimension frequency divisors
            if rope_scaling is not None:
                raise ValueError(
                    f"{path}: both rope_freqs.weight and {name}.rope.scaling.type "
                    f"'{rope_scaling['rope_type']}': which one applies is not defined"
                )
            rope_scaling = {"rope_type": "freq_factors", "factors": [float(v) for v in arr.reshape(-1)]}
            continue
        if t.name.startswith("blk."):
            _, idx, rest = t.name.split(".", 2)
            if rest not in layer_names:
                raise ValueError(f"{path}: tensor '{t.name}' is not part of the {name} layout this engine implements")
            hf_name = f"model.layers.{idx}.{layer_names[rest]}"
            if arch.is_qk_permuted and rest.startswith("attn_q."):
                arr = _unpermute_rope_rows(arr, hp["num_heads"])
            elif arch.is_qk_permuted and rest.startswith("attn_k."):
                arr = _unpermute_rope_rows(arr, hp["num_kv_heads"])
        elif t.name in _GGUF_NAMES:
            hf_name = _GGUF_NAMES[t.name]
        else:
            raise ValueError(f"{path}: tensor '{t.name}' is not part of the {name} layout this engine implements")
        sd[hf_name] = torch.from_numpy(np.array(arr, dtype=np.float32, order="C", copy=True))
    cfg = ModelConfig(
        vocab_size=sd["model.embed_tokens.weight"].shape[0],
        tie_word_embeddings="lm_head.weight" not in sd,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        rope_scaling=rope_scaling,
        qk_norm=arch.is_qk_norm,
        **hp,
    )
    return cfg, sd


def _gguf_hparams(path: Path, meta: dict[str, Any], arch: str) -> dict[str, Any]:
    """The `{arch}.*` metadata as ModelConfig fields (besides the ones tensors decide), with an error
    naming each key that changes the math in a way this engine does not implement."""

    def key(name: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise ValueError(f"{path}: GGUF metadata key '{arch}.{name}' is missing")
        return value

    n_head = int(key("attention.head_count"))
    hidden = int(key("embedding_length"))
    head_dim = int(key("attention.key_length", hidden // n_head))  # written when the HF config has head_dim
    problems = []
    if int(key("attention.value_length", head_dim)) != head_dim:
        problems.append(
            f"{arch}.attention.value_length {meta[f'{arch}.attention.value_length']} != key_length "
            f"{head_dim} (one head_dim for q, k and v)"
        )
    if int(key("rope.dimension_count", head_dim)) != head_dim:
        problems.append(
            f"{arch}.rope.dimension_count {meta[f'{arch}.rope.dimension_count']} != head_dim {head_dim} "
            "(rotary on part of each head)"
        )
    if f"{arch}.attention.sliding_window_pattern" in meta and arch != "gemma3":
        problems.append(f"{arch}.attention.sliding_window_pattern (a window on some layers only)")
    try:
        rope_scaling = _gguf_rope_scaling(meta, arch)
    except ValueError as e:
        problems.append(str(e))
    n_layer = int(key("block_count"))
    extra = _gguf_gemma3(meta, n_layer, hidden, n_head, head_dim, problems) if arch == "gemma3" else {}
    if arch == "smollm3":  # llama.cpp's llama_model_smollm3: NoPE on every 4th layer, not in the header
        extra = {"no_rope_layers": tuple(i for i in range(n_layer) if (i + 1) % 4 == 0)}
    if problems:
        raise ValueError(f"{path} ({arch}): not implemented: {'; '.join(problems)}")
    return extra | dict(
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_layers=n_layer,
        num_heads=n_head,
        num_kv_heads=int(key("attention.head_count_kv", n_head)),
        head_dim=head_dim,
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=int(key("context_length", 2048)),
        sliding_window=int(key("attention.sliding_window", 0)) or None,
        rope_scaling=rope_scaling,
    )


def _gguf_gemma3(meta: dict[str, Any], n_layer: int, hidden: int, n_head: int, head_dim: int, problems: list) -> dict:
    """A gemma3 GGUF's ModelConfig fields beyond the llama ones, as llama.cpp's llama_model_gemma3
    reads them: the header carries the window and the global RoPE base; the layer pattern (every
    6th layer attends every key), the windowed layers' RoPE base (10000) and the softmax scale are
    llama.cpp constants unless the header overrides the first two."""
    if meta.get("gemma3.final_logit_softcapping"):
        problems.append(f"gemma3.final_logit_softcapping {meta['gemma3.final_logit_softcapping']}")
    windowed = int(meta.get("gemma3.attention.sliding_window") or 0) > 0
    pattern = meta.get("gemma3.attention.sliding_window_pattern", 6)
    if isinstance(pattern, list):  # per layer: True = windowed
        full = tuple(i for i, swa in enumerate(pattern) if not swa)
    else:
        full = tuple(i for i in range(n_layer) if pattern and i % pattern == pattern - 1)
    return dict(
        full_attention_layers=full if windowed else (),
        local_rope_theta=float(meta.get("gemma3.rope.freq_base_swa", 10_000.0)) if windowed else None,
        sandwich_norms=True,
        hidden_act="gelu_tanh",
        embed_scale=hidden**0.5,
        attn_scale=(hidden // n_head if n_layer == 62 else head_dim) ** -0.5,  # 62 layers: the 27B model
    )


# rope.scaling.* keys read below; `finetuned` is a note about training, not math.
_GGUF_ROPE_SCALING_KEYS = ("type", "factor", "original_context_length", "finetuned")


def _gguf_rope_scaling(meta: dict[str, Any], arch: str) -> dict | None:
    """{arch}.rope.scaling.* metadata -> the rope_scaling dict (layers/ops.py), or an error naming it."""
    prefix = f"{arch}.rope.scaling."
    unknown = sorted(k for k in meta if k.startswith(prefix) and k[len(prefix) :] not in _GGUF_ROPE_SCALING_KEYS)
    if unknown:  # e.g. yarn_beta_fast, attn_factor: they change the math
        raise ValueError(f"{', '.join(unknown)} (only {', '.join(prefix + k for k in _GGUF_ROPE_SCALING_KEYS)})")
    kind = meta.get(prefix + "type")
    if kind in (None, "none"):
        return None
    factor = float(meta.get(prefix + "factor", 1.0))
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        return {
            "rope_type": "yarn",
            "factor": factor,
            "original_max_position_embeddings": int(meta[prefix + "original_context_length"]),
        }
    raise ValueError(f"{prefix}type '{kind}' (supported: none, linear, yarn)")


# --- Hugging Face checkpoint dir ----------------------------------------------------------

HF_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "smollm3", "phi3", "gemma3_text")


def _load_hf_dir(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    hf = json.loads((path / "config.json").read_text())
    cfg_without_weights = _hf_config(path, hf)  # every config check before any weight is read
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors files (only safetensors checkpoints are loaded)")
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        for k, v in load_file(str(f)).items():
            sd[k] = v.float()
    tied = bool(hf.get("tie_word_embeddings", "lm_head.weight" not in sd))
    if hf.get("model_type") == "gemma3_text":  # its norms scale by (1 + w): store 1 + w, as llama.cpp's GGUFs do
        sd = {k: v + 1.0 if k.endswith("norm.weight") else v for k, v in sd.items()}
    if hf.get("model_type") == "phi3":
        sd = _split_phi3(sd, cfg_without_weights)
    return ModelConfig(**cfg_without_weights, tie_word_embeddings=tied), sd


def _split_phi3(sd: dict[str, torch.Tensor], cfg: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Phi-3's fused qkv_proj and gate_up_proj as the separate projections the model fuses again."""
    q = cfg["num_heads"] * cfg["head_dim"]
    kv = cfg["num_kv_heads"] * cfg["head_dim"]
    out = {}
    for k, v in sd.items():
        if k.endswith("self_attn.qkv_proj.weight"):
            p = k[: -len("qkv_proj.weight")]
            out[p + "q_proj.weight"], out[p + "k_proj.weight"], out[p + "v_proj.weight"] = v.split([q, kv, kv])
        elif k.endswith("mlp.gate_up_proj.weight"):
            p = k[: -len("gate_up_proj.weight")]
            out[p + "gate_proj.weight"], out[p + "up_proj.weight"] = v.chunk(2)
        else:
            out[k] = v
    return out


def _hf_config(path: Path, hf: dict[str, Any]) -> dict[str, Any]:
    """config.json -> ModelConfig fields (all but tie_word_embeddings), or an error naming each field
    that changes the math in a way this engine does not implement."""
    model_type = hf.get("model_type")
    if model_type not in HF_MODEL_TYPES and not any("Llama" in a for a in hf.get("architectures") or []):
        raise ValueError(
            f"{path}: model_type '{model_type}' is not implemented (supported: "
            f"{', '.join(HF_MODEL_TYPES)}, or a LlamaForCausalLM architecture)"
        )
    if model_type == "gemma3_text":
        return _hf_gemma3(path, hf)
    _refuse_unimplemented_math(path, hf)
    n_head = hf["num_attention_heads"]
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})  # transformers >= 5: rope_parameters
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    if model_type == "phi3" and rope_type in ("su", "yarn"):  # Phi3Config reads both as longrope
        rope_type = "longrope"
    rope_scaling = None
    if rope_type != "default":
        if rope_type not in ROPE_TYPES:
            raise ValueError(
                f"{path}: rope_scaling type '{rope_type}' is not implemented (supported: default, "
                f"{', '.join(t for t in ROPE_TYPES if t != 'freq_factors')})"
            )
        drop = ("type", "rope_theta", "partial_rotary_factor")
        rope_scaling = {k: v for k, v in rope.items() if k not in drop} | {"rope_type": rope_type}
        rope_scaling.setdefault(  # Phi-3 keeps it at the top level
            "original_max_position_embeddings",
            hf.get("original_max_position_embeddings") or hf.get("max_position_embeddings", 2048),
        )
        if rope_type == "longrope" and rope_scaling.get("factor") is None:  # transformers' default
            rope_scaling["factor"] = hf["max_position_embeddings"] / rope_scaling["original_max_position_embeddings"]
    eos = hf.get("eos_token_id")
    head_dim = hf.get("head_dim") or hf["hidden_size"] // n_head  # Qwen3: explicit, may differ
    partial = float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) or 1.0)
    return dict(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=n_head,
        num_kv_heads=hf.get("num_key_value_heads", n_head),
        head_dim=head_dim,
        # transformers >= 5 nests it under rope_parameters
        rope_theta=float(hf.get("rope_theta") or rope.get("rope_theta", 10000.0)),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
        max_position_embeddings=hf.get("max_position_embeddings", 2048),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_id=eos[0] if isinstance(eos, list) else eos,
        rope_scaling=rope_scaling,
        sliding_window=_hf_sliding_window(path, hf),
        qk_norm=model_type == "qwen3",
        no_rope_layers=_hf_no_rope_layers(hf) if model_type == "smollm3" else (),
        rotary_dim=int(head_dim * partial) if partial != 1.0 else None,
    )


def _hf_no_rope_layers(hf: dict[str, Any]) -> tuple[int, ...]:
    """SmolLM3's layers without RoPE: `no_rope_layers` holds 1 where a layer rotates, else every
    `no_rope_layer_interval`-th layer (transformers' SmolLM3Config rule)."""
    n, interval = hf["num_hidden_layers"], hf.get("no_rope_layer_interval", 4)
    uses = hf.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(n)]
    return tuple(i for i, u in enumerate(uses) if not u)


def _hf_gemma3(path: Path, hf: dict[str, Any]) -> dict[str, Any]:
    """A Gemma3ForCausalLM config.json (transformers' Gemma3TextConfig, defaults included) -> ModelConfig
    fields: every layer normed four times, GeGLU, q/k norms, embeddings scaled by sqrt(hidden),
    query_pre_attn_scalar, windowed layers with their own RoPE base between full-attention ones."""
    problems = []
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        problems.append(f"hidden_activation '{act}' (only gelu_pytorch_tanh)")
    for key in ("attn_logit_softcapping", "final_logit_softcapping", "use_bidirectional_attention"):
        if hf.get(key):
            problems.append(f"{key} {hf[key]}")
    n = hf["num_hidden_layers"]
    pattern = hf.get("sliding_window_pattern", 6)
    layer_types = hf.get("layer_types") or [
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)
    ]
    if len(layer_types) != n or not set(layer_types) <= {"sliding_attention", "full_attention"}:
        problems.append(f"layer_types {layer_types}")
    # transformers >= 5 nests RoPE per layer type; older configs: rope_theta, rope_local_base_freq, rope_scaling
    rope = hf.get("rope_parameters") or {}
    full = dict(rope.get("full_attention") or hf.get("rope_scaling") or {})
    local = dict(rope.get("sliding_attention") or {})
    full_theta = float(full.pop("rope_theta", hf.get("rope_theta", 1_000_000.0)))
    local_theta = float(local.pop("rope_theta", hf.get("rope_local_base_freq", 10_000.0)))
    if (local.get("rope_type") or local.get("type") or "default") != "default":
        problems.append(f"rope scaling on the sliding-window layers ({local})")
    kind = full.get("rope_type") or full.get("type") or "default"
    rope_scaling = None
    if kind == "linear":
        rope_scaling = {"rope_type": "linear", "factor": float(full["factor"])}
    elif kind != "default":
        problems.append(f"rope_scaling type '{kind}' on the full-attention layers (supported: default, linear)")
    if problems:
        raise ValueError(f"{path} (gemma3_text): not implemented: {'; '.join(problems)}")
    n_head = hf.get("num_attention_heads", 8)
    eos = hf.get("eos_token_id", 1)
    return dict(
        vocab_size=hf.get("vocab_size", 262_208),
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=n,
        num_heads=n_head,
        num_kv_heads=hf.get("num_key_value_heads", 4),
        head_dim=hf.get("head_dim", 256),
        rope_theta=full_theta,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=hf.get("max_position_embeddings", 131_072),
        bos_token_id=hf.get("bos_token_id", 2),
        eos_token_id=eos[0] if isinstance(eos, list) else eos,
        rope_scaling=rope_scaling,
        sliding_window=int(window) if (window := hf.get("sliding_window", 4096)) else None,
        qk_norm=True,
        full_attention_layers=tuple(i for i, t in enumerate(layer_types) if t == "full_attention"),
        local_rope_theta=local_theta,
        sandwich_norms=True,
        hidden_act="gelu_tanh",
        embed_scale=hf["hidden_size"] ** 0.5,
        attn_scale=float(hf.get("query_pre_attn_scalar", 256)) ** -0.5,
    )


def _hf_sliding_window(path: Path, hf: dict[str, Any]) -> int | None:
    """The window every layer attends over (as transformers reads the config), or None; a window on
    some layers only is refused."""
    model_type = hf.get("model_type")
    window = hf.get("sliding_window") if model_type in ("mistral", "qwen2", "qwen3", "smollm3", "phi3") else None
    if model_type in ("qwen2", "qwen3", "smollm3") and not hf.get("use_sliding_window", False):
        window = None  # these configs carry a sliding_window that only use_sliding_window turns on
    if window is None:
        return None
    layer_types = hf.get("layer_types")
    if layer_types is None and model_type in ("qwen2", "qwen3"):  # transformers' Qwen2Config/Qwen3Config rule
        first = hf.get("max_window_layers", 28)
        layer_types = ["sliding_attention" if i >= first else "full_attention" for i in range(hf["num_hidden_layers"])]
    kinds = set(layer_types or ["sliding_attention"])
    if kinds == {"full_attention"}:
        return None
    if kinds != {"sliding_attention"}:
        raise ValueError(
            f"{path} ({model_type}): not implemented: sliding_window {window} on some layers only "
            f"(layer_types / max_window_layers: {layer_types})"
        )
    return int(window)


def _refuse_unimplemented_math(path: Path, hf: dict[str, Any]) -> None:
    """Config fields that change the math and that this engine does not implement: an error naming
    the field, never a quietly different model."""
    problems = []
    if hf.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act '{hf['hidden_act']}' (only silu)")
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if hf.get(key):
            problems.append(f"{key} {hf[key]}")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    partial = float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) or 1.0)
    if partial != 1.0 and hf.get("model_type") != "phi3":  # transformers rotates part of a head in Phi-3's code only
        problems.append("partial_rotary_factor (rotary on part of each head)")
    if problems:
        raise ValueError(f"{path} ({hf.get('model_type')}): not implemented: {'; '.join(problems)}")
