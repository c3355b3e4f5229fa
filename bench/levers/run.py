"""Every engine lever on/off on the same workloads, one table (CPU).

Rows: the fp32 baseline; weight quantization (bf16, int8, int4 g32/g64, fp8 emulated); KV
precision (int8, fp8); prefix caching; speculative decoding (n-gram, early exit, int4/int8
copies of the target as drafts). Columns (every row runs every workload unless marked):
  weight MB, KV bytes/token, KV blocks in the same 0.25 GiB budget
  batch-1 TPOT (64-token prompt, 24 greedy tokens) and the weight GB/s it implies
  saturation throughput (16 concurrent, 64 in / 16 out, output tokens/s incl. prefill)
  TTFT on a shared 512-token system prompt + distinct ~16-token questions (median of 3, warm)
  spec decode (spec rows + baseline): batch-1 tokens/s on a structured (code/list, repetitive)
    and an open-ended (prose) prompt set, acceptance rate, tokens per verification, speedup
  quality vs the fp32 baseline: top-1 agreement and mean KL(base || cand) over 16 x 63
    8 x 63 positions of real text, teacher-forced *through the paged KV cache* (so KV precision counts)

Timed workloads are interleaved across rows and repeated; medians are reported. The machine
is shared (see load averages in the result), which is why repeats matter.

Usage: python bench/levers/run.py [--repeats 3] [--out bench/levers]
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # shared cores: do not spin-wait (set before torch loads)

import argparse
import itertools
import json
import platform
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
from slotune.engine import LLM, EngineConfig, SamplingParams
from slotune.engine.llm_engine import LLMEngine
from slotune.engine.model_runner import ModelRunner
from slotune.engine.scheduler import ScheduledSeq
from slotune.engine.sequence import Sequence
from slotune.engine.tokenizer import Tokenizer
from slotune.tuner.workload.requests import corpus_token_ids

MACHINE = "2-core Intel Xeon (AVX-512/AMX), no GPU"
BASE = {"max_model_len": 1024, "max_num_seqs": 16, "kv_cache_memory_gb": 0.25}
SPEC_K = 4
NUM_QUALITY_PROMPTS = 8  # x 63 positions
TPOT_TOKENS, SAT_TOKENS, SPEC_TOKENS = 24, 16, 32
ROWS: list[tuple[str, str, dict]] = [  # (name, lever, overrides)
    ("fp32 (baseline)", "-", {}),
    ("bf16", "weights", {"dtype": "bfloat16"}),
    ("int8", "weights", {"quantization": "int8"}),
    ("int4 g32", "weights", {"quantization": "int4", "quant_group_size": 32}),
    ("int4 g64", "weights", {"quantization": "int4", "quant_group_size": 64}),
    ("fp8 (emulated)", "weights", {"quantization": "fp8"}),
    ("kv int8", "kv cache", {"kv_dtype": "int8"}),
    ("kv fp8", "kv cache", {"kv_dtype": "fp8"}),
    ("prefix cache", "prefix", {"enable_prefix_caching": True}),
    ("spec ngram k4", "spec", {"speculative": {"method": "ngram", "num_speculative_tokens": SPEC_K}}),
    (
        "spec early-exit L24 k2",
        "spec",
        {"speculative": {"method": "early_exit", "early_exit_layers": 24, "num_speculative_tokens": 2}},
    ),
    (
        "spec int4-g32-draft k4",
        "spec",
        {
            "quant_group_size": 32,  # only the draft is quantized
            "speculative": {"method": "quantized", "draft_quantization": "int4", "num_speculative_tokens": SPEC_K},
        },
    ),
    (
        "spec int8-draft k4",
        "spec",
        {"speculative": {"method": "quantized", "draft_quantization": "int8", "num_speculative_tokens": SPEC_K}},
    ),
]
CODE = (
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n    return a * b\n\n\n"
    "def div(a, b):\n    if b == 0:\n        raise ZeroDivisionError('b is zero')\n    return a / b\n"
)
STRUCTURED = [  # answers that copy or repeat what the prompt holds
    f"Rewrite this Python code with a one-line docstring added to every function:\n```python\n{CODE}```",
    "Write the weekly schedule for Monday to Friday. Every day is exactly: 9:00 standup, 10:00 code review, "
    "12:00 lunch, 14:00 planning, 17:00 wrap-up. One line per day, in the format 'Day: schedule'.",
    "Convert to a JSON list of objects with keys name and age: Alice 31, Bob 27, Carol 45, Dave 38, Erin 29, Frank 52.",
]
OPEN = [  # free prose
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain in detail why the sky is blue, for a curious ten-year-old.",
    "Describe the history of the printing press and why it mattered.",
]


class _Tokenizers:
    """Reading the GGUF tokenizer costs seconds per engine; load it once."""

    def __init__(self) -> None:
        self.memo: dict[str, Tokenizer] = {}
        self.original = Tokenizer.from_model_path

    def __call__(self, path):
        key = str(path)
        if key not in self.memo:
            self.memo[key] = self.original(path)
        return self.memo[key]


def build(name: str, overrides: dict, shared: LLM | None) -> LLM:
    """An LLM for a row; rows whose weights equal the baseline's share its model object."""
    cfg = EngineConfig().with_updates({**BASE, **overrides})
    if shared is None or cfg.quantization != "none" or cfg.dtype != shared.config.dtype:
        return LLM(cfg)
    llm = LLM.__new__(LLM)
    llm.config = cfg
    llm.engine = LLMEngine(cfg, runner=ModelRunner(cfg, model=shared.engine.runner.model), tokenizer=shared.tokenizer)
    llm.tokenizer = llm.engine.tokenizer
    llm._ids = itertools.count()
    return llm


# --- workloads ---------------------------------------------------------------------------
def tpot_ms(llm: LLM, prompt: list[int], n: int = TPOT_TOKENS) -> float:
    out = llm.generate(prompt, SamplingParams(max_tokens=n, ignore_eos=True))[0]
    t = out.metrics.token_times
    return (t[-1] - t[0]) / (len(t) - 1) * 1e3


def saturation_tps(llm: LLM, prompts: list[list[int]], n: int = SAT_TOKENS) -> float:
    t = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=n, ignore_eos=True))
    return sum(len(o.output_token_ids) for o in outs) / (time.perf_counter() - t)


def shared_prefix_ttft_ms(llm: LLM, system: list[int], questions: list[list[int]]) -> float:
    p = SamplingParams(max_tokens=1)
    llm.generate(system + questions[0], p)  # warm-up (with prefix caching: fills the cache)
    ttfts = []
    for q in questions[1:]:
        m = llm.generate(system + q, p)[0].metrics
        ttfts.append((m.first_token_time - m.arrival_time) * 1e3)
    return statistics.median(ttfts)


def chat(llm: LLM, text: str) -> list[int]:
    return llm.tokenizer.encode(llm.tokenizer.apply_chat_template([{"role": "user", "content": text}]))


def spec_run(llm: LLM, prompts: list[str], n: int = SPEC_TOKENS) -> dict:
    """Batch-1 greedy replies (chat template); decode tokens/s = tokens after the first / time after the first."""
    st0 = llm.engine.stats()
    num, dt = 0, 0.0
    for p in prompts:
        t = llm.generate(chat(llm, p), SamplingParams(max_tokens=n))[0].metrics.token_times
        num, dt = num + len(t) - 1, dt + t[-1] - t[0]
    st = llm.engine.stats()
    drafts = st.num_draft_tokens - st0.num_draft_tokens
    acc = st.num_accepted_tokens - st0.num_accepted_tokens
    ver = st.num_spec_verifications - st0.num_spec_verifications
    return {
        "tps": num / dt if dt else 0.0,
        "tokens": num,
        "acceptance": acc / drafts if drafts else 0.0,
        "tokens_per_verify": (acc + ver) / ver if ver else 1.0,
    }


@torch.inference_mode()
def cache_path_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    """Logits at positions 1..T-1 ([T-1, V]), teacher-forced through the paged KV cache: position 0 is
    prefilled alone, then positions 1..T-1 attend over K/V read back from the (possibly quantized) cache."""
    eng = llm.engine
    runner = eng.runner
    seq = Sequence("quality", ids, SamplingParams(max_tokens=1), 0.0)
    assert eng.block_manager.allocate(seq, len(ids))
    try:
        runner.execute([ScheduledSeq(seq, 1)])
        seq.num_computed_tokens = 1
        (hidden,) = runner.forward_hidden([ScheduledSeq(seq, len(ids) - 1)])
        return runner.model.compute_logits(hidden).float()
    finally:
        eng.block_manager.free_seq(seq)


def agreement(llm: LLM, prompts: list[list[int]], ref: list[torch.Tensor]) -> dict:
    top1, kl = [], []
    for ids, r in zip(prompts, ref):
        c = torch.log_softmax(cache_path_logits(llm, ids), -1)
        top1.append((c.argmax(-1) == r.argmax(-1)).float())
        kl.append((r.exp() * (r - c)).sum(-1))
    return {"top1": torch.cat(top1).mean().item(), "mean_kl": torch.cat(kl).mean().item()}


# --- main ----------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent)
    args = ap.parse_args()
    t_start = time.perf_counter()
    load0 = os.getloadavg()
    Tokenizer.from_model_path = staticmethod(_Tokenizers())  # bench process only

    base = build(ROWS[0][0], ROWS[0][2], None)
    tok = base.tokenizer
    corpus = corpus_token_ids(tok)
    step = (len(corpus) - 64) // 40
    windows = [corpus[i * step : i * step + 64] for i in range(40)]
    b1_prompt, sat_prompts, quality_prompts = windows[0], windows[1:17], windows[17 : 17 + NUM_QUALITY_PROMPTS]
    system = corpus[-600:-88]  # 512 tokens
    questions = [tok.encode(f"\nQuestion {i}: what does the passage above say about item {i}?") for i in range(4)]
    ref = [torch.log_softmax(base.engine.runner.full_logits(ids)[1:].float(), -1) for ids in quality_prompts]

    llms: dict[str, LLM] = {}
    res: dict = {name: {"lever": lever, "overrides": over} for name, lever, over in ROWS}
    for name, _, over in ROWS:
        llms[name] = base if not over else build(name, over, base)
        e = llms[name].engine
        r = res[name]
        r["weight_bytes"] = e.weight_bytes
        r["kv_bytes_per_token"] = e.kv_bytes_per_token
        r["kv_blocks"] = e.runner.num_blocks
        if name == ROWS[0][0]:
            r["top1"], r["mean_kl"] = 1.0, 0.0
        elif e.runner.model is base.engine.runner.model and e.cfg.kv_dtype == "auto":
            r["top1"], r["mean_kl"], r["lossless"] = None, None, True  # same weights and cache: not a quality lever
        else:
            r.update(agreement(llms[name], quality_prompts, ref))
        print(f"[{time.perf_counter() - t_start:.0f}s] {name}: {r}", flush=True)

    timed = {
        name: {"tpot_ms": [], "sat_tps": [], "ttft_ms": [], "spec_structured": [], "spec_open": []} for name in llms
    }
    spec_rows = [n for n, lever, _ in ROWS if lever in ("spec", "-")]
    for rep in range(args.repeats):
        order = list(llms) if rep % 2 == 0 else list(reversed(llms))  # interleave, alternate the order
        for name in order:
            llm, t = llms[name], timed[name]
            if rep == 0:
                llm.generate(b1_prompt, SamplingParams(max_tokens=2))  # warm-up
            t["tpot_ms"].append(tpot_ms(llm, b1_prompt))
            t["sat_tps"].append(saturation_tps(llm, sat_prompts))
            t["ttft_ms"].append(shared_prefix_ttft_ms(llm, system, questions))
            if name in spec_rows:
                t["spec_structured"].append(spec_run(llm, STRUCTURED))
                t["spec_open"].append(spec_run(llm, OPEN))
            print(
                f"[{time.perf_counter() - t_start:.0f}s] repeat {rep} {name}: tpot {t['tpot_ms'][-1]:.1f} ms, sat {t['sat_tps'][-1]:.1f} tok/s, "
                f"ttft {t['ttft_ms'][-1]:.0f} ms",
                flush=True,
            )

    med = statistics.median
    for name, t in timed.items():
        r = res[name]
        r["tpot_ms"] = med(t["tpot_ms"])
        r["weight_gbs"] = r["weight_bytes"] / (r["tpot_ms"] / 1e3) / 1e9
        r["sat_tps"] = med(t["sat_tps"])
        r["ttft_ms"] = med(t["ttft_ms"])
        r["prefix_hit_rate"] = llms[name].engine.stats().prefix_cache_hit_rate
        for kind in ("spec_structured", "spec_open"):
            if t[kind]:
                r[kind] = {k: med(x[k] for x in t[kind]) for k in ("tps", "acceptance", "tokens_per_verify")}
    b = res[ROWS[0][0]]
    for name, r in res.items():
        r["tpot_speedup"] = b["tpot_ms"] / r["tpot_ms"]
        r["sat_ratio"] = r["sat_tps"] / b["sat_tps"]
        r["ttft_ratio"] = r["ttft_ms"] / b["ttft_ms"]
        for kind in ("spec_structured", "spec_open"):
            if kind in r:
                r[kind]["speedup"] = r[kind]["tps"] / b[kind]["tps"]

    meta = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        "machine": MACHINE,
        "platform": platform.platform(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "repeats": args.repeats,
        "loadavg_start": load0,
        "loadavg_end": os.getloadavg(),
        "wall_s": time.perf_counter() - t_start,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"results-{meta['date']}"
    (args.out / f"{stem}.json").write_text(json.dumps({"meta": meta, "rows": res}, indent=1))
    (args.out / f"{stem}.md").write_text(render(meta, res))
    print(render(meta, res))


def render(meta: dict, res: dict) -> str:
    def spec(r, kind):
        if kind not in r:
            return "—"
        s = r[kind]
        if r["lever"] != "spec":
            return f"{s['tps']:.1f} tok/s"
        return f"{s['acceptance']:.0%} acc, {s['tokens_per_verify']:.2f} tok/verify, {s['speedup']:.2f}x"

    lines = [
        f"# Engine levers, on/off ({meta['date']}, {meta['machine']})",
        "",
        f"torch {meta['torch']}, {meta['threads']} threads, SmolLM2-135M-Instruct (bundled GGUF, dequantized). "
        f"Command: `python bench/levers/run.py --repeats {meta['repeats']}`; timed workloads interleaved across rows, "
        f"medians of {meta['repeats']} repeats; wall time {meta['wall_s'] / 60:.1f} min. Load average "
        f"{meta['loadavg_start'][0]:.1f} at start, {meta['loadavg_end'][0]:.1f} at end (this run's own load included; "
        "above ~2 means other jobs shared the cores and absolute times are noisy); ratios come from interleaved runs.",
        "",
        "| config | lever | weight MB | KV B/token | KV blocks @0.25 GiB | batch-1 TPOT ms (x) | weight GB/s | "
        "saturation tok/s (x) | shared-prefix TTFT ms (x) | spec: structured | spec: open-ended | top-1 agree | mean KL |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in res.items():
        q1 = "lossless" if r.get("lossless") else f"{r['top1']:.3f}"
        kl = "0" if r.get("lossless") else f"{r['mean_kl']:.4f}"
        lines.append(
            f"| {name} | {r['lever']} | {r['weight_bytes'] / 1e6:.0f} | {r['kv_bytes_per_token']} | {r['kv_blocks']} | "
            f"{r['tpot_ms']:.1f} ({r['tpot_speedup']:.2f}x) | {r['weight_gbs']:.1f} | {r['sat_tps']:.0f} ({r['sat_ratio']:.2f}x) | "
            f"{r['ttft_ms']:.0f} ({r['ttft_ratio']:.2f}x) | {spec(r, 'spec_structured')} | {spec(r, 'spec_open')} | {q1} | {kl} |"
        )
    pr = res.get("prefix cache")
    lines += [
        "",
        "Notes:",
        "- (x) columns: ratio to the fp32 baseline row (TPOT: baseline/row, higher is faster; TTFT: row/baseline, "
        "lower is better).",
        "- noise check: `prefix cache` runs the baseline's exact code for batch-1 TPOT and saturation, so its (x) "
        "there should read 1.00x; its deviation is this run's noise level.",
        f"- prefix cache hit rate over the row's whole run: {pr['prefix_hit_rate']:.0%} of prompt tokens."
        if pr
        else "",
        "- spec columns: batch-1 greedy chat replies (32 tokens, 3 prompts per set); decode tokens/s "
        "(after the first token); acc = accepted / proposed drafts; tok/verify = tokens emitted per "
        "verification step (accepted + 1); x = decode tokens/s vs the baseline row on the same prompts.",
        "- quality: the baseline's fp32 full-sequence logits vs the row's logits teacher-forced through its paged "
        "KV cache, 8 windows x 63 positions of the bundled corpus; `lossless` = same weights and cache "
        "precision (prefix caching and greedy speculative decoding are exact; tested).",
        "- LM head: int8 per-channel for every weight-quantized row (slotune/engine/quantize.py explains why).",
        "- fp8 on CPU is emulated (e4m3 codes dequantized per matmul): it shows fp8's quality, not its speed.",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
