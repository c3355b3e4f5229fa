"""Triton path: the same interfaces as the torch backend, with our kernels (slotune/kernels/).

Decode attention reads the paged cache directly (no gather) with the tile config from
`EngineConfig.kernels.decode_attention`. Extend attention (several prefills in one step,
chunked prefill or prefix-cache hits over a cached context, speculative verification) runs
the paged prefill kernel (`kernels.prefill_attention` tiles): no gathered copy of the context,
no [B, 1, Q, L] mask. A single fresh prompt with no cached context keeps torch SDPA with
`is_causal` over the step's own K/V: that is FlashAttention, already at the tensor-core
roofline, and it needs neither gather nor mask.
"""

from __future__ import annotations

import logging

import torch

from slotune.engine.config import KernelConfig
from slotune.engine.layers.attention import AttentionMetadata, KVCache, TorchAttentionBackend
from slotune.engine.layers.backend import Backend
from slotune.engine.layers.ops import gelu_tanh_and_mul
from slotune.kernels.activation import silu_and_mul
from slotune.kernels.decode_attention import paged_decode_attention
from slotune.kernels import prefill_attention
from slotune.kernels.kv_store import store_kv
from slotune.kernels.rms_norm import rms_norm
from slotune.kernels.rotary import rotary
from slotune.kernels.tiles import DecodeAttentionConfig, PrefillAttentionConfig

log = logging.getLogger("slotune.engine")


class TritonAttentionBackend(TorchAttentionBackend):
    name = "triton"

    def __init__(
        self,
        tiles: DecodeAttentionConfig,
        prefill_tiles: PrefillAttentionConfig,
        sliding_window: int | None = None,
        full_layers: tuple[int, ...] = (),
    ) -> None:
        super().__init__(sliding_window, full_layers)  # the torch masks serve the one-fresh-prompt SDPA path
        self.config = tiles
        self.prefill_config = prefill_tiles
        self._prefill_ran = self._prefill_failed = False
        self.num_prefill_fallbacks = 0  # prefill calls that ran torch SDPA because the kernel failed
        self._extend_meta: AttentionMetadata | None = None  # the step whose extend tensors are cached
        self._extend_args: tuple = ()

    def kernel_fallbacks(self) -> dict[str, int]:
        return {"triton_prefill_to_sdpa": self.num_prefill_fallbacks}

    def store_kv(self, cache: KVCache, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        store_kv(
            k,
            v,
            cache.k[layer],
            cache.v[layer],
            slots,
            cache.k_scale[layer] if cache.is_quantized else None,
            cache.v_scale[layer] if cache.is_quantized else None,
        )

    def forward(
        self,
        cache: KVCache,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        self.store_kv(cache, layer, k, v, meta.slot_mapping)  # the kernel skips slot -1 itself
        ne = meta.num_extend_tokens
        if ne == 0:
            return self._decode(cache, layer, q, meta, scale)
        out = torch.empty_like(q)
        out[:ne] = self._extend(cache, layer, q[:ne], k[:ne], v[:ne], meta, scale)
        if ne < q.shape[0]:
            out[ne:] = self._decode(cache, layer, q[ne:], meta, scale)
        return out

    def _extend(
        self,
        cache: KVCache,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        if meta.extend_mask is None:  # one fresh prompt: flash SDPA over its own K/V
            return super()._extend(cache, layer, q, k, v, meta, scale)
        if self._prefill_failed:  # the kernel failed before: torch's extend path, counted
            self.num_prefill_fallbacks += 1
            return super()._extend(cache, layer, q, k, v, meta, scale)
        if self._extend_meta is not meta:  # once per step, not per layer: [Be] int32 each
            lens = meta.extend_query_lens
            starts = [0]
            for n in lens[:-1]:
                starts.append(starts[-1] + n)
            table = torch.tensor([starts, lens, meta.extend_context_lens], dtype=torch.int32)
            table = table.to(q.device, non_blocking=True)
            self._extend_args = (table[0], table[1], table[2], max(lens))
            self._extend_meta = meta
        starts, q_lens, ctx_lens, max_q = self._extend_args
        try:
            # through the module: tests put a failing kernel there (the fallback below)
            out = prefill_attention.paged_prefill_attention(
                q,
                cache.k[layer],
                cache.v[layer],
                meta.extend_block_tables,
                starts,
                q_lens,
                ctx_lens,
                max_q,
                scale,
                cache.k_scale[layer] if cache.is_quantized else None,
                cache.v_scale[layer] if cache.is_quantized else None,
                config=self.prefill_config,
                window=self.window(layer),
            )
        except Exception as exc:
            if self._prefill_ran:
                raise  # it worked before: a real error, not a toolchain/tile problem
            # First call failed to compile or launch on this device/toolchain: keep serving on
            # the torch extend path (gather + SDPA) rather than failing every prefill.
            log.warning("Triton prefill kernel unavailable (%r); using torch SDPA", exc)
            self._prefill_failed = True
            self.num_prefill_fallbacks += 1
            return super()._extend(cache, layer, q, k, v, meta, scale)
        self._prefill_ran = True
        return out

    def _decode(
        self, cache: KVCache, layer: int, q: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        return paged_decode_attention(
            q,
            cache.k[layer],
            cache.v[layer],
            meta.decode_block_tables,
            meta.decode_context_lens,
            scale,
            cache.k_scale[layer] if cache.is_quantized else None,
            cache.v_scale[layer] if cache.is_quantized else None,
            config=self.config,
            max_context=meta.max_context,
            window=self.window(layer),
        )


class TritonOps:
    """Fused pointwise kernels (same call shapes as the torch ops)."""

    rms_norm = staticmethod(rms_norm)
    silu_and_mul = staticmethod(silu_and_mul)
    gelu_tanh_and_mul = staticmethod(gelu_tanh_and_mul)  # torch's: no kernel of ours yet

    @staticmethod
    def rotary(x, cos_sin):
        positions = torch.arange(x.shape[0], device=x.device)  # cos_sin is already indexed by position
        return rotary(x, cos_sin, positions)


def triton_backend(kernels: KernelConfig, sliding_window: int | None, full_layers: tuple[int, ...] = ()) -> Backend:
    """Our kernels with the config's tiles: attention, pointwise ops, and the quantized layers' matmul tiles."""
    attn = TritonAttentionBackend(kernels.decode_attention, kernels.prefill_attention, sliding_window, full_layers)
    return Backend("triton", attn, TritonOps(), kernels.matmul)
