"""Triton path: the same interfaces as the torch backend, with our kernels (kernels/).

Decode attention reads the paged cache directly (no gather) with the tile config from
`EngineConfig.kernels.decode_attention`. Prefill/extend attention keeps torch SDPA over the
gathered context: prefill is compute-bound, SDPA's flash kernel is already at the tensor-core
roofline, and the gather costs one pass over the context per layer — small next to the
O(n^2) attention it feeds.
"""

from __future__ import annotations

import torch

from slotune.engine.layers.attention import AttentionMetadata, KVCache, TorchAttentionBackend


class TritonAttentionBackend(TorchAttentionBackend):
    name = "triton"

    def __init__(self, tiles) -> None:
        from slotune.kernels.decode_attention import DecodeAttentionConfig

        self.config = DecodeAttentionConfig(tiles.block_n, tiles.num_splits, tiles.num_warps, tiles.num_stages)
        self.max_context: int | None = None  # set by the model runner (static bound: no host sync)

    def store_kv(self, cache: KVCache, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        from slotune.kernels.kv_store import store_kv

        store_kv(k, v, cache.k[layer], cache.v[layer], slots,
                 cache.k_scale[layer] if cache.is_quantized else None, cache.v_scale[layer] if cache.is_quantized else None)

    def forward(self, cache: KVCache, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        self.store_kv(cache, layer, k, v, meta.slot_mapping)  # the kernel skips slot -1 itself
        ne = meta.num_extend_tokens
        if ne == 0:
            return self._decode(cache, layer, q, meta, scale)
        out = torch.empty_like(q)
        out[:ne] = self._extend(cache, layer, q[:ne], k[:ne], v[:ne], meta, scale)
        if ne < q.shape[0]:
            out[ne:] = self._decode(cache, layer, q[ne:], meta, scale)
        return out

    def _decode(self, cache: KVCache, layer: int, q: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        from slotune.kernels.decode_attention import paged_decode_attention

        return paged_decode_attention(
            q, cache.k[layer], cache.v[layer], meta.decode_block_tables, meta.decode_context_lens, scale,
            cache.k_scale[layer] if cache.is_quantized else None, cache.v_scale[layer] if cache.is_quantized else None,
            config=self.config, max_context=self.max_context)


class TritonOps:
    """Fused pointwise kernels (same call shapes as the torch ops)."""

    @staticmethod
    def rms_norm(x, weight, eps, residual=None):
        from slotune.kernels.rms_norm import rms_norm

        return rms_norm(x, weight, eps, residual)

    @staticmethod
    def silu_and_mul(x):
        from slotune.kernels.activation import silu_and_mul

        return silu_and_mul(x)

    @staticmethod
    def rotary(x, cos_sin):
        from slotune.kernels.rotary import rotary

        positions = torch.arange(x.shape[0], device=x.device)  # cos_sin is already indexed by position
        return rotary(x, cos_sin, positions)


def use_triton(model, cfg) -> None:
    """Swap the model's attention backend and pointwise ops for the Triton ones."""
    model.attn = TritonAttentionBackend(cfg.kernels.decode_attention)
    model.ops = TritonOps()
    from slotune.kernels.quant_matmul import MatmulConfig

    t = cfg.kernels.matmul
    tiles = MatmulConfig(t.block_m, t.block_n, t.block_k, t.num_warps, t.num_stages)
    for m in model.modules():
        if hasattr(m, "triton_tiles"):
            m.triton_tiles = tiles
