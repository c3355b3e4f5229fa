"""Fused residual-add + RMSNorm: one read of x (and residual), two writes, float32 math."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    n_cols,
    eps,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x += tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
    x_in = x.to(res_out_ptr.dtype.element_ty)
    tl.store(res_out_ptr + row * stride_ro + cols, x_in, mask=mask)
    x = x_in.to(tl.float32)
    var = tl.sum(x * x, axis=0) / n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = x * tl.rsqrt(var + eps) * w
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [T, D]; weight: [D] -> (normed [T, D], x + residual [T, D])."""
    assert x.dim() == 2 and weight.shape == (x.shape[1],), f"bad shapes {tuple(x.shape)} / {tuple(weight.shape)}"
    assert x.stride(-1) == 1 and (residual is None or residual.shape == x.shape)
    out = torch.empty_like(x)
    res_out = torch.empty_like(x)
    T, D = x.shape
    if T:
        _rms_norm_kernel[(T,)](
            x,
            residual if residual is not None else x,
            weight,
            out,
            res_out,
            D,
            eps,
            x.stride(0),
            residual.stride(0) if residual is not None else 0,
            out.stride(0),
            res_out.stride(0),
            HAS_RESIDUAL=residual is not None,
            BLOCK=triton.next_power_of_2(D),
        )
    return out, res_out
