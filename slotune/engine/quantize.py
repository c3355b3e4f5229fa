"""Weight-only quantization (int8 per-channel, int4 group-wise) and FP8 (e4m3, per-channel).

gpt-fast's two steps: quantize each dense `Linear` once at load into a compact state, then swap in a
module with the same `forward(x)`. Weights stay quantized in memory: fewer bytes moved per decode step.

CPU: small steps run in the native step (slotune/kernels/cpu_decode.c), reading these buffers in place; here
int8/int4 use torch's packed kernels (bf16 activations) below `CPU_GEMM_MIN_ROWS` rows and a per-call
dequantize + GEMM from there (`cpu_gemm_dtype`); FP8 is emulated (correct, not faster). CUDA: int8/int4 dequantize in
the matmul (slotune/kernels/quant_matmul.py under the Triton backend); FP8 uses `torch._scaled_mm` on compute
capability >= 8.9, except decode-sized batches (<= 16 rows) under the Triton backend (weight-only fp8).
Int4: w = q * scale + min, q in [0, 15], per group of `group_size` input channels, K zero-padded to a
multiple of the group. The LM head is always int8 per-channel: it dominates batch-1 bytes once the layers
are small, and int8 is the knee of bytes against agreement. Measurements: docs/design/engine-quantization.md.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from slotune.engine.layers.linear import Linear
from slotune.kernels.tiles import MatmulConfig

FP8_MAX = 448.0
# Rows from which dequantize-then-GEMM beats torch's packed CPU kernels (their cost grows linearly with
# the rows); crossovers on SmolLM2 shapes: docs/design/engine-quantization.md.
CPU_GEMM_MIN_ROWS = {"int8": 16, "int4": 48}


@functools.cache
def cpu_gemm_dtype() -> torch.dtype:
    """The dequantize + GEMM's dtype: bf16 where oneDNN multiplies it natively (AVX-512 BF16, AMX),
    float32 elsewhere: on an AVX2-only CPU torch's bf16 GEMM is 5-60x slower than float32's
    (docs/design/engine-quantization.md)."""
    return torch.bfloat16 if torch.ops.mkldnn._is_mkldnn_bf16_supported() else torch.float32


def _rows(x: torch.Tensor) -> int:
    return x.numel() // max(x.shape[-1], 1)


class _QuantLinear(nn.Module):
    """Common part of the quantized layers: an optional float bias added after the matmul."""

    def __init__(self, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._matmul(x)
        return out if self.bias is None else out + self.bias.to(out.dtype)


class Int8Linear(_QuantLinear):
    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None = None, tiles: MatmulConfig | None = None
    ) -> None:
        super().__init__(bias)
        w = weight.float()
        # Round the scale to its stored bf16 first, then the codes against it: |error| <= half a step.
        scale = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-10).to(torch.bfloat16)
        self.register_buffer(
            "qweight", torch.round(w / scale.float()[:, None]).clamp_(-127, 127).to(torch.int8)
        )  # [N, K]
        self.register_buffer("scales", scale)  # [N]
        self.tiles = tiles  # the Triton backend's: slotune/kernels/quant_matmul.py; None = torch

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.tiles is not None:
            from slotune.kernels.quant_matmul import int8_matmul  # imports triton: the Triton backend's layers only

            return int8_matmul(x, self.qweight, self.scales, self.tiles)
        if x.device.type == "cpu":
            if _rows(x) >= CPU_GEMM_MIN_ROWS["int8"]:  # per-channel scale commutes with the GEMM
                gd = cpu_gemm_dtype()
                return (F.linear(x.to(gd), self.qweight.to(gd)) * self.scales).to(x.dtype)
            return torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), self.qweight, self.scales).to(x.dtype)
        w = self.qweight.to(x.dtype) * self.scales.to(x.dtype)[:, None]
        return F.linear(x, w)

    def dequantize(self) -> torch.Tensor:
        return self.qweight.float() * self.scales.float()[:, None]

    def weight_bytes(self) -> int:
        return self.qweight.numel() + self.scales.numel() * 2


def _cpu_int4_block() -> int:
    """Channels per block of torch's CPU int4 pack in this process (64 AVX-512, 32 AVX2; 0 unknown:
    then only torch's own kernel reads it)."""
    from slotune.kernels.cpu_decode import torch_int4_block  # the probe lives with the kernel that reads the pack

    return torch_int4_block()


class Int4Linear(_QuantLinear):
    def __init__(
        self, weight: torch.Tensor, group_size: int, bias: torch.Tensor | None = None, tiles: MatmulConfig | None = None
    ) -> None:
        super().__init__(bias)
        n, k = weight.shape
        self.pad = -k % group_size  # zero columns appended to K (and to x in forward)
        k += self.pad
        w = F.pad(weight.float(), (0, self.pad)).view(n, k // group_size, group_size)
        lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
        self.group_size, self.n, self.k = group_size, n, k
        self.tiles = tiles  # the Triton backend's (CUDA layout only); None = torch
        self.on_cpu = weight.device.type == "cpu"
        # Codes are computed against the stored (rounded) scale and min, as the kernel will read them.
        sdt = torch.bfloat16 if self.on_cpu else weight.dtype
        scale = ((hi - lo) / 15.0).clamp_min(1e-10).to(sdt).float()
        if self.on_cpu:
            zero = (lo + 8 * scale).to(sdt).float()  # the CPU kernel computes (q - 8) * scale + zero
            lo = zero - 8 * scale
        else:
            lo = lo.to(sdt).float()
        q = torch.round((w - lo) / scale).clamp_(0, 15).to(torch.uint8).view(n, k)
        if self.on_cpu:
            # torch's CPU kernel layout; [K/g, N, 2] = (scale, min + 8 * scale)
            self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1))
            sz = torch.cat([scale, zero], dim=-1)
            self.register_buffer("scales_and_zeros", sz.transpose(0, 1).contiguous().to(sdt))
            self._gemm_scales: tuple[torch.Tensor, torch.Tensor] | None = None
        else:
            # our layout (slotune/kernels/quant_matmul.py): [N, K/2] uint8, low nibble = even k
            self.register_buffer("packed", (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous())
            self.register_buffer("scales", scale.view(n, -1).to(sdt).contiguous())  # [N, K/g]
            self.register_buffer("mins", lo.view(n, -1).to(sdt).contiguous())  # [N, K/g]

    def dequantize(self) -> torch.Tensor:
        """[N, K] float32 weights the kernel computes with (padding dropped)."""
        b = _cpu_int4_block()
        if self.on_cpu and b and self.n % b == 0:  # unpack the CPU layout (see _dequant_gemm), exactly in float32
            p = self.packed.view(self.n // b, self.k, b // 2)
            q = torch.cat([p & 15, p >> 4], dim=-1).permute(0, 2, 1).reshape(self.n, self.k).float()
            sz = self.scales_and_zeros.float().transpose(0, 1).repeat_interleave(self.group_size, dim=1)  # [N, K, 2]
            w = (q - 8) * sz[..., 0] + sz[..., 1]
        elif self.on_cpu:  # layout-agnostic: multiply by the identity through the kernel (output rounded to bf16)
            eye = torch.eye(self.k, dtype=torch.bfloat16)
            w = (
                torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.packed, self.group_size, self.scales_and_zeros)
                .float()
                .t()
            )
        else:
            q = torch.stack([self.packed & 0xF, self.packed >> 4], dim=-1).view(self.n, -1, self.group_size).float()
            w = (q * self.scales.float()[..., None] + self.mins.float()[..., None]).view(self.n, self.k)
        return w[:, : self.k - self.pad].contiguous()

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.pad:
            x = F.pad(x, (0, self.pad))
        if self.tiles is not None and not self.on_cpu:
            from slotune.kernels.quant_matmul import int4_matmul  # imports triton: the Triton backend's layers only

            return int4_matmul(x, self.packed, self.scales, self.mins, self.group_size, self.tiles)
        if self.on_cpu:
            b = _cpu_int4_block()
            if _rows(x) >= CPU_GEMM_MIN_ROWS["int4"] and b and self.n % b == 0:
                return self._dequant_gemm(x.to(cpu_gemm_dtype())).to(x.dtype)
            return torch.ops.aten._weight_int4pack_mm_for_cpu(
                x.to(torch.bfloat16), self.packed, self.group_size, self.scales_and_zeros
            ).to(x.dtype)
        return F.linear(x, F.pad(self.dequantize(), (0, self.pad)).to(x.dtype))

    def _dequant_gemm(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] @ W^T through a per-call copy of W in x's dtype, in the packed layout's own order.

        torch's CPU int4 pack (`_convert_weight_to_int4pack_for_cpu`, innerKTiles=1) stores
        blocks of B output channels, B = 64 when torch runs AVX-512 code and 32 under AVX2
        (`kernels.cpu_decode.torch_int4_block`): for each k, B/2 bytes whose low nibbles are the
        block's first B/2 channels and high nibbles the rest. Unpacking in that order ([N/B, K, B])
        and multiplying per block (a batched GEMM) avoids a transpose of the weight; tested
        against the kernel.
        """
        n, k, g, b = self.n, self.k, self.group_size, _cpu_int4_block()
        if self._gemm_scales is None or self._gemm_scales[0].dtype != x.dtype:
            sz = self.scales_and_zeros.float()  # [K/g, N, 2]; w = (q - 8) * scale + zero
            scale = sz[..., 0].view(k // g, n // b, b).permute(1, 0, 2).unsqueeze(2)
            offset = (sz[..., 1] - 8 * sz[..., 0]).view(k // g, n // b, b).permute(1, 0, 2).unsqueeze(2)
            self._gemm_scales = (scale.to(x.dtype).contiguous(), offset.to(x.dtype).contiguous())
        scale, offset = self._gemm_scales
        p = self.packed.view(n // b, k, b // 2)
        q = torch.cat([p & 15, p >> 4], dim=-1).view(n // b, k // g, g, b).to(x.dtype)
        w = torch.addcmul(offset, q, scale).view(n // b, k, b)  # [N/B, K, B]
        lead = x.shape[:-1]
        out = torch.matmul(x.reshape(1, -1, k), w)  # [N/B, M, B]
        return out.permute(1, 0, 2).reshape(*lead, n)

    def weight_bytes(self) -> int:
        if self.on_cpu:
            return self.packed.numel() + self.scales_and_zeros.numel() * 2
        return self.packed.numel() + (self.scales.numel() + self.mins.numel()) * self.scales.element_size()


class FP8Linear(_QuantLinear):
    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None = None, tiles: MatmulConfig | None = None
    ) -> None:
        super().__init__(bias)
        w = weight.float()
        scale = (w.abs().amax(dim=1) / FP8_MAX).clamp_min(1e-12)
        self.register_buffer("qweight", (w / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn))
        self.register_buffer("scales", scale)  # [N] float32
        self.tiles = tiles  # the Triton backend's: decode-sized batches use slotune/kernels/quant_matmul.py

    def _use_scaled_mm(self, x: torch.Tensor) -> bool:
        return x.device.type == "cuda" and torch.cuda.get_device_capability(x.device) >= (8, 9)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.tiles is not None and x.numel() <= 16 * x.shape[-1]:
            # Decode: weight-only fp8 (bf16 activations, no per-call activation quantization).
            from slotune.kernels.quant_matmul import fp8_matmul  # imports triton: the Triton backend's layers only

            return fp8_matmul(x, self.qweight, self.scales, self.tiles)
        if self._use_scaled_mm(x):
            # Per-token activation scales, per-channel weight scales; both fp8 e4m3.
            x2 = x.reshape(-1, x.shape[-1])
            xs = (x2.abs().amax(dim=1, keepdim=True).float() / FP8_MAX).clamp_min(1e-12)
            xq = (x2.float() / xs).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
            out = torch._scaled_mm(xq, self.qweight.t(), scale_a=xs, scale_b=self.scales[None, :], out_dtype=x.dtype)
            return out.view(*x.shape[:-1], -1)
        return F.linear(x, (self.qweight.to(torch.float32) * self.scales[:, None]).to(x.dtype))

    def dequantize(self) -> torch.Tensor:
        return self.qweight.float() * self.scales[:, None]

    def weight_bytes(self) -> int:
        return self.qweight.numel() + self.scales.numel() * 4


def quantize_linear(lin: Linear, method: str, group_size: int, tiles: MatmulConfig | None = None) -> nn.Module:
    """tiles: the Triton quantized-matmul tiles the layer multiplies with (None: torch's matmuls)."""
    w, b = lin.weight.data, None if lin.bias is None else lin.bias.data
    if method == "int8":
        return Int8Linear(w, b, tiles)
    if method == "int4":
        return Int4Linear(w, group_size, b, tiles)
    if method == "fp8":
        return FP8Linear(w, b, tiles)
    raise ValueError(f"unknown quantization '{method}' (none|int8|int4|fp8)")


LM_HEAD_METHOD = "int8"  # why int8: docs/design/engine-quantization.md


def quantize_model(
    model: nn.Module,
    method: str,
    group_size: int = 64,
    lm_head: str | None = LM_HEAD_METHOD,
    tiles: MatmulConfig | None = None,
) -> nn.Module:
    """Replace every Linear in place: projections with `method`, the LM head with `lm_head`
    (None = the same method, "none" = keep it dense). Returns the model.

    The one conversion a built model goes through (gpt-fast's "convert modules for runtime"), done
    by the runner right after construction: the quantized modules take the backend's matmul
    `tiles` as they are built, and nothing changes them afterwards.

    A tied LM head is quantized from the embedding; the embedding itself stays dense (decode
    gathers one row of it per token, so its bytes do not count toward a step).
    """
    if method == "none":
        return model
    for _, mod in list(model.named_modules()):
        for child_name, child in list(mod.named_children()):
            if not isinstance(child, Linear):
                continue
            m = (lm_head or method) if child_name == "lm_head" else method
            if m != "none":
                setattr(mod, child_name, quantize_linear(child, m, group_size, tiles))
    return model
