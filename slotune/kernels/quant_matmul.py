"""Weight-only quantized matmul, dequantized in-kernel: y = x @ W^T.

Weight formats (produced by slotune/engine/quantize.py; N = out features, K = in features):
- int8: qweight [N, K] int8, scales [N] (per output channel, any float dtype): W = q * scale.
- int4: packed [N, K/2] uint8, byte j of row n holds k = 2j in its low nibble and k = 2j+1 in
  its high nibble; scales, mins [N, K/group] (group in 32..256 along K, any float dtype);
  codes q in 0..15, asymmetric: W[n, k] = q * scales[n, k // group] + mins[n, k // group].
  K must be a multiple of the group (slotune/engine/quantize.py zero-pads K).
- fp8: qweight [N, K] torch.float8_e4m3fn, scales [N] float: W = q * scale (weight-only,
  activations stay in model dtype; the W8A8 path is torch._scaled_mm in slotune/engine/quantize.py).

Decode is bound by weight bytes, so the kernel streams the compact codes and converts them
to the activation dtype in registers (int8, int4 and e4m3 codes are exact in bf16), then runs
tensor-core dots with float32 accumulation. Scales are applied after the dot, once per tile:
per channel at the end (int8/fp8), per (channel, group) per K tile for int4, where BLOCK_K
divides the group so a tile never straddles two groups:
    sum_k x_k (q_k s + m) = s * (x . q) + m * sum_k x_k.
Nibbles are not interleaved back into k order: the even and odd columns of x are loaded
separately and dotted with the low and high nibbles.

Split-K (SPLIT_K > 1) gives skinny decode shapes (few N tiles) enough programs: each split
writes a float32 partial, summed afterwards (deterministic, no atomics).

int4 with at most GEMV_MAX_ROWS rows of x runs slotune/kernels/int4_gemv.py instead (no tensor cores, K
tiles of whole groups): on an H200 at 4096x4096 it took 14 us at M=1 and 33 us at M=4, where this
kernel's best tile took 34 us and 94 us and bf16 F.linear 19 us (bench/gpu, H200 results).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from slotune.kernels.int4_gemv import int4_gemv
from slotune.kernels.split_k import finish, split_k_output
from slotune.kernels.tiles import (
    MATMUL_BLOCK_K,
    MATMUL_BLOCK_M,
    MATMUL_BLOCK_N,
    MATMUL_NUM_STAGES,
    MATMUL_NUM_WARPS,
    MATMUL_SPLIT_K,
    MatmulConfig,
)

INT8, INT4, FP8 = 0, 1, 2
GEMV_MAX_ROWS = 4  # int4 rows of x up to which int4_gemv runs


def configs(m: int, n: int, k: int, group_size: int | None = None) -> list[MatmulConfig]:
    """Valid tiles for a shape: BLOCK_K divides the int4 group, tiles no larger than needed,
    split-K only where each split still gets at least one full K tile."""
    out = []
    for bm in MATMUL_BLOCK_M:
        if bm > max(16, triton.next_power_of_2(m)):
            continue
        for bn in MATMUL_BLOCK_N:
            if bn > max(32, triton.next_power_of_2(n)):
                continue
            for bk in MATMUL_BLOCK_K:
                if (group_size and group_size % bk) or bk > max(32, triton.next_power_of_2(k)):
                    continue
                for sk in MATMUL_SPLIT_K:
                    if sk > 1 and (m > 64 or k < sk * bk):
                        continue
                    for w in MATMUL_NUM_WARPS:
                        for s in MATMUL_NUM_STAGES:
                            out.append(
                                MatmulConfig(block_m=bm, block_n=bn, block_k=bk, num_warps=w, num_stages=s, split_k=sk)
                            )
    return out


@triton.jit
def _quant_matmul_kernel(
    # pointers
    x_ptr,
    w_ptr,
    s_ptr,
    z_ptr,
    out_ptr,
    # sizes
    M,
    N,
    K,
    k_per_split,
    # strides
    stride_xm,
    stride_wn,
    stride_sn,
    stride_om,
    stride_os,
    # meta
    FORMAT: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = rm < M
    n_mask = rn < N
    cdt = x_ptr.dtype.element_ty  # dot operands in the activation dtype
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        if FORMAT == 1:  # int4: even/odd columns of x against low/high nibbles
            j = tl.arange(0, BLOCK_K // 2)
            kk = k0 + 2 * j
            k_mask = kk < k_end
            x_even = tl.load(
                x_ptr + rm[:, None] * stride_xm + kk[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0
            )
            x_odd = tl.load(
                x_ptr + rm[:, None] * stride_xm + kk[None, :] + 1, mask=m_mask[:, None] & k_mask[None, :], other=0.0
            )
            p = tl.load(
                w_ptr + rn[:, None] * stride_wn + (k0 // 2 + j)[None, :],
                mask=n_mask[:, None] & k_mask[None, :],
                other=0,
            )
            lo = (p & 0xF).to(cdt)
            hi = (p >> 4).to(cdt)
            part = tl.dot(x_even, tl.trans(lo)) + tl.dot(x_odd, tl.trans(hi))  # [BLOCK_M, BLOCK_N]
            g = k0 // GROUP
            sc = tl.load(s_ptr + rn * stride_sn + g, mask=n_mask, other=0.0).to(tl.float32)
            mn = tl.load(z_ptr + rn * stride_sn + g, mask=n_mask, other=0.0).to(tl.float32)
            x_sum = tl.sum(x_even.to(tl.float32), axis=1) + tl.sum(x_odd.to(tl.float32), axis=1)
            acc += part * sc[None, :] + x_sum[:, None] * mn[None, :]
        else:  # int8 / fp8 codes, per-channel scale applied at the end
            rk = k0 + tl.arange(0, BLOCK_K)
            k_mask = rk < k_end
            x = tl.load(
                x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0
            )
            w = tl.load(
                w_ptr + rn[:, None] * stride_wn + rk[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0
            )
            acc += tl.dot(x, tl.trans(w.to(cdt)))
    if FORMAT != 1:
        acc *= tl.load(s_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(
        out_ptr + pid_k * stride_os + rm[:, None] * stride_om + rn[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=m_mask[:, None] & n_mask[None, :],
    )


def _launch(
    x: torch.Tensor,
    w: torch.Tensor,
    s: torch.Tensor,
    z: torch.Tensor,
    n: int,
    fmt: int,
    group: int,
    cfg: MatmulConfig | None,
) -> torch.Tensor:
    cfg = cfg or MatmulConfig()
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M, K = x2.shape
    block_k = min(cfg.block_k, group) if fmt == INT4 else cfg.block_k  # a K tile stays inside one group
    out, k_per_split, split_k = split_k_output(x, M, n, K, block_k, cfg.split_k)
    grid = (triton.cdiv(M, cfg.block_m), triton.cdiv(n, cfg.block_n), split_k)
    _quant_matmul_kernel[grid](
        x2,
        w,
        s,
        z,
        out,
        M,
        n,
        K,
        k_per_split,
        x2.stride(0),
        w.stride(0),
        s.stride(0),
        out.stride(-2),
        out.stride(0) if split_k > 1 else 0,
        FORMAT=fmt,
        GROUP=group,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=block_k,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return finish(out, x, n)


def int8_matmul(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, config: MatmulConfig | None = None
) -> torch.Tensor:
    """x: [..., K]; qweight: [N, K] int8; scales: [N] -> [..., N] in x's dtype."""
    return _per_channel("int8_matmul", torch.int8, INT8, x, qweight, scales, config)


def fp8_matmul(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, config: MatmulConfig | None = None
) -> torch.Tensor:
    """Weight-only fp8: x: [..., K]; qweight: [N, K] float8_e4m3fn; scales: [N] -> [..., N] in x's dtype."""
    return _per_channel("fp8_matmul", torch.float8_e4m3fn, FP8, x, qweight, scales, config)


def _per_channel(
    name: str,
    dtype: torch.dtype,
    fmt: int,
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    config: MatmulConfig | None,
) -> torch.Tensor:
    """The per-output-channel formats (int8, fp8): check shapes, then launch."""
    if qweight.dtype != dtype or qweight.shape[1] != x.shape[-1] or scales.shape != (qweight.shape[0],):
        raise ValueError(
            f"{name}: want qweight [N, {x.shape[-1]}] {str(dtype).removeprefix('torch.')} and scales [N], "
            f"got {tuple(qweight.shape)} {qweight.dtype} and {tuple(scales.shape)}"
        )
    assert qweight.stride(-1) == 1
    return _launch(x, qweight, scales, scales, qweight.shape[0], fmt, 1, config)


def int4_matmul(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor,
    group_size: int,
    config: MatmulConfig | None = None,
    max_gemv_rows: int = GEMV_MAX_ROWS,
) -> torch.Tensor:
    """x: [..., K]; packed: [N, K/2] uint8; scales, mins: [N, K/group] -> [..., N] in x's dtype.
    Up to max_gemv_rows rows: int4_gemv (its own tiles); more: the dot kernel with `config`."""
    n, k = packed.shape[0], x.shape[-1]
    if packed.dtype != torch.uint8 or packed.shape[1] * 2 != k:
        raise ValueError(f"int4_matmul: packed must be [N, {k // 2}] uint8, got {tuple(packed.shape)} {packed.dtype}")
    if group_size < 32 or group_size & (group_size - 1) or k % group_size:
        raise ValueError(f"int4_matmul: group_size must be a power of two >= 32 dividing K={k}, got {group_size}")
    if scales.shape != (n, k // group_size) or mins.shape != scales.shape or scales.stride() != mins.stride():
        raise ValueError(
            f"int4_matmul: scales and mins must be [N, K/group] = {(n, k // group_size)}, got "
            f"{tuple(scales.shape)} and {tuple(mins.shape)}"
        )
    assert packed.stride(-1) == 1 and scales.stride(-1) == 1
    if x.numel() // k <= max_gemv_rows:
        return int4_gemv(x, packed, scales, mins, group_size, block_k=1024 if k >= 1024 else 512 if k >= 512 else 256)
    return _launch(x, packed, scales, mins, n, INT4, group_size, config)
