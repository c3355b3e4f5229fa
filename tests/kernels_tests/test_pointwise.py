"""Fused pointwise kernels (RMSNorm+residual, SiLU-and-mul, rotary) against torch."""

from __future__ import annotations

import pytest
import torch

from slotune.kernels import reference as ref
from slotune.kernels.activation import silu_and_mul
from slotune.kernels.rms_norm import rms_norm
from slotune.kernels.rotary import rotary
from tests.kernels_tests.device import DEV

# dtype -> (atol, rtol); no tl.dot here (so no TF32 dots on GPU): the same float32 bound on either device
TOL = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (3e-2, 2e-2)}


def _close(a, b, dtype):
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(a.float(), b.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("T", "D", "residual"), [(7, 576, False), (7, 576, True), (3, 100, True)])
def test_rms_norm(dtype, T, D, residual):
    torch.manual_seed(0)
    x, w = torch.randn(T, D, dtype=dtype), torch.randn(D, dtype=dtype)
    r = torch.randn(T, D, dtype=dtype) if residual else None
    y, res = rms_norm(x, w, 1e-5, r)
    ry, rres = ref.rms_norm(x, w, 1e-5, r)
    _close(y, ry, dtype)
    _close(res, rres, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("T", "I"), [(5, 1536), (2, 77)])
def test_silu_and_mul(dtype, T, I):  # noqa: E741
    x = torch.randn(T, 2 * I, dtype=dtype)
    _close(silu_and_mul(x, block=64), ref.silu_and_mul(x), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("T", "H", "D"), [(1, 12, 64), (9, 3, 64), (4, 5, 32)])
def test_rotary(T, H, D, dtype):
    from slotune.engine.layers.ops import rope_cos_sin

    table = rope_cos_sin(D, 256, 100000.0, torch.device(DEV))
    x = torch.randn(T, H, D, dtype=dtype)
    pos = torch.randint(0, 256, (T,))
    _close(rotary(x, table, pos), ref.rotary(x, table[pos]), dtype)
