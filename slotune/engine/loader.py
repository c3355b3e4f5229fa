"""Read model weights: the bundled GGUFs, a GGUF of an implemented architecture, or an HF checkpoint dir.

Both paths produce the same thing: a `ModelConfig` plus a state dict in Hugging Face naming
and layout, so one model implementation serves every source. What loads is decided from the
metadata first (slotune/engine/checkpoint.py, the check `tune validate` runs), before a weight is read.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from slotune.engine.checkpoint import (
    GGUF_ARCHS,
    GGUF_NAMES,
    ModelConfig,
    gguf_config,
    hf_config,
    read_config_json,
    safetensors_names,
    with_rope_factors,
)
from slotune.engine.gguf_header import read_gguf_layout
from slotune.engine.paths import BUNDLED_MODELS, cache_root, resolve_model_path  # noqa: F401 (re-exported)


def load_model(model: str) -> tuple[ModelConfig, dict[str, torch.Tensor], Path]:
    """Returns (config, float32 state dict in HF naming, resolved path)."""
    path = resolve_model_path(model)
    if path.is_dir():
        cfg, sd = _load_hf_dir(path)
    else:
        cfg, sd = _load_gguf_cached(path)
    return cfg, sd, path


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


def _load_gguf(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    from gguf import GGUFReader
    from gguf.quants import dequantize

    cfg = gguf_config(path, *read_gguf_layout(path))  # every check before any tensor is read
    reader = GGUFReader(str(path))
    arch = GGUF_ARCHS[reader.fields["general.architecture"].contents()]
    sd: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        arr = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        # GGUF lists dims fastest-first; numpy data is already [rows, cols] = HF [out, in].
        arr = arr.reshape([int(d) for d in reversed(t.shape)])
        if t.name.startswith("rope_"):  # Llama 3.x's rope_freqs, Phi-3's longrope factors
            cfg = with_rope_factors(cfg, t.name, [float(v) for v in arr.reshape(-1)])
            continue
        if t.name.startswith("blk."):
            _, idx, rest = t.name.split(".", 2)
            hf_name = f"model.layers.{idx}.{arch.layer_names[rest]}"
            if arch.is_qk_permuted and rest.startswith("attn_q."):
                arr = _unpermute_rope_rows(arr, cfg.num_heads)
            elif arch.is_qk_permuted and rest.startswith("attn_k."):
                arr = _unpermute_rope_rows(arr, cfg.num_kv_heads)
        else:
            hf_name = GGUF_NAMES[t.name]
        sd[hf_name] = torch.from_numpy(np.array(arr, dtype=np.float32, order="C", copy=True))
    return cfg, _split_phi3(sd, cfg)


def _unpermute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's convert-time row permutation of q/k so HF's rotate-half rotary applies.

    llama.cpp stores rows as (head, dim/2, 2) interleaved pairs; HF keeps (head, 2, dim/2).
    """
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _load_hf_dir(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    hf = read_config_json(path)
    cfg = hf_config(path, hf, safetensors_names(path))  # every check before any weight is read
    sd: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        for k, v in load_file(str(f)).items():
            sd[k] = v.float()
    if hf.get("model_type") == "gemma3_text":  # its norms scale by (1 + w): store 1 + w, as llama.cpp's GGUFs do
        sd = {k: v + 1.0 if k.endswith("norm.weight") else v for k, v in sd.items()}
    return cfg, _split_phi3(sd, cfg)


def _split_phi3(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Phi-3's fused qkv_proj and gate_up_proj (HF and GGUF alike) as the separate projections
    the model fuses again; other state dicts pass through."""
    q = cfg.num_heads * cfg.head_dim
    kv = cfg.num_kv_heads * cfg.head_dim
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
