"""`check_model` (what `tune validate` and the operator's admission run, from metadata alone) and
the engine's loading refuse the same files with the same message, and what the check accepts loads
to the same ModelConfig. Each mutation below makes one refusal happen; a last test holds the list to
every refusal slotune/engine/checkpoint.py can make.

Checkpoints are tiny random transformers models (tests/hf_checkpoints.py), as HF directories and as
GGUFs written the way llama.cpp's converter writes them, with a small vocabulary of their own.
"""

from __future__ import annotations

import ast
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models

from slotune.engine import checkpoint
from slotune.engine.checkpoint import check_model
from slotune.engine.loader import load_model
from slotune.engine.paths import BUNDLED_MODELS, resolve_model_path
from slotune.engine.tokenizer import Tokenizer
from slotune.operator.admission import check_serving, model_problem
from tests.hf_checkpoints import hf_checkpoint, write_gguf

pytest.importorskip("transformers")

VOCAB = [chr(ord("a") + i % 26) * (1 + i // 26) for i in range(128)]  # a..z, aa..zz, ...
GGUF_VOCAB = {
    "tokenizer.ggml.model": "gpt2",
    "tokenizer.ggml.pre": "gpt-2",
    "tokenizer.ggml.tokens": VOCAB,
    "tokenizer.ggml.token_type": [1] * len(VOCAB),
    "tokenizer.ggml.merges": ["a a"],
    "tokenizer.ggml.bos_token_id": 1,
    "tokenizer.ggml.eos_token_id": 2,
}
HF = {  # config class and kw of each base checkpoint
    "llama": ("LlamaConfig", {}),
    "qwen2": ("Qwen2Config", {}),
    "gemma3": ("Gemma3TextConfig", {"head_dim": 16, "sliding_window": 8, "layer_types": None}),
    "phi3": (  # longrope: the GGUF carries its factors as two tensors
        "Phi3Config",
        {
            "rope_parameters": {
                "rope_theta": 1e4,
                "rope_type": "longrope",
                "short_factor": [1.0] * 4 + [2.0] * 4,
                "long_factor": [4.0] * 8,
            },
            "original_max_position_embeddings": 128,
            **{k: None for k in ("pad_token_id", "bos_token_id", "eos_token_id")},
        },
    ),
}


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict[str, dict]:
    """name -> the reference of a checkpoint in tmp/name (HF dirs and GGUFs with a vocabulary)."""
    root = tmp_path_factory.mktemp("bases")
    out = {}
    for name, (cls, kw) in HF.items():
        out[name] = hf_checkpoint(root / name, cls, **kw)
        HFTokenizer(models.BPE(vocab={t: i for i, t in enumerate(VOCAB)}, merges=[("a", "a")])).save(
            str(root / name / "tokenizer.json")
        )
    out["root"] = root
    return out


def hf_dir(bases, tmp_path: Path, name: str, config=None, tensors=None, remove=()) -> str:
    """A copy of base `name` with config.json keys changed (None removes), tensors added, files removed."""
    d = tmp_path / name
    shutil.copytree(bases["root"] / name, d)
    cfg = json.loads((d / "config.json").read_text())
    for k, v in (config or {}).items():
        cfg.pop(k) if v is None else cfg.__setitem__(k, v)
    (d / "config.json").write_text(json.dumps(cfg))
    if tensors:
        save_file(load_file(str(d / "model.safetensors")) | tensors, str(d / "model.safetensors"))
    for f in remove:
        (d / f).unlink()
    return str(d)


def gguf_file(bases, tmp_path: Path, name: str, arch: str, metadata=None, **kw) -> str:
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / f"{arch}.gguf"
    write_gguf(path, bases[name], arch, metadata=GGUF_VOCAB | (metadata or {}), **kw)
    return str(path)


def engine_load(model: str):
    """What the engine loads: the weights and config, then the tokenizer."""
    cfg, _, path = load_model(model)
    Tokenizer.from_model_path(path)
    return cfg


def _error(fn, model: str) -> str:
    with pytest.raises((ValueError, FileNotFoundError)) as info:
        fn(model)
    return str(info.value)


ROPE_YARN = {"rope_theta": 10000.0, "rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64}
MUTATIONS = {  # id -> (how to build the refused checkpoint, what its refusal says)
    "hf-model-type": (
        lambda b, t: hf_dir(b, t, "llama", {"model_type": "gemma2", "architectures": None}),
        "model_type 'gemma2' is not implemented",
    ),
    "hf-unread-key-nope": (
        lambda b, t: hf_dir(b, t, "llama", {"no_rope_layers": [1, 0]}),
        "no_rope_layers = [1, 0] (a key this engine does not read)",
    ),
    "hf-unread-key-window": (lambda b, t: hf_dir(b, t, "llama", {"sliding_window": 64}), "sliding_window = 64 (a key"),
    "hf-neutral-key-value": (
        lambda b, t: hf_dir(b, t, "llama", {"final_logit_softcapping": 30.0}),
        "final_logit_softcapping = 30.0",
    ),
    "hf-activation": (lambda b, t: hf_dir(b, t, "llama", {"hidden_act": "gelu"}), "hidden_act 'gelu' (only silu)"),
    "hf-partial-rotary": (
        lambda b, t: hf_dir(
            b,
            t,
            "llama",
            {"rope_parameters": {"rope_theta": 1e4, "rope_type": "default", "partial_rotary_factor": 0.5}},
        ),
        "partial_rotary_factor (rotary on part of each head)",
    ),
    "hf-rope-type": (
        lambda b, t: hf_dir(b, t, "llama", {"rope_parameters": {"rope_theta": 1e4, "rope_type": "mrope"}}),
        "rope_scaling type 'mrope' is not implemented",
    ),
    "hf-missing-key": (
        lambda b, t: hf_dir(b, t, "llama", {"hidden_size": None}),
        "no 'hidden_size', which the model needs",
    ),
    "hf-some-layers-windowed": (
        lambda b, t: hf_dir(
            b,
            t,
            "qwen2",
            {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1, "layer_types": None},
        ),
        "sliding_window 16 on some layers only",
    ),
    "hf-tensor": (
        lambda b, t: hf_dir(b, t, "llama", tensors={"model.layers.0.self_attn.q_norm.weight": torch.ones(16)}),
        "q_norm.weight' (not part of the llama layout)",
    ),
    "hf-no-weights": (lambda b, t: hf_dir(b, t, "llama", remove=["model.safetensors"]), "no *.safetensors files"),
    "hf-no-tokenizer": (lambda b, t: hf_dir(b, t, "llama", remove=["tokenizer.json"]), "tokenizer.json missing"),
    "hf-not-json": (
        lambda b, t: (Path(d := hf_dir(b, t, "llama")) / "config.json").write_text("[1]") and d,
        "config.json: not a JSON object",
    ),
    "hf-bad-json": (
        lambda b, t: (Path(d := hf_dir(b, t, "llama")) / "config.json").write_text("{") and d,
        "config.json: cannot read: Expecting property name",
    ),
    "gemma3-activation": (
        lambda b, t: hf_dir(b, t, "gemma3", {"hidden_activation": "gelu"}),
        "hidden_activation 'gelu' (only gelu_pytorch_tanh)",
    ),
    "gemma3-softcapping": (
        lambda b, t: hf_dir(b, t, "gemma3", {"attn_logit_softcapping": 50.0}),
        "attn_logit_softcapping 50.0",
    ),
    "gemma3-layer-types": (
        lambda b, t: hf_dir(b, t, "gemma3", {"layer_types": ["chunked_attention", "full_attention"]}),
        "layer_types ['chunked_attention'",
    ),
    "gemma3-local-rope": (
        lambda b, t: hf_dir(
            b, t, "gemma3", {"rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0}}}
        ),
        "rope scaling on the sliding-window layers",
    ),
    "gemma3-full-rope": (
        lambda b, t: hf_dir(b, t, "gemma3", {"rope_parameters": {"full_attention": ROPE_YARN}}),
        "rope_scaling type 'yarn' on the full-attention layers",
    ),
    "gguf-arch": (
        lambda b, t: gguf_file(b, t, "llama", "llama", {"general.architecture": "gemma2"}),
        "unsupported GGUF architecture 'gemma2'",
    ),
    "gguf-unread-key": (
        lambda b, t: gguf_file(b, t, "llama", "llama", {"llama.expert_count": 8}),
        "llama.expert_count = 8 (a key this engine does not read)",
    ),
    "gguf-missing-key": (
        lambda b, t: gguf_file(b, t, "llama", "llama", {"llama.block_count": None}),
        "GGUF metadata key 'llama.block_count' is missing",
    ),
    "gguf-value-length": (
        lambda b, t: gguf_file(
            b, t, "llama", "llama", {"llama.attention.key_length": 16, "llama.attention.value_length": 8}
        ),
        "llama.attention.value_length 8 != key_length 16",
    ),
    "gguf-partial-rotary": (
        lambda b, t: gguf_file(b, t, "llama", "llama", {"llama.rope.dimension_count": 8}),
        "llama.rope.dimension_count 8 != head_dim 16",
    ),
    "gguf-rope-type": (
        lambda b, t: gguf_file(b, t, "llama", "llama", {"llama.rope.scaling.type": "su"}),
        "llama.rope.scaling.type 'su' (supported: none, linear, yarn)",
    ),
    "gguf-split": (lambda b, t: gguf_file(b, t, "llama", "llama", {"split.count": 2}), "split.count 2: a split GGUF"),
    "gguf-tensor": (
        lambda b, t: gguf_file(b, t, "llama", "llama", extra={"blk.0.attn_q_norm.weight": torch.ones(16)}),
        "tensor 'blk.0.attn_q_norm.weight' is not part of the llama layout",
    ),
    "gguf-no-embeddings": (
        lambda b, t: gguf_file(b, t, "llama", "llama", drop=("token_embd.weight",)),
        "no token_embd.weight tensor",
    ),
    "gguf-rope-twice": (
        lambda b, t: gguf_file(b, t, "llama", "llama", {"llama.rope.scaling.type": "linear"}, rope_freqs=torch.ones(8)),
        "both rope_freqs.weight and llama.rope.scaling.type 'linear'",
    ),
    "gguf-phi3-one-factor": (
        lambda b, t: gguf_file(b, t, "phi3", "phi3", drop=("rope_factors_short.weight",)),
        "longrope takes both rope_factors_long.weight and rope_factors_short.weight",
    ),
    "gguf-gemma3-softcapping": (
        lambda b, t: gguf_file(b, t, "gemma3", "gemma3", {"gemma3.final_logit_softcapping": 30.0}),
        "gemma3.final_logit_softcapping = 30.0",
    ),
    "gguf-vocabulary": (
        lambda b, t: gguf_file(b, t, "llama", "llama", {"tokenizer.ggml.model": "bert"}),
        "tokenizer.ggml.model 'bert' is not supported",
    ),
    "gguf-pre-tokenizer": (
        lambda b, t: gguf_file(b, t, "llama", "llama", {"tokenizer.ggml.pre": "falcon"}),
        "tokenizer.ggml.pre 'falcon' is not supported",
    ),
    "gguf-no-tokens": (
        lambda b, t: gguf_file(b, t, "llama", "llama", {"tokenizer.ggml.tokens": None}),
        "tokenizer.ggml.tokens is missing",
    ),
    "gguf-no-merges": (
        lambda b, t: gguf_file(b, t, "llama", "llama", {"tokenizer.ggml.merges": None}),
        "tokenizer.ggml.merges is missing",
    ),
    "gguf-no-scores": (
        lambda b, t: gguf_file(b, t, "llama", "llama", {"tokenizer.ggml.model": "llama"}),
        "needs tokenizer.ggml.scores, one per token (0 for 128 tokens)",
    ),
    "gguf-token-id": (
        lambda b, t: gguf_file(b, t, "llama", "llama", {"tokenizer.ggml.eos_token_id": 500}),
        "tokenizer.ggml.eos_token_id = 500 is outside the vocabulary of 128 tokens",
    ),
}


@pytest.mark.parametrize("mutation", MUTATIONS)
def test_the_check_and_the_engine_refuse_the_same_file_with_the_same_message(bases, tmp_path, mutation):
    build, says = MUTATIONS[mutation]
    model = build(bases, tmp_path)
    refused = _error(check_model, model)
    assert says in refused
    assert _error(engine_load, model) == refused


@pytest.mark.parametrize(
    "model",
    ["llama", "qwen2", "gemma3", "llama-gguf", "gemma3-gguf", *BUNDLED_MODELS],
)
def test_what_the_check_accepts_loads_to_the_same_config(bases, tmp_path, model):
    if model in BUNDLED_MODELS:
        try:
            resolve_model_path(model)
        except FileNotFoundError as exc:
            pytest.skip(str(exc))  # gemma3-270m: an extra
    elif model.endswith("-gguf"):
        arch = model.removesuffix("-gguf")
        model = gguf_file(bases, tmp_path, arch, arch)
    else:
        model = str(bases["root"] / model)
    assert check_model(model) == engine_load(model)


def test_the_operator_admits_and_refuses_models_as_the_check_does(bases, tmp_path):
    good = str(bases["root"] / "llama")
    bad = MUTATIONS["hf-unread-key-nope"][0](bases, tmp_path)
    assert check_serving({"config": {"model": good}}) is None
    rejection = check_serving({"config": {"model": good}, "canary": {"config": {"model": bad}}})
    assert rejection is not None and rejection.field == "spec.canary.config.model"
    assert rejection.message == _error(check_model, bad)
    # a model the operator's file system cannot see is left to the Job's own check
    assert model_problem(str(tmp_path / "on-a-volume" / "model.gguf")) is None


def test_every_refusal_the_check_can_make_has_a_mutation(bases, tmp_path):
    """Each message literal in a `raise ValueError(...)` or `problems.append(...)` of
    slotune/engine/checkpoint.py appears in the refusal of some mutation."""
    tree = ast.parse(Path(checkpoint.__file__).read_text())
    fragments = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not node.args:
            continue
        f = node.func
        if (isinstance(f, ast.Name) and f.id in ("ValueError", "FileNotFoundError")) or (
            isinstance(f, ast.Attribute) and f.attr == "append" and getattr(f.value, "id", "") == "problems"
        ):
            parts = [
                c.value for c in ast.walk(node.args[0]) if isinstance(c, ast.Constant) and isinstance(c.value, str)
            ]
            longest = max(parts, key=len, default="")
            if len(longest.strip()) >= 8:
                fragments.append(longest.strip())
    expected = " | ".join(_error(check_model, build(bases, tmp_path / m)) for m, (build, _) in MUTATIONS.items())
    missing = [f for f in fragments if f not in expected]
    assert not missing, f"refusals no mutation makes: {missing}"
