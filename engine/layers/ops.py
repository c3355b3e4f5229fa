"""Pointwise model ops in plain torch (the CPU path; Triton versions live in kernels/)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (normed, new_residual); new_residual = x + residual (or x) in input dtype."""
    if residual is not None:
        x = x + residual
    # One fused op for every dtype: for bf16/fp16 it accumulates and applies the weight in
    # float32 and rounds once (checked against an all-float32 reference: exact), one rounding
    # fewer than normalising, rounding, then multiplying by the weight.
    return F.rms_norm(x, weight.shape, weight, eps), x


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    # x: [T, 2*I] (gate | up) -> [T, I]
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def rope_cos_sin(head_dim: int, max_positions: int, theta: float, device: torch.device) -> torch.Tensor:
    """[max_positions, head_dim] table: cos in the first half, sin in the second."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim))
    t = torch.arange(max_positions, dtype=torch.float64, device=device)
    freqs = torch.outer(t, inv)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).float()


def apply_rotary(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """HF rotate-half rotary. x: [T, H, D]; cos_sin: [T, D] (already indexed by position)."""
    half = x.shape[-1] // 2
    cos, sin = cos_sin[:, None, :half], cos_sin[:, None, half:]
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
