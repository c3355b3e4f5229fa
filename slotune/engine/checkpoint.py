"""What a checkpoint says the model is, from its metadata alone: a GGUF's header (keys and tensor
list) or an HF directory's config.json and safetensors headers, read into a `ModelConfig`.

Every GGUF key and config.json key the engine reads is named here, beside the keys known to leave
the computation alone; any other key is refused by name, whatever `model_type` or `architectures`
say. `check_model` (tune validate, the operator's admission) and `loader.load_model` call the same
functions, so what one refuses the other does. Pure standard library: no torch, gguf or tokenizers.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from slotune.engine.gguf_header import read_gguf_layout
from slotune.engine.gguf_vocab import PRE_TOKENIZERS, VOCABULARIES
from slotune.engine.paths import resolve_model_path

ROPE_TYPES = ("linear", "llama3", "yarn", "dynamic", "longrope", "freq_factors")  # besides plain RoPE (None)


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


def check_model(model: str) -> ModelConfig:
    """The config `load_model` would build, or the error it would raise, without reading a weight."""
    path = resolve_model_path(model)
    if path.is_dir():
        cfg = hf_config(path, read_config_json(path), safetensors_names(path))
        if not (path / "tokenizer.json").exists():
            raise FileNotFoundError(f"{path}: tokenizer.json missing (needed to load an HF checkpoint dir)")
        return cfg
    meta, tensors = read_gguf_layout(path)
    cfg = gguf_config(path, meta, tensors)
    check_gguf_vocab(path, meta)
    return cfg


def context_problem(cfg: ModelConfig, max_model_len: int, source: str = "") -> str | None:
    """Why `max_model_len` tokens cannot run on this model, or None; `source` names where the
    model's context comes from."""
    if max_model_len > (n := cfg.max_position_embeddings):
        return f"max_model_len {max_model_len}, beyond the model's context of {n} tokens{source}; use at most {n}"
    rope = cfg.rope_scaling or {}
    kind = rope.get("rope_type")
    if kind in ("dynamic", "longrope") and max_model_len > rope["original_max_position_embeddings"]:
        # transformers re-derives dynamic NTK frequencies (and switches longrope's short factors for
        # its long ones) from the longest sequence so far; keys in a paged cache were rotated at the
        # frequencies of their own step, so past the original context no cache can give its logits
        within = "plain RoPE" if kind == "dynamic" else "RoPE with its short factors"
        return (
            f"rope_scaling {kind}: max_model_len ({max_model_len}) exceeds original_max_position_embeddings "
            f"({rope['original_max_position_embeddings']}); within it {kind} is {within} and runs exactly; "
            f"set max_model_len <= {rope['original_max_position_embeddings']}"
        )
    return None


def _refuse(path: Path, what: str, problems: list[str]) -> None:
    if problems:
        raise ValueError(f"{path} ({what}): not implemented: {'; '.join(problems)}")


def _unknown_keys(keys: dict[str, Any], read: set[str], neutral: dict[str, tuple | None], name: str) -> list[str]:
    """Keys neither read nor neutral at their value, named: each may change the computation. A key
    this module does not know passes only unset (null, false)."""
    out = []
    for key, value in keys.items():
        if key in read:
            continue
        allowed = neutral[key] if key in neutral else (None, False)
        if allowed is not None and value not in allowed:
            out.append(f"{name.format(key)} = {value!r} (a key this engine does not read)")
    return out


# --- GGUF -------------------------------------------------------------------------------

GGUF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
GGUF_LAYER_NAMES = {
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

_GGUF_PHI3_NAMES = {"attn_qkv.weight": "self_attn.qkv_proj.weight", "ffn_up.weight": "mlp.gate_up_proj.weight"}
_GGUF_ROPE_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")  # phi3: longrope

# `{arch}.<key>` read for every architecture (llama.cpp's LLM_KV names)
GGUF_KEYS = {
    "context_length",
    "embedding_length",
    "block_count",
    "feed_forward_length",
    "attention.head_count",
    "attention.head_count_kv",
    "attention.key_length",
    "attention.value_length",
    "attention.layer_norm_rms_epsilon",
    "rope.freq_base",
    "rope.dimension_count",
    "attention.sliding_window",
    "rope.scaling.type",
    "rope.scaling.factor",
    "rope.scaling.original_context_length",
}
# keys that leave the computation alone: at any value (None) or at the values listed
GGUF_NEUTRAL_KEYS: dict[str, tuple | None] = {
    "vocab_size": None,  # the embedding's rows decide
    "rope.scaling.finetuned": None,  # a note about training
    "expert_count": (0,),
    "expert_used_count": (0,),
    "attention.causal": (True,),
    "final_logit_softcapping": (0.0, None),
}


@dataclass(frozen=True, slots=True)
class _GgufArch:
    """How one llama.cpp architecture differs from the llama layout."""

    # llama.cpp's converter permutes q/k rows only for its llama-style models (rope type NORM,
    # interleaved pairs; convert_hf_to_gguf.py LlamaModel.modify_tensors); Qwen2/Qwen3 keep HF's
    # row order and run NEOX (rotate-half) rope on it (Qwen2Model/Qwen3Model rename tensors only).
    is_qk_permuted: bool
    names: dict[str, str] | None = None  # layer tensors besides and over GGUF_LAYER_NAMES
    keys: tuple[str, ...] = ()  # `{arch}.<key>` read besides GGUF_KEYS

    @property
    def is_qk_norm(self) -> bool:  # Qwen3, Gemma 3: blk.N.attn_q_norm / attn_k_norm
        return "attn_q_norm.weight" in (self.names or {})

    @property
    def layer_names(self) -> dict[str, str]:
        return GGUF_LAYER_NAMES | (self.names or {})


GGUF_ARCHS = {
    "llama": _GgufArch(is_qk_permuted=True),
    "qwen2": _GgufArch(is_qk_permuted=False),
    "qwen3": _GgufArch(is_qk_permuted=False, names=_GGUF_QK_NORM_NAMES),
    "smollm3": _GgufArch(is_qk_permuted=True),  # every 4th layer without RoPE: _gguf_hparams
    # NEOX rope (rows as HF's); norms stored as 1 + w by the converter (Gemma3Model.norm_shift)
    "gemma3": _GgufArch(
        is_qk_permuted=False,
        names=_GGUF_GEMMA3_NAMES,
        keys=("attention.sliding_window_pattern", "rope.freq_base_swa"),
    ),
    # fused qkv and gate_up (split at load), RoPE on part of each head, longrope as two tensors
    "phi3": _GgufArch(is_qk_permuted=False, names=_GGUF_PHI3_NAMES, keys=("rope.scaling.attn_factor",)),
}


def gguf_config(path: Path, meta: dict[str, Any], tensors: dict[str, tuple[int, ...]]) -> ModelConfig:
    """A GGUF's ModelConfig from its keys and tensor shapes (HF order), or an error naming each key
    and tensor that changes the computation in a way this engine does not implement. `rope_freqs`
    (Llama 3.x) gives rope_scaling {"rope_type": "freq_factors"}; the loader adds the factors."""
    name = meta.get("general.architecture")
    if name not in GGUF_ARCHS:
        raise ValueError(
            f"{path}: unsupported GGUF architecture '{name}' (supported: {', '.join(GGUF_ARCHS)}); "
            "a Hugging Face directory of a supported family loads instead"
        )
    arch = GGUF_ARCHS[name]
    if int(meta.get("split.count") or 1) > 1:
        raise ValueError(f"{path}: split.count {meta['split.count']}: a split GGUF; merge it with llama-gguf-split")
    hp = _gguf_hparams(path, meta, name)
    top = {*GGUF_NAMES, "rope_freqs.weight", *(_GGUF_ROPE_FACTORS if name == "phi3" else ())}
    for t in tensors:
        layer = t.split(".", 2)[-1] if t.startswith("blk.") else None
        if (layer not in arch.layer_names) if layer else t not in top:
            raise ValueError(f"{path}: tensor '{t}' is not part of the {name} layout this engine implements")
    if "token_embd.weight" not in tensors:
        raise ValueError(f"{path}: no token_embd.weight tensor")
    if "rope_freqs.weight" in tensors:  # Llama 3.x: per-dimension frequency divisors
        if hp["rope_scaling"] is not None:
            raise ValueError(
                f"{path}: both rope_freqs.weight and {name}.rope.scaling.type "
                f"'{hp['rope_scaling']['rope_type']}': which one applies is not defined"
            )
        hp["rope_scaling"] = {"rope_type": "freq_factors"}
    if any(t in tensors for t in _GGUF_ROPE_FACTORS):  # as convert_hf_to_gguf.py's Phi3MiniModel writes longrope
        orig = meta.get(f"{name}.rope.scaling.original_context_length")
        if orig is None or not all(t in tensors for t in _GGUF_ROPE_FACTORS):
            raise ValueError(
                f"{path}: longrope takes both {' and '.join(_GGUF_ROPE_FACTORS)} and "
                f"{name}.rope.scaling.original_context_length"
            )
        orig = int(orig)
        hp["rope_scaling"] = {
            "rope_type": "longrope",
            "original_max_position_embeddings": orig,
            "factor": hp["max_position_embeddings"] / orig,
            "attention_factor": float(meta.get(f"{name}.rope.scaling.attn_factor", 1.0)),
        }
    return ModelConfig(
        vocab_size=tensors["token_embd.weight"][0],
        tie_word_embeddings="output.weight" not in tensors,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        qk_norm=arch.is_qk_norm,
        **hp,
    )


# the special tokens' ids (llama.cpp's key names; "seperator" is its spelling); the last three end a turn
GGUF_TOKEN_IDS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "sep_token": "tokenizer.ggml.seperator_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
    "mask_token": "tokenizer.ggml.mask_token_id",
}
GGUF_STOP_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
GGUF_TOKEN_ID_KEYS = (*GGUF_TOKEN_IDS.values(), *GGUF_STOP_KEYS[1:])


def check_gguf_vocab(path: Path, meta: dict[str, Any]) -> None:
    """The GGUF's vocabulary is one gguf_vocab builds, and its special token ids are inside it."""
    kind = meta.get("tokenizer.ggml.model")
    if kind not in VOCABULARIES:
        raise ValueError(
            f"{path}: tokenizer.ggml.model '{kind}' is not supported (supported: {', '.join(VOCABULARIES)}); "
            "use the model's HF directory (config.json + tokenizer.json) instead"
        )
    name = meta.get("tokenizer.ggml.pre")
    if kind == "gpt2" and name not in PRE_TOKENIZERS:
        raise ValueError(
            f"{path}: tokenizer.ggml.pre '{name}' is not supported (supported: {', '.join(sorted(PRE_TOKENIZERS))}); "
            "its words would be split differently from the model's training. Use the model's HF directory "
            "(config.json + tokenizer.json) instead"
            + (
                ", or re-convert it with a current convert_hf_to_gguf.py, which records the pre-tokenizer"
                if name is None
                else ""
            )
        )
    for key in ("tokenizer.ggml.tokens", *(["tokenizer.ggml.merges"] if kind == "gpt2" else [])):
        if meta.get(key) is None:
            raise ValueError(
                f"{path}: {key} is missing: the file has no complete vocabulary; re-convert it with "
                "llama.cpp's convert_hf_to_gguf.py, or use the model's HF directory"
            )
    n = len(meta["tokenizer.ggml.tokens"])
    scores = meta.get("tokenizer.ggml.scores")
    if kind == "llama" and (scores is None or len(scores) != n):
        raise ValueError(
            f"{path}: a SentencePiece vocabulary needs tokenizer.ggml.scores, one per token "
            f"({0 if scores is None else len(scores)} for {n} tokens)"
        )
    for key in GGUF_TOKEN_ID_KEYS:
        if meta.get(key) is not None and not 0 <= int(meta[key]) < n:
            raise ValueError(f"{path}: {key} = {meta[key]} is outside the vocabulary of {n} tokens")


def _gguf_hparams(path: Path, meta: dict[str, Any], arch: str) -> dict[str, Any]:
    """The `{arch}.*` keys as ModelConfig fields (besides the ones tensors decide)."""

    def key(name: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise ValueError(f"{path}: GGUF metadata key '{arch}.{name}' is missing")
        return value

    own = {k[len(arch) + 1 :]: v for k, v in meta.items() if k.startswith(f"{arch}.")}
    problems = _unknown_keys(own, GGUF_KEYS | set(GGUF_ARCHS[arch].keys), GGUF_NEUTRAL_KEYS, f"{arch}.{{}}")
    n_head = int(key("attention.head_count"))
    hidden = int(key("embedding_length"))
    head_dim = int(key("attention.key_length", hidden // n_head))  # written when the HF config has head_dim
    if int(key("attention.value_length", head_dim)) != head_dim:
        problems.append(
            f"{arch}.attention.value_length {own['attention.value_length']} != key_length "
            f"{head_dim} (one head_dim for q, k and v)"
        )
    rotary_dim = int(key("rope.dimension_count", head_dim))
    if rotary_dim != head_dim and arch != "phi3":
        problems.append(
            f"{arch}.rope.dimension_count {own['rope.dimension_count']} != head_dim {head_dim} "
            "(rotary on part of each head)"
        )
    try:
        rope_scaling = _gguf_rope_scaling(own, arch)
    except ValueError as e:
        problems.append(str(e))
    n_layer = int(key("block_count"))
    extra = _gguf_gemma3(own, n_layer, hidden, n_head, head_dim) if arch == "gemma3" else {}
    if arch == "smollm3":  # llama.cpp's llama_model_smollm3: NoPE on every 4th layer, not in the header
        extra = {"no_rope_layers": tuple(i for i in range(n_layer) if (i + 1) % 4 == 0)}
    _refuse(path, arch, problems)
    return extra | dict(
        rotary_dim=rotary_dim if rotary_dim != head_dim else None,
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


def _gguf_gemma3(own: dict[str, Any], n_layer: int, hidden: int, n_head: int, head_dim: int) -> dict:
    """A gemma3 GGUF's fields beyond the llama ones, as llama.cpp's llama_model_gemma3 reads them:
    the header carries the window and the global RoPE base; the layer pattern (every 6th layer
    attends every key), the windowed layers' RoPE base (10000) and the softmax scale are llama.cpp
    constants unless the header overrides the first two."""
    windowed = int(own.get("attention.sliding_window") or 0) > 0
    pattern = own.get("attention.sliding_window_pattern", 6)
    if isinstance(pattern, list):  # per layer: True = windowed
        full = tuple(i for i, swa in enumerate(pattern) if not swa)
    else:
        full = tuple(i for i in range(n_layer) if pattern and i % pattern == pattern - 1)
    return dict(
        full_attention_layers=full if windowed else (),
        local_rope_theta=float(own.get("rope.freq_base_swa", 10_000.0)) if windowed else None,
        sandwich_norms=True,
        hidden_act="gelu_tanh",
        embed_scale=hidden**0.5,
        attn_scale=(hidden // n_head if n_layer == 62 else head_dim) ** -0.5,  # 62 layers: the 27B model
    )


def _gguf_rope_scaling(own: dict[str, Any], arch: str) -> dict | None:
    """rope.scaling.* keys -> the rope_scaling dict (layers/ops.py), or an error naming the type."""
    kind = own.get("rope.scaling.type")
    if kind in (None, "none"):
        return None
    factor = float(own.get("rope.scaling.factor", 1.0))
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        return {
            "rope_type": "yarn",
            "factor": factor,
            "original_max_position_embeddings": int(own["rope.scaling.original_context_length"]),
        }
    raise ValueError(f"{arch}.rope.scaling.type '{kind}' (supported: none, linear, yarn)")


# --- Hugging Face checkpoint dir ----------------------------------------------------------

# config.json keys read for every family (the llama set), and per model_type besides
HF_KEYS = {
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "rms_norm_eps",
    "max_position_embeddings",
    "bos_token_id",
    "eos_token_id",
    "tie_word_embeddings",
}
_HF_WINDOW_KEYS = ("sliding_window", "use_sliding_window", "max_window_layers", "layer_types")
HF_FAMILY_KEYS = {
    "llama": (),
    "mistral": ("sliding_window",),
    "qwen2": _HF_WINDOW_KEYS,
    "qwen3": _HF_WINDOW_KEYS,
    "smollm3": (*_HF_WINDOW_KEYS, "no_rope_layers", "no_rope_layer_interval"),
    "phi3": ("sliding_window", "original_max_position_embeddings", "partial_rotary_factor"),
    "gemma3_text": (
        "hidden_activation",
        "query_pre_attn_scalar",
        "sliding_window",
        "sliding_window_pattern",
        "_sliding_window_pattern",
        "layer_types",
        "rope_local_base_freq",
        "attn_logit_softcapping",
        "final_logit_softcapping",
        "use_bidirectional_attention",
    ),
}
HF_MODEL_TYPES = tuple(HF_FAMILY_KEYS)
# keys that leave the forward pass alone (bookkeeping, generation defaults, training-only
# settings); biases are decided by the weights present: at any value (None) or the values listed
HF_NEUTRAL_KEYS: dict[str, tuple | None] = {
    k: None
    for k in (
        "_name_or_path _model_name_or_path architectures auto_map transformers_version torch_dtype dtype use_cache "
        "initializer_range attention_dropout embd_pdrop resid_pdrop pad_token_id sep_token_id "
        "decoder_start_token_id pretraining_tp attention_bias mlp_bias cache_implementation "
        "is_llama_config transformers.js_config id2label label2id problem_type return_dict "
        "output_attentions output_hidden_states chunk_size_feed_forward torchscript use_bfloat16 "
        "tokenizer_class prefix task_specific_params finetuning_task max_length min_length do_sample "
        "early_stopping num_beams num_beam_groups diversity_penalty temperature top_k top_p typical_p "
        "repetition_penalty length_penalty no_repeat_ngram_size encoder_no_repeat_ngram_size "
        "bad_words_ids num_return_sequences output_scores return_dict_in_generate forced_bos_token_id "
        "forced_eos_token_id remove_invalid_values exponential_decay_length_penalty suppress_tokens "
        "begin_suppress_tokens tf_legacy_loss pruned_heads tie_encoder_decoder is_decoder"
    ).split()
} | {
    "is_encoder_decoder": (False,),
    "add_cross_attention": (False,),
    "rope_interleaved": (False,),  # nanotron's flag; transformers rotates halves whatever it says
    "partial_rotary_factor": (1.0,),
    "attn_logit_softcapping": (None, 0, 0.0),
    "final_logit_softcapping": (None, 0, 0.0),
}
_HF_LAYER_TENSORS = (
    "input_layernorm.weight post_attention_layernorm.weight "
    "self_attn.q_proj self_attn.k_proj self_attn.v_proj self_attn.o_proj "
    "mlp.gate_proj mlp.up_proj mlp.down_proj"
).split()
_HF_QK_NORM = ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
HF_LAYER_TENSORS = {  # per model_type: each layer's tensors (a projection: its .weight and .bias)
    "llama": _HF_LAYER_TENSORS,
    "mistral": _HF_LAYER_TENSORS,
    "qwen2": _HF_LAYER_TENSORS,
    "qwen3": _HF_LAYER_TENSORS + _HF_QK_NORM,
    "smollm3": _HF_LAYER_TENSORS,
    "phi3": [*_HF_LAYER_TENSORS, "self_attn.qkv_proj", "mlp.gate_up_proj"],  # fused; split at load
    "gemma3_text": _HF_LAYER_TENSORS
    + _HF_QK_NORM
    + ["pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight"],
}
HF_TENSORS = ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")


def read_config_json(path: Path) -> dict[str, Any]:
    try:
        hf = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path / 'config.json'}: cannot read: {exc}") from None
    if not isinstance(hf, dict):
        raise ValueError(f"{path / 'config.json'}: not a JSON object")
    return hf


def safetensors_names(path: Path) -> dict[str, tuple[int, ...]]:
    """Every tensor's name and shape in the directory's *.safetensors files, from their headers."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors files (only safetensors checkpoints are loaded)")
    out = {}
    for f in files:
        with f.open("rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        out |= {k: tuple(v["shape"]) for k, v in header.items() if k != "__metadata__"}
    return out


def hf_family(hf: dict[str, Any]) -> str:
    model_type = hf.get("model_type")
    if model_type in HF_FAMILY_KEYS:
        return model_type
    if any("Llama" in a for a in hf.get("architectures") or []):
        return "llama"
    raise ValueError(
        f"model_type '{model_type}' is not implemented (supported: "
        f"{', '.join(HF_MODEL_TYPES)}, or a LlamaForCausalLM architecture)"
    )


def hf_config(path: Path, hf: dict[str, Any], tensors: dict[str, tuple[int, ...]]) -> ModelConfig:
    """config.json and the tensor names -> ModelConfig, or an error naming each key and tensor
    that changes the computation in a way this engine does not implement."""
    try:
        family = hf_family(hf)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
    problems = _unknown_keys(hf, HF_KEYS | set(HF_FAMILY_KEYS[family]), HF_NEUTRAL_KEYS, "{}")
    layer = re.compile(r"model\.layers\.\d+\.(.+)")
    allowed = {
        n for t in HF_LAYER_TENSORS[family] for n in ((t,) if t.endswith("weight") else (t + ".weight", t + ".bias"))
    }
    for name in tensors:
        m = layer.fullmatch(name)
        if (m.group(1) not in allowed) if m else name not in HF_TENSORS:
            problems.append(f"tensor '{name}' (not part of the {family} layout)")
    try:
        fields = _hf_gemma3(hf) if family == "gemma3_text" else _hf_fields(hf, family)
    except KeyError as exc:
        raise ValueError(f"{path / 'config.json'}: no {exc.args[0]!r}, which the model needs") from None
    except ValueError as exc:
        problems.append(str(exc))
    _refuse(path, family, problems)
    tied = bool(hf.get("tie_word_embeddings", "lm_head.weight" not in tensors))
    return ModelConfig(**fields, tie_word_embeddings=tied)


def _hf_fields(hf: dict[str, Any], family: str) -> dict[str, Any]:
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act '{hf['hidden_act']}' (only silu)")
    n_head = hf["num_attention_heads"]
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})  # transformers >= 5: rope_parameters
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    if family == "phi3" and rope_type in ("su", "yarn"):  # Phi3Config reads both as longrope
        rope_type = "longrope"
    partial = float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) or 1.0)
    if partial != 1.0 and family != "phi3":  # transformers rotates part of a head in Phi-3's code only
        raise ValueError("partial_rotary_factor (rotary on part of each head)")
    rope_scaling = None
    if rope_type != "default":
        if rope_type not in ROPE_TYPES:
            raise ValueError(
                f"rope_scaling type '{rope_type}' is not implemented (supported: default, "
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
        sliding_window=_hf_sliding_window(hf, family),
        qk_norm=family == "qwen3",
        no_rope_layers=_hf_no_rope_layers(hf) if family == "smollm3" else (),
        rotary_dim=int(head_dim * partial) if partial != 1.0 else None,
    )


def _hf_no_rope_layers(hf: dict[str, Any]) -> tuple[int, ...]:
    """SmolLM3's layers without RoPE: `no_rope_layers` holds 1 where a layer rotates, else every
    `no_rope_layer_interval`-th layer (transformers' SmolLM3Config rule)."""
    n, interval = hf["num_hidden_layers"], hf.get("no_rope_layer_interval", 4)
    uses = hf.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(n)]
    return tuple(i for i, u in enumerate(uses) if not u)


def _hf_gemma3(hf: dict[str, Any]) -> dict[str, Any]:
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
    pattern = hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or 6
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
        raise ValueError("; ".join(problems))
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


def _hf_sliding_window(hf: dict[str, Any], family: str) -> int | None:
    """The window every layer attends over (as transformers reads the config), or None; a window on
    some layers only is refused."""
    window = hf.get("sliding_window") if family in ("mistral", "qwen2", "qwen3", "smollm3", "phi3") else None
    if family in ("qwen2", "qwen3", "smollm3") and not hf.get("use_sliding_window", False):
        window = None  # these configs carry a sliding_window that only use_sliding_window turns on
    if window is None:
        return None
    layer_types = hf.get("layer_types")
    if layer_types is None and family in ("qwen2", "qwen3"):  # transformers' Qwen2Config/Qwen3Config rule
        first = hf.get("max_window_layers", 28)
        layer_types = ["sliding_attention" if i >= first else "full_attention" for i in range(hf["num_hidden_layers"])]
    kinds = set(layer_types or ["sliding_attention"])
    if kinds == {"full_attention"}:
        return None
    if kinds != {"sliding_attention"}:
        raise ValueError(
            f"sliding_window {window} on some layers only (layer_types / max_window_layers: {layer_types})"
        )
    return int(window)


def with_rope_factors(cfg: ModelConfig, tensor: str, factors: list[float]) -> ModelConfig:
    """`cfg` with the values of a GGUF's RoPE factor tensor `tensor` (gguf_config left them out)."""
    key = {"rope_freqs.weight": "factors", "rope_factors_long.weight": "long_factor"}.get(tensor, "short_factor")
    return replace(cfg, rope_scaling=cfg.rope_scaling | {key: factors})
