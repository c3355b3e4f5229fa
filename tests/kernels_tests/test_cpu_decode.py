"""The native CPU decode step (slotune/kernels/cpu_decode.c) against the torch model, on the bundled model.

Each configuration's weights (dense, int8, int4 with and without K padding) are dequantized
into a float32 torch reference; the native kernel decodes three sequences token by token over
shuffled, non-contiguous block tables, and its logits at every position are compared with the
reference's full-sequence logits.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest
import torch

from slotune.engine import LLM, EngineConfig
from slotune.engine.layers.linear import Linear
from slotune.engine.loader import load_model
from slotune.engine.model_runner import ModelRunner
from slotune.engine.models.llama import LlamaModel
from slotune.engine.native_step import native_linear
from slotune.engine.quantize import Int4Linear, Int8Linear
from slotune.kernels.cpu_decode import load_library, torch_int4_block
from tests.engine_driver import generate
from tests.kernels_tests.device import GPU

pytestmark = [
    pytest.mark.skipif(GPU, reason="native CPU kernel: CPU only"),
    pytest.mark.skipif(isinstance(load_library(), str), reason=f"native kernel unavailable: {load_library()}"),
]

PROMPTS = [
    "The capital of France is Paris, and the capital of Italy is",
    "def add(a, b):\n    return",
    "Once upon a time",
]


def _dense(mod) -> torch.Tensor:
    """[N, K] float32 weights the native kernel multiplies with. Int4 is unpacked by the block width
    torch packed it with here (64 channels under AVX-512, 32 under AVX2: torch_int4_block), exactly;
    Int4Linear.dequantize reads the AVX-512 layout only."""
    if isinstance(mod, Linear):
        return mod.weight.float()
    if not isinstance(mod, Int4Linear):
        return mod.dequantize()
    block = torch_int4_block()
    p = mod.packed.view(mod.n // block, mod.k, block // 2)
    q = torch.cat([p & 15, p >> 4], dim=-1).permute(0, 2, 1).reshape(mod.n, mod.k).float()
    sz = mod.scales_and_zeros.float().transpose(0, 1).repeat_interleave(mod.group_size, dim=1)  # [N, K, 2]
    return ((q - 8) * sz[..., 0] + sz[..., 1])[:, : mod.k - mod.pad].contiguous()


def test_int4_unpack_follows_torchs_layout():
    """The block width probed from torch's pack (which the kernel build must match) unpacks to the
    weights quantized: within half a step of the originals, and far off with the other width."""
    torch.manual_seed(0)
    w = torch.randn(128, 256)
    mod = Int4Linear(w, 32)
    step = mod.scales_and_zeros[..., 0].float().t().repeat_interleave(32, dim=1)  # [N, K]
    assert ((_dense(mod) - w).abs() <= 0.5 * step + 1e-2).all()
    assert load_library().slotune_int4_block() == torch_int4_block()


def _reference(llm: LLM) -> LlamaModel:
    """A float32 torch model holding exactly the weights the native kernel reads."""
    model = llm.engine.runner.model
    cfg, sd, _ = load_model(llm.engine.cfg.model)
    ref = LlamaModel(cfg, sd, torch.float32, torch.device("cpu"))
    dense = _dense
    for mine, theirs in zip(model.layers, ref.layers):
        for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            getattr(theirs, name).weight.data = dense(getattr(mine, name)).contiguous()
        theirs.input_norm.data, theirs.mlp_norm.data = mine.input_norm.float(), mine.mlp_norm.float()
    ref.embed.data, ref.norm.data = model.embed.float(), model.norm.float()
    ref.lm_head = Linear(dense(model.lm_head).contiguous())
    return ref


def _native_logits(runner: ModelRunner, seqs: list[list[int]]) -> list[torch.Tensor]:
    """Each sequence's logits at every position, decoded token by token by the native step, all
    sequences in one batch over shuffled, non-contiguous block tables (block_size 8, 4 blocks each)."""
    assert runner.backend == "native"
    blocks = list(range(runner.num_blocks))
    random.Random(0).shuffle(blocks)  # pages scattered across the cache, not in order
    tables = [blocks[i * 4 : (i + 1) * 4] for i in range(len(seqs))]
    got: list[list[torch.Tensor]] = [[] for _ in seqs]
    for p in range(max(map(len, seqs))):
        live = [i for i, s in enumerate(seqs) if p < len(s)]  # the batch shrinks as prompts end
        logits = runner.native.step(
            ids=[seqs[i][p] for i in live],
            positions=[p] * len(live),
            slots=[tables[i][p // 8] * 8 + p % 8 for i in live],
            block_tables=[tables[i] for i in live],
        )
        for row, i in enumerate(live):
            got[i].append(logits[row].clone())
    return [torch.stack(g) for g in got]


def _reference_runner(llm: LLM) -> ModelRunner:
    return ModelRunner(
        EngineConfig(device="cpu", num_kv_blocks=2, max_model_len=128, kernels={"backend": "torch"}),
        model=_reference(llm),
    )


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"dtype": "bfloat16"},
        {"dtype": "bfloat16", "quantization": "int8"},
        {"dtype": "bfloat16", "quantization": "int4", "quant_group_size": 32},
        {"quantization": "int4", "quant_group_size": 128},  # 576 = 4.5 groups: K padded, the tail skipped
    ],
)
def test_native_decode_matches_dequantized_torch_reference(overrides):
    """float32 models: within 2e-3 of the reference logits. bfloat16 models: the kernel keeps
    activations in float32 and rounds only the cache's K/V to bf16, so it must land at most half
    as far from the reference as the torch path it replaces (measured: 3-4x closer)."""
    cfg = EngineConfig().with_updates(
        {
            "max_model_len": 128,
            "num_kv_blocks": 24,
            "block_size": 8,
            "max_num_seqs": 4,
            "kernels": {"backend": "native"},
            **overrides,
        }
    )
    llm = LLM(cfg)
    runner = llm.engine.runner
    seqs = [llm.tokenizer.encode(p) for p in PROMPTS]
    got = _native_logits(llm.engine.runner, seqs)
    reference = _reference_runner(llm)
    for i, ids in enumerate(seqs):
        want = reference.full_logits(ids)
        mine = got[i]
        err = (mine - want).abs()
        if cfg.dtype == "float32" or cfg.dtype == "auto":
            assert err.max() < 2e-3, float(err.max())
        else:
            torch_err = (runner.full_logits(ids) - want).abs()  # the torch path this kernel replaces
            assert err.max() < 0.5 * torch_err.max() and err.mean() < 0.5 * torch_err.mean(), (err, torch_err)
        assert (mine.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9


def test_int8_activation_group_size_reaches_the_native_step():
    """kernels.int8_activation_group_size is the kernel's activation group: groups of 128 give other
    logits than groups of 32, both near the float32 reference of the same int8 weights (mean error
    under a tenth of the mean logit), 32 nearer."""
    from slotune.kernels.cpu_decode import has_int8_activations

    if not has_int8_activations():
        pytest.skip("this build has no int8 kernels (AVX-512 without VNNI/VBMI)")
    errors, logits = {}, {}
    for group in (32, 128):
        cfg = EngineConfig().with_updates(
            {
                "max_model_len": 128,
                "num_kv_blocks": 24,
                "block_size": 8,
                "max_num_seqs": 4,
                "quantization": "int8",
                "kernels": {"backend": "native", "int8_activations": True, "int8_activation_group_size": group},
            }
        )
        llm = LLM(cfg)
        assert llm.engine.runner.native._m.act_group == group
        seqs = [llm.tokenizer.encode(p) for p in PROMPTS]
        logits[group] = torch.cat(_native_logits(llm.engine.runner, seqs))
        reference = _reference_runner(llm)
        want = torch.cat([reference.full_logits(ids) for ids in seqs])
        errors[group] = (logits[group] - want).abs().mean()
        assert errors[group] < 0.1 * want.abs().mean()
    assert not torch.equal(logits[32], logits[128])
    assert errors[32] < errors[128]


@pytest.mark.parametrize(("head_dim", "heads", "kv_heads"), [(48, 3, 1), (64, 6, 2), (128, 5, 1), (256, 4, 1)])
def test_native_attention_matches_torch_at_every_head_shape(head_dim, heads, kv_heads):
    """The attention loops are instantiated per head size (64, 128, 256 dims) and query heads per kv
    head (1-4; 5 run as 4 + 1); other sizes (48 dims) take the generic loops. Each shape, float32,
    over scattered pages: within 2e-3 of torch's logits at every position of 3 sequences of up to 30
    keys (a whole 16-key chunk and a partial one), and of one sequence alone: with one kv head, fewer
    tasks than threads, each task's keys are split (attend_span), down to a span of none at the first key."""
    import dataclasses

    from tests.kernels_tests.test_triton_engine import TINY, _state_dict

    mc = dataclasses.replace(TINY, head_dim=head_dim, num_heads=heads, num_kv_heads=kv_heads)
    sd = _state_dict(mc)

    def runner(backend: str) -> ModelRunner:
        cfg = EngineConfig(
            device="cpu", num_kv_blocks=24, block_size=8, max_model_len=128, kernels={"backend": backend}
        )
        return ModelRunner(cfg, weights=(mc, dict(sd)))

    native, plain = runner("native"), runner("torch")
    seqs = [[(7 * j + 3) % 256 for j in range(n)] for n in (5, 19, 30)]
    for ids, got in zip(seqs, _native_logits(native, seqs), strict=True):
        torch.testing.assert_close(got, plain.full_logits(ids), atol=2e-3, rtol=0)
    (alone,) = _native_logits(native, seqs[1:2])
    torch.testing.assert_close(alone, plain.full_logits(seqs[1]), atol=2e-3, rtol=0)


def test_native_backend_refuses_what_it_cannot_read():
    cfg = EngineConfig().with_updates(
        {"max_model_len": 64, "num_kv_blocks": 8, "kv_dtype": "int8", "kernels": {"backend": "native"}}
    )
    with pytest.raises(ValueError, match="kernels.backend: native cannot run this config: kv_dtype int8"):
        LLM(cfg)
    auto = LLM(cfg.with_updates({"kernels": {"backend": "auto"}}))  # auto keeps the torch path instead
    assert auto.engine.runner.backend == "torch" and auto.engine.runner.native is None


def _fake_quant_rows(x: torch.Tensor, group: int = 32) -> torch.Tensor:
    """What the int8-activation kernel multiplies with: symmetric int8 codes, one scale per `group`
    inputs (a row's last group shorter when K is not a multiple)."""
    parts = []
    for xb in x.split(group, dim=1):
        d = xb.abs().amax(-1, keepdim=True) / 127
        parts.append(torch.round(xb / torch.where(d > 0, d, 1)).clamp(-127, 127) * d)
    return torch.cat(parts, dim=1)


@pytest.mark.parametrize("rows", [1, 3, 4, 7, 9, 16])
@pytest.mark.parametrize(
    ("kind", "k"),
    [
        ("fp32", 72),
        ("bf16", 100),
        ("int8", 77),
        ("int4-g32", 576),
        ("int4-g128", 576),
        ("int4-g32-int8act", 576),
        ("int4-g64-int8act", 320),
        ("int8-int8act", 160),
        ("int8-int8act-a128", 576),  # activation groups of 128: 4 and a last one of 64
        ("int4-g64-int8act-a256", 320),
    ],
)
def test_matmul_kernels_match_torch(kind, k, rows):
    """Each weight format's matmul against x @ dequantized W^T, odd K tails and row counts included;
    `-aN`: one activation scale per N inputs."""
    from slotune.kernels.cpu_decode import has_int8_activations, matmul

    torch.manual_seed(0)
    # int8: 9 blocks of 16, the VNNI kernel's pairs and a lone last block; int4-g32: 3 blocks of 64, on two
    # threads at 1-2 rows the last is split over K (int4_vnni_span)
    n = {"int8-int8act": 144, "int4-g32-int8act": 192}.get(kind, 128)
    w, x = torch.randn(n, k) / k**0.5, torch.randn(rows, k)
    x[:, 5] *= 30  # an outlier channel, as real activations have
    if kind == "fp32":
        mod = Linear(w)
    elif kind == "bf16":
        mod = Linear(w.to(torch.bfloat16))
    elif kind.startswith("int8"):
        mod = Int8Linear(w)
    else:
        mod = Int4Linear(w, int(kind.split("-g")[1].split("-")[0]))
    int8act = "int8act" in kind
    act_group = int(kind.split("-a")[1]) if "-a" in kind else 32
    if int8act and not has_int8_activations():
        pytest.skip("this build has no int8 kernels (AVX-512 without VNNI/VBMI)")
    dense = _dense(mod)
    got = matmul(native_linear(mod), x, int8_activations=int8act, act_group=act_group)
    want = (x.double() @ dense.double().T).float()
    if not int8act:
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    else:  # exact up to the activation codes: against the fake-quantized input, and far from the float input
        xq = _fake_quant_rows(x, act_group)
        fq = xq.double() @ dense.double().T
        if isinstance(mod, Int4Linear):  # w = q * scale + offset; the offset's sum_k x is taken from the float x
            sz = mod.scales_and_zeros.double()  # [K/g, N, 2]
            offset = sz[..., 1] - 8 * sz[..., 0]
            fq = fq + (x - xq).double().reshape(rows, -1, mod.group_size).sum(-1) @ offset
        fq = fq.float()
        torch.testing.assert_close(got, fq, atol=2e-3, rtol=1e-4)
        assert (got - want).abs().max() > 10 * (got - fq).abs().max()


def test_int8_activations_repack_follows_the_build():
    """With int8 activations an int8 weight is repacked for the int8 kernel the library reports
    (slotune_isa), never by the CPU flags alone: [N/16, K/4, 16, 4] + 128 for VNNI, [N/8, K/4, 8, 4]
    signed for AVX2; a shape the kernel cannot take stays on the float kernel."""
    from slotune.kernels import cpu_decode as cd

    torch.manual_seed(0)
    for n in (128, 136):  # 136: a multiple of 8, not of 16
        mod, keep = Int8Linear(torch.randn(n, 64)), []
        lin = cd._lin(native_linear(mod), keep, int8_activations=True)
        q = mod.qweight
        if cd.isa() & cd.ISA_INT8_VNNI and n % 16 == 0:
            assert lin.kind == cd.W_INT8_VNNI
            assert torch.equal(
                keep[0].view(n // 16, 16, 16, 4)[1, 2, 3].to(torch.int16) - 128, q[19, 8:12].to(torch.int16)
            )
        elif cd.isa() & cd.ISA_INT8_AVX2:
            assert lin.kind == cd.W_INT8_AVX2 and keep[0].data_ptr() == lin.w
            assert torch.equal(keep[0].view(n // 8, 16, 8, 4)[2, 3, 5], q[21, 12:16])  # [block, quad, channel, input]
        else:
            assert lin.kind == cd.W_INT8
        assert cd._lin(native_linear(mod), [], int8_activations=False).kind == cd.W_INT8


def test_int4_repack_puts_each_channels_quad_in_one_lane():
    """With int8 activations an int4 weight is repacked once for the build's int8 kernel. VNNI: for
    block b, slice s, quad q, byte (v, c, i) holds channel 64b + 16v + c at input 32s + 4q + i in its
    low nibble and channel 64b + 32 + 16v + c in its high one. AVX2: the same in blocks of 32
    (channels 32b + 8v + c and 32b + 16 + 8v + c). Both put scales block-major.
    Without int8 activations it stays in torch's pack."""
    from slotune.kernels import cpu_decode as cd

    torch.manual_seed(0)
    n, k = 128, 96
    mod, keep = Int4Linear(torch.randn(n, k), 32), []
    lin = cd._lin(native_linear(mod), keep, int8_activations=True)
    assert cd._lin(native_linear(mod), [], int8_activations=False).kind == cd.W_INT4
    if cd.isa() & cd.ISA_INT8_VNNI:
        assert lin.kind == cd.W_INT4_VNNI
        blk, vec = 64, 16
    elif cd.isa() & cd.ISA_INT8_AVX2:
        assert lin.kind == cd.W_INT4_AVX2
        blk, vec = 32, 8
    else:
        assert lin.kind == cd.W_INT4 and not keep
        return
    sz = mod.scales_and_zeros.view(k // 32, n // blk, blk, 2)
    assert torch.equal(keep[1][1, 2], sz[2, 1])
    block = mod.packed.view(n // blk, k, blk // 2)
    codes = torch.cat([block & 15, block >> 4], dim=-1).permute(0, 2, 1).reshape(n, k)  # [N, K]
    rep = keep[0].view(n // blk, k // 32, 8, 2, vec, 4)
    for b, s, q, v, c, i in [(0, 0, 0, 0, 0, 0), (1, 2, 7, 1, vec - 1, 3), (1, 1, 3, 0, 5, 2), (0, 2, 5, 1, 4, 1)]:
        byte, kk = int(rep[b, s, q, v, c, i]), 32 * s + 4 * q + i
        assert byte & 15 == codes[blk * b + vec * v + c, kk]
        assert byte >> 4 == codes[blk * b + blk // 2 + vec * v + c, kk]


@pytest.mark.parametrize("act_group", [32, 256])
@pytest.mark.parametrize("n", [128, 136])
def test_int8_activation_kernel_at_the_extremes(n, act_group):
    """Weight and activation codes all +-127 (the largest int16 pair sums the int8 kernels form:
    2 * 127 * 127, and 8 int4 quads 8 * 2 * 15 * 127, both below 32767): exact against the
    fake-quantized input, so nothing saturated. 136 channels: AVX2's 8-channel repack. Groups of 256:
    the int8 kernels' int32 sum over a group at its largest (256 * 127 * 255 < 2^24)."""
    from slotune.kernels.cpu_decode import has_int8_activations, matmul

    if not has_int8_activations():
        pytest.skip("this build has no int8 kernels (AVX-512 without VNNI/VBMI)")
    g = torch.Generator().manual_seed(0)
    k = 256
    sign = lambda *s: torch.randint(0, 2, s, generator=g).float() * 2 - 1  # noqa: E731
    w = sign(n, k) * torch.rand(n, 1, generator=g)  # every weight at its row's max: codes +-127
    x = sign(17, k) * 3.0  # every activation at its group's max: codes +-127; 17 rows: an AMX tile and a tail
    mod = Int8Linear(w)
    assert mod.qweight.abs().min() == 127
    got = matmul(native_linear(mod), x, int8_activations=True, act_group=act_group)
    want = (x.double() @ _dense(mod).double().T).float()
    torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-5)
    if n % 64 == 0:  # int4: codes 0 and 15 only (two values per group), activations +-127
        mod4 = Int4Linear(w, 32)
        got4 = matmul(native_linear(mod4), x, int8_activations=True, act_group=act_group)
        torch.testing.assert_close(got4, (x.double() @ _dense(mod4).double().T).float(), atol=1e-3, rtol=1e-5)


@pytest.mark.parametrize("rows", [16, 17, 33, 80])
@pytest.mark.parametrize(
    ("kind", "n", "k", "act_group"),
    [("int8", 144, 160, 32), ("int8", 144, 576, 128), ("int4-g32", 128, 576, 32), ("int4-g64", 192, 320, 64)],
)
def test_amx_kernels_give_the_vnni_kernels_results_bit_for_bit(kind, n, k, act_group, rows):
    """With AMX (whole 16-row tiles; the remaining rows through VNNI) every output equals the VNNI
    kernel's exactly: the same int32 group sums scaled in the same order. 80 rows: more tiles than one
    int4 pass holds (4); 17 and 33: a tail; K = 576 in groups of 128: a last group of 64."""
    from slotune.kernels import cpu_decode as cd

    if not cd.set_amx(True):
        pytest.skip("no AMX here (the CPU, Linux or this build)")
    torch.manual_seed(0)
    w, x = torch.randn(n, k) / k**0.5, torch.randn(rows, k)
    x[:, 5] *= 30
    mod = Int8Linear(w) if kind == "int8" else Int4Linear(w, int(kind.split("-g")[1]))
    try:
        assert cd.isa() & cd.ISA_AMX
        amx = cd.matmul(native_linear(mod), x, int8_activations=True, act_group=act_group)
        assert not cd.set_amx(False) and not cd.isa() & cd.ISA_AMX
        vnni = cd.matmul(native_linear(mod), x, int8_activations=True, act_group=act_group)
    finally:
        cd.set_amx(True)
    assert torch.equal(amx, vnni)
    want = (_fake_quant_rows(x, act_group).double() @ _dense(mod).double().T).float()
    assert (amx - want).abs().max() < 0.05 * want.abs().max()  # and it is the matmul, not zeros


@pytest.mark.parametrize(
    ("overrides", "max_native_rows"),
    [({}, None), ({"max_num_batched_tokens": 16}, None), ({"max_num_batched_tokens": 16}, 2)],
    ids=["batched", "chunked", "chunked-split"],
)
def test_native_engine_matches_torch_engine_on_a_tiny_gqa_model(overrides, max_native_rows):
    """2 layers, GQA 4:2 heads, head_dim 32, hidden 128: batched prompts of different lengths,
    decode batches that shrink as requests end, float32 — the same greedy tokens as torch.
    Prefill chunks run natively beside the decodes; with the native row limit lowered to 2, steps
    split: the decodes natively, the prefill chunks through torch, in the same step."""
    from tests.kernels_tests.test_triton_engine import _engine

    prompts = [[(7 * j + 3) % 256 for j in range(n)] for n in (5, 19, 33)]
    native, plain = (
        _engine(kernels={"backend": "native"}, **overrides),
        _engine(kernels={"backend": "torch"}, **overrides),
    )
    assert (native.runner.backend, plain.runner.backend) == ("native", "torch")
    if max_native_rows:
        native.runner.native.max_native_rows = max_native_rows
    groups = []
    real = native.runner._native_step
    native.runner._native_step = lambda group: groups.append([s.num_new_tokens for s in group]) or real(group)
    assert generate(native, prompts, 24) == generate(plain, prompts, 24)
    fallbacks = native.stats().kernel_fallbacks["native_rows_to_torch"]
    if max_native_rows:
        assert all(sum(g) <= 2 for g in groups) and any(len(g) == 2 for g in groups)
        assert fallbacks > 0  # the rows past the limit ran on torch, and the stats say so
    else:
        assert any(max(g) > 1 for g in groups)  # prefill rows ran natively
        assert fallbacks == 0
    assert "native_rows_to_torch" not in plain.stats().kernel_fallbacks  # torch chosen: not a fallback


def test_a_step_with_more_rows_than_one_native_call_runs_natively_in_several():
    """A burst of prompts: 3 sequences of 40-70 tokens in one step is 170 rows, more than one
    native call holds (max_num_seqs + 64 = 67), for a weight format with no torch crossover
    (float32). The step runs natively in consecutive calls, each attending to the KV the earlier
    ones wrote, and gives torch's greedy tokens."""
    from tests.kernels_tests.test_triton_engine import _engine

    prompts = [[(5 * j + 1) % 256 for j in range(n)] for n in (40, 60, 70)]
    native, plain = (
        _engine(kernels={"backend": "native"}, max_num_seqs=3),
        _engine(kernels={"backend": "torch"}, max_num_seqs=3),
    )
    assert native.runner.native.max_native_rows is None and native.runner.native.max_rows == 67
    calls = []
    real = native.runner.native.step
    native.runner.native.step = lambda ids, *a: calls.append(len(ids)) or real(ids, *a)
    assert generate(native, prompts, 24) == generate(plain, prompts, 24)
    assert calls[:3] == [67, 67, 36]  # the first step: 170 rows in three calls


@pytest.mark.parametrize("variant", ["qk_norm", "sliding_window", "both"])
def test_native_engine_matches_torch_engine_on_qk_norm_and_window_variants(variant):
    """Qwen3's per-head q/k RMSNorm and Mistral's sliding window (12 keys here, prompts of up to 33
    tokens plus 24 decoded: most steps attend past it) run in the native step, not refused: the same
    greedy tokens as the torch path, on a tiny float32 model whose q/k norm weights are not ones."""
    import dataclasses

    from slotune.engine.llm_engine import LLMEngine
    from tests.engine_driver import IdsTokenizer
    from tests.kernels_tests.test_triton_engine import TINY, _state_dict

    mc = dataclasses.replace(
        TINY, qk_norm=variant != "sliding_window", sliding_window=None if variant == "qk_norm" else 12
    )
    sd = _state_dict(mc)
    g = torch.Generator().manual_seed(1)
    if mc.qk_norm:
        for i in range(mc.num_layers):
            for n in ("q_norm", "k_norm"):
                sd[f"model.layers.{i}.self_attn.{n}.weight"] = 1.0 + 0.3 * torch.randn(mc.head_dim, generator=g)

    def engine(backend: str) -> LLMEngine:
        cfg = EngineConfig(
            device="cpu", num_kv_blocks=48, block_size=8, max_model_len=256, kernels={"backend": backend}
        )
        return LLMEngine(cfg, runner=ModelRunner(cfg, weights=(mc, dict(sd))), tokenizer=IdsTokenizer())

    native, plain = engine("native"), engine("torch")
    assert (native.runner.backend, plain.runner.backend) == ("native", "torch")
    prompts = [[(7 * j + 3) % 256 for j in range(n)] for n in (5, 19, 33)]
    assert generate(native, prompts, 24) == generate(plain, prompts, 24)


def test_the_avx2_kernels_pass_these_tests_on_an_avx512_cpu():
    """An AVX-512 CPU runs the AVX2 build too: this file's kernel and engine tests again in a child
    process built with `-mno-avx512f` and torch at its AVX2 level (int4 packed in blocks of 32), so the
    AVX2 kernels are checked wherever CI runs."""
    from slotune.kernels import cpu_decode as cd

    if not cd.isa() & cd.ISA_AVX512:
        pytest.skip("this build is the AVX2 one already")
    env = {**os.environ, "SLOTUNE_NATIVE_CFLAGS": "-mno-avx512f", "ATEN_CPU_CAPABILITY": "avx2"}
    check = [sys.executable, "-c", "from slotune.kernels import cpu_decode as c; print(c.isa(), c.torch_int4_block())"]
    assert subprocess.run(check, env=env, capture_output=True, text=True, check=True).stdout.split() == [
        str(cd.ISA_AVX2 | cd.ISA_INT8_AVX2 | cd.ISA_INT4_INT8ACT),
        "32",
    ]
    tests = "matmul_kernels or repack or extremes or native_decode_matches or native_engine_matches or several"
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", tests],
        env=env,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and "skipped" not in r.stdout.splitlines()[-1], r.stdout[-2000:]
