"""The prefill path's dequantize + GEMM in bf16 against float32, on SmolLM2's gate_up shape.

torch's bf16 GEMM is fast only where oneDNN has a native bf16 path (AVX-512 BF16, AMX); `cpu_gemm_dtype`
picks float32 elsewhere. Run it as is and with oneDNN capped at AVX2 (what a Zen 3 or an AVX2-only
Xeon has), the two in one session:

    .venv/bin/python bench/engine/cpu_gemm_dtype.py
    ONEDNN_MAX_CPU_ISA=AVX2 .venv/bin/python bench/engine/cpu_gemm_dtype.py

Prints, per layer kind, the median of 9 calls alternating the two dtypes, and their ratio.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from slotune.engine import quantize  # noqa: E402
from slotune.engine.quantize import Int4Linear, Int8Linear  # noqa: E402

ROWS, N, K = 128, 2 * 1536, 576  # a 128-token prefill chunk through SmolLM2-135M's gate_up


def main() -> None:
    torch.manual_seed(0)
    w, x = torch.randn(N, K) * 0.05, torch.randn(ROWS, K)
    native = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    print(
        f"torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()}, oneDNN native bf16: {native}, "
        f"{torch.get_num_threads()} threads, {ROWS} x {K} @ {K} x {N}; picked: {quantize.cpu_gemm_dtype()}"
    )
    for layer in (Int8Linear(w), Int4Linear(w, 32)):
        times: dict[torch.dtype, list[float]] = {torch.bfloat16: [], torch.float32: []}
        for i in range(10):
            for dt in times:
                quantize.cpu_gemm_dtype = lambda dt=dt: dt
                t = time.perf_counter()
                layer(x)
                if i:  # the first round warms up
                    times[dt].append(time.perf_counter() - t)
        bf, f32 = (statistics.median(times[d]) * 1e3 for d in (torch.bfloat16, torch.float32))
        print(f"{type(layer).__name__}: bf16 {bf:.2f} ms, float32 {f32:.2f} ms, bf16 / float32 {bf / f32:.2f}")


if __name__ == "__main__":
    main()
