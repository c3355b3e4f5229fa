"""Pointwise model ops in plain torch (the CPU path; Triton versions live in slotune/kernels/)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from slotune.engine.checkpoint import ROPE_TYPES


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
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


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    # x: [T, 2*I] (gate | up) -> [T, I]; GeGLU with tanh-approximate GELU (Gemma)
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def rope_frequencies(head_dim: int, theta: float, scaling: dict | None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [head_dim / 2] float64, factor applied to cos and sin), as transformers'
    rope init functions compute them (modeling_rope_utils.py); `freq_factors` is llama.cpp's
    per-dimension divisor tensor (GGUF `rope_freqs.weight`, Llama 3's scaling baked in)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    kind = (scaling or {}).get("rope_type")
    if kind is None:
        return inv, 1.0
    if kind == "dynamic":  # dynamic NTK is plain RoPE up to the original context; the runner stops max_model_len there
        return inv, 1.0
    if kind == "linear":
        return inv / scaling["factor"], 1.0
    if kind == "longrope":  # within the original context (the runner stops max_model_len there): short factors
        factor, old = scaling["factor"], scaling["original_max_position_embeddings"]
        attn = scaling.get("attention_factor")
        if attn is None:
            attn = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old))
        return inv / torch.tensor(scaling["short_factor"], dtype=torch.float64), float(attn)
    if kind == "freq_factors":
        return inv / torch.tensor(scaling["factors"], dtype=torch.float64), 1.0
    if kind == "llama3":
        factor, lo, hi = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old / hi) & (wavelen <= old / lo)
        return torch.where(medium, smoothed, scaled), 1.0
    if kind == "yarn":
        factor, old = scaling["factor"], scaling["original_max_position_embeddings"]
        mscale = lambda s, m=1.0: 1.0 if s <= 1 else 0.1 * m * math.log(s) + 1.0  # noqa: E731
        attn = scaling.get("attention_factor")
        if attn is None:
            m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
            attn = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
        fast, slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1
        dim_of = lambda rot: head_dim * math.log(old / (rot * 2 * math.pi)) / (2 * math.log(theta))  # noqa: E731
        low, high = dim_of(fast), dim_of(slow)
        if scaling.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, head_dim - 1)
        ramp = (torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low if high != low else 0.001)
        extrapolate = (1 - ramp.clamp(0, 1)).double()
        return inv / factor * (1 - extrapolate) + inv * extrapolate, float(attn)
    raise ValueError(f"rope_scaling type '{kind}' is not implemented (supported: default, {', '.join(ROPE_TYPES)})")


def rope_cos_sin(
    head_dim: int, max_positions: int, theta: float, device: torch.device, scaling: dict | None = None
) -> torch.Tensor:
    """[max_positions, head_dim] table: cos in the first half, sin in the second."""
    inv, attention_factor = rope_frequencies(head_dim, theta, scaling)
    t = torch.arange(max_positions, dtype=torch.float64)
    freqs = torch.outer(t, inv)
    return (torch.cat([freqs.cos(), freqs.sin()], dim=-1) * attention_factor).float().to(device)


def apply_rotary(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """HF rotate-half rotary. x: [T, H, D]; cos_sin: [T, D] (already indexed by position)."""
    half = x.shape[-1] // 2
    cos, sin = cos_sin[:, None, :half], cos_sin[:, None, half:]
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class TorchOps:
    """The pointwise ops a model runs (the Triton backend's `TritonOps` has the same calls)."""

    rms_norm = staticmethod(rms_norm)
    silu_and_mul = staticmethod(silu_and_mul)
    gelu_tanh_and_mul = staticmethod(gelu_tanh_and_mul)
    rotary = staticmethod(apply_rotary)
