"""Engine benchmarks, side by side in one run (medians of interleaved repeats).

(a) continuous vs static batching on a mixed-length workload (output tokens/s)
(b) our engine vs transformers `generate` on the same weights and dtype, batch 1 and 16
(c) batch-1 decode tokens/s as a fraction of the memory-bandwidth roofline
(d) weight-quantization and KV-precision levers at batch 1 and at saturation

Usage: python bench/engine/run.py [--repeats 3] [--out bench/engine]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from slotune.engine import LLM, EngineConfig, SamplingParams
from slotune.engine.loader import resolve_model_path
from slotune.tuner.bench import run_benchmark
from slotune.tuner.workload import WorkloadSpec, generate_requests


def copy_bandwidth_gbs() -> float:
    x = torch.randn(64 * 2**20)  # 256 MiB
    y = torch.empty_like(x)
    ts = []
    for _ in range(7):
        t = time.perf_counter()
        y.copy_(x)
        ts.append(time.perf_counter() - t)
    return 2 * x.numel() * 4 / statistics.median(ts) / 1e9  # read + write


def decode_tps(llm: LLM, prompts: list[list[int]], n: int) -> float:
    p = SamplingParams(max_tokens=n, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate(prompts, p)
    return sum(len(o.output_token_ids) for o in outs) / (time.perf_counter() - t)


def hf_tps(model, prompts: list[list[int]], n: int, pad_id: int) -> float:
    """transformers generate: batch 1 per prompt, or one left-padded batch of all prompts."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    t = time.perf_counter()
    with torch.no_grad():
        model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=pad_id)
    return len(prompts) * n / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent)
    args = ap.parse_args()
    res: dict = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
                 "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, no GPU",
                 "torch": torch.__version__}

    # (a) continuous vs static, same engine weights, interleaved
    wl = WorkloadSpec.load("batch-mixed")
    llm = LLM(EngineConfig(max_num_seqs=32, num_kv_blocks=1024))
    cont, stat = [], []
    for _ in range(args.repeats):
        for mode, acc in (("continuous", cont), ("static", stat)):
            llm.engine.scheduler.static_batching = mode == "static"
            acc.append(run_benchmark(llm.config, wl, llm=llm).metrics["output_tokens_per_s"])
    llm.engine.scheduler.static_batching = False
    res["batching"] = {"workload": "batch-mixed (48 requests, concurrency 32, lognormal lengths)",
                       "continuous_tps": statistics.median(cont), "static_tps": statistics.median(stat),
                       "ratio": statistics.median(cont) / statistics.median(stat)}
    print("batching", res["batching"], flush=True)

    # (b) vs transformers, float32 both
    import transformers

    path = resolve_model_path("smollm2-135m")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    reqs = generate_requests(WorkloadSpec(num_requests=16, warmup_requests=0, prompt_len={"kind": "fixed", "value": 64}),
                             llm.tokenizer)
    prompts = [r.prompt_token_ids for r in reqs]
    n = 64
    ours1, theirs1, ours16, theirs16 = [], [], [], []
    decode_tps(llm, prompts[:1], 4)
    hf_tps(hf, prompts[:1], 4, 2)
    for _ in range(args.repeats):
        ours1.append(decode_tps(llm, prompts[:1], n))
        theirs1.append(hf_tps(hf, prompts[:1], n, 2))
        ours16.append(decode_tps(llm, prompts, n))
        theirs16.append(hf_tps(hf, prompts, n, 2))
    med = statistics.median
    res["vs_transformers"] = {"dtype": "float32", "new_tokens": n, "prompt_len": 64,
                              "batch1": {"ours_tps": med(ours1), "hf_tps": med(theirs1), "ratio": med(ours1) / med(theirs1)},
                              "batch16": {"ours_tps": med(ours16), "hf_tps": med(theirs16), "ratio": med(ours16) / med(theirs16)}}
    print("vs transformers", res["vs_transformers"], flush=True)
    del hf

    # (c) roofline at batch 1
    bw = copy_bandwidth_gbs()
    levers = {}
    for name, over in (("fp32", {}), ("bf16", {"dtype": "bfloat16"}), ("int8", {"quantization": "int8"}),
                       ("int4", {"quantization": "int4", "quant_group_size": 64}), ("kv_int8", {"kv_dtype": "int8"})):
        e = llm if not over else LLM(EngineConfig(max_num_seqs=32, num_kv_blocks=1024, **over))
        decode_tps(e, prompts[:1], 4)
        b1 = med([decode_tps(e, prompts[:1], n) for _ in range(args.repeats)])
        b16 = med([decode_tps(e, prompts, n) for _ in range(args.repeats)])
        wb = e.engine.weight_bytes
        levers[name] = {"weight_bytes": wb, "kv_bytes_per_token": e.engine.kv_bytes_per_token,
                        "batch1_tps": b1, "batch1_tpot_ms": 1e3 / b1, "batch16_tps": b16,
                        "achieved_gbs": wb * b1 / 1e9, "roofline_fraction": wb * b1 / 1e9 / bw}
        print(name, levers[name], flush=True)
    res["copy_bandwidth_gbs"] = bw
    res["levers"] = levers
    res["roofline"] = {"batch1_fraction_fp32": levers["fp32"]["roofline_fraction"], "copy_bandwidth_gbs": bw}

    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"results-{res['date']}-cpu"
    (args.out / f"{stem}.json").write_text(json.dumps(res, indent=1))
    lines = [f"# Engine benchmark ({res['date']}, {res['machine']}, torch {res['torch']})", "",
             "Command: `python bench/engine/run.py --repeats 3` (medians of interleaved repeats).", "",
             "| comparison | ours | reference | ratio |", "|---|---|---|---|",
             f"| continuous vs static batching, output tok/s (batch-mixed) | {res['batching']['continuous_tps']:.1f} | "
             f"{res['batching']['static_tps']:.1f} | {res['batching']['ratio']:.2f}x |",
             f"| vs transformers generate, batch 1, tok/s (fp32) | {res['vs_transformers']['batch1']['ours_tps']:.1f} | "
             f"{res['vs_transformers']['batch1']['hf_tps']:.1f} | {res['vs_transformers']['batch1']['ratio']:.2f}x |",
             f"| vs transformers generate, 16 concurrent, tok/s (fp32) | {res['vs_transformers']['batch16']['ours_tps']:.1f} | "
             f"{res['vs_transformers']['batch16']['hf_tps']:.1f} | {res['vs_transformers']['batch16']['ratio']:.2f}x |", "",
             f"Copy bandwidth (read+write): {bw:.1f} GB/s.", "",
             "| config | weight MB | KV bytes/token | batch-1 TPOT ms | batch-1 tok/s | achieved GB/s | roofline | 16-batch tok/s |",
             "|---|---|---|---|---|---|---|---|"]
    for name, v in levers.items():
        lines.append(f"| {name} | {v['weight_bytes'] / 1e6:.0f} | {v['kv_bytes_per_token']} | {v['batch1_tpot_ms']:.1f} | "
                     f"{v['batch1_tps']:.1f} | {v['achieved_gbs']:.1f} | {v['roofline_fraction']:.0%} | {v['batch16_tps']:.1f} |")
    (args.out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
