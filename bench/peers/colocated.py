"""Would an engine-core process (vLLM's split) make the server cheaper? Python work beside the engine,
in a thread of the engine's process or in a process of its own, measured side by side.

`tune serve` runs the HTTP event loop in the engine's process: the event loop and the engine loop
thread share one interpreter, so while one runs Python the other waits for the GIL. vLLM answers
that with an engine-core process. Before building it, this measures what it could gain: the same
in-process replay (the engine alone, no HTTP) three ways, alternated:

- `none`: nothing beside the engine;
- `thread`: after every engine step, a thread of this process does what the event loop does per
  step at that concurrency: one burst of pure-Python work (`--burst-us`, default 70 us: the event
  loop's CPU per token at 16 concurrent, overhead-*.md) and one write syscall per sequence that
  produced a token, as an SSE send would;
- `process`: the same work in another process, woken through a pipe after every step (the
  engine-core split: the front end gets each step's outputs and works while the engine goes on).

If the GIL were the cost, `process` would keep (nearly) all of `none`'s speed and `thread` would not.

Usage: python bench/peers/colocated.py [--concurrency 16] [--pairs 6] [--burst-us 70]
Writes colocated-DATE-MACHINE.{json,md} beside this file.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shlex
import statistics
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from run import (
    CONFIG_DIR,
    HERE,
    Point,
    default_llama_bin,
    machine_info,
    machine_label,  # this folder is sys.path[0]
    measure_in_process,
    slotune_config,
    versions,
)
from slotune.engine import LLM, EngineConfig

CONDITIONS = ("none", "thread", "process")
_CHUNK = {
    "id": "chatcmpl-1",
    "object": "chat.completion.chunk",
    "created": 0,
    "model": "m",
    "choices": [{"index": 0, "delta": {"content": " hello"}, "finish_reason": None}],
}


def _front_end(read_fd: int, burst_us: float, inherited_write_fd: int | None = None) -> None:
    """Per byte read (one per step; its value: the sequences that produced a token), that many bursts.
    A forked front end closes its copy of the pipe's write end, or it would never read end-of-file."""
    if inherited_write_fd is not None:
        os.close(inherited_write_fd)
    sink = os.open(os.devnull, os.O_WRONLY)
    while True:
        data = os.read(read_fd, 4096)
        if not data:
            return
        for n in data:
            for _ in range(n):
                until = time.perf_counter() + burst_us * 1e-6
                while time.perf_counter() < until:
                    event = "data: " + json.dumps(_CHUNK) + "\n\n"
                os.write(sink, event.encode())


class StepSignal:
    """Wraps an engine's `step` (this bench's probe, not engine behaviour) to write one byte per step
    to the front end's pipe while one is attached."""

    def __init__(self, engine) -> None:
        self.write_fd: int | None = None
        self._step = engine.step
        engine.step = self.step

    def step(self):
        outputs = self._step()
        if self.write_fd is not None and outputs:
            os.write(self.write_fd, bytes([min(len(outputs), 255)]))
        return outputs


def replay(llm: LLM, signal: StepSignal, cond: str, point: Point, num_requests: int, burst_us: float) -> dict:
    worker = None
    if cond != "none":
        read_fd, signal.write_fd = os.pipe()
        if cond == "thread":
            worker = threading.Thread(target=_front_end, args=(read_fd, burst_us), daemon=True)
        else:
            worker = mp.get_context("fork").Process(
                target=_front_end, args=(read_fd, burst_us, signal.write_fd), daemon=True
            )
        worker.start()
    try:
        m = measure_in_process(llm, point, num_requests, 0)["metrics"]
    finally:
        if worker is not None:
            os.close(signal.write_fd)
            signal.write_fd = None
            worker.join()
            os.close(read_fd)
    return {"tok_s": m["output_tokens_per_s"], "tpot_p50": m["tpot_p50"]}


def to_markdown(rep: dict[str, Any]) -> str:
    rows = rep["rows"]
    med = {c: {k: statistics.median(r[c][k] for r in rows) for k in ("tok_s", "tpot_p50")} for c in CONDITIONS}
    lines = [
        f"# Python work beside the engine: in its process or in another ({rep['date']}, "
        f"{rep['machine']['model_name']}, {rep['machine']['cpu_count']} CPUs)",
        "",
        f"Command: `{rep['command']}`; commit {rep['versions']['slotune_git']}; config {rep['config']}, "
        f"short prompts, {rep['concurrency']} concurrent, {rep['num_requests']} requests per replay; after "
        f"every engine step, one {rep['burst_us']:g} us burst of Python and one write per sequence stepped. "
        f"Conditions alternated in rotating order, {len(rows)} rounds.",
        "",
        "| condition | tok/s per round | median tok/s | / none | median TPOT p50 | none / this |",
        "|---|---|---|---|---|---|",
    ]
    for c in CONDITIONS:
        per = ", ".join(f"{r[c]['tok_s']:.0f}" for r in rows)
        lines.append(
            f"| {c} | {per} | {med[c]['tok_s']:.1f} | "
            f"{med[c]['tok_s'] / med['none']['tok_s']:.3f} | {med[c]['tpot_p50'] * 1e3:.2f} ms | "
            f"{med['none']['tpot_p50'] / med[c]['tpot_p50']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="int8-bf16-int8act", help=f"a name in {CONFIG_DIR.name}/")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--pairs", type=int, default=6, help="rounds; each measures every condition once")
    ap.add_argument("--burst-us", type=float, default=70.0)
    ap.add_argument("--out", type=Path, default=HERE)
    args = ap.parse_args(argv)
    config = slotune_config(CONFIG_DIR / f"{args.config}.yaml", slots=args.concurrency, ctx_per_slot=256)
    llm = LLM(EngineConfig.from_dict(config))
    signal, point = StepSignal(llm.engine), Point("short", args.concurrency)
    info = machine_info()
    rep: dict[str, Any] = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        "machine": info,
        "versions": versions(default_llama_bin()),
        "config": args.config,
        "concurrency": args.concurrency,
        "num_requests": args.num_requests,
        "burst_us": args.burst_us,
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "command": shlex.join(["python", "bench/peers/colocated.py", *(argv if argv is not None else sys.argv[1:])]),
        "rows": [],
    }
    for i in range(args.pairs):
        row = {}
        for cond in CONDITIONS[i % 3 :] + CONDITIONS[: i % 3]:
            row[cond] = replay(llm, signal, cond, point, args.num_requests, args.burst_us)
            print(
                f"round {i + 1} {cond:>7}: {row[cond]['tok_s']:.1f} tok/s, TPOT p50 "
                f"{row[cond]['tpot_p50'] * 1e3:.2f} ms",
                flush=True,
            )
        rep["rows"].append(row)
    stem = args.out / f"colocated-{rep['date']}-{machine_label(info)}"
    stem.with_suffix(".json").write_text(json.dumps(rep, indent=1) + "\n")
    md = to_markdown(rep)
    stem.with_suffix(".md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
