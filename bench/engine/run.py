"""Engine benchmarks on CPU, side by side in one run (medians of interleaved repeats).

(a) continuous vs static batching (EngineConfig.scheduling) on the mixed-length built-in
    workload `batch-mixed`, replayed with `run_in_process_replay`: ratio of output tokens/s.
(b) our engine vs transformers `generate` on the same GGUF weights, both float32:
    batch 1 (one request) and 16 concurrent requests. Ours: 16 requests submitted at once to
    the continuous-batching engine. transformers: one batched `generate` call on the same 16
    prompts (equal lengths, so its left-padding wastes nothing: the comparison is as kind to
    transformers as it can be). Both greedy, `min_new_tokens = max_new_tokens` so every request
    produces exactly N tokens; tokens/s counts output tokens over wall time, prefill included.
(c) batch-1 decode tokens/s (1 / median TPOT, prefill excluded) as a fraction of the
    memory-bandwidth roofline: weight_bytes x tokens/s / read bandwidth (bench/bandwidth.py).
(d) levers (skip with --no-levers): weight quantization and KV precision at batch 1 and 16.

The machine is shared and noisy, so configurations are interleaved inside every repeat and
we report medians and ratios of medians; the load average before and after is recorded.

Usage: .venv/bin/python bench/engine/run.py [--repeats 3] [--no-levers] [--out bench/engine]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.bandwidth import read_bandwidth_gbs  # noqa: E402
from slotune.engine import LLM, EngineConfig, SamplingParams  # noqa: E402
from slotune.engine.llm_engine import LLMEngine  # noqa: E402
from slotune.engine.loader import resolve_model_path  # noqa: E402
from slotune.tuner.measure.in_process_replay import run_in_process_replay  # noqa: E402
from slotune.tuner.spec.workload_spec import WorkloadSpec  # noqa: E402
from slotune.tuner.workload.requests import generate_requests  # noqa: E402

MACHINE = "2-core Intel Xeon (AVX-512/AMX), no GPU"
COMMAND = ".venv/bin/python bench/engine/run.py --repeats 3"
med = statistics.median


def matmul_gflops(n: int = 2048, repeats: int = 5) -> float:
    """fp32 GEMM throughput: the compute ceiling for batched decode on this machine."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        a @ b
        ts.append(time.perf_counter() - t)
    return 2 * n**3 / min(ts) / 1e9


def ours(llm, prompts: list[list[int]], n: int) -> tuple[float, float]:
    """(output tokens/s incl. prefill, decode tokens/s of one sequence = 1 / median TPOT)."""
    t = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=n, ignore_eos=True))
    wall = time.perf_counter() - t
    assert all(len(o.output_token_ids) == n for o in outs)
    return len(prompts) * n / wall, 1.0 / med([o.metrics.tpot for o in outs])


def theirs(model, prompts: list[list[int]], n: int, pad_id: int) -> float:
    """transformers generate: one left-padded batch of all prompts; output tokens/s incl. prefill."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    t = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=pad_id
        )
    wall = time.perf_counter() - t
    assert out.shape[1] == width + n
    return len(prompts) * n / wall


def static_twin(llm: LLM):
    """A static-batching engine sharing `llm`'s loaded weights and KV cache tensor (runs are sequential)."""
    cfg = llm.config.with_updates({"scheduling": "static"})
    engine = LLMEngine(cfg, runner=llm.engine.runner, tokenizer=llm.tokenizer)
    return SimpleNamespace(config=cfg, engine=engine, tokenizer=llm.tokenizer)


def bench_batching(llm: LLM, repeats: int) -> dict:
    wl = WorkloadSpec.load("batch-mixed")
    static = static_twin(llm)
    runs: dict[str, list[dict]] = {"continuous": [], "static": []}
    for i in range(repeats):
        order = (("continuous", llm), ("static", static)) if i % 2 == 0 else (("static", static), ("continuous", llm))
        for name, target in order:
            m = run_in_process_replay(target.config, wl, llm=target).metrics
            runs[name].append(m)
            print(f"  (a) {name}: {m['output_tokens_per_s']:.1f} tok/s, ttft p50 {m['ttft_p50']:.2f} s", flush=True)
    out = {
        "workload": f"batch-mixed ({wl.num_requests} requests, closed loop, concurrency {wl.concurrency}, "
        f"lognormal prompt ~{wl.prompt_len.mean:g} / output ~{wl.output_len.mean:g} tokens)",
        "max_num_seqs": llm.config.max_num_seqs,
    }
    for name, ms in runs.items():
        out[name] = {
            "output_tokens_per_s": med([m["output_tokens_per_s"] for m in ms]),
            "runs_output_tokens_per_s": [m["output_tokens_per_s"] for m in ms],
            "ttft_p50_s": med([m["ttft_p50"] for m in ms]),
            "ttft_p99_s": med([m["ttft_p99"] for m in ms]),
            "tpot_p50_s": med([m["tpot_p50"] for m in ms]),
            "e2e_p50_s": med([m["e2e_p50"] for m in ms]),
        }
    out["ratio"] = out["continuous"]["output_tokens_per_s"] / out["static"]["output_tokens_per_s"]
    return out


def bench_vs_transformers(llm: LLM, repeats: int, n: int, prompt_len: int) -> dict:
    import transformers

    path = resolve_model_path(llm.config.model)
    t = time.perf_counter()
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    load_s = time.perf_counter() - t
    reqs = generate_requests(
        WorkloadSpec(num_requests=16, warmup_requests=0, prompt_len={"kind": "fixed", "value": prompt_len}),
        llm.tokenizer,
    )
    prompts = [r.prompt_token_ids for r in reqs]
    pad = llm.tokenizer.eos_token_id or 0
    ours(llm, prompts[:1], 4), theirs(hf, prompts[:1], 4, pad)  # warm-up both
    res = {b: {"ours": [], "transformers": []} for b in ("batch1", "batch16")}
    for i in range(repeats):
        for b, ps in (("batch1", prompts[:1]), ("batch16", prompts)):
            pair = [("ours", lambda: ours(llm, ps, n)[0]), ("transformers", lambda: theirs(hf, ps, n, pad))]
            for name, fn in pair if i % 2 == 0 else pair[::-1]:
                res[b][name].append(fn())
                print(f"  (b) {b} {name}: {res[b][name][-1]:.1f} tok/s", flush=True)
    hf = None  # frees the model before the GEMM measurement
    # Batched decode is compute-bound: ~2 FLOPs per weight per token (attention is small at these lengths).
    gflops = matmul_gflops()
    flops_per_token = 2 * llm.engine.weight_bytes / 4
    out = {
        "gemm_gflops": gflops,
        "compute_ceiling_tps": gflops * 1e9 / flops_per_token,
        "dtype": "float32",
        "prompt_len": prompt_len,
        "new_tokens": n,
        "transformers": transformers.__version__,
        "transformers_load_s": load_s,
    }
    for b, r in res.items():
        out[b] = {
            "ours_tps": med(r["ours"]),
            "transformers_tps": med(r["transformers"]),
            "runs_ours": r["ours"],
            "runs_transformers": r["transformers"],
            "ratio": med(r["ours"]) / med(r["transformers"]),
        }
    return out


def bench_roofline(llm: LLM, repeats: int, n: int, prompt: list[int]) -> dict:
    # Bandwidth is measured right before each decode run, so both see the same machine load.
    wb = llm.engine.weight_bytes
    bws, decode = [], []
    for _ in range(repeats):
        bws.append(read_bandwidth_gbs())
        decode.append(ours(llm, [prompt], n)[1])
    bw, tps = med(bws), med(decode)
    return {
        "read_bandwidth_gbs": bw,
        "runs_read_bandwidth_gbs": bws,
        "weight_bytes": wb,
        "batch1_decode_tps": tps,
        "runs_decode_tps": decode,
        "batch1_tpot_ms": 1e3 / tps,
        "achieved_gbs": wb * tps / 1e9,
        "fraction": med([wb * t / 1e9 / b for t, b in zip(decode, bws)]),
        "roofline_tps": bw * 1e9 / wb,
    }


def bench_levers(base: LLM, repeats: int, n: int, prompts: list[list[int]], bw: float) -> dict:
    levers = {}
    for name, over in (
        ("fp32", {}),
        ("bf16", {"dtype": "bfloat16"}),
        ("int8", {"quantization": "int8"}),
        ("int4", {"quantization": "int4", "quant_group_size": 64}),
        ("kv_int8", {"kv_dtype": "int8"}),
    ):
        e = base if not over else LLM(base.config.with_updates(over))
        ours(e, prompts[:1], 4)
        b1 = med([ours(e, prompts[:1], n)[1] for _ in range(repeats)])
        b16 = med([ours(e, prompts, n)[0] for _ in range(repeats)])
        wb = e.engine.weight_bytes
        levers[name] = {
            "weight_bytes": wb,
            "kv_bytes_per_token": e.engine.kv_bytes_per_token,
            "batch1_decode_tps": b1,
            "batch1_tpot_ms": 1e3 / b1,
            "batch16_tps": b16,
            "achieved_gbs": wb * b1 / 1e9,
            "roofline_fraction": wb * b1 / 1e9 / bw,
        }  # bw: from (c)
        print(f"  (d) {name}: batch-1 decode {b1:.1f} tok/s, 16 concurrent {b16:.1f} tok/s", flush=True)
        if e is not base:
            del e
    return levers


def write_markdown(res: dict, path: Path) -> None:
    a, b, c = res["batching"], res["vs_transformers"], res["roofline"]
    lines = [
        f"# Engine benchmark: {res['date']}, {res['machine']}",
        "",
        f"torch {res['torch']}, {res['threads']} threads, transformers {b['transformers']}, model {res['model']} "
        f"(float32). Load average {res['load_before']} before, {res['load_after']} after (shared machine).",
        "",
        f"Command: `{COMMAND}` ({res['repeats']} interleaved repeats, medians; {res['wall_s']:.0f} s wall).",
        "",
        "| comparison | ours | baseline | ratio | goal |",
        "|---|---|---|---|---|",
        f"| (a) continuous vs static batching, output tok/s, {a['workload']} | {a['continuous']['output_tokens_per_s']:.1f} "
        f"| {a['static']['output_tokens_per_s']:.1f} | **{a['ratio']:.2f}x** | >= 2x |",
        f"| (b) vs transformers `generate`, batch 1, output tok/s | {b['batch1']['ours_tps']:.1f} | "
        f"{b['batch1']['transformers_tps']:.1f} | **{b['batch1']['ratio']:.2f}x** | >= 1.5x |",
        f"| (b) vs transformers `generate`, 16 concurrent (one padded batch for transformers), output tok/s | "
        f"{b['batch16']['ours_tps']:.1f} | {b['batch16']['transformers_tps']:.1f} | **{b['batch16']['ratio']:.2f}x** | >= 5x |",
        "",
        f"(b): prompts of {b['prompt_len']} tokens from the bundled corpus, {b['new_tokens']} new tokens each, greedy, "
        "prefill included in the wall time. Compute ceiling for batched decode: fp32 GEMM "
        f"{b['gemm_gflops']:.0f} GFLOP/s / (2 FLOPs x {res['roofline']['weight_bytes'] / 4e6:.0f} M weights) = "
        f"{b['compute_ceiling_tps']:.0f} tok/s, i.e. at most {b['compute_ceiling_tps'] / b['batch16']['transformers_tps']:.1f}x "
        "transformers' 16-batch rate for any engine on this CPU.",
        "",
        f"(a) latency medians: continuous TTFT p50 {a['continuous']['ttft_p50_s']:.2f} s / p99 {a['continuous']['ttft_p99_s']:.2f} s, "
        f"TPOT p50 {a['continuous']['tpot_p50_s'] * 1e3:.0f} ms; static TTFT p50 {a['static']['ttft_p50_s']:.2f} s / "
        f"p99 {a['static']['ttft_p99_s']:.2f} s, TPOT p50 {a['static']['tpot_p50_s'] * 1e3:.0f} ms.",
        "",
        "## (c) Batch-1 decode vs the memory-bandwidth roofline",
        "",
        f"Read bandwidth (bench/bandwidth.py: a float32 sum over 4x the last-level cache, best of 7, median over repeats): "
        f"**{c['read_bandwidth_gbs']:.1f} GB/s**. "
        f"Weights {c['weight_bytes'] / 1e6:.0f} MB float32, so the roofline is {c['roofline_tps']:.1f} tok/s.",
        "",
        f"Batch-1 decode: {c['batch1_decode_tps']:.1f} tok/s (TPOT {c['batch1_tpot_ms']:.1f} ms) = "
        f"{c['achieved_gbs']:.1f} GB/s of weights = **{c['fraction']:.0%} of the roofline** (median of per-repeat fractions, each against the bandwidth measured just before it).",
        "",
    ]
    if res.get("levers"):
        lines += [
            "## (d) Levers",
            "",
            "| config | weight MB | KV bytes/token | batch-1 TPOT ms | batch-1 decode tok/s | weight GB/s | roofline | "
            "16 concurrent tok/s |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for name, v in res["levers"].items():
            lines.append(
                f"| {name} | {v['weight_bytes'] / 1e6:.0f} | {v['kv_bytes_per_token']} | {v['batch1_tpot_ms']:.1f} | "
                f"{v['batch1_decode_tps']:.1f} | {v['achieved_gbs']:.1f} | {v['roofline_fraction']:.0%} | "
                f"{v['batch16_tps']:.1f} |"
            )
        lines.append("")
    lines += ["Where the time goes, and what the numbers mean: see README.md in this folder.", ""]
    path.write_text("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--no-levers", action="store_true")
    ap.add_argument("--only", choices=["a", "b", "c"], default=None, help="run one section (no files written)")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent)
    args = ap.parse_args()
    t_start = time.perf_counter()
    res: dict = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        "machine": MACHINE,
        "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "repeats": args.repeats,
        "load_before": round(os.getloadavg()[0], 1),
    }
    cfg = EngineConfig(dtype="float32", max_num_seqs=32, num_kv_blocks=1024)
    llm = LLM(cfg)
    res["model"] = cfg.model
    res["config"] = cfg.model_dump(mode="json")
    prompt = generate_requests(
        WorkloadSpec(num_requests=1, warmup_requests=0, prompt_len={"kind": "fixed", "value": 64}), llm.tokenizer
    )[0].prompt_token_ids
    if args.only in (None, "a"):
        print("(a) continuous vs static batching", flush=True)
        res["batching"] = bench_batching(llm, args.repeats)
        print(f"  ratio {res['batching']['ratio']:.2f}x", flush=True)
    if args.only in (None, "b"):
        print("(b) vs transformers", flush=True)
        res["vs_transformers"] = bench_vs_transformers(llm, args.repeats, args.new_tokens, 64)
        print(
            f"  ratios {res['vs_transformers']['batch1']['ratio']:.2f}x / {res['vs_transformers']['batch16']['ratio']:.2f}x",
            flush=True,
        )
    if args.only in (None, "c"):
        print("(c) roofline", flush=True)
        res["roofline"] = bench_roofline(llm, args.repeats, args.new_tokens, prompt)
        print(f"  {res['roofline']['fraction']:.0%} of {res['roofline']['read_bandwidth_gbs']:.1f} GB/s", flush=True)
    if args.only:
        print(json.dumps(res, indent=1))
        return
    if not args.no_levers:
        print("(d) levers", flush=True)
        prompts = [
            r.prompt_token_ids
            for r in generate_requests(
                WorkloadSpec(num_requests=16, warmup_requests=0, prompt_len={"kind": "fixed", "value": 64}),
                llm.tokenizer,
            )
        ]
        res["levers"] = bench_levers(llm, args.repeats, args.new_tokens, prompts, res["roofline"]["read_bandwidth_gbs"])
    res["load_after"] = round(os.getloadavg()[0], 1)
    res["wall_s"] = time.perf_counter() - t_start
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"results-{res['date']}-cpu"
    (args.out / f"{stem}.json").write_text(json.dumps(res, indent=1))
    write_markdown(res, args.out / f"{stem}.md")
    print((args.out / f"{stem}.md").read_text())


if __name__ == "__main__":
    main()
