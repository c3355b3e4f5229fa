"""Plain-torch references for every kernel: the ground truth the kernel tests compare with."""

from __future__ import annotations

import torch

from slotune.kernels.kv_quant import quantize_kv


def dequant_cache(cache: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    return cache.float() if scale is None else cache.float() * scale[..., None].float()


def paged_decode_attention(
    q, k_cache, v_cache, block_tables, context_lens, scale, k_scale=None, v_scale=None, window=None
):
    """q: [B, H, D]; caches: [NB, BS, Hkv, D]; block_tables: [B, MB]; context_lens: [B] -> [B, H, D] (float32).
    window: only the last `window` keys (sliding window); None = all."""
    B, H, D = q.shape
    BS, Hkv = k_cache.shape[1], k_cache.shape[2]
    kf, vf = dequant_cache(k_cache, k_scale), dequant_cache(v_cache, v_scale)
    out = torch.empty(B, H, D, dtype=torch.float32, device=q.device)
    for b in range(B):
        n = int(context_lens[b])
        blocks = block_tables[b, : (n + BS - 1) // BS].long()
        k = kf[blocks].reshape(-1, Hkv, D)[:n]
        v = vf[blocks].reshape(-1, Hkv, D)[:n]
        first = 0 if window is None else max(n - window, 0)
        k = k[first:].repeat_interleave(H // Hkv, dim=1)
        v = v[first:].repeat_interleave(H // Hkv, dim=1)
        s = torch.einsum("hd,nhd->hn", q[b].float(), k) * scale
        out[b] = torch.einsum("hn,nhd->hd", s.softmax(-1), v)
    return out


def paged_prefill_attention(
    q, k_cache, v_cache, block_tables, query_lens, context_lens, scale, k_scale=None, v_scale=None, window=None
):
    """Causal attention of each sequence's new tokens over its whole paged context (cached prefix
    + new tokens, already stored). q: [T, H, D] (sequences back to back); query_lens,
    context_lens: per-sequence lists -> [T, H, D] (float32). window: a query at position p sees
    keys p - window < k <= p (sliding window); None = all k <= p."""
    H, D = q.shape[1:]
    BS, Hkv = k_cache.shape[1], k_cache.shape[2]
    kf, vf = dequant_cache(k_cache, k_scale), dequant_cache(v_cache, v_scale)
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    start = 0
    for b, (nq, nk) in enumerate(zip(query_lens, context_lens)):
        blocks = block_tables[b, : (nk + BS - 1) // BS].long()
        k = kf[blocks].reshape(-1, Hkv, D)[:nk].repeat_interleave(H // Hkv, dim=1)
        v = vf[blocks].reshape(-1, Hkv, D)[:nk].repeat_interleave(H // Hkv, dim=1)
        s = torch.einsum("qhd,nhd->hqn", q[start : start + nq].float(), k) * scale
        q_pos = torch.arange(nk - nq, nk)[:, None]
        k_pos = torch.arange(nk)[None, :]
        s = s.masked_fill(k_pos > q_pos, float("-inf"))
        if window is not None:
            s = s.masked_fill(k_pos <= q_pos - window, float("-inf"))
        out[start : start + nq] = torch.einsum("hqn,nhd->qhd", s.softmax(-1), v)
        start += nq
    return out


def rms_norm(x, weight, eps, residual=None):
    """-> (normed, new_residual) in x's dtype; math in float32."""
    if residual is not None:
        x = (x.float() + residual.float()).to(x.dtype)
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return y.to(x.dtype), x


def silu_and_mul(x):
    g, u = x.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(g) * u).to(x.dtype)


def rotary(x, cos_sin):
    """x: [T, H, D]; cos_sin: [T, D] (cos | sin halves) -> rotate-half rotary."""
    half = x.shape[-1] // 2
    cos, sin = cos_sin[:, None, :half].float(), cos_sin[:, None, half:].float()
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).to(x.dtype)


def store_kv(k, v, k_cache, v_cache, slots, k_scale=None, v_scale=None):
    """Write [T, Hkv, D] into flat cache slots (quantizing per token-head when scales are given)."""
    kc, vc = k_cache.view(-1, *k_cache.shape[2:]), v_cache.view(-1, *v_cache.shape[2:])
    keep = slots >= 0
    if k_scale is None:
        kc[slots[keep]] = k[keep].to(kc.dtype)
        vc[slots[keep]] = v[keep].to(vc.dtype)
        return
    kind = "int8" if k_cache.dtype == torch.int8 else "fp8"
    kq, ks = quantize_kv(k[keep], kind)
    vq, vs = quantize_kv(v[keep], kind)
    kc[slots[keep]] = kq
    vc[slots[keep]] = vq
    k_scale.view(-1, k_scale.shape[-1])[slots[keep]] = ks
    v_scale.view(-1, v_scale.shape[-1])[slots[keep]] = vs


def int8_matmul(x, qweight, scales):
    return (x.float() @ (qweight.float() * scales.float()[:, None]).t()).to(x.dtype)


def fp8_matmul(x, qweight, scales):
    return (x.float() @ (qweight.float() * scales.float()[:, None]).t()).to(x.dtype)


def int4_matmul(x, packed, scales, mins, group_size):
    """Our CUDA int4 layout: packed [N, K/2] (low nibble = even k), scales/mins [N, K/group]."""
    n = packed.shape[0]
    q = torch.stack([packed & 0xF, packed >> 4], -1).view(n, -1, group_size).float()
    w = (q * scales.float()[..., None] + mins.float()[..., None]).view(n, -1)
    return (x.float() @ w.t()).to(x.dtype)
