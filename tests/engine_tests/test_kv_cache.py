"""KV-cache precision: int8 / fp8-e4m3 with per-(token, head) scales, bytes per token, block counts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from slotune.engine import SamplingParams
from slotune.engine.layers.attention import KVCache, TorchAttentionBackend
from slotune.engine.layers.attn_metadata import AttentionMetadata
from slotune.kernels.kv_quant import quantize_kv

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


@pytest.mark.parametrize(("kv_dtype", "rel"), [("int8", 0.5 / 127), ("fp8", 2**-4)])
def test_quantize_kv_error_is_bounded_per_token_and_head(kv_dtype, rel):
    torch.manual_seed(0)
    x = torch.randn(7, 3, 64) * torch.logspace(-2, 2, 3)[None, :, None]  # heads at very different scales
    q, scale = quantize_kv(x, kv_dtype)
    assert q.shape == x.shape and scale.shape == (7, 3)
    deq = q.float() * scale[..., None]
    amax = x.abs().amax(-1, keepdim=True)
    bound = rel * amax if kv_dtype == "int8" else rel * x.abs() + amax * 2**-9 / 448 * 8  # e4m3: 3 mantissa bits
    assert ((deq - x).abs() <= bound * 1.01 + 1e-7).all()


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_paged_attention_over_a_quantized_cache_matches_dequantized_reference(kv_dtype):
    """Store K/V through the backend, decode one query per sequence, compare with plain SDPA."""
    torch.manual_seed(0)
    L, nb, bs, h, d, heads = 1, 8, 4, 2, 16, 4
    cache = KVCache(L, nb, bs, h, d, torch.float32, kv_dtype, torch.device("cpu"))
    attn = TorchAttentionBackend()
    ctx = [5, 9]
    tables = torch.tensor([[3, 1, 0], [2, 6, 4]], dtype=torch.int32)
    ks = [torch.randn(n, h, d) for n in ctx]
    vs = [torch.randn(n, h, d) for n in ctx]
    for i, n in enumerate(ctx):
        p = torch.arange(n)
        attn.store_kv(cache, 0, ks[i], vs[i], tables[i, p // bs].long() * bs + p % bs)
    q = torch.randn(2, heads, d)
    mask = (torch.arange(3 * bs)[None, :] < torch.tensor(ctx)[:, None])[:, None, None, :]
    meta = AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.int64),
        num_extend_tokens=0,
        extend_query_lens=[],
        extend_context_lens=[],
        extend_block_tables=None,
        extend_mask=None,
        decode_block_tables=tables,
        decode_context_lens=torch.tensor(ctx, dtype=torch.int32),
        decode_mask=mask,
        block_size=bs,
    )
    out = attn._decode(cache, 0, q, meta, d**-0.5)
    for i, n in enumerate(ctx):
        kq, kscale = quantize_kv(ks[i], kv_dtype)
        vq, vscale = quantize_kv(vs[i], kv_dtype)
        k, v = kq.float() * kscale[..., None], vq.float() * vscale[..., None]
        ref = F.scaled_dot_product_attention(
            q[i][:, None], k.transpose(0, 1), v.transpose(0, 1), scale=d**-0.5, enable_gqa=True
        )[:, 0]
        torch.testing.assert_close(out[i], ref, rtol=1e-5, atol=1e-5)


def test_bytes_per_token_formula():
    # SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64
    assert KVCache.bytes_per_token(30, 3, 64, torch.float32, "auto") == 2 * 30 * 3 * 64 * 4
    assert KVCache.bytes_per_token(30, 3, 64, torch.bfloat16, "auto") == 2 * 30 * 3 * 64 * 2
    for kv in ("int8", "fp8"):  # one byte per element + one float32 scale per (token, head)
        assert KVCache.bytes_per_token(30, 3, 64, torch.float32, kv) == 2 * 30 * 3 * (64 + 4)


@pytest.fixture(scope="module")
def engines(make_llm):
    """Same KV memory budget, three precisions."""
    return {kv: make_llm(kv_dtype=kv, num_kv_blocks=None, kv_cache_memory_gb=0.005) for kv in ("auto", "int8", "fp8")}


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_same_budget_holds_more_blocks(engines, kv_dtype):
    base, low = engines["auto"].engine, engines[kv_dtype].engine
    ratio = base.kv_bytes_per_token / low.kv_bytes_per_token
    assert ratio == pytest.approx(4 * 64 / 68)
    assert low.runner.num_blocks == int(0.005 * 2**30 // (low.kv_bytes_per_token * low.cfg.block_size))
    assert low.runner.num_blocks >= int(base.runner.num_blocks * ratio)
    assert low.stats().num_total_blocks == low.runner.num_blocks
    # the KV tensors really are one byte per element
    assert low.runner.kv_cache.k.element_size() == 1


PROMPTS = ["The capital of France is", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def reference(engines):
    return [o.output_token_ids for o in engines["auto"].generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_quantized_kv_generation_tracks_the_full_precision_cache(engines, reference, kv_dtype):
    ref = reference
    out = [o.output_token_ids for o in engines[kv_dtype].generate(PROMPTS, GREEDY)]
    for a, b in zip(ref, out):
        assert a[:4] == b[:4]
    agree = sum(x == y for a, b in zip(ref, out) for x, y in zip(a, b)) / sum(map(len, ref))
    assert agree >= 0.5
    st = engines[kv_dtype].engine.stats()
    assert st.num_free_blocks == st.num_total_blocks


@pytest.mark.parametrize(("dtype", "atol"), [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("batch", [1, 3])
def test_decode_attention_matches_a_float64_reference(dtype, atol, batch):
    """The decode path (SDPA at fp32 batch 1, grouped matmuls otherwise) over a paged cache, GQA 9:3."""
    torch.manual_seed(0)
    L, nb, bs, h, hkv, d = 1, 12, 4, 9, 3, 16
    cache = KVCache(L, nb, bs, hkv, d, dtype, "auto", torch.device("cpu"))
    cache.k.normal_()
    cache.v.normal_()
    tables = torch.tensor([[5, 1, 7], [2, 0, 9], [11, 4, 3]], dtype=torch.int32)[:batch]
    ctx = [9, 5, 12][:batch]
    mask = (torch.arange(3 * bs)[None, :] < torch.tensor(ctx)[:, None])[:, None, None, :]
    meta = AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.int64),
        num_extend_tokens=0,
        extend_query_lens=[],
        extend_context_lens=[],
        extend_block_tables=None,
        extend_mask=None,
        decode_block_tables=tables,
        decode_context_lens=torch.tensor(ctx, dtype=torch.int32),
        decode_mask=mask,
        block_size=bs,
    )
    q = torch.randn(batch, h, d, dtype=dtype)
    out = TorchAttentionBackend()._decode(cache, 0, q, meta, d**-0.5)
    for i in range(batch):
        k = cache.k[0, tables[i].long()].reshape(-1, hkv, d)[: ctx[i]].double().repeat_interleave(h // hkv, dim=1)
        v = cache.v[0, tables[i].long()].reshape(-1, hkv, d)[: ctx[i]].double().repeat_interleave(h // hkv, dim=1)
        p = torch.einsum("hd,thd->ht", q[i].double(), k).mul(d**-0.5).softmax(-1)
        torch.testing.assert_close(out[i].double(), torch.einsum("ht,thd->hd", p, v), atol=atol, rtol=0)
