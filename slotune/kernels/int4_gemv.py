"""int4 weight-only matmul for decode batches (a few rows of x): y = x @ W^T without tensor cores.

The int4 format is quant_matmul.py's: packed [N, K/2] uint8 (k = 2j in the low nibble of byte j,
2j+1 in the high one), scales and mins [N, K/group]. One program takes one row of x and BLOCK_N
output channels and streams BLOCK_K/2 bytes of each channel's codes per step, BLOCK_K spanning
several groups: the products are summed per group, then scaled,
    sum_k x_k (q_k s + m) = s * (x . q) + m * sum_k x_k,
so the loads are long and the per-group work is one multiply-add. At M = 1 the dot kernel pads x
to 16 rows and its K tile stays inside one group (32 bytes per channel per step).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from slotune.kernels.split_k import finish, split_k_output


@triton.jit
def _int4_gemv_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    z_ptr,
    out_ptr,
    N,
    K,
    k_per_split,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_om,
    stride_os,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    m = tl.program_id(0)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    pid_k = tl.program_id(2)
    n_mask = rn < N
    NG: tl.constexpr = BLOCK_K // GROUP
    HALF: tl.constexpr = GROUP // 2
    j = tl.arange(0, BLOCK_K // 2)
    gi = tl.arange(0, NG)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    for k0 in range(k_start, k_end, BLOCK_K):
        kk = k0 + 2 * j
        k_mask = kk < k_end
        xe = tl.load(x_ptr + m * stride_xm + kk, mask=k_mask, other=0.0).to(tl.float32)
        xo = tl.load(x_ptr + m * stride_xm + kk + 1, mask=k_mask, other=0.0).to(tl.float32)
        p = tl.load(w_ptr + rn[:, None] * stride_wn + (k0 // 2 + j)[None, :], mask=n_mask[:, None] & k_mask[None, :])
        prod = (p & 0xF).to(tl.float32) * xe[None, :] + (p >> 4).to(tl.float32) * xo[None, :]
        part = tl.sum(tl.reshape(prod, (BLOCK_N, NG, HALF)), axis=2)  # [BLOCK_N, NG]
        xs = tl.sum(tl.reshape(xe + xo, (NG, HALF)), axis=1)  # [NG]
        g = k0 // GROUP + gi
        g_mask = n_mask[:, None] & (g * GROUP < k_end)[None, :]
        sc = tl.load(s_ptr + rn[:, None] * stride_sn + g[None, :], mask=g_mask, other=0.0).to(tl.float32)
        mn = tl.load(z_ptr + rn[:, None] * stride_sn + g[None, :], mask=g_mask, other=0.0).to(tl.float32)
        acc += tl.sum(part * sc + xs[None, :] * mn, axis=1)
    tl.store(out_ptr + pid_k * stride_os + m * stride_om + rn, acc.to(out_ptr.dtype.element_ty), mask=n_mask)


def int4_gemv(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor,
    group_size: int,
    block_n: int = 8,
    block_k: int = 1024,
    split_k: int = 1,
    num_warps: int = 4,
) -> torch.Tensor:
    """x: [..., K]; packed: [N, K/2] uint8; scales, mins: [N, K/group] -> [..., N] in x's dtype.
    block_k: a multiple of the group (K tiles hold whole groups); split_k > 1 sums float32 partials.
    The defaults were the fastest at 4096x4096, M=1, on an H200 (bench/gpu)."""
    n, k = packed.shape[0], x.shape[-1]
    if block_k % group_size or k % group_size:
        raise ValueError(f"int4_gemv: block_k ({block_k}) and K ({k}) must be multiples of the group ({group_size})")
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    out, k_per_split, split_k = split_k_output(x, M, n, k, block_k, split_k)
    grid = (M, triton.cdiv(n, block_n), split_k)
    _int4_gemv_kernel[grid](
        x2,
        packed,
        scales,
        mins,
        out,
        n,
        k,
        k_per_split,
        x2.stride(0),
        packed.stride(0),
        scales.stride(0),
        out.stride(-2),
        out.stride(0) if split_k > 1 else 0,
        GROUP=group_size,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=num_warps,
    )
    return finish(out, x, n)
