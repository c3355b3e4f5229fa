"""What the server costs, side by side: one config served and in-process, alternated point by point.

`run.py --in-process` replays every point on the server, then every point in-process, so a
point's two numbers are minutes apart, and on a 2-core VM whose same replay varies 1.34x back to
back (bench/tuner/noise-floor-*.md) their ratio mostly measures the machine. Here, for each point,
one `tune serve` process is started and stays up, the same config's engine is loaded in this
process, and the point's served and in-process replays alternate (S I, I S, S I, ...) `--pairs`
times: each ratio compares runs seconds apart. The idle side waits without spinning (libgomp's
default policy in the server, nothing running in this process while the client waits on the
server), so neither takes a core from the other.

Where the time goes: every replay also counts CPU seconds per output token, from /proc: in this
process (in-process: the engine; served: the client) and in the server's threads (its main thread
runs the HTTP event loop; the rest are the engine thread, its OpenMP workers and the tokenizer
pool). On a machine whose engine keeps every core busy, the client's and the event loop's CPU is
taken from the engine.

Goal (issue 12 item 3): served keeps >= 0.95x the in-process output tokens/s and TPOT p50 at
concurrency 1 and 16. Reported per point: every pair's ratio and their median.

Usage: python bench/peers/overhead.py [--configs int8-bf16-int8act] [--concurrency 1,16]
                                      [--prompt short,long] [--pairs 6]
Writes overhead-DATE-MACHINE.{json,md} beside this file.
       python bench/peers/overhead.py --pool overhead-*.json
Pools the pairs of stored runs per config and point: the geometric mean of the per-pair ratios and
its 95% interval (`slotune.tuner.measure.metrics.ratio_interval`).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shlex
import signal
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from report import fmt_ms  # this folder is sys.path[0]
from run import (
    CONFIG_DIR,
    HERE,
    MODEL,
    OUTPUT_LEN,
    PROMPT_LENS,
    Point,
    _csv,
    _interrupt,
    default_llama_bin,
    free_port,
    machine_info,
    machine_label,
    measure,
    measure_in_process,
    sizing,
    slotune_config,
    start,
    stop,
    tune_serve,
    versions,
)
from slotune.engine import LLM, EngineConfig
from slotune.engine.loader import resolve_model_path
from slotune.engine.tokenizer import Tokenizer
from slotune.tuner.measure.intervals import ratio_interval

GOAL = 0.95


def _row(m: dict[str, Any]) -> dict[str, float]:
    return {"tok_s": m["output_tokens_per_s"], "tpot_p50": m.get("tpot_p50"), "ttft_p50": m.get("ttft_p50")}


def server_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) of a process's main thread and of all its other threads."""
    tick, out = os.sysconf("SC_CLK_TCK"), {"event_loop": 0.0, "engine": 0.0}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except FileNotFoundError:  # a thread that ended between the listing and the read
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after "(comm)": state is fields[0], utime [11], stime [12]
        out["event_loop" if int(tid) == pid else "engine"] += (int(fields[11]) + int(fields[12])) / tick
    return out


def replay_tokens(point: Point, num_requests: int | None, seed: int) -> int:
    """Output tokens a replay makes, its warm-up requests included (the CPU counted spans them too)."""
    wl = point.workload(num_requests, seed)
    return (wl["num_requests"] + wl["warmup_requests"]) * OUTPUT_LEN


def cpu_us_per_token(side: str, before: tuple, after: tuple, tokens: int) -> dict[str, float]:
    """(process_time, server_cpu_s) before and after -> microseconds of CPU per output token."""
    here = (after[0] - before[0]) * 1e6 / tokens
    if side == "in_process":
        return {"engine": here}
    return {"client": here, **{k: (after[1][k] - before[1][k]) * 1e6 / tokens for k in after[1]}}


def ratios(served: dict[str, float], inproc: dict[str, float]) -> dict[str, float]:
    """>1 is the server faster; tokens/s served / in-process, TPOT in-process / served."""
    return {"tok_s": served["tok_s"] / inproc["tok_s"], "tpot_p50": inproc["tpot_p50"] / served["tpot_p50"]}


def run_point(
    name: str,
    config: dict[str, Any],
    llm: LLM,
    point: Point,
    *,
    port: int,
    tokenizer,
    pairs: int,
    num_requests: int | None,
    seed: int,
    workdir: Path,
    threads: int,
) -> dict[str, Any]:
    server = tune_serve(name, config, threads=threads, port=port, workdir=workdir)
    log = workdir / f"{name}-{point.key}.log"
    proc = start(server, port, log)
    out: dict[str, Any] = {"point": point.key, "pairs": [], "log": str(log)}
    try:
        for i in range(pairs):
            order = ("served", "in_process") if i % 2 == 0 else ("in_process", "served")
            pair: dict[str, Any] = {"order": list(order)}
            for side in order:
                before = (time.process_time(), server_cpu_s(proc.pid))
                if side == "served":
                    r = measure(f"http://127.0.0.1:{port}", point, tokenizer, num_requests, seed)
                else:
                    r = measure_in_process(llm, point, num_requests, seed)
                after = (time.process_time(), server_cpu_s(proc.pid))
                pair[side] = {
                    **_row(r["metrics"]),
                    "is_exact": r["is_exact"],
                    "load_avg": os.getloadavg()[0],
                    "cpu_us_per_token": cpu_us_per_token(side, before, after, replay_tokens(point, num_requests, seed)),
                }
            pair["ratio"] = ratios(pair["served"], pair["in_process"])
            out["pairs"].append(pair)
            s, p = pair["served"], pair["in_process"]
            print(
                f"  {name} {point.key:>9} pair {i + 1}: served {s['tok_s']:6.1f} tok/s TPOT {fmt_ms(s['tpot_p50'])}"
                f" | in-process {p['tok_s']:6.1f} tok/s TPOT {fmt_ms(p['tpot_p50'])} | ratio tok/s "
                f"{pair['ratio']['tok_s']:.3f} TPOT {pair['ratio']['tpot_p50']:.3f}"
                f"{'' if s['is_exact'] and p['is_exact'] else '  NOT EXACT'}",
                flush=True,
            )
    finally:
        out["exit_code"] = stop(proc)
    for key in ("tok_s", "tpot_p50"):
        out[f"median_{key}"] = statistics.median(p["ratio"][key] for p in out["pairs"])
    out["median_cpu_us_per_token"] = {
        side: {
            k: statistics.median(p[side]["cpu_us_per_token"][k] for p in out["pairs"])
            for k in out["pairs"][0][side]["cpu_us_per_token"]
        }
        for side in ("served", "in_process")
    }
    return out


def to_markdown(rep: dict[str, Any]) -> str:
    lines = [
        f"# Server overhead, side by side ({rep['date']}, {rep['machine']['model_name']}, "
        f"{rep['machine']['cpu_count']} CPUs)",
        "",
        f"Command: `{rep['command']}`; commit {rep['versions']['slotune_git']}. For each point one `tune serve` "
        f"and the same engine in-process, replays alternated (S I, I S, ...) {rep['pairs']} times; "
        f"ratio > 1: served faster. Goal: >= {GOAL}x at concurrency 1 and 16.",
        "",
        *([f"Note: {rep['note']}.", ""] if rep.get("note") else []),
        "| config | point | served / in-process tok/s, per pair | median | in-process / served TPOT p50, per pair "
        "| median | served tok/s (median) | in-process tok/s (median) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    cpu = [
        "",
        "CPU per output token (microseconds, medians over the pairs): in-process, the engine (every thread "
        "of this process); served, the client process, the server's event-loop thread and its other threads "
        "(engine, OpenMP workers, tokenizer pool). Engine figures include OpenMP workers spinning between "
        "parallel regions.",
        "",
        "| config | point | in-process engine | served: client | event loop | engine threads | client + event "
        "loop, share of the machine at the served rate |",
        "|---|---|---|---|---|---|---|",
    ]
    ncpu = rep["machine"]["cpu_count"]
    for res in rep["results"]:
        for pt in res["points"]:
            per = lambda k: ", ".join(f"{p['ratio'][k]:.3f}" for p in pt["pairs"])  # noqa: E731
            med = lambda side: statistics.median(p[side]["tok_s"] for p in pt["pairs"])  # noqa: E731
            lines.append(
                f"| {res['config']} | {pt['point']} | {per('tok_s')} | **{pt['median_tok_s']:.3f}** | "
                f"{per('tpot_p50')} | **{pt['median_tpot_p50']:.3f}** | {med('served'):.1f} | "
                f"{med('in_process'):.1f} |"
            )
            c, e = pt["median_cpu_us_per_token"]["served"], pt["median_cpu_us_per_token"]["in_process"]["engine"]
            cpu.append(
                f"| {res['config']} | {pt['point']} | {e:.0f} | {c['client']:.0f} | {c['event_loop']:.0f} | "
                f"{c['engine']:.0f} | {(c['client'] + c['event_loop']) * med('served') / 1e6 / ncpu:.1%} |"
            )
    return "\n".join(lines + cpu) + "\n"


def pooled(paths: list[Path]) -> str:
    """Markdown: per config and point, the pairs of every run in `paths` pooled."""
    pairs: dict[tuple[str, str], list[dict]] = {}
    for path in paths:
        for res in json.loads(path.read_text())["results"]:
            for pt in res["points"]:
                pairs.setdefault((res["config"], pt["point"]), []).extend(p["ratio"] for p in pt["pairs"])
    lines = [
        f"Pooled over {len(paths)} runs: {', '.join(p.name for p in paths)}",
        "",
        "| config | point | pairs | served / in-process tok/s (95% interval) | in-process / served TPOT p50 (95% interval) |",
        "|---|---|---|---|---|",
    ]
    for (config, point), ratios in pairs.items():
        cells = []
        for key in ("tok_s", "tpot_p50"):
            values = [r[key] for r in ratios]
            iv = ratio_interval(values)
            cells.append(
                f"{statistics.geometric_mean(values):.4f}" + ("" if iv is None else f" ({iv[0]:.4f}-{iv[1]:.4f})")
            )
        lines.append(f"| {config} | {point} | {len(ratios)} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default="int8-bf16-int8act", help=f"names in {CONFIG_DIR.name}/ or YAML paths")
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--prompt", default="short,long")
    ap.add_argument("--pairs", type=int, default=6)
    ap.add_argument("--num-requests", type=int, default=None, help="per replay (default max(2 x concurrency, 8))")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=HERE)
    ap.add_argument("--pool", type=Path, nargs="+", metavar="JSON", help="pool stored runs instead of measuring")
    args = ap.parse_args(argv)
    args.concurrency = [int(c) for c in _csv(args.concurrency)]
    args.prompt = _csv(args.prompt)
    if any(p not in PROMPT_LENS for p in args.prompt):
        ap.error(f"--prompt: one of {', '.join(PROMPT_LENS)}")
    if args.pairs < 1 or any(c < 1 for c in args.concurrency):
        ap.error("--pairs and --concurrency must be >= 1")
    args.configs = [Path(c) if c.endswith((".yaml", ".yml")) else CONFIG_DIR / f"{c}.yaml" for c in _csv(args.configs)]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.pool:
        print(pooled(args.pool), end="")
        return 0
    signal.signal(signal.SIGTERM, _interrupt)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))  # as tune_serve gives the server
    tokenizer = Tokenizer.from_model_path(resolve_model_path(MODEL))
    points = [Point(p, c) for p in args.prompt for c in args.concurrency]
    slots, ctx = sizing(points)
    port, workdir = free_port(), Path(tempfile.mkdtemp(prefix="slotune-overhead-"))
    info = machine_info()
    rep: dict[str, Any] = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        "machine": info,
        "versions": versions(default_llama_bin()),
        "pairs": args.pairs,
        "slots": slots,
        "ctx_per_slot": ctx,
        "threads": args.threads,
        "model": MODEL,
        "results": [],
        "command": shlex.join(["python", "bench/peers/overhead.py", *(argv if argv is not None else sys.argv[1:])]),
    }
    try:
        for path in args.configs:
            config = slotune_config(path, slots=slots, ctx_per_slot=ctx)
            llm = LLM(EngineConfig.from_dict(config))
            res = {"config": path.stem, "engine_config": config, "points": []}
            for point in points:
                res["points"].append(
                    run_point(
                        path.stem,
                        config,
                        llm,
                        point,
                        port=port,
                        tokenizer=tokenizer,
                        pairs=args.pairs,
                        num_requests=args.num_requests,
                        seed=args.seed,
                        workdir=workdir,
                        threads=args.threads,
                    )
                )
            rep["results"].append(res)
            del llm
            gc.collect()
    except KeyboardInterrupt:
        print("interrupted: the server is stopped; nothing written", file=sys.stderr)
        return 130
    label = machine_label(info)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"overhead-{rep['date']}-{label}"
    stem.with_suffix(".json").write_text(json.dumps(rep, indent=1) + "\n")
    md = to_markdown(rep)
    stem.with_suffix(".md").write_text(md)
    print(md)
    print(f"wrote {stem}.json and {stem}.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
