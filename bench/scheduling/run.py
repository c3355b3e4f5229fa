"""scheduling_policy: fcfs vs shortest_prompt_first on mixed prompt lengths, side by side.

One workload with a long tail of prompt lengths (lognormal, median 64 tokens, sigma 1.2, up to
1024) and Poisson arrivals near the engine's capacity, so requests queue: then the admission
order decides who waits. Both policies run the same config otherwise (each its own engine, built
once), interleaved inside every repeat on the same request seeds; medians over repeats.

Usage: .venv/bin/python bench/scheduling/run.py [--repeats 3] [--rate 6] [--num-requests 60] [--engine JSON]
Writes bench/scheduling/results-DATE-rateR.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
from datetime import datetime, timezone
from pathlib import Path

from slotune.engine import LLM, EngineConfig
from slotune.tuner.measure.in_process_replay import run_in_process_replay
from slotune.tuner.spec.workload_spec import WorkloadSpec

POLICIES = ("fcfs", "shortest_prompt_first")
KEYS = ("ttft_p50", "ttft_p95", "ttft_p99", "ttft_mean", "tpot_p50", "e2e_p95", "output_tokens_per_s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rate", type=float, default=6.0, help="Poisson arrivals, requests/s")
    ap.add_argument("--num-requests", type=int, default=60)
    ap.add_argument(
        "--engine",
        type=json.loads,
        default={},
        help='EngineConfig overrides as JSON, e.g. \'{"kernels": {"int8_activations": true}}\'',
    )
    ap.add_argument("--out", type=Path, default=Path(__file__).parent)
    args = ap.parse_args()

    base = {
        "quantization": "int8",
        "dtype": "bfloat16",
        "max_num_seqs": 8,
        "max_num_batched_tokens": 256,
        "max_model_len": 1280,
        "num_kv_blocks": 8 * 1280 // 16,
        **args.engine,
    }
    llms = {p: LLM(EngineConfig.from_dict({**base, "scheduling_policy": p})) for p in POLICIES}
    rows: dict[str, list[dict[str, float]]] = {p: [] for p in POLICIES}
    load = [os.getloadavg()[0]]
    for r in range(args.repeats):
        wl = WorkloadSpec.load(
            {
                "name": "mixed-prompts",
                "arrivals": "poisson",
                "rate": args.rate,
                "num_requests": args.num_requests,
                "warmup_requests": 2,
                "prompt_len": {"kind": "lognormal", "mean": 64, "sigma": 1.2, "min": 8, "max": 1024},
                "output_len": {"kind": "lognormal", "mean": 32, "sigma": 0.5, "min": 8, "max": 128},
                "seed": r,
            }
        )
        for p in POLICIES if r % 2 == 0 else POLICIES[::-1]:
            m = run_in_process_replay(None, wl, llm=llms[p]).metrics
            rows[p].append({k: m[k] for k in KEYS})
            print(f"[{r}] {p:>22}: " + ", ".join(f"{k} {m[k]:.3f}" for k in KEYS), flush=True)
    load.append(os.getloadavg()[0])

    med = {p: {k: statistics.median(x[k] for x in rows[p]) for k in KEYS} for p in POLICIES}
    date = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    out = {
        "date": date,
        "machine": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "config": base,
        "rate": args.rate,
        "num_requests": args.num_requests,
        "repeats": rows,
        "medians": med,
        "load_avg_before_after": load,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"results-{date}-rate{args.rate:g}.json").write_text(json.dumps(out, indent=2))
    lines = [
        f"# scheduling_policy on mixed prompt lengths ({date}, {os.cpu_count()} CPUs)",
        "",
        f"Command: `python bench/scheduling/run.py --repeats {args.repeats} --rate {args.rate} "
        f"--num-requests {args.num_requests}"
        + (f" --engine '{json.dumps(args.engine)}'" if args.engine else "")
        + f"`. Config: `{json.dumps(base)}`. Workload: Poisson {args.rate} req/s, "
        "prompt lognormal(median 64, sigma 1.2, 8..1024), output lognormal(median 32, sigma 0.5, 8..128); "
        f"medians of {args.repeats} interleaved repeats. Load average before/after: {load[0]:.1f} / {load[1]:.1f}.",
        "",
        "| metric | fcfs | shortest_prompt_first | ratio (spf / fcfs) |",
        "|---|---|---|---|",
    ]
    for k in KEYS:
        a, b = med["fcfs"][k], med["shortest_prompt_first"][k]
        lines.append(f"| {k} | {a:.3f} | {b:.3f} | {b / a:.2f}x |")
    (args.out / f"results-{date}-rate{args.rate:g}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
