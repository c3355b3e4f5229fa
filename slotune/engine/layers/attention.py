"""Paged attention: the KV-cache store, and attention over block tables (torch backend).

A step's inputs (slots, block tables, masks, the extend/decode layout) are `AttentionMetadata`,
built in slotune/engine/layers/attn_metadata.py. The Triton backend (`slotune/engine/layers/triton_backend.py`)
implements the same interface.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from slotune.engine.layers.attn_metadata import AttentionMetadata, window_masks
from slotune.kernels.kv_quant import quantize_kv


class KVCache:
    """Preallocated paged cache for all layers: [L, num_blocks, block_size, Hkv, D] per K and V.

    Quantized caches (int8 / fp8-e4m3) store one float32 scale per (token, head).
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        kv_dtype: str,
        device: torch.device,
    ) -> None:
        self.kv_dtype = kv_dtype
        self.block_size = block_size
        store = {"auto": dtype, "int8": torch.int8, "fp8": torch.float8_e4m3fn}[kv_dtype]
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=store, device=device)
        self.v = torch.zeros(shape, dtype=store, device=device)
        self.is_quantized = kv_dtype != "auto"
        if self.is_quantized:
            self.k_scale = torch.ones(shape[:-1], dtype=torch.float32, device=device)
            self.v_scale = torch.ones(shape[:-1], dtype=torch.float32, device=device)
        else:
            self.k_scale = self.v_scale = None
        self.compute_dtype = dtype

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, kv_dtype: str) -> int:
        elem = {"auto": torch.finfo(dtype).bits // 8 if dtype.is_floating_point else 4, "int8": 1, "fp8": 1}[kv_dtype]
        scale = 4 if kv_dtype != "auto" else 0
        return 2 * num_layers * num_kv_heads * (head_dim * elem + scale)


class TorchAttentionBackend:
    """Reference-quality attention in plain torch; what runs on CPU.

    `sliding_window` (Mistral): a query at position q attends keys q - window < k <= q, as
    transformers' sliding-window mask; None: every key <= q. `full_layers` (Gemma 3): the layers
    that attend every key all the same. The cache keeps the whole context.
    """

    name = "torch"

    def __init__(self, sliding_window: int | None = None, full_layers: tuple[int, ...] = ()) -> None:
        self.sliding_window = sliding_window
        self.full_layers = frozenset(full_layers)
        self._window_meta: AttentionMetadata | None = None  # the step whose windowed masks are cached
        self._window_masks: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)

    def window(self, layer: int) -> int | None:
        return None if layer in self.full_layers else self.sliding_window

    def _masks(self, meta: AttentionMetadata, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(decode mask, extend mask) of this step for `layer`, its window applied; built once per
        step, not per layer."""
        if self.window(layer) is None:
            return meta.decode_mask, meta.extend_mask
        if self._window_meta is not meta:
            self._window_masks = window_masks(meta, self.sliding_window)
            self._window_meta = meta
        return self._window_masks

    def kernel_fallbacks(self) -> dict[str, int]:
        """Calls that ran another path than this backend's kernels, by reason (none here)."""
        return {}

    def store_kv(self, cache: KVCache, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        # k, v: [T, Hkv, D]; slots: [T]
        kc = cache.k[layer].view(-1, *cache.k.shape[-2:])
        vc = cache.v[layer].view(-1, *cache.v.shape[-2:])
        if cache.is_quantized:
            kq, ks = quantize_kv(k, cache.kv_dtype)
            vq, vs = quantize_kv(v, cache.kv_dtype)
            if kq.dtype == torch.float8_e4m3fn:  # CPU index ops lack fp8: move the raw bytes
                kc, vc, kq, vq = kc.view(torch.uint8), vc.view(torch.uint8), kq.view(torch.uint8), vq.view(torch.uint8)
            kc.index_copy_(0, slots, kq)
            vc.index_copy_(0, slots, vq)
            cache.k_scale[layer].view(-1, ks.shape[-1]).index_copy_(0, slots, ks)
            cache.v_scale[layer].view(-1, vs.shape[-1]).index_copy_(0, slots, vs)
        else:
            kc.index_copy_(0, slots, k.to(kc.dtype))
            vc.index_copy_(0, slots, v.to(vc.dtype))

    def _gather(self, cache: KVCache, layer: int, block_tables: torch.Tensor, which: str) -> torch.Tensor:
        """[B, max_blocks] block ids -> [B, Hkv, max_blocks*block_size, D] in compute dtype."""
        b, nb = block_tables.shape
        flat = block_tables.reshape(-1).long()
        # index_select on a flat block index is several times faster than advanced indexing.
        src = (cache.k if which == "k" else cache.v)[layer]
        if src.dtype == torch.float8_e4m3fn:
            c = src.view(torch.uint8).index_select(0, flat).view(torch.float8_e4m3fn)
        else:
            c = src.index_select(0, flat)  # [B*nb, bs, Hkv, D]
        _, bs, h, d = c.shape
        if cache.is_quantized:
            s = (cache.k_scale if which == "k" else cache.v_scale)[layer].index_select(0, flat)
            c = c.to(torch.float32) * s[..., None]
        return c.view(b, nb * bs, h, d).transpose(1, 2).to(cache.compute_dtype)

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
        # q: [T, H, D]; k, v: [T, Hkv, D] -> out [T, H, D]
        if not meta.has_skipped_slots:
            self.store_kv(cache, layer, k, v, meta.slot_mapping)
        else:
            valid = meta.slot_mapping >= 0
            self.store_kv(cache, layer, k[valid], v[valid], meta.slot_mapping[valid])
        ne = meta.num_extend_tokens
        if ne == 0:
            return self._decode(cache, layer, q, meta, scale)
        if ne == q.shape[0]:
            return self._extend(cache, layer, q, k, v, meta, scale)
        out = torch.empty_like(q)
        if ne:
            out[:ne] = self._extend(cache, layer, q[:ne], k[:ne], v[:ne], meta, scale)
        if ne < q.shape[0]:
            out[ne:] = self._decode(cache, layer, q[ne:], meta, scale)
        return out

    def _decode(
        self, cache: KVCache, layer: int, q: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        # q: [B, H, D] -> [B, H, D]
        kk = self._gather(cache, layer, meta.decode_block_tables, "k")  # [B, Hkv, L, D]
        vv = self._gather(cache, layer, meta.decode_block_tables, "v")
        b, h, d = q.shape
        hkv = kk.shape[1]
        mask = self._masks(meta, layer)[0]
        if q.dtype == torch.float32 and b == 1:  # the one shape where SDPA's CPU kernel is faster
            o = F.scaled_dot_product_attention(q.unsqueeze(2), kk, vv, attn_mask=mask, scale=scale, enable_gqa=True)
            return o.squeeze(2)
        # Two batched matmuls, the GQA group as the row dimension. For one query row, SDPA's CPU
        # kernel is slow (timings: docs/design/engine-attention.md).
        scores = torch.matmul(q.reshape(b, hkv, h // hkv, d), kk.transpose(-1, -2)).float()  # [B, Hkv, G, L]
        scores = torch.where(mask, scores * scale, float("-inf"))  # mask [B, 1, 1, L]
        return torch.matmul(scores.softmax(-1).to(vv.dtype), vv).view(b, h, d)

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
        mask = self._masks(meta, layer)[1]
        if meta.extend_mask is None:
            # One plain prefill with no cached context: attend over this step's own K/V (causal,
            # or the [T, T] window mask when the prompt is longer than the window).
            o = F.scaled_dot_product_attention(
                q.transpose(0, 1),
                k.transpose(0, 1),
                v.transpose(0, 1),
                attn_mask=mask,
                is_causal=mask is None,
                scale=scale,
                enable_gqa=True,
            )
            return o.transpose(0, 1)
        lens = meta.extend_query_lens
        qmax = max(lens)
        qp = q.new_zeros(len(lens), qmax, *q.shape[1:])
        start = 0
        for i, n in enumerate(lens):
            qp[i, :n] = q[start : start + n]
            start += n
        kk = self._gather(cache, layer, meta.extend_block_tables, "k")
        vv = self._gather(cache, layer, meta.extend_block_tables, "v")
        o = F.scaled_dot_product_attention(qp.transpose(1, 2), kk, vv, attn_mask=mask, scale=scale, enable_gqa=True)
        o = o.transpose(1, 2)  # [Be, Qmax, H, D]
        return torch.cat([o[i, :n] for i, n in enumerate(lens)])
