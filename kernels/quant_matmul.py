"""Weight-only quantized matmul, dequantized in-kernel: y = x @ W^T.

Formats (produced by engine/quantize.py):
- int8: qweight [N, K] int8, scales [N] (per output channel): W = q * scale.
- int4: packed [N, K/2] uint8, low nibble = even k; scales, mins [N, K/group]: W = q * scale + min.
The kernel streams the compact weights (1 or 0.5 byte per element) and does the math in
float32 on tensor cores (bf16/fp16 operands), which is what makes decode faster: decode is
bound by weight bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True, slots=True)
class MatmulConfig:
    block_m: int = 16
    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3


def configs(m: int, n: int, k: int, group_size: int | None = None) -> list[MatmulConfig]:
    """Valid tiles for a shape: BLOCK_K divides the group (int4), tiles no larger than needed."""
    out = []
    for bm in (16, 32, 64, 128):
        if bm > max(16, triton.next_power_of_2(m)):
            continue
        for bn in (32, 64, 128, 256):
            for bk in (32, 64, 128, 256):
                if group_size and group_size % bk and bk % group_size:
                    continue
                if bk > max(32, triton.next_power_of_2(k)):
                    continue
                for w in (2, 4, 8):
                    for s in (2, 3, 4):
                        out.append(MatmulConfig(bm, bn, bk, w, s))
    return out


@triton.jit
def _quant_matmul_kernel(
    # pointers
    x_ptr, w_ptr, s_ptr, z_ptr, out_ptr,
    # sizes
    M, N, K,
    # strides
    stride_xm, stride_wn, stride_sn, stride_om,
    # meta
    INT4: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
        if INT4:
            rk2 = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            p = tl.load(w_ptr + rn[:, None] * stride_wn + rk2[None, :], mask=(rn[:, None] < N) & (rk2[None, :] < K // 2),
                        other=0)
            lo = (p & 0xF).to(tl.float32)
            hi = (p >> 4).to(tl.float32)
            q = tl.reshape(tl.join(lo, hi), (BLOCK_N, BLOCK_K))  # interleave: even k = low nibble
            g = rk // GROUP
            sm = (rn[:, None] < N) & (rk[None, :] < K)
            sc = tl.load(s_ptr + rn[:, None] * stride_sn + g[None, :], mask=sm, other=0.0).to(tl.float32)
            mn = tl.load(z_ptr + rn[:, None] * stride_sn + g[None, :], mask=sm, other=0.0).to(tl.float32)
            w = q * sc + mn
        else:
            w = tl.load(w_ptr + rn[:, None] * stride_wn + rk[None, :], mask=(rn[:, None] < N) & (rk[None, :] < K),
                        other=0).to(tl.float32)
        acc += tl.dot(x.to(tl.float32), tl.trans(w))
    if not INT4:
        acc *= tl.load(s_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def _launch(x, w, s, z, n, int4, group, cfg):
    cfg = cfg or MatmulConfig()
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M, K = x2.shape
    out = torch.empty(M, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(M, cfg.block_m), triton.cdiv(n, cfg.block_n))
    _quant_matmul_kernel[grid](
        x2, w, s, z, out, M, n, K, x2.stride(0), w.stride(0), s.stride(0), out.stride(0),
        INT4=int4, GROUP=group, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out.view(*x.shape[:-1], n)


def int8_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, config: MatmulConfig | None = None) -> torch.Tensor:
    """x: [..., K]; qweight: [N, K] int8; scales: [N] -> [..., N]."""
    assert qweight.dtype == torch.int8 and qweight.shape[1] == x.shape[-1] and scales.shape == (qweight.shape[0],)
    return _launch(x, qweight, scales, scales, qweight.shape[0], False, 1, config)


def int4_matmul(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group_size: int,
                config: MatmulConfig | None = None) -> torch.Tensor:
    """x: [..., K]; packed: [N, K/2] uint8; scales, mins: [N, K/group] -> [..., N]."""
    n, k = packed.shape[0], x.shape[-1]
    assert packed.dtype == torch.uint8 and packed.shape[1] * 2 == k, "packed must be [N, K/2] uint8"
    assert scales.shape == mins.shape == (n, k // group_size), "scales/mins must be [N, K/group]"
    cfg = config or MatmulConfig()
    assert cfg.block_k % 2 == 0
    return _launch(x, packed, scales, mins, n, True, group_size, cfg)
