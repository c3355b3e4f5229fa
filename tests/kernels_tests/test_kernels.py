"""Every kernel against its torch reference, under TRITON_INTERPRET=1 on CPU (odd shapes)."""

from __future__ import annotations

import pytest
import torch

from slotune.kernels import reference as ref
from slotune.kernels.activation import silu_and_mul
from slotune.kernels.decode_attention import DecodeAttentionConfig, configs, paged_decode_attention
from slotune.kernels.kv_store import store_kv
from slotune.kernels.quant_matmul import MatmulConfig, int4_matmul, int8_matmul
from slotune.kernels.rms_norm import rms_norm
from slotune.kernels.rotary import rotary

TOL = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (3e-2, 2e-2)}


def _close(a, b, dtype):
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(a.float(), b.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize(("H", "Hkv", "lens", "cfg"), [
    (9, 3, [1, 37, 80], DecodeAttentionConfig(16, 1)),
    (9, 3, [5, 64, 33], DecodeAttentionConfig(32, 3)),
    (4, 4, [17], DecodeAttentionConfig(16, 2)),
    (32, 2, [20, 3], DecodeAttentionConfig(16, 1)),  # group of 16: tensor-core path
])
@pytest.mark.parametrize("kv", ["model", "int8", "fp8"])
def test_paged_decode_attention(H, Hkv, lens, cfg, kv):
    torch.manual_seed(0)
    D, BS, NB = 64, 16, 24
    q = torch.randn(len(lens), H, D)
    k, v = torch.randn(NB * BS, Hkv, D), torch.randn(NB * BS, Hkv, D)
    kc, vc = torch.zeros(NB, BS, Hkv, D), torch.zeros(NB, BS, Hkv, D)
    ks = vs = None
    if kv != "model":
        dt = torch.int8 if kv == "int8" else torch.float8_e4m3fn
        kc, vc = torch.zeros(NB, BS, Hkv, D, dtype=dt), torch.zeros(NB, BS, Hkv, D, dtype=dt)
        ks, vs = torch.zeros(NB, BS, Hkv), torch.zeros(NB, BS, Hkv)
    ref.store_kv(k, v, kc, vc, torch.arange(NB * BS), ks, vs)
    bt = torch.randperm(NB, dtype=torch.int32)[: len(lens) * 6].view(len(lens), 6)
    ctx = torch.tensor(lens, dtype=torch.int32)
    out = paged_decode_attention(q, kc, vc, bt, ctx, D ** -0.5, ks, vs, config=cfg)
    torch.testing.assert_close(out, ref.paged_decode_attention(q, kc, vc, bt, ctx, D ** -0.5, ks, vs), atol=1e-4, rtol=1e-4)


def test_decode_attention_configs_are_valid_for_shape():
    cands = configs(max_context=100, num_seqs=4)
    assert DecodeAttentionConfig() in cands
    assert all(c.num_splits * c.block_n <= 128 or c.num_splits == 1 for c in cands)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm(dtype, residual):
    torch.manual_seed(0)
    x, w = torch.randn(7, 576, dtype=dtype), torch.randn(576, dtype=dtype)
    r = torch.randn(7, 576, dtype=dtype) if residual else None
    y, res = rms_norm(x, w, 1e-5, r)
    ry, rres = ref.rms_norm(x, w, 1e-5, r)
    _close(y, ry, dtype)
    _close(res, rres, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul(dtype):
    x = torch.randn(5, 2 * 1536, dtype=dtype)
    _close(silu_and_mul(x), ref.silu_and_mul(x), dtype)


@pytest.mark.parametrize(("T", "H"), [(1, 12), (9, 3)])
def test_rotary(T, H):
    from slotune.engine.layers.ops import rope_cos_sin

    table = rope_cos_sin(64, 256, 100000.0, torch.device("cpu"))
    x = torch.randn(T, H, 64)
    pos = torch.randint(0, 256, (T,))
    _close(rotary(x, table, pos), ref.rotary(x, table[pos]), torch.float32)


@pytest.mark.parametrize("kind", ["model", "int8", pytest.param("fp8", marks=pytest.mark.xfail(
    reason="Triton's CPU interpreter converts float32->fp8e4m3 off by up to a binade (e.g. -96 -> -64); "
           "the conversion is checked on the GPU by bench/gpu/run_all.py", strict=False))])
def test_kv_store_with_skipped_slots(kind):
    torch.manual_seed(0)
    NB, BS, H, D = 6, 8, 3, 64
    dt = {"model": torch.float32, "int8": torch.int8, "fp8": torch.float8_e4m3fn}[kind]
    caches = [torch.zeros(NB, BS, H, D, dtype=dt) for _ in range(4)]
    scales = [torch.zeros(NB, BS, H) for _ in range(4)] if kind != "model" else [None] * 4
    k, v = torch.randn(5, H, D), torch.randn(5, H, D)
    slots = torch.tensor([3, -1, 17, 40, 0])
    store_kv(k, v, caches[0], caches[1], slots, scales[0], scales[1])
    ref.store_kv(k, v, caches[2], caches[3], slots, scales[2], scales[3])
    for a, b in ((caches[0], caches[2]), (caches[1], caches[3])):
        diff = (a.float() - b.float()).abs()
        if kind == "fp8":  # one e4m3 step (3 mantissa bits): rounding mode may differ from torch's
            assert (diff <= b.float().abs() / 8 + 2**-6).all()  # + one subnormal step
        else:
            assert diff.max() <= (1.0 if kind == "int8" else 0.0)
    if kind != "model":
        torch.testing.assert_close(scales[0], scales[2])


@pytest.mark.parametrize(("M", "N", "K"), [(1, 96, 128), (5, 67, 192), (17, 130, 64)])
def test_int8_matmul(M, N, K):
    torch.manual_seed(0)
    x = torch.randn(M, K)
    q = torch.randint(-127, 128, (N, K), dtype=torch.int8)
    s = torch.rand(N) * 0.02
    out = int8_matmul(x, q, s, MatmulConfig(16, 32, 32))
    torch.testing.assert_close(out, ref.int8_matmul(x, q, s), atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize(("M", "N", "K", "G"), [(1, 96, 128, 32), (3, 70, 192, 64)])
def test_int4_matmul(M, N, K, G):
    torch.manual_seed(0)
    x = torch.randn(M, K)
    packed = torch.randint(0, 256, (N, K // 2), dtype=torch.uint8)
    s, z = torch.rand(N, K // G) * 0.1, torch.randn(N, K // G) * 0.1
    out = int4_matmul(x, packed, s, z, G, MatmulConfig(16, 32, 32))
    torch.testing.assert_close(out, ref.int4_matmul(x, packed, s, z, G), atol=1e-3, rtol=1e-3)


def test_int4_kernel_reads_the_engine_format():
    """The engine's CUDA-layout Int4Linear and the kernel agree (layout built on CPU by hand)."""
    from slotune.engine.quantize import Int4Linear

    w = torch.randn(64, 128)
    m = Int4Linear.__new__(Int4Linear)
    torch.nn.Module.__init__(m)
    g = 32
    wg = w.view(64, -1, g)
    lo, hi = wg.amin(-1, keepdim=True), wg.amax(-1, keepdim=True)
    sc = (hi - lo) / 15
    q = torch.round((wg - lo) / sc).clamp(0, 15).to(torch.uint8).view(64, 128)
    m.group_size, m.n, m.k, m.on_cpu = g, 64, 128, False
    m.register_buffer("packed", (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous())
    m.register_buffer("scales", sc.view(64, -1).contiguous())
    m.register_buffer("mins", lo.view(64, -1).contiguous())
    x = torch.randn(2, 128)
    torch.testing.assert_close(int4_matmul(x, m.packed, m.scales, m.mins, g), x @ m.dequantize().t(), atol=1e-3, rtol=1e-3)


def test_triton_path_engine_matches_torch_path(llm):
    """The engine with kernels.backend=triton (interpreter on CPU) emits the torch path's greedy tokens."""
    from slotune.engine import LLM, EngineConfig, SamplingParams

    tri = LLM(EngineConfig(kernels={"backend": "triton", "decode_attention": {"block_n": 16, "num_splits": 2}},
                           num_kv_blocks=32, max_model_len=128))
    assert tri.engine.runner.backend == "triton"
    prompts = ["The capital of France is", "1, 2, 3,"]
    p = SamplingParams(max_tokens=4, ignore_eos=True)
    assert [o.output_token_ids for o in tri.generate(prompts, p)] == [o.output_token_ids for o in llm.generate(prompts, p)]
