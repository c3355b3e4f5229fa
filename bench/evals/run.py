"""Reproduce bench/evals/results-<date>.md: every bundled task's baseline score vs chance and CPU
runtime, and the scores of quantized configs against the baseline (paired drops, SEs).

Usage: python bench/evals/run.py [--limit N] [--configs baseline,int8,int4,int4-g64,kv-int8,kv-fp8] [--out DIR]
Each config loads its own engine; the baseline's numbers come from a fresh cache folder, so
the first (baseline) row also times the baseline computation.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import tempfile
import time
from pathlib import Path

CONFIGS = {
    "baseline": {},
    "int8": {"quantization": "int8"},
    "int4": {"quantization": "int4", "quant_group_size": 32},  # the bundled GGUF's own grouping (Q4_1)
    "int4-g64": {"quantization": "int4", "quant_group_size": 64},  # coarser: should lose quality
    "kv-int8": {"kv_dtype": "int8"},
    "kv-fp8": {"kv_dtype": "fp8"},
}
TASK_METRIC = {
    "slotune_arithmetic_1digit": "acc",
    "slotune_arithmetic_1digit_gen": "exact_match",
    "slotune_general_knowledge": "acc",
    "slotune_code_line_description": "acc_norm",
    "slotune_kjv_perplexity": "word_perplexity",
}


def chance(task: str) -> float | None:
    from slotune.evals.tasks import data_dir

    folder = data_dir() / task.removeprefix("slotune_")
    if task.endswith("_gen") or task.endswith("perplexity"):
        return None
    rows = [json.loads(x) for x in (folder / "test.jsonl").read_text().splitlines() if x.strip()]
    return sum(1 / len(r["choices"]) for r in rows) / len(rows)


def machine() -> str:
    try:
        model = next(
            ln.split(":", 1)[1].strip()
            for ln in Path("/proc/cpuinfo").read_text().splitlines()
            if ln.startswith("model name")
        )
    except (OSError, StopIteration):
        model = platform.processor()
    import torch

    return f"{model}, {os.cpu_count()} cores, torch {torch.__version__} ({torch.get_num_threads()} threads), no GPU"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--limit", type=int, default=None, help="documents per task (default all)")
    ap.add_argument("--prompts", type=int, default=32, help="agreement prompts")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--out", type=Path, default=Path(__file__).parent)
    args = ap.parse_args()

    from slotune.engine import LLM, EngineConfig
    from slotune.evals.gate_spec import GateSpec
    from slotune.evals.gates import evaluate_gates

    gates = [GateSpec(name="agreement", kind="agreement", min_top1=0.0, max_mean_kl=100.0, limit=args.prompts)]
    for task, metric in TASK_METRIC.items():
        kind = "perplexity" if metric.endswith("perplexity") else "lm_eval"
        gates.append(
            GateSpec(
                name=task.removeprefix("slotune_"),
                kind=kind,
                task=task,
                metric=metric,
                limit=args.limit,
                max_rel_drop=10.0,
            )
        )
    cache = Path(tempfile.mkdtemp(prefix="slotune-evals-bench-"))
    base = EngineConfig(device="cpu", num_kv_blocks=256, max_model_len=1024)
    rows = []
    load0 = os.getloadavg()
    for name in args.configs.split(","):
        cfg = base.with_updates(CONFIGS[name])
        t0 = time.perf_counter()
        llm = LLM(cfg)
        load_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        report = evaluate_gates(cfg, gates, llm=llm, cache_dir=cache)
        total_s = time.perf_counter() - t0
        rows.append(
            {
                "config": name,
                "overrides": CONFIGS[name],
                "load_s": load_s,
                "total_s": total_s,
                "gates": report.to_dict()["gates"],
                "loadavg": os.getloadavg(),
            }
        )
        print(json.dumps(rows[-1]["gates"], default=str)[:2000], flush=True)
        del llm
    date = dt.date.today().isoformat()
    meta = {
        "date": date,
        "machine": machine(),
        "limit": args.limit,
        "prompts": args.prompts,
        "loadavg_start": load0,
        "git": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
    }
    (args.out / f"results-{date}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=str))
    (args.out / f"results-{date}.md").write_text(render(meta, rows))
    print((args.out / f"results-{date}.md").read_text())


def render(meta: dict, rows: list[dict]) -> str:
    f = lambda v, d=3: "-" if v is None else f"{v:.{d}f}"  # noqa: E731
    out = [
        f"# Quality gates: bundled tasks on SmolLM2-135M ({meta['date']})",
        "",
        f"Machine: {meta['machine']}. Commit {meta['git']}. Documents per task: {meta['limit'] or 'all'}; "
        f"agreement prompts: {meta['prompts']} x 64 tokens. Reproduce: `python bench/evals/run.py`.",
        f"Load average at start {tuple(round(x, 1) for x in meta['loadavg_start'])}: runtimes are "
        "wall-clock on a shared machine and only comparable within this file.",
        "",
    ]
    base = rows[0]
    out += [
        "## Baseline score vs chance, and CPU runtime",
        "",
        "| task | metric | items | baseline | chance | stderr | runtime (s) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for g in base["gates"]:
        task = g["details"].get("task")
        ch = chance(task) if task else None
        se = None
        if g["kind"] == "lm_eval" and g["baseline"] is not None:
            p = g["baseline"]
            se = (p * (1 - p) / max(g["num_items"], 1)) ** 0.5  # binomial SE of the baseline score
        out.append(
            f"| {g['name']} | {g['metric']} | {g['num_items']} | {f(g['baseline'])} | {f(ch)} | {f(se)} | "
            f"{g['seconds']:.1f} |"
        )
    out += ["", "Agreement of the baseline with itself is 1 by construction; its runtime is the candidate pass.", ""]
    out += [
        "## Quantized configs vs baseline",
        "",
        "drop = baseline - candidate (accuracy) or candidate - baseline (perplexity, KL); stderr is paired "
        "(same items under both configs).",
        "",
    ]
    names = [g["name"] for g in base["gates"]]
    out += [
        "| config | load (s) | " + " | ".join(names) + " |",
        "| --- | --- | " + " | ".join("---" for _ in names) + " |",
    ]
    for r in rows:
        cells = []
        for g in r["gates"]:
            if g["candidate"] is None:
                cells.append("error")
            elif g["kind"] == "agreement":
                cells.append(f"top1 {f(g['candidate'])} (se {f(g['stderr'])}), KL {f(g['details']['mean_kl'], 4)}")
            else:
                cells.append(f"{f(g['candidate'])} (drop {f(g['drop'])} +- {f(g['stderr'])})")
        out.append(f"| {r['config']} | {r['load_s']:.1f} | " + " | ".join(cells) + " |")
    out += [
        "",
        "## Runtime per gate (s, candidate pass)",
        "",
        "| config | " + " | ".join(names) + " | total incl. baseline |",
        "| --- | " + " | ".join("---" for _ in names) + " | --- |",
    ]
    for r in rows:
        out.append(
            f"| {r['config']} | " + " | ".join(f"{g['seconds']:.1f}" for g in r["gates"]) + f" | {r['total_s']:.0f} |"
        )
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    main()
