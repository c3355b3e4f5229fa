"""Native decode step vs torch eager ops, per config and batch rows (bench/engine/native-avx2-2026-11-24.md).

Two engines per config over the same GGUF (kernels.backend native and torch), each holding `rows`
sequences in decode; their `step()`s alternate (A B, then B A) so load on the shared machine hits
both alike; medians of `--repeats` steps each and the ratio. The native engine's row limit
(MAX_NATIVE_ROWS) is lifted so every step runs natively: this is how the crossovers are measured.
Batch-1 roofline: weight_bytes / native step time / read bandwidth (bench/bandwidth.py, measured
right before each config).

    .venv/bin/python bench/engine/native_avx2.py --configs int8-act,int4-act,bf16 --rows 1,16,64
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from slotune.engine import EngineConfig, SamplingParams  # noqa: E402
from slotune.engine.llm_engine import LLMEngine  # noqa: E402

from bench.bandwidth import read_bandwidth_gbs  # noqa: E402

CONFIGS = {
    "int8-act": {"dtype": "bfloat16", "quantization": "int8", "kernels": {"int8_activations": True}},
    "int4-act": {
        "dtype": "bfloat16",
        "quantization": "int4",
        "quant_group_size": 32,
        "kernels": {"int8_activations": True},
    },
    "bf16": {"dtype": "bfloat16"},
    "int8": {"dtype": "bfloat16", "quantization": "int8"},
    "int4": {"dtype": "bfloat16", "quantization": "int4", "quant_group_size": 32},
    "fp32": {"dtype": "float32"},
}
PROMPT_LEN = 32


def _engine(
    overrides: dict, backend: str, rows: int, steps: int, model: str = "smollm2-135m", prompt_len: int = PROMPT_LEN
) -> LLMEngine:
    kernels = {**overrides.get("kernels", {}), "backend": backend}
    cfg = EngineConfig(model=model).with_updates(
        {
            **overrides,
            "kernels": kernels,
            "max_num_seqs": rows,
            "max_model_len": max(512, prompt_len + steps + 16),
            "block_size": 16,
            "num_kv_blocks": rows * (-(-(prompt_len + steps + 8) // 16)) + 8,
        }
    )
    engine = LLMEngine(cfg)
    if engine.runner.native is not None:
        engine.runner.native.max_native_rows = None  # measure past the limit: every row native
    params = SamplingParams(max_tokens=steps + 8, ignore_eos=True)
    for i in range(rows):
        engine.add_request(f"r{i}", [(37 * i + 11 * j + 5) % 40000 for j in range(prompt_len)], params)
    while any(s.num_computed_tokens < prompt_len for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()  # prefill (chunked), until every sequence decodes
    return engine


def _timed_step(engine: LLMEngine) -> float:
    t = time.perf_counter()
    engine.step()
    return time.perf_counter() - t


def bench(name: str, rows: int, repeats: int) -> dict:
    native, plain = (_engine(CONFIGS[name], b, rows, 2 * repeats + 4) for b in ("native", "torch"))
    assert native.runner.backend == "native" and plain.runner.backend == "torch"
    for e in (native, plain):
        _timed_step(e), _timed_step(e)  # warm-up
    tn, tt = [], []
    for r in range(repeats):
        pair = (native, plain) if r % 2 == 0 else (plain, native)
        for e in pair:
            (tn if e is native else tt).append(_timed_step(e))
    res = {
        "config": name,
        "rows": rows,
        "native_ms": 1e3 * statistics.median(tn),
        "torch_ms": 1e3 * statistics.median(tt),
        "runs_native_ms": [1e3 * t for t in tn],
        "runs_torch_ms": [1e3 * t for t in tt],
        "weight_bytes": native.weight_bytes,
        "loadavg": os.getloadavg()[0],
    }
    res["speedup"] = res["torch_ms"] / res["native_ms"]
    if rows == 1:
        bw = read_bandwidth_gbs()
        res |= {
            "read_bandwidth_gbs": bw,
            "roofline_fraction": native.weight_bytes / (res["native_ms"] / 1e3) / (bw * 1e9),
        }
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="int8-act,int4-act,bf16")
    ap.add_argument("--rows", default="1,16,64")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", type=Path, default=None, help="append one JSON line per result")
    args = ap.parse_args()
    for name in args.configs.split(","):
        for rows in map(int, args.rows.split(",")):
            res = bench(name, rows, args.repeats)
            line = (
                f"{name:9s} rows {rows:3d}: native {res['native_ms']:7.1f} ms  torch {res['torch_ms']:7.1f} ms  "
                f"x{res['speedup']:.2f}  load {res['loadavg']:.1f}"
            )
            if rows == 1:
                line += f"  roofline {res['roofline_fraction']:.0%} of {res['read_bandwidth_gbs']:.1f} GB/s"
            print(line, flush=True)
            if args.out:
                with args.out.open("a") as f:
                    f.write(json.dumps(res) + "\n")


if __name__ == "__main__":
    main()
