"""KV-cache quantization math in plain torch: per-(token, head) symmetric int8 / fp8-e4m3.

The one definition of the format: the torch attention backend stores with it, the Triton KV
store kernel (kv_store.py) computes the same thing in-register, and the reference checks both.
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn
INT8_MAX = 127.0
QMAX = {"int8": INT8_MAX, "fp8": FP8_MAX}


def quantize_kv(x: torch.Tensor, kv_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-(token, head) symmetric quantization. x: [T, H, D] -> (q [T, H, D], scale [T, H] float32)."""
    amax = x.abs().amax(dim=-1).float().clamp_min(1e-8)
    if kv_dtype == "int8":
        scale = amax / INT8_MAX
        q = torch.round(x.float() / scale[..., None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    else:
        scale = amax / FP8_MAX
        q = (x.float() / scale[..., None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale
