"""Paged prefill/extend attention: causal, variable lengths in one batch, over the block table.

Each sequence contributes `query_len` new tokens (its K/V already written to the cache by the
KV store) at the end of a context of `context_len` tokens, so a cached prefix (prefix caching,
chunked prefill, speculative verification) is just `context_len - query_len` earlier tokens.
New token i sits at absolute position `context_len - query_len + i` and sees keys 0..position,
or with a sliding window (WINDOW > 0) keys position - WINDOW < k <= position.

Grid: (sequence, query head, query tile). Each program loads BLOCK_M query rows of one head,
streams keys straight from the paged cache in BLOCK_N tiles (no gather, no mask tensor), and
keeps an online softmax in float32. Quantized caches (int8 / fp8-e4m3) are dequantized
in-register with their per-(token, head) scales. Programs past a sequence's last query tile
run zero iterations and store nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from slotune.kernels.tiles import (
    PREFILL_BLOCK_M,
    PREFILL_BLOCK_N,
    PREFILL_NUM_STAGES,
    PREFILL_NUM_WARPS,
    PrefillAttentionConfig,
)


def configs(max_query_len: int, head_dim: int) -> list[PrefillAttentionConfig]:
    """Valid candidates: query tiles no larger than the longest query, register-sized tiles."""
    out = []
    for bm in PREFILL_BLOCK_M:
        if bm > max(16, triton.next_power_of_2(max_query_len)):
            continue
        for bn in PREFILL_BLOCK_N:
            if bm * bn * head_dim > 128 * 128 * 128:  # q, k, v and s tiles must fit in registers/smem
                continue
            for warps in PREFILL_NUM_WARPS:
                for stages in PREFILL_NUM_STAGES:
                    out.append(PrefillAttentionConfig(block_m=bm, block_n=bn, num_warps=warps, num_stages=stages))
    return out


@triton.jit
def _prefill_attention_kernel(
    # pointers
    q_ptr,
    k_ptr,
    v_ptr,
    ks_ptr,
    vs_ptr,
    bt_ptr,
    q_start_ptr,
    q_len_ptr,
    ctx_ptr,
    out_ptr,
    # sizes
    sm_scale,
    # strides
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_sb,
    stride_st,
    stride_btb,
    stride_ot,
    stride_oh,
    # meta
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    QUANTIZED: tl.constexpr,
    WINDOW: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    mb = tl.program_id(2)
    q_len = tl.load(q_len_ptr + b)
    ctx = tl.load(ctx_ptr + b)
    q0 = tl.load(q_start_ptr + b)
    prefix = ctx - q_len
    kvh = h // GROUP

    offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)  # query rows, relative to this sequence's new tokens
    m_mask = offs_m < q_len
    q_pos = prefix + offs_m
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(
        q_ptr + (q0 + offs_m)[:, None] * stride_qt + h * stride_qh + d[None, :], mask=m_mask[:, None], other=0.0
    )
    cdt = q.dtype

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    # keys up to the last query row of this tile (0 iterations for tiles past the sequence)
    end = tl.where(mb * BLOCK_M < q_len, tl.minimum(ctx, prefix + (mb + 1) * BLOCK_M), 0)
    first = 0  # oldest key any row of this tile attends
    if WINDOW > 0:
        first = tl.maximum(prefix + mb * BLOCK_M - WINDOW + 1, 0) // BLOCK_N * BLOCK_N
    for n0 in range(first, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        blk = tl.load(bt_ptr + b * stride_btb + offs_n // BLOCK_SIZE, mask=n_mask, other=0)
        tok = offs_n % BLOCK_SIZE
        kv_off = blk[:, None] * stride_kb + tok[:, None] * stride_kt + kvh * stride_kh + d[None, :]
        k = tl.load(k_ptr + kv_off, mask=n_mask[:, None], other=0.0)
        v = tl.load(v_ptr + kv_off, mask=n_mask[:, None], other=0.0)
        if QUANTIZED:
            s_off = blk * stride_sb + tok * stride_st + kvh
            k = (k.to(tl.float32) * tl.load(ks_ptr + s_off, mask=n_mask, other=0.0)[:, None]).to(cdt)
            v = (v.to(tl.float32) * tl.load(vs_ptr + s_off, mask=n_mask, other=0.0)[:, None]).to(cdt)
        s = tl.dot(q, tl.trans(k)) * sm_scale
        causal = (offs_n[None, :] <= q_pos[:, None]) & n_mask[None, :]
        if WINDOW > 0:
            causal = causal & (offs_n[None, :] > q_pos[:, None] - WINDOW)
        s = tl.where(causal, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_shift = m_new
        if WINDOW > 0:
            # Causal only, every row sees key 0 in the first tile. With a window, a row whose window
            # starts past this tile has seen no key yet: shift by 0, not -inf (exp(-inf - -inf) is
            # NaN); its alpha and p come out 0 and its max stays -inf.
            m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_shift)
        p = tl.exp(s - m_shift[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(cdt), v)
        m_i = m_new
    out = acc / tl.maximum(l_i, 1e-30)[:, None]
    tl.store(
        out_ptr + (q0 + offs_m)[:, None] * stride_ot + h * stride_oh + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=m_mask[:, None],
    )


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_starts: torch.Tensor,
    query_lens: torch.Tensor,
    context_lens: torch.Tensor,
    max_query_len: int,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    config: PrefillAttentionConfig | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """q: [T, H, D] (sequences back to back); k/v_cache: [NB, BS, Hkv, D]; block_tables: [B, MB] int32;
    query_starts, query_lens, context_lens: [B] int32 (context includes the new tokens) -> [T, H, D].

    window: a query at position p attends keys p - window < k <= p (sliding window); None = all k <= p."""
    cfg = config or PrefillAttentionConfig()
    T, H, D = q.shape
    NB, BS, Hkv, D2 = k_cache.shape
    B = block_tables.shape[0]
    assert D == D2 and H % Hkv == 0 and v_cache.shape == k_cache.shape, "shape mismatch"
    assert D >= 16 and D & (D - 1) == 0, "head_dim must be a power of two >= 16"
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and query_lens.shape == context_lens.shape == (B,)
    assert window is None or window > 0, f"window {window}"
    quantized = k_scale is not None
    out = torch.empty_like(q)
    ks = k_scale if quantized else q  # dummy pointer when unquantized
    vs = v_scale if quantized else q
    grid = (B, H, triton.cdiv(max(max_query_len, 1), cfg.block_m))
    if T:
        _prefill_attention_kernel[grid](
            q,
            k_cache,
            v_cache,
            ks,
            vs,
            block_tables,
            query_starts,
            query_lens,
            context_lens,
            out,
            scale,
            q.stride(0),
            q.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            ks.stride(0) if quantized else 0,
            ks.stride(1) if quantized else 0,
            block_tables.stride(0),
            out.stride(0),
            out.stride(1),
            GROUP=H // Hkv,
            HEAD_DIM=D,
            BLOCK_SIZE=BS,
            BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n,
            QUANTIZED=quantized,
            WINDOW=window or 0,
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )
    return out
