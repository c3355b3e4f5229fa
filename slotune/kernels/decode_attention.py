"""Paged decode attention (flash-decoding): one query token per sequence over its block table.

Grid: (sequence, kv head, split). Each program handles all query heads of one KV head
(GQA: the group shares every K/V load), walks its slice of the context in BLOCK_N tiles
with an online softmax, and writes a partial (max, sum, acc). A second kernel reduces the
splits. Quantized caches (int8 / fp8-e4m3) are dequantized in-register with their per
(token, head) scales. With a sliding window (WINDOW > 0) a sequence's keys are its last WINDOW
ones, [ctx - WINDOW, ctx), and the splits divide that span.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from slotune.kernels.tiles import (
    DECODE_BLOCK_N,
    DECODE_NUM_SPLITS,
    DECODE_NUM_STAGES,
    DECODE_NUM_WARPS,
    DecodeAttentionConfig,
)


def configs(max_context: int, num_seqs: int) -> list[DecodeAttentionConfig]:
    """Valid candidates for a shape: tiles no larger than the context, splits only if they have work."""
    out = []
    for bn in DECODE_BLOCK_N:
        if bn > max(16, triton.next_power_of_2(max_context)):
            continue
        for splits in DECODE_NUM_SPLITS:
            if splits > 1 and max_context < splits * bn:
                continue
            for warps in DECODE_NUM_WARPS:
                for stages in DECODE_NUM_STAGES:
                    out.append(DecodeAttentionConfig(block_n=bn, num_splits=splits, num_warps=warps, num_stages=stages))
    return out


@triton.jit
def _decode_attention_kernel(
    # pointers
    q_ptr,
    k_ptr,
    v_ptr,
    ks_ptr,
    vs_ptr,
    bt_ptr,
    ctx_ptr,
    mid_o_ptr,
    mid_lse_ptr,
    # sizes
    sm_scale,
    max_blocks,
    chunk,
    # strides
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_sb,
    stride_st,
    stride_btb,
    stride_ob,
    stride_oh,
    stride_os,
    stride_lb,
    stride_lh,
    # meta
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    QUANTIZED: tl.constexpr,
    WINDOW: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(ctx_ptr + b)
    first = 0  # oldest key the query (at position ctx - 1) attends
    if WINDOW > 0:
        first = tl.maximum(ctx - WINDOW, 0)
    start = first + split * chunk
    end = tl.minimum(start + chunk, ctx)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM)
    g_mask = g < GROUP
    heads = kvh * GROUP + g
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=g_mask[:, None], other=0.0)
    q = q.to(tl.float32) * sm_scale

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs = n0 + tl.arange(0, BLOCK_N)
        valid = offs < end
        blk = tl.load(bt_ptr + b * stride_btb + offs // BLOCK_SIZE, mask=valid, other=0)
        tok = offs % BLOCK_SIZE
        kv_off = blk[:, None] * stride_kb + tok[:, None] * stride_kt + kvh * stride_kh + d[None, :]
        k = tl.load(k_ptr + kv_off, mask=valid[:, None], other=0.0).to(tl.float32)
        v = tl.load(v_ptr + kv_off, mask=valid[:, None], other=0.0).to(tl.float32)
        if QUANTIZED:
            s_off = blk * stride_sb + tok * stride_st + kvh
            k = k * tl.load(ks_ptr + s_off, mask=valid, other=0.0)[:, None]
            v = v * tl.load(vs_ptr + s_off, mask=valid, other=0.0)[:, None]
        if GROUP_PAD >= 16:
            s = tl.dot(q, tl.trans(k))
        else:  # tiny GQA groups: tensor cores need >= 16 rows, a broadcast-reduce is cheaper
            s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if GROUP_PAD >= 16:
            pv = tl.dot(p, v)
        else:
            pv = tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    out = acc / tl.maximum(l_i, 1e-30)[:, None]
    lse = m_i + tl.log(tl.maximum(l_i, 1e-30))
    lse = tl.where(l_i > 0, lse, float("-inf"))
    tl.store(
        mid_o_ptr + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + d[None, :],
        out,
        mask=g_mask[:, None],
    )
    tl.store(mid_lse_ptr + b * stride_lb + heads * stride_lh + split, lse, mask=g_mask)


@triton.jit
def _reduce_splits_kernel(
    mid_o_ptr,
    mid_lse_ptr,
    out_ptr,
    stride_ob,
    stride_oh,
    stride_os,
    stride_lb,
    stride_lh,
    stride_outb,
    stride_outh,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, HEAD_DIM)
    sm = s < NUM_SPLITS
    lse = tl.load(mid_lse_ptr + b * stride_lb + h * stride_lh + s, mask=sm, other=float("-inf"))
    m = tl.max(lse, axis=0)
    w = tl.where(sm, tl.exp(lse - m), 0.0)
    o = tl.load(
        mid_o_ptr + b * stride_ob + h * stride_oh + s[:, None] * stride_os + d[None, :], mask=sm[:, None], other=0.0
    )
    res = tl.sum(o * w[:, None], axis=0) / tl.sum(w, axis=0)
    tl.store(out_ptr + b * stride_outb + h * stride_outh + d, res.to(out_ptr.dtype.element_ty))


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    config: DecodeAttentionConfig | None = None,
    max_context: int | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """q: [B, H, D]; k/v_cache: [NB, BS, Hkv, D]; block_tables: [B, MB] int32; context_lens: [B] int32 -> [B, H, D].

    window: attend only the last `window` keys of each sequence (sliding window); None = all."""
    cfg = config or DecodeAttentionConfig()
    B, H, D = q.shape
    NB, BS, Hkv, D2 = k_cache.shape
    assert D == D2 and H % Hkv == 0 and v_cache.shape == k_cache.shape, "shape mismatch"
    assert D & (D - 1) == 0, "head_dim must be a power of two"
    assert k_cache.stride(-1) == 1 and q.stride(-1) == 1
    quantized = k_scale is not None
    group = H // Hkv
    assert window is None or window > 0, f"window {window}"
    if max_context is None:
        max_context = block_tables.shape[1] * BS  # no host sync: an upper bound
    span = max_context if window is None else min(max_context, window)  # keys one query attends, at most
    splits = max(1, min(cfg.num_splits, triton.cdiv(span, cfg.block_n)))
    chunk = triton.cdiv(triton.cdiv(span, splits), cfg.block_n) * cfg.block_n
    mid_o = torch.empty(B, H, splits, D, dtype=torch.float32, device=q.device)
    mid_lse = torch.empty(B, H, splits, dtype=torch.float32, device=q.device)
    ks = k_scale if quantized else q  # dummy pointer when unquantized
    vs = v_scale if quantized else q
    _decode_attention_kernel[(B, Hkv, splits)](
        q,
        k_cache,
        v_cache,
        ks,
        vs,
        block_tables,
        context_lens,
        mid_o,
        mid_lse,
        scale,
        block_tables.shape[1],
        chunk,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        ks.stride(0) if quantized else 0,
        ks.stride(1) if quantized else 0,
        block_tables.stride(0),
        mid_o.stride(0),
        mid_o.stride(1),
        mid_o.stride(2),
        mid_lse.stride(0),
        mid_lse.stride(1),
        GROUP=group,
        GROUP_PAD=max(triton.next_power_of_2(group), 1),
        HEAD_DIM=D,
        BLOCK_SIZE=BS,
        BLOCK_N=cfg.block_n,
        QUANTIZED=quantized,
        WINDOW=window or 0,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    out = torch.empty(B, H, D, dtype=q.dtype, device=q.device)
    _reduce_splits_kernel[(B, H)](
        mid_o,
        mid_lse,
        out,
        mid_o.stride(0),
        mid_o.stride(1),
        mid_o.stride(2),
        mid_lse.stride(0),
        mid_lse.stride(1),
        out.stride(0),
        out.stride(1),
        NUM_SPLITS=splits,
        SPLITS_PAD=triton.next_power_of_2(splits),
        HEAD_DIM=D,
        num_warps=1,
    )
    return out
