"""What `tune serve --record-traffic` costs: served tokens/s with and without recording, side by side.

Two `tune serve` processes of the same config (one with `--record-traffic`), run one at a time
and alternated over rounds (A B, B A, ...), each measured by the same `tune bench --url` client
on the same closed-loop workload. Goal (issue 16): recording keeps >= 0.98x the tokens/s.

Usage: .venv/bin/python bench/server/record_overhead.py [--rounds 4] [--concurrency 16] [--num-requests 48]
Writes bench/server/record-overhead-DATE.md.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

from slotune.engine.loader import resolve_model_path
from slotune.engine.tokenizer import Tokenizer
from slotune.tuner.measure.http_replay import run_http_replay, wait_ready
from slotune.tuner.spec.trace_reader import load_trace
from slotune.tuner.spec.workload_spec import WorkloadSpec

CONFIG = (
    "quantization: int8\ndtype: bfloat16\nkernels: {int8_activations: true}\nmax_num_seqs: 16\n"
    "num_kv_blocks: 512\nmax_model_len: 512\n"
)
CONFIG_LINE = "; ".join(CONFIG.strip().splitlines())  # the config on one line, for the report


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(cfg: Path, record_dir: Path | None, wl: WorkloadSpec, tok) -> tuple[float, int]:
    port = _port()
    argv = [sys.executable, "-m", "slotune.tuner.cli_main", "serve", str(cfg), "--port", str(port)]
    if record_dir is not None:
        argv += ["--record-traffic", str(record_dir)]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base, proc=proc)
        res = run_http_replay(base, wl, tokenizer=tok)
        assert res.metrics["num_failed"] == 0, res.metrics
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    lines = len(load_trace(record_dir).requests) if record_dir is not None else 0
    return res.metrics["output_tokens_per_s"], lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--num-requests", type=int, default=48)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent)
    args = ap.parse_args()
    tok = Tokenizer.from_model_path(resolve_model_path("smollm2-135m"))
    wl = WorkloadSpec.load(
        {
            "arrivals": "closed_loop",
            "concurrency": args.concurrency,
            "num_requests": args.num_requests,
            "warmup_requests": args.concurrency,
            "prompt_len": {"kind": "fixed", "value": 32},
            "output_len": {"kind": "fixed", "value": 64},
            "seed": 1,
        }
    )
    tps: dict[str, list[float]] = {"off": [], "on": []}
    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp) / "c.yaml"
        cfg.write_text(CONFIG)
        for r in range(args.rounds):
            for mode in ("off", "on") if r % 2 == 0 else ("on", "off"):
                rec = Path(tmp) / f"rec-{r}" if mode == "on" else None
                t, lines = measure(cfg, rec, wl, tok)
                tps[mode].append(t)
                print(f"[{r}] recording {mode:>3}: {t:7.1f} tok/s" + (f", {lines} lines" if rec else ""), flush=True)
    load.append(os.getloadavg()[0])
    off, on = statistics.median(tps["off"]), statistics.median(tps["on"])
    paired = [b / a for a, b in zip(tps["off"], tps["on"])]  # each round's on/off, same load conditions
    date = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    md = "\n".join(
        [
            f"# `tune serve --record-traffic` overhead ({date}, {os.cpu_count()} CPUs)",
            "",
            f"Command: `python bench/server/record_overhead.py --rounds {args.rounds} --concurrency {args.concurrency} "
            f"--num-requests {args.num_requests}`; config `{CONFIG_LINE}`; closed loop, 32-token prompts, 64 output "
            f"tokens; load average before/after {load[0]:.1f} / {load[1]:.1f}.",
            "",
            "| recording | tok/s per round | median |",
            "|---|---|---|",
            f"| off | {', '.join(f'{x:.1f}' for x in tps['off'])} | {off:.1f} |",
            f"| on | {', '.join(f'{x:.1f}' for x in tps['on'])} | {on:.1f} |",
            "",
            f"Recording on / off: **{on / off:.3f}x** of the medians; per round {', '.join(f'{x:.3f}' for x in paired)}, "
            f"median **{statistics.median(paired):.3f}x** (goal >= 0.98x).",
        ]
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"record-overhead-{date}.md").write_text(md + "\n")
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
