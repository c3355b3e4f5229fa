"""SiLU(gate) * up on the fused gate|up projection output."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, n, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    g = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + n + cols, mask=mask, other=0.0).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """x: [T, 2I] -> [T, I]."""
    assert x.dim() == 2 and x.shape[1] % 2 == 0 and x.stride(-1) == 1
    T, n = x.shape[0], x.shape[1] // 2
    out = torch.empty(T, n, dtype=x.dtype, device=x.device)
    if T:
        _silu_and_mul_kernel[(T, triton.cdiv(n, block))](x, out, n, x.stride(0), out.stride(0), BLOCK=block)
    return out
