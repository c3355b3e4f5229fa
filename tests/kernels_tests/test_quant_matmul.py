"""Weight-only quantized matmul (int8, int4 group-wise, fp8) against the torch reference."""

from __future__ import annotations

import pytest
import torch

from slotune.kernels import reference as ref
from slotune.kernels.quant_matmul import MatmulConfig, configs, fp8_matmul, int4_matmul, int8_matmul
from tests.kernels_tests.device import GPU

# dtype -> (atol, rtol) relative to the output's largest magnitude: the kernel's dot is exact
# on the codes, so the error is float32 accumulation order, or one bf16 rounding of the output.
# TF32 dots on GPU: float32 x is rounded to 10 mantissa bits (the codes stay exact); emulating that
# (truncation) moves these tests' normalized outputs by up to 6.7e-4 (5 seeds), so 2e-3 there.
TOL = {torch.float32: (2e-3, 2e-3) if GPU else (1e-5, 1e-4), torch.bfloat16: (1e-2, 1e-2)}


def _unoffered(**tiles) -> MatmulConfig:
    """Tiles configs() never offers (an odd split count): the launcher's rounding of them."""
    return MatmulConfig.model_construct(**tiles)


def _close(out, expected, dtype):
    atol, rtol = TOL[dtype]
    scale = expected.float().abs().max().clamp_min(1.0)
    torch.testing.assert_close(out.float() / scale, expected.float() / scale, atol=atol, rtol=rtol)


@pytest.mark.parametrize(
    ("M", "N", "K", "cfg"),
    [
        (1, 96, 128, MatmulConfig(block_m=16, block_n=32, block_k=32)),
        (5, 67, 192, MatmulConfig(block_m=16, block_n=32, block_k=64, split_k=2)),
        (17, 130, 80, _unoffered(block_m=16, block_n=64, block_k=32, split_k=3)),  # K not a multiple of BLOCK_K
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_per_channel_matmul(M, N, K, cfg, dtype, fmt):
    torch.manual_seed(0)
    x = torch.randn(M, K, dtype=dtype)
    s = torch.rand(N) * 0.02
    if fmt == "int8":
        q = torch.randint(-127, 128, (N, K), dtype=torch.int8)
        out, expected = int8_matmul(x, q, s, cfg), ref.int8_matmul(x, q, s)
    else:
        q = (torch.randn(N, K) * 64).to(torch.float8_e4m3fn)
        out, expected = fp8_matmul(x, q, s, cfg), ref.fp8_matmul(x, q, s)
    assert out.dtype == dtype and out.shape == (M, N)
    _close(out, expected, dtype)


@pytest.mark.parametrize(
    ("M", "N", "K", "G", "cfg"),
    [
        (1, 96, 128, 32, MatmulConfig(block_m=16, block_n=32, block_k=32)),
        (3, 70, 192, 64, MatmulConfig(block_m=16, block_n=32, block_k=128)),  # BLOCK_K clamped to the group
        (2, 40, 512, 256, MatmulConfig(block_m=16, block_n=32, block_k=64, split_k=4)),
        (4, 33, 256, 128, _unoffered(block_m=16, block_n=32, block_k=64, split_k=3)),  # splits straddle groups
        (1, 20, 576, 64, MatmulConfig()),  # the gemv: K not a multiple of its K tile (512)
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernel", ["dot", "gemv"])
def test_int4_matmul(M, N, K, G, cfg, dtype, kernel):
    torch.manual_seed(0)
    x = torch.randn(M, K, dtype=dtype)
    packed = torch.randint(0, 256, (N, K // 2), dtype=torch.uint8)
    s, z = (torch.rand(N, K // G) * 0.1).to(dtype), (torch.randn(N, K // G) * 0.1).to(dtype)
    out = int4_matmul(x, packed, s, z, G, cfg, max_gemv_rows=M if kernel == "gemv" else 0)
    _close(out, ref.int4_matmul(x, packed, s, z, G), dtype)


def test_int4_gemv_splits_and_tiles():
    """The gemv's own tiles: split-K partials, several channels per program, a K tile of 4 groups."""
    from slotune.kernels.int4_gemv import int4_gemv

    torch.manual_seed(0)
    x = torch.randn(3, 1024, dtype=torch.bfloat16)
    packed = torch.randint(0, 256, (37, 512), dtype=torch.uint8)
    s, z = (torch.rand(37, 16) * 0.1).to(torch.bfloat16), (torch.randn(37, 16) * 0.1).to(torch.bfloat16)
    expected = ref.int4_matmul(x, packed, s, z, 64)
    for block_n, block_k, split_k in ((8, 256, 1), (16, 256, 2), (32, 512, 4)):
        _close(int4_gemv(x, packed, s, z, 64, block_n, block_k, split_k), expected, torch.bfloat16)
    with pytest.raises(ValueError, match="multiples of the group"):
        int4_gemv(x, packed, s, z, 64, block_k=96)


def test_leading_dims_and_bad_shapes():
    x = torch.randn(2, 3, 64)
    q = torch.randint(-127, 128, (16, 64), dtype=torch.int8)
    s = torch.rand(16)
    assert int8_matmul(x, q, s, MatmulConfig(block_m=16, block_n=32, block_k=32)).shape == (2, 3, 16)
    with pytest.raises(ValueError, match="int8_matmul"):
        int8_matmul(torch.randn(2, 63), q, s)
    with pytest.raises(ValueError, match="group_size"):
        int4_matmul(x, torch.zeros(16, 32, dtype=torch.uint8), s[:, None], s[:, None], 48)


def test_configs_respect_group_and_shape():
    cands = configs(1, 576, 576, group_size=64)
    assert cands and all(64 % c.block_k == 0 for c in cands)
    assert all(c.block_m == 16 for c in cands) and any(c.split_k > 1 for c in cands)
    assert MatmulConfig() in configs(16, 4096, 4096)
    assert all(c.split_k == 1 for c in configs(256, 4096, 4096))


def test_int4_kernel_reads_the_engine_format():
    """The engine's CUDA-layout Int4Linear and the kernel agree (layout built by hand, on_cpu=False on
    either device: the kernel reads only that layout)."""
    from slotune.engine.quantize import Int4Linear

    torch.manual_seed(0)
    w = torch.randn(64, 128)
    m = Int4Linear.__new__(Int4Linear)
    torch.nn.Module.__init__(m)
    g = 32
    wg = w.view(64, -1, g)
    lo, hi = wg.amin(-1, keepdim=True), wg.amax(-1, keepdim=True)
    sc = (hi - lo) / 15
    q = torch.round((wg - lo) / sc).clamp(0, 15).to(torch.uint8).view(64, 128)
    m.group_size, m.n, m.k, m.on_cpu, m.pad = g, 64, 128, False, 0
    m.register_buffer("packed", (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous())
    m.register_buffer("scales", sc.view(64, -1).contiguous())
    m.register_buffer("mins", lo.view(64, -1).contiguous())
    x = torch.randn(2, 128)
    with torch.device("cpu"):  # dequantize probes torch's CPU int4 pack first (kernels.cpu_decode.torch_int4_block)
        w_kernel = m.dequantize()
    # TF32 dots on GPU: x rounded to 10 mantissa bits moves x @ w.t() (|out| ~ 11) by up to 1.6e-2 (emulated)
    tol = 4e-2 if GPU else 1e-3
    torch.testing.assert_close(int4_matmul(x, m.packed, m.scales, m.mins, g), x @ w_kernel.t(), atol=tol, rtol=tol)
