"""The machine's own noise: one config, one workload seed, replayed back to back in one process.

    python bench/tuner/noise_floor.py CONFIG.yaml --spec examples/02-batch-throughput/spec.yaml --runs 8

Every replay sends the same requests and the engine schedules them into the same steps (the step
count is printed to show it), so whatever varies between replays is the machine: how fast the same
steps ran. Between replays a fixed GEMM (the model's MLP shape, 512 rows, bf16 and fp32) is timed
for half a second, to show whether slow replays coincide with a slow machine. A tuner cannot
promise any number more closely than this spread; the tuner's goals (goals.py) are read against it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


def gemm_gflops(dtype, seconds: float = 0.5) -> float:
    import torch

    a, w = torch.randn(512, 576, dtype=dtype), torch.randn(1536, 576, dtype=dtype)
    torch.nn.functional.linear(a, w)
    n, t = 0, time.perf_counter()
    while time.perf_counter() - t < seconds:
        torch.nn.functional.linear(a, w)
        n += 1
    return 2 * 512 * 576 * 1536 * n / (time.perf_counter() - t) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config", type=Path, help="EngineConfig YAML or a best.yaml")
    ap.add_argument("--spec", type=Path, required=True, help="tuning spec: its workload, seed and limits")
    ap.add_argument("--runs", type=int, default=8)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    import torch
    from slotune.engine import LLM, SamplingParams
    from slotune.engine.config import EngineConfig
    from slotune.tuner.measure.in_process_replay import run_in_process_replay
    from slotune.tuner.spec.tuning_spec import TuningSpec

    spec = TuningSpec.from_yaml(args.spec)
    obj, key = spec.objective, spec.objective.metric_key()
    cfg = EngineConfig.from_yaml(args.config)
    llm = LLM(cfg)
    llm.generate("Hello", SamplingParams(max_tokens=2))
    engine, steps = llm.engine, []
    engine.add_step_hook(lambda eng, outputs: steps.append(time.perf_counter()) and None)
    rows = []
    for i in range(args.runs):
        fp32, bf16 = gemm_gflops(torch.float32), gemm_gflops(torch.bfloat16)
        steps.clear()
        m = run_in_process_replay(
            cfg,
            spec.workload,
            llm=llm,
            ttft_limit_s=obj.ttft_limit_s,
            tpot_limit_s=obj.tpot_limit_s,
            percentiles=(obj.percentile,),
        ).metrics
        gaps = [b - a for a, b in zip(steps, steps[1:])]
        rows.append(
            {
                key: m[key],
                "duration_s": m["duration_s"],
                "steps": len(steps),
                "median_step_ms": statistics.median(gaps) * 1e3 if gaps else None,
                "gemm_fp32_gflops": fp32,
                "gemm_bf16_gflops": bf16,
            }
        )
        print(
            f"run {i}: {key} {m[key]:.4g}, {m['duration_s']:.2f} s, {len(steps)} steps (median "
            f"{rows[-1]['median_step_ms']:.1f} ms); GEMM before: fp32 {fp32:.0f}, bf16 {bf16:.0f} GFLOP/s",
            flush=True,
        )
    vals = [r[key] for r in rows]
    cv = statistics.pstdev(vals) / statistics.mean(vals)
    g = [r["gemm_bf16_gflops"] for r in rows]
    print(
        f"\n{key}: median {statistics.median(vals):.4g}, min {min(vals):.4g}, max {max(vals):.4g}, "
        f"max/min {max(vals) / min(vals):.2f}, CV {cv:.1%}; step counts {sorted({r['steps'] for r in rows})}; "
        f"bf16 GEMM max/min {max(g) / min(g):.2f}"
    )
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "config": cfg.model_dump(mode="json", exclude_defaults=True),
                    "spec": str(args.spec),
                    "runs": rows,
                    "cv": cv,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
