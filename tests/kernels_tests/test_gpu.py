"""Compiled kernels on a CUDA GPU against the torch references (bf16, the serving dtype).

Run on a GPU machine with the interpreter off:
    TRITON_INTERPRET=0 pytest -m gpu tests/kernels_tests/test_gpu.py
Skipped (never silently passed) without CUDA or under the interpreter.
"""

from __future__ import annotations

import os

import pytest
import torch

from slotune.kernels import reference as ref

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="needs compiled kernels: TRITON_INTERPRET=0"),
]
DEV = "cuda"


def _rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _cache(NB, BS, Hkv, D, kv):
    from slotune.kernels.kv_store import store_kv

    k = torch.randn(NB * BS, Hkv, D, device=DEV, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    dt = {"model": torch.bfloat16, "int8": torch.int8, "fp8": torch.float8_e4m3fn}[kv]
    kc = torch.empty(NB, BS, Hkv, D, device=DEV, dtype=dt)
    vc = torch.empty_like(kc)
    ks = vs = None
    if kv != "model":
        ks, vs = torch.empty(NB, BS, Hkv, device=DEV), torch.empty(NB, BS, Hkv, device=DEV)
    store_kv(k, v, kc, vc, torch.arange(NB * BS, device=DEV), ks, vs)
    return kc, vc, ks, vs


@pytest.mark.parametrize("kv", ["model", "int8", "fp8"])
@pytest.mark.parametrize(("H", "Hkv", "D"), [(9, 3, 64), (32, 8, 128)])
def test_decode_and_prefill_attention(kv, H, Hkv, D):
    from slotune.kernels.decode_attention import paged_decode_attention
    from slotune.kernels.prefill_attention import paged_prefill_attention

    torch.manual_seed(0)
    kc, vc, ks, vs = _cache(64, 16, Hkv, D, kv)
    bt = torch.randperm(64, device=DEV)[:48].view(3, 16).to(torch.int32)
    lens = [200, 1, 77]
    q = torch.randn(3, H, D, device=DEV, dtype=torch.bfloat16)
    ctx = torch.tensor(lens, dtype=torch.int32, device=DEV)
    out = paged_decode_attention(q, kc, vc, bt, ctx, D**-0.5, ks, vs)
    assert _rel(out, ref.paged_decode_attention(q, kc, vc, bt, ctx, D**-0.5, ks, vs)) < 1e-2
    qlens = [150, 1, 77]
    qp = torch.randn(sum(qlens), H, D, device=DEV, dtype=torch.bfloat16)
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32, device=DEV)  # noqa: E731
    out = paged_prefill_attention(qp, kc, vc, bt, i32([0, 150, 151]), i32(qlens), ctx, max(qlens), D**-0.5, ks, vs)
    assert _rel(out, ref.paged_prefill_attention(qp, kc, vc, bt, qlens, lens, D**-0.5, ks, vs)) < 1e-2


@pytest.mark.parametrize(("M", "N", "K"), [(1, 576, 576), (7, 1536, 576), (64, 4096, 1024)])
def test_quant_matmul(M, N, K):
    from slotune.kernels.quant_matmul import MatmulConfig, fp8_matmul, int4_matmul, int8_matmul

    torch.manual_seed(0)
    x = torch.randn(M, K, device=DEV, dtype=torch.bfloat16)
    q8 = torch.randint(-127, 128, (N, K), device=DEV, dtype=torch.int8)
    s = torch.rand(N, device=DEV) * 0.01
    qf = (torch.randn(N, K, device=DEV) * 64).to(torch.float8_e4m3fn)
    packed = torch.randint(0, 256, (N, K // 2), device=DEV, dtype=torch.uint8)
    s4 = torch.rand(N, K // 64, device=DEV, dtype=torch.bfloat16) * 0.01
    z4 = torch.randn(N, K // 64, device=DEV, dtype=torch.bfloat16) * 0.01
    for cfg in (
        MatmulConfig(),
        MatmulConfig(block_m=16, block_n=32, block_k=128, num_warps=4, num_stages=3, split_k=4),
    ):
        assert _rel(int8_matmul(x, q8, s, cfg), ref.int8_matmul(x, q8, s)) < 1e-2
        assert _rel(fp8_matmul(x, qf, s, cfg), ref.fp8_matmul(x, qf, s)) < 1e-2
        assert _rel(int4_matmul(x, packed, s4, z4, 64, cfg), ref.int4_matmul(x, packed, s4, z4, 64)) < 1e-2


def test_pointwise_and_fp8_store():
    from slotune.engine.layers.ops import rope_cos_sin
    from slotune.kernels.activation import silu_and_mul
    from slotune.kernels.rms_norm import rms_norm
    from slotune.kernels.rotary import rotary

    x, r = (
        torch.randn(33, 576, device=DEV, dtype=torch.bfloat16),
        torch.randn(33, 576, device=DEV, dtype=torch.bfloat16),
    )
    w = torch.randn(576, device=DEV, dtype=torch.bfloat16)
    assert _rel(rms_norm(x, w, 1e-5, r)[0], ref.rms_norm(x, w, 1e-5, r)[0]) < 1e-2
    g = torch.randn(33, 3072, device=DEV, dtype=torch.bfloat16)
    assert _rel(silu_and_mul(g), ref.silu_and_mul(g)) < 1e-2
    table = rope_cos_sin(64, 512, 1e5, torch.device(DEV))
    qk = torch.randn(33, 12, 64, device=DEV, dtype=torch.bfloat16)
    pos = torch.randint(0, 512, (33,), device=DEV)
    assert _rel(rotary(qk, table, pos), ref.rotary(qk, table[pos])) < 1e-2
    kc, vc, ks, vs = _cache(4, 16, 3, 64, "fp8")  # kernel store ...
    k = torch.randn(64, 3, 64, device=DEV, dtype=torch.bfloat16)
    rc, rv = torch.empty_like(kc), torch.empty_like(vc)
    rks, rvs = torch.empty_like(ks), torch.empty_like(vs)
    from slotune.kernels.kv_store import store_kv

    store_kv(k, k, kc, vc, torch.arange(64, device=DEV), ks, vs)
    ref.store_kv(k, k, rc, rv, torch.arange(64, device=DEV), rks, rvs)  # ... vs torch's conversion
    assert _rel(kc.float() * ks[..., None], rc.float() * rks[..., None]) < 1e-2
