"""The markdown report of a bench/peers run, from its results JSON alone.

`run.py` calls `to_markdown` after a run; `python bench/peers/report.py RESULTS.json` rewrites
the .md beside it (after editing a note, or with a newer table layout).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

KEY_METRICS = (
    "output_tokens_per_s",
    "tpot_p50",
    "ttft_p50",
    "itl_p50",
    "e2e_p50",
    "num_failed",
    "num_short_outputs",
    "client_cpu_s",
)


def medians(rounds: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, float]]]:
    """{server: {point: {metric: median over rounds}}}."""
    by: dict[str, dict[str, list[dict[str, float]]]] = {}
    for entry in rounds:
        for r in entry["results"]:
            by.setdefault(entry["server"], {}).setdefault(r["point"], []).append(r["metrics"])
    out: dict[str, dict[str, dict[str, float]]] = {}
    for server, points in by.items():
        for point, ms in points.items():
            keys = [k for k in KEY_METRICS if all(k in m for m in ms)]
            out.setdefault(server, {})[point] = {k: statistics.median(m[k] for m in ms) for k in keys}
    return out


def fmt_ms(s: float | None) -> str:
    return "-" if s is None else f"{1e3 * s:.1f}"


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if not a or not b else f"{a / b:.2f}x"


def _header(rep: dict[str, Any]) -> list[str]:
    m, v = rep["machine"], rep["versions"]
    lens = ", ".join(f"{p['prompt_len']} ({p['prompt']})" for p in {p["prompt"]: p for p in rep["points"]}.values())
    return [
        "# tune serve vs llama-server (llama.cpp): same GGUF, same client",
        "",
        f"Machine: {m.get('model_name')}, {m['cpu_count']} CPUs, {m.get('mem_total_gib')} GiB. Date: {rep['date']}. "
        f"Rounds: {rep['repeats']} (medians across them). slotune {v['slotune']} ({v['slotune_git']}), torch "
        f"{v['torch']}; llama-server `{v['llama_server_version'].splitlines()[0]}` built from the llama.cpp "
        f"vendored in llama-cpp-python {v.get('llama_cpp_python_sdist')} ({v.get('ggml_lib')}).",
        "",
        f"Command: `{rep['command']}`. Model: {rep['model']} ({Path(rep['gguf']).name}). Each point: closed loop, "
        f"{rep['output_len']} output tokens (greedy, ignore_eos), prompts of {lens} tokens sent as token ids; every "
        f"server sized for {rep['slots']} slots x {rep['ctx_per_slot']} tokens. The exact server commands and "
        "slotune configs are in the JSON.",
    ]


def _versus(rep: dict[str, Any], med: dict, ref: str, ours: list[str]) -> list[str]:
    lines = [
        "",
        f"## {ref} vs the best tune serve config (by tok/s) at each point",
        "",
        f"Ratios: tok/s is slotune / {ref}; TPOT and TTFT are {ref} / slotune. So **> 1 means slotune is "
        "better** in every ratio column.",
        "",
        f"| point | {ref} tok/s | TPOT p50 ms | TTFT p50 ms | best config | tok/s | TPOT p50 ms | TTFT p50 ms "
        "| tok/s ratio | TPOT ratio | TTFT ratio |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in rep["points"]:
        r = med.get(ref, {}).get(p["key"], {})
        cands = [(med[s][p["key"]]["output_tokens_per_s"], s) for s in ours if p["key"] in med.get(s, {})]
        if not cands:
            continue
        best = max(cands)[1]
        b = med[best][p["key"]]
        lines.append(
            f"| {p['key']} | {r.get('output_tokens_per_s', 0):.1f} | {fmt_ms(r.get('tpot_p50'))} | "
            f"{fmt_ms(r.get('ttft_p50'))} | {best} | {b['output_tokens_per_s']:.1f} | {fmt_ms(b.get('tpot_p50'))} | "
            f"{fmt_ms(b.get('ttft_p50'))} | {_ratio(b['output_tokens_per_s'], r.get('output_tokens_per_s'))} | "
            f"{_ratio(r.get('tpot_p50'), b.get('tpot_p50'))} | {_ratio(r.get('ttft_p50'), b.get('ttft_p50'))} |"
        )
    return lines


def _roofline(rep: dict[str, Any], med: dict) -> list[str]:
    read = "read_bandwidth_gbs" in rep["rounds"][0]  # runs before bench/bandwidth.py divided by copy bandwidth
    bw = statistics.median(e["read_bandwidth_gbs" if read else "copy_bandwidth_gbs"] for e in rep["rounds"])
    c1 = [p for p in rep["points"] if p["concurrency"] == 1]
    lines = [
        "",
        "## Batch 1 against the memory-bandwidth roofline",
        "",
        (
            f"Read bandwidth {bw:.1f} GB/s (bench/bandwidth.py: a float32 sum over 4x the last-level cache, best of 7; "
            if read
            else f"Copy bandwidth {bw:.1f} GB/s (a 256 MiB float32 copy, read + write bytes, best of 5; "
        )
        + "median of the measurements before each server start). Roofline tok/s = bandwidth / bytes one decode step reads "
        "(llama-server: the GGUF's tensors as stored; slotune: `LLMEngine.weight_bytes`). Decode tok/s = "
        "1 / TPOT p50 at concurrency 1, HTTP and SSE included.",
        "",
        "| server | weight MB / token | roofline tok/s | "
        + " | ".join(f"{p['key']} decode tok/s (% of roofline)" for p in c1)
        + " |",
        "|---|---|---|" + "---|" * len(c1),
    ]
    for s in rep["servers"]:
        roof = bw * 1e9 / rep["weight_bytes"][s]
        cells = []
        for p in c1:
            tpot = med.get(s, {}).get(p["key"], {}).get("tpot_p50")
            cells.append("-" if not tpot else f"{1 / tpot:.1f} ({100 / tpot / roof:.0f}%)")
        lines.append(f"| {s} | {rep['weight_bytes'][s] / 1e6:.1f} | {roof:.1f} | " + " | ".join(cells) + " |")
    return lines


def _every(rep: dict[str, Any], med: dict, ref: str) -> list[str]:
    lines = [
        "",
        "## Every server and config",
        "",
        f"| point | server | tok/s | vs {ref} tok/s | TPOT p50 ms | TTFT p50 ms | ITL p50 ms | e2e p50 ms "
        "| failed | client CPU s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in rep["points"]:
        r0 = med.get(ref, {}).get(p["key"], {})
        for s in rep["servers"]:
            r = med.get(s, {}).get(p["key"])
            if r is None:
                continue
            vs = "-" if s == ref else _ratio(r["output_tokens_per_s"], r0.get("output_tokens_per_s"))
            lines.append(
                f"| {p['key']} | {s} | {r['output_tokens_per_s']:.1f} | {vs} | {fmt_ms(r.get('tpot_p50'))} | "
                f"{fmt_ms(r.get('ttft_p50'))} | {fmt_ms(r.get('itl_p50'))} | {fmt_ms(r.get('e2e_p50'))} | "
                f"{r.get('num_failed', 0):.0f} | {r.get('client_cpu_s', 0):.1f} |"
            )
    return lines


def _overhead(rep: dict[str, Any], med: dict) -> list[str]:
    """Served / in-process for each config run with --in-process."""
    names = rep.get("in_process") or []
    if not names:
        return []
    lines = [
        "",
        "## The server's cost: served / in-process, same config and points",
        "",
        "In-process: the same workload replayed on the engine inside the bench process (`tune bench`, "
        "no HTTP). Goal: served keeps >= 0.95x the in-process tok/s and TPOT.",
        "",
        "| point | config | served tok/s | in-process tok/s | tok/s served / in-process | served TPOT p50 ms "
        "| in-process TPOT p50 ms | TPOT in-process / served |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for p in rep["points"]:
        for s in names:
            a, b = med.get(s, {}).get(p["key"]), med.get(s + "@in-process", {}).get(p["key"])
            if not a or not b:
                continue
            lines.append(
                f"| {p['key']} | {s} | {a['output_tokens_per_s']:.1f} | {b['output_tokens_per_s']:.1f} | "
                f"{_ratio(a['output_tokens_per_s'], b['output_tokens_per_s'])} | {fmt_ms(a.get('tpot_p50'))} | "
                f"{fmt_ms(b.get('tpot_p50'))} | {_ratio(b.get('tpot_p50'), a.get('tpot_p50'))} |"
            )
    return lines


def _checks(rep: dict[str, Any]) -> list[str]:
    rounds = rep["rounds"]
    inexact = [
        f"{e['server']} {r['point']} (round {e['round'] + 1})"
        for e in rounds
        for r in e["results"]
        if not r["is_exact"]
    ]
    cached = {
        s: sum(r["cached_prompt_tokens"] for e in rounds if e["server"] == s for r in e["results"])
        for s in rep["servers"]
    }
    errors = [f"{e['server']} (round {e['round'] + 1}): {e['error']}" for e in rounds if e.get("error")]
    return [f"\n**Failed**: {err}" for err in errors] + [
        "",
        "Every request completed with exactly its prompt and output token counts (the servers' `usage`)."
        if not inexact
        else "**Not exact** (failures, or `usage` token counts other than asked): " + ", ".join(inexact) + ".",
        "",
        "Prompt tokens served from a prompt/prefix cache (`usage.prompt_tokens_details.cached_tokens`; the "
        "points share no prompts, so only a rare repeated corpus window should hit): "
        + ", ".join(f"{s} {n}" for s, n in cached.items())
        + ".",
        "",
        "1-minute load average before each server start: "
        + ", ".join(f"{e['server']} {e['load_avg_before'][0]:.1f}" for e in rounds)
        + ".",
    ]


def to_markdown(rep: dict[str, Any]) -> str:
    ref = rep["reference"]
    med = medians(rep["rounds"])
    ours = [s for s in rep["servers"] if s != ref]
    lines = _header(rep)
    if ref in rep["servers"] and ours:
        lines += _versus(rep, med, ref, ours)
    lines += _roofline(rep, med) + _overhead(rep, med) + _every(rep, med, ref) + _checks(rep)
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python bench/peers/report.py RESULTS.json (rewrites RESULTS.md beside it)")
    path = Path(sys.argv[1])
    path.with_suffix(".md").write_text(to_markdown(json.loads(path.read_text())))
    print(f"wrote {path.with_suffix('.md')}")
