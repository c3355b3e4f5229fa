"""The native CPU decode step's view of an engine model: `LlamaModel`'s layers read into the
plain tensors `slotune/kernels/cpu_decode.py` takes (kernels import nothing from the engine; this is
the glue, on the engine's side).

`native_decoder` returns the `CpuDecoder` for a model over its KV cache, or the reason it
cannot run here (the runner logs it, or raises it when kernels.backend is native).
"""

from __future__ import annotations

import torch

from slotune.engine.layers.attention import KVCache
from slotune.engine.layers.linear import Linear
from slotune.engine.models.llama import LlamaModel
from slotune.engine.quantize import Int4Linear, Int8Linear
from slotune.kernels.cpu_decode import W_BF16, W_F32, W_INT4, W_INT8, CpuDecoder, NativeLayer, NativeLinear, NativeModel

_DENSE = {torch.float32: W_F32, torch.bfloat16: W_BF16}


def native_linear(mod: torch.nn.Module) -> NativeLinear | str:
    """The kernel's view of one engine projection (read in place), or why it has none."""
    bias = getattr(mod, "bias", None)
    if isinstance(mod, Linear):
        w = mod.weight
        if w.dtype not in _DENSE:
            return f"dense weight of dtype {w.dtype}"
        return NativeLinear(_DENSE[w.dtype], w.shape[0], w.shape[1], w.data, bias=bias)
    if isinstance(mod, Int8Linear):
        if mod.tiles is not None:
            return "Triton int8 layer"
        return NativeLinear(W_INT8, mod.qweight.shape[0], mod.qweight.shape[1], mod.qweight, mod.scales, bias)
    if isinstance(mod, Int4Linear):
        if not mod.on_cpu:
            return f"int4 layer in the CUDA layout ({mod.n} output channels)"
        return NativeLinear(W_INT4, mod.n, mod.k - mod.pad, mod.packed, mod.scales_and_zeros, bias, mod.group_size)
    return f"{type(mod).__name__} weights"


def native_model(model: LlamaModel) -> NativeModel | str:
    """Every tensor the native step reads, or what of the model it cannot run."""
    c = model.cfg
    layers = []
    for i, ly in enumerate(model.layers):
        proj = [native_linear(m) for m in (ly.qkv_proj, ly.o_proj, ly.gate_up_proj, ly.down_proj)]
        bad = next((p for p in proj if isinstance(p, str)), None)
        if bad is not None:
            return bad
        norms = [None if n is None else n.data for n in (ly.q_norm, ly.k_norm, ly.attn_out_norm, ly.mlp_out_norm)]
        table = model.cos_sin_local if ly.local_rope else model.cos_sin
        layers.append(
            NativeLayer(ly.input_norm.data, ly.mlp_norm.data, *proj, *norms, table if ly.rope else None, c.window_of(i))
        )
    lm_head = native_linear(model.lm_head)
    if isinstance(lm_head, str):
        return lm_head
    return NativeModel(
        c.hidden_size,
        c.intermediate_size,
        c.num_heads,
        c.num_kv_heads,
        c.head_dim,
        c.rms_norm_eps,
        model.embed.data,
        model.norm.data,
        layers,
        lm_head,
        rotary_dim=c.rotary_dim or c.head_dim,
        attn_scale=c.attn_scale or c.head_dim**-0.5,
        embed_scale=None if model.embed_scale is None else float(model.embed_scale),
        gelu=c.hidden_act == "gelu_tanh",
    )


def native_decoder(
    model: LlamaModel, cache: KVCache, max_rows: int, max_ctx: int, int8_activations: bool, act_group: int = 32
) -> CpuDecoder | str:
    """The native decode step for `model` over `cache`, or why it cannot run here."""
    if cache.is_quantized:
        return f"kv_dtype {cache.kv_dtype} (the kernel reads a cache in the model dtype)"
    weights = native_model(model)
    if isinstance(weights, str):
        return weights
    reason = CpuDecoder.unsupported(weights, cache.k)
    if reason is not None:
        return reason
    return CpuDecoder(
        weights,
        cache.k,
        cache.v,
        max_rows=max_rows,
        max_ctx=max_ctx,
        int8_activations=int8_activations,
        act_group=act_group,
    )
