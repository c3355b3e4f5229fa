"""Weight quantization: int8 per-channel, int4 group-wise (packed), fp8 e4m3 per-channel."""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch

from slotune.engine import SamplingParams
from slotune.engine.layers.linear import Linear
from slotune.engine.quantize import FP8Linear, Int4Linear, Int8Linear, quantize_linear, quantize_model


def _int4_step(w: torch.Tensor, g: int) -> torch.Tensor:
    """Per-element quantization step of asymmetric 4-bit groups of g input channels (K zero-padded)."""
    n, k = w.shape
    wp = torch.nn.functional.pad(w, (0, -k % g)).view(n, -1, g)
    step = (wp.amax(-1, keepdim=True) - wp.amin(-1, keepdim=True)) / 15
    return step.expand_as(wp).reshape(n, -1)[:, :k]


@pytest.mark.parametrize(("n", "k"), [(96, 128), (40, 576), (33, 96)])
def test_int8_is_per_channel_round_to_nearest(n, k):
    torch.manual_seed(0)
    w = torch.randn(n, k) * torch.linspace(0.1, 3, n)[:, None]  # channels of very different scale
    m = Int8Linear(w)
    step = w.abs().amax(1, keepdim=True) / 127
    # codes are rounded against the stored bf16 scale: at most half a step off (plus fp slack)
    assert ((m.dequantize() - w).abs() <= step * 0.502 + 1e-6).all()
    x = torch.randn(3, k)
    rel = (m(x) - x @ m.dequantize().T).norm() / (x @ m.dequantize().T).norm()
    assert rel < 1e-2  # only the bf16 activation cast differs
    assert m.weight_bytes() == n * k + 2 * n


@pytest.mark.parametrize("group_size", [32, 64, 128, 256])
def test_int4_group_wise_matches_reference_for_every_group_size(group_size):
    # K = 576 (SmolLM2's hidden size) is not a multiple of 128 or 256: K is zero-padded.
    torch.manual_seed(0)
    w, x = torch.randn(48, 576), torch.randn(5, 576)
    m = Int4Linear(w, group_size)
    deq = m.dequantize()
    assert deq.shape == w.shape
    # round-to-nearest: half a step, plus bf16 rounding of the kernel's output (dequantize runs through it)
    assert ((deq - w).abs() <= 0.502 * _int4_step(w, group_size) + 2**-8 * w.abs() + 1e-6).all()
    rel = (m(x) - x @ deq.T).norm() / (x @ deq.T).norm()
    assert rel < 1e-2
    k_pad = 576 + (-576 % group_size)
    assert m.weight_bytes() == 48 * k_pad // 2 + 48 * (k_pad // group_size) * 2 * 2  # codes + bf16 scale/min


@pytest.mark.parametrize("group_size", [32, 128])
def test_int4_exact_unpack_agrees_with_torchs_own_kernel(group_size):
    """dequantize() unpacks torch's CPU layout in float32 (what slotune/kernels/cpu_decode.c reads);
    the identity pushed through torch's int4 kernel must give the same weights up to its bf16 output."""
    torch.manual_seed(0)
    m = Int4Linear(torch.randn(192, 576), group_size)
    exact = m.dequantize()
    eye = torch.eye(m.k, dtype=torch.bfloat16)
    via_kernel = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, m.packed, group_size, m.scales_and_zeros).float().t()
    via_kernel = via_kernel[:, :576]
    assert ((exact - via_kernel).abs() <= 2**-8 * exact.abs() + 1e-6).all()
    assert not torch.equal(exact, exact.to(torch.bfloat16).float())  # float32, not rounded to bf16


@pytest.mark.parametrize("gemm_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("n", "k", "group_size"), [(128, 576, 32), (192, 576, 128), (64, 1536, 64)])
def test_prefill_sized_inputs_take_the_dequantized_gemm_path_with_the_same_result(
    n, k, group_size, gemm_dtype, monkeypatch
):
    """Past CPU_GEMM_MIN_ROWS rows the CPU path dequantizes (int4: unpacking torch's packed
    layout) and runs a GEMM in bf16 or float32 (`cpu_gemm_dtype`); it must compute what the packed
    kernels compute."""
    from slotune.engine import quantize

    monkeypatch.setattr(quantize, "cpu_gemm_dtype", lambda: gemm_dtype)
    torch.manual_seed(0)
    w, x = torch.randn(n, k) * 0.05, torch.randn(96, k)
    for m in (Int8Linear(w), Int4Linear(w, group_size)):
        ref = x @ m.dequantize().T
        gemm = m(x)  # 96 rows: above both thresholds
        saved = dict(quantize.CPU_GEMM_MIN_ROWS)
        try:
            quantize.CPU_GEMM_MIN_ROWS.update(int8=10**9, int4=10**9)
            packed = m(x)
        finally:
            quantize.CPU_GEMM_MIN_ROWS.update(saved)
        assert gemm.shape == packed.shape == (96, n)
        for out in (gemm, packed):
            assert (out - ref).norm() / ref.norm() < 1e-2
        # a wrong nibble order or group mapping would be off by O(1), not by bf16 rounding
        assert (gemm - packed).norm() / packed.norm() < 1e-2


def test_a_cpu_without_a_native_bf16_gemm_dequantizes_to_float32():
    """oneDNN capped at AVX2 (the ISA of a Zen 3 or an AVX2-only Xeon, where torch's bf16 GEMM is
    5-60x slower than float32's) has no native bf16 GEMM: the prefill path multiplies in float32.
    Checked in a child process: the cap is read when oneDNN starts."""
    code = "from slotune.engine.quantize import cpu_gemm_dtype; print(cpu_gemm_dtype())"
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["torch.float32"]


def test_int4_packs_two_codes_per_byte():
    m = Int4Linear(torch.randn(64, 256), 64)
    assert m.packed.element_size() * m.packed.numel() <= 64 * 256 // 2 * 1.01


def test_fp8_is_emulated_on_cpu():
    """CPU has no fp8 matmul: FP8Linear keeps e4m3 codes + per-channel scales and dequantizes per call."""
    torch.manual_seed(0)
    w, x = torch.randn(64, 128), torch.randn(4, 128)
    m = FP8Linear(w)
    assert m.qweight.dtype == torch.float8_e4m3fn
    assert ((m.dequantize() - w).abs() <= w.abs() * 2**-3 + 1e-3).all()  # 3 mantissa bits
    torch.testing.assert_close(m(x), x @ m.dequantize().T, rtol=1e-5, atol=1e-5)
    assert m.weight_bytes() == 64 * 128 + 64 * 4


def test_unknown_method_names_the_value():
    with pytest.raises(ValueError, match="'int3'"):
        quantize_linear(Linear(torch.randn(8, 32)), "int3", 32)


@pytest.mark.parametrize("method", ["int8", "int4", "fp8"])
def test_quantize_model_replaces_every_linear_and_keeps_the_embedding(llm, method):
    model = copy.deepcopy(llm.engine.runner.model)
    quantize_model(model, method, 64)
    assert not model.linears()  # no dense Linear left
    assert isinstance(model.lm_head, Int8Linear)  # the LM head is int8 for every method (see quantize.py)
    assert model.embed.dtype == torch.float32  # tied embedding stays dense for the row gather
    body = type(model.layers[0].qkv_proj)
    assert body is {"int8": Int8Linear, "int4": Int4Linear, "fp8": FP8Linear}[method]
    assert model.weight_bytes() < llm.engine.weight_bytes / 3.5


def test_engine_weight_bytes_fall_and_the_top_token_holds(llm, make_llm):
    ids = llm.tokenizer.encode("The capital of France is")
    ref = llm.logits(ids)
    sizes = {"none": llm.engine.weight_bytes}
    for q, gs in (("int8", 64), ("int4", 32)):
        qllm = make_llm(quantization=q, quant_group_size=gs)
        sizes[q] = qllm.engine.weight_bytes
        out = qllm.logits(ids)
        assert out[-1].argmax() == ref[-1].argmax()
        assert (out.argmax(-1) == ref.argmax(-1)).float().mean() > 0.8
        # generation goes through the packed kernels (decode at batch 1)
        assert len(qllm.generate(ids, SamplingParams(max_tokens=4))[0].output_token_ids) > 0
        del qllm
    assert sizes["int4"] < sizes["int8"] < sizes["none"] / 3.5


@pytest.mark.parametrize("method", ["int8", "int4", "fp8"])
def test_quantized_layers_keep_the_bias(method):
    """Qwen2's q/k/v and Llama's attention/MLP biases survive quantization: the layer computes
    x @ dequantized W^T + b (the bias kept in full precision)."""
    torch.manual_seed(0)
    w, b, x = torch.randn(128, 96) / 10, torch.randn(128), torch.randn(5, 96)
    m = quantize_linear(Linear(w, b), method, 32)
    want = x @ m.dequantize().T + b
    got = m(x).float()
    torch.testing.assert_close(got, want, atol=2e-2, rtol=1e-2)  # the CPU int8/int4 GEMMs take bf16 activations
    assert (got - (x @ m.dequantize().T)).abs().max() > 0.5  # the bias is really there
