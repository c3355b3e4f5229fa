"""Split-K bookkeeping shared by the weight-only matmul kernels (quant_matmul.py, int4_gemv.py): each
split covers whole K tiles and writes a float32 partial, summed afterwards (deterministic, no atomics)."""

from __future__ import annotations

import torch
import triton


def split_k_output(x: torch.Tensor, rows: int, n: int, k: int, block_k: int, split_k: int):
    """-> (out, k_per_split, splits): out is [rows, n] in x's dtype for one split, else [splits, rows, n]
    float32 partials for `finish`. A split count past the K tiles is reduced to one split per tile."""
    k_per_split = triton.cdiv(triton.cdiv(k, max(1, split_k)), block_k) * block_k
    splits = triton.cdiv(k, k_per_split)
    if splits == 1:
        return torch.empty(rows, n, dtype=x.dtype, device=x.device), k_per_split, splits
    return torch.empty(splits, rows, n, dtype=torch.float32, device=x.device), k_per_split, splits


def finish(out: torch.Tensor, x: torch.Tensor, n: int) -> torch.Tensor:
    """The kernel's output as [..., n] in x's dtype: partials summed when there are several."""
    if out.dim() == 3:
        out = out.sum(0).to(x.dtype)
    return out.view(*x.shape[:-1], n)
