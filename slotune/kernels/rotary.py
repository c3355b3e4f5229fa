"""Rotate-half rotary embedding on [T, H, D] with a cos|sin table indexed by position."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotary_kernel(
    x_ptr,
    cs_ptr,
    pos_ptr,
    out_ptr,
    n_heads,
    stride_xt,
    stride_xh,
    stride_cs,
    stride_ot,
    stride_oh,
    HALF: tl.constexpr,
    HEADS_PAD: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.arange(0, HEADS_PAD)[:, None]
    d = tl.arange(0, HALF)[None, :]
    hm = h < n_heads
    p = tl.load(pos_ptr + t)
    cos = tl.load(cs_ptr + p * stride_cs + d)
    sin = tl.load(cs_ptr + p * stride_cs + HALF + d)
    base = x_ptr + t * stride_xt + h * stride_xh
    x1 = tl.load(base + d, mask=hm, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF + d, mask=hm, other=0.0).to(tl.float32)
    ob = out_ptr + t * stride_ot + h * stride_oh
    tl.store(ob + d, (x1 * cos - x2 * sin).to(out_ptr.dtype.element_ty), mask=hm)
    tl.store(ob + HALF + d, (x2 * cos + x1 * sin).to(out_ptr.dtype.element_ty), mask=hm)


def rotary(x: torch.Tensor, cos_sin_table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D] (last dim contiguous); cos_sin_table: [P, D] float32; positions: [T] -> [T, H, D]."""
    T, H, D = x.shape
    assert x.stride(-1) == 1 and cos_sin_table.shape[1] == D and D % 2 == 0 and (D // 2) & (D // 2 - 1) == 0
    out = torch.empty(T, H, D, dtype=x.dtype, device=x.device)
    if T:
        _rotary_kernel[(T,)](
            x,
            cos_sin_table,
            positions,
            out,
            H,
            x.stride(0),
            x.stride(1),
            cos_sin_table.stride(0),
            out.stride(0),
            out.stride(1),
            HALF=D // 2,
            HEADS_PAD=triton.next_power_of_2(H),
        )
    return out
