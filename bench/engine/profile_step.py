"""Where a native decode step's time goes: per op, against the bytes it reads and the read bandwidth.

For each config and row count, one engine holds `rows` sequences in decode (32-token prompts) over the
profiling build of slotune/kernels/cpu_decode.c (`-DSLOTUNE_PROFILE`: the master thread's clock at each op's
closing barrier, so an op's time is its slowest thread's, barrier included). It takes `--steps` engine
steps; per step it reports each op's time, the bytes it reads (weights as stored, KV cache rows), the
rate that makes, and what share of the read bandwidth (bench/bandwidth.py) that is. `engine step` is the whole `LLMEngine.step()` (scheduler, sampling, Python); `native
call` the ops' sum; the difference is the step's Python. Batch-1 roofline: weight bytes / read bandwidth.
These VMs' bandwidth moves within minutes, so it is read before every 16 steps: the roofline uses the
median of those reads, and the paired fraction is the median over (read, 16 steps) pairs (each read
also flushes the L3, so the step after it starts with no weights cached). Beside each read, a compute
probe (`slotune_vnni_peak`, as kernel_rate.py): when other tenants share these vCPUs' cores, it and
the step's cache-resident ops (norms, gate) slow together while the bandwidth read does not.

    .venv/bin/python bench/engine/profile_step.py --configs int8-act,int4-act --rows 1,16 --steps 64 [--against OLD.c]
        [--model gemma3-270m] [--prompt-len 32]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from slotune.kernels import cpu_decode  # noqa: E402
from slotune.tuner.measure import machine  # noqa: E402

from bench.bandwidth import read_bandwidth_gbs  # noqa: E402
from bench.engine.kernel_rate import peak  # noqa: E402
from bench.engine.native_avx2 import CONFIGS, PROMPT_LEN, _engine  # noqa: E402

OPS = ["embed", "norms", "quantize x", "qkv", "rope + kv store", "attention", "o", "gate_up", "gate", "down", "lm_head"]
CHUNK = 16  # steps between two reads of the bandwidth
WEIGHT_OPS = {"qkv": "qkv", "o": "o", "gate_up": "gate_up", "down": "down"}


def lin_bytes(lin) -> int:
    """Bytes one pass over a projection reads: its weights (as the kernel reads them) and scales."""
    n, k = lin.n, lin.k
    if lin.kind in (cpu_decode.W_INT4, cpu_decode.W_INT4_VNNI, cpu_decode.W_INT4_AVX2):
        kp = -(-k // lin.group) * lin.group
        return n * kp // 2 + (kp // lin.group) * n * 4
    if lin.kind in (cpu_decode.W_INT8, cpu_decode.W_INT8_VNNI, cpu_decode.W_INT8_AVX2):
        return n * k + 2 * n
    return n * k * (4 if lin.kind == cpu_decode.W_F32 else 2)


def op_bytes(dec, rows: int, ctx: int) -> dict[str, int]:
    """Bytes each op reads per step (weights once per step; each row's keys and values)."""
    m = dec._m
    out = {op: 0 for op in OPS}
    for i in range(m.num_layers):
        for op, field in WEIGHT_OPS.items():
            out[op] += lin_bytes(getattr(dec._layers[i], field))
    out["lm_head"] = lin_bytes(m.lm_head)
    kv_elem = 2 if m.dtype == cpu_decode.W_BF16 else 4
    out["attention"] = 2 * rows * ctx * m.num_kv_heads * m.head_dim * kv_elem * m.num_layers
    return out


def profile(
    name: str,
    rows: int,
    steps: int,
    against: Path | None = None,
    model: str = "smollm2-135m",
    prompt_len: int = PROMPT_LEN,
) -> list[dict]:
    """One result per build: this source's, and with `against` another's, their steps alternating on
    the same engine (each build keeps its own clocks)."""
    engine = _engine(CONFIGS[name], "native", rows, steps * (2 if against else 1) + 4, model, prompt_len)
    dec = engine.runner.native
    builds = {"this": cpu_decode.load_library(profile=True)}
    if against:
        builds["against"] = cpu_decode.load_library(profile=True, source=against.resolve())
    for lib in builds.values():
        assert not isinstance(lib, str), lib
        lib.slotune_profile.restype = ctypes.c_int
    chunk = (ctypes.c_double * len(OPS))()
    sums = {b: (ctypes.c_double * len(OPS))() for b in builds}
    walls: dict[str, list[float]] = {b: [] for b in builds}
    paired: dict[str, list[dict]] = {b: [] for b in builds}
    for lib in builds.values():
        dec.lib = lib  # same entry points and structs; this build also keeps the clock
        engine.step()  # warm-up
        lib.slotune_profile(chunk)  # zero the counters
    for i in range(0, steps, CHUNK):  # the bandwidth read beside every CHUNK steps: the pair's ratio
        vnni_i = peak("vnni", builds["this"]) / 1e9  # before the bandwidth read, which flushes the L3
        bw_i = read_bandwidth_gbs(repeats=3)
        n = min(CHUNK, steps - i)
        for _ in range(n):
            for b, lib in builds.items():
                dec.lib = lib
                t = time.perf_counter()
                engine.step()
                walls[b].append(time.perf_counter() - t)
        for b, lib in builds.items():
            lib.slotune_profile(chunk)
            for j in range(len(OPS)):
                sums[b][j] += chunk[j]
            paired[b].append({"read_bandwidth_gbs": bw_i, "vnni_gmacs": vnni_i, "native_ms": 1e3 * sum(chunk) / n})
    ctx = prompt_len + 2 + steps * len(builds) // 2  # the keys a row attends to, on average over the steps
    nbytes = op_bytes(dec, rows, ctx)
    weights = sum(nbytes[op] for op in (*WEIGHT_OPS, "lm_head"))
    results = []
    for b in builds:
        ops = {}
        for i, op in enumerate(OPS):
            s = sums[b][i] / steps
            ops[op] = {
                "ms": 1e3 * s,
                "bytes": nbytes[op],
                "gbs": nbytes[op] / s / 1e9 if s > 0 and nbytes[op] else None,
            }
        native_ms = sum(o["ms"] for o in ops.values())
        for p in paired[b]:
            p["roofline_fraction"] = weights / (p["read_bandwidth_gbs"] * 1e9) / (p["native_ms"] / 1e3)
        results.append(
            with_roofline(
                {
                    "config": (name if model == "smollm2-135m" else f"{model} {name}")
                    + ("" if b == "this" else f" ({against})"),
                    "rows": rows,
                    "prompt_len": prompt_len,
                    "steps": steps,
                    "engine_step_ms": 1e3 * statistics.median(walls[b]),
                    "engine_step_mean_ms": 1e3 * statistics.fmean(walls[b]),
                    "native_ms": native_ms,
                    "weight_bytes": weights,
                    "paired": paired[b],  # per CHUNK steps: the bandwidth read just before and the ops' time
                    "roofline_fraction_median": statistics.median(p["roofline_fraction"] for p in paired[b]),
                    "ops": ops,
                    "loadavg": os.getloadavg()[0],
                }
            )
        )
    return results


def with_roofline(r: dict) -> dict:
    """The run's roofline at the median of its paired bandwidth reads."""
    r["read_bandwidth_gbs"] = statistics.median(p["read_bandwidth_gbs"] for p in r["paired"])
    if all("vnni_gmacs" in p for p in r["paired"]):
        r["vnni_gmacs"] = statistics.median(p["vnni_gmacs"] for p in r["paired"])
    r["roofline_ms"] = r["weight_bytes"] / (r["read_bandwidth_gbs"] * 1e9) * 1e3
    return r


def _commit() -> str:
    root = Path(__file__).resolve().parents[2]
    return subprocess.run(
        ["git", "-C", str(root), "describe", "--always", "--dirty"], capture_output=True, text=True
    ).stdout.strip()


def header(command: str) -> str:
    env = " ".join(f"{k}={os.environ[k]}" for k in ("SLOTUNE_NATIVE_CFLAGS", "ATEN_CPU_CAPABILITY") if k in os.environ)
    avx2 = not cpu_decode.isa() & cpu_decode.ISA_AVX512
    return (
        f"Machine: {machine.words()}. Date: {datetime.now(timezone.utc):%Y-%m-%d}. "
        f"Commit {_commit()}. Kernels: {'AVX2' if avx2 else 'AVX-512'}. Command: `{(env + ' ' if env else '') + command}`."
    )


def to_markdown(results: list[dict], head: str) -> str:
    lines = [
        "# Native decode step, per op",
        "",
        head,
        "",
        "Per step (means over the profiled steps). GB/s: the op's bytes / its time; % bw: of the read "
        "bandwidth, the median of the reads taken before every 16 steps. The native call's ops sum to "
        "`native`; `engine step` is the whole LLMEngine.step() (median).",
        "",
    ]
    for r in results:
        bw = r["read_bandwidth_gbs"]
        lines += [
            f"## {r['config']}, {r['rows']} rows",
            "",
            f"Read bandwidth {bw:.1f} GB/s; weights {r['weight_bytes'] / 1e6:.1f} MB/step, roofline "
            f"{r['roofline_ms']:.2f} ms; native {r['native_ms']:.2f} ms "
            f"({r['roofline_ms'] / r['native_ms']:.0%} of roofline; median over {len(r['paired'])} pairs of a "
            f"bandwidth read and {CHUNK} steps {r['roofline_fraction_median']:.0%}); engine step {r['engine_step_ms']:.2f} ms "
            f"(Python {r['engine_step_mean_ms'] - r['native_ms']:.2f} ms mean); load {r['loadavg']:.1f}"
            + (f"; compute probe {r['vnni_gmacs']:.0f} GMAC/s." if r.get("vnni_gmacs") else "."),
            "",
            "| op | ms | % of native | MB read | GB/s | % bw |",
            "|---|---|---|---|---|---|",
        ]
        for op, o in r["ops"].items():
            gbs = "" if o["gbs"] is None else f"{o['gbs']:.1f}"
            pct = "" if o["gbs"] is None else f"{o['gbs'] / bw:.0%}"
            mb = f"{o['bytes'] / 1e6:.1f}" if o["bytes"] else ""
            lines.append(f"| {op} | {o['ms']:.3f} | {o['ms'] / r['native_ms']:.0%} | {mb} | {gbs} | {pct} |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="int8-act,int4-act")
    ap.add_argument("--rows", default="1,16")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--model", default="smollm2-135m", help="a bundled model: smollm2-135m or gemma3-270m")
    ap.add_argument("--prompt-len", type=int, default=PROMPT_LEN, help="tokens each row holds before decoding")
    ap.add_argument("--out", type=Path, default=None, help="write <out>.json and <out>.md")
    ap.add_argument("--render", type=Path, default=None, help="rewrite the .md of a committed .json")
    ap.add_argument(
        "--against", type=Path, default=None, help="another cpu_decode.c, its steps alternating with this one's"
    )
    args = ap.parse_args()
    if args.render:
        results = [with_roofline(r) for r in json.loads(args.render.read_text())]
        md = args.render.with_suffix(".md")
        md.write_text(to_markdown(results, next(ln for ln in md.read_text().splitlines() if ln.startswith("Machine:"))))
        return
    results = []
    for name in args.configs.split(","):
        for rows in map(int, args.rows.split(",")):
            for r in profile(name, rows, args.steps, args.against, args.model, args.prompt_len):
                results.append(r)
                print(
                    f"{r['config']} rows {rows}: native {r['native_ms']:.2f} ms, step {r['engine_step_ms']:.2f} ms, "
                    f"roofline {r['roofline_ms']:.2f} ms at {r['read_bandwidth_gbs']:.1f} GB/s; paired fraction "
                    f"{r['roofline_fraction_median']:.0%}",
                    flush=True,
                )
    md = to_markdown(results, header("python bench/engine/profile_step.py " + " ".join(sys.argv[1:])))
    print(md)
    if args.out:
        args.out.with_suffix(".json").write_text(json.dumps(results, indent=1))
        args.out.with_suffix(".md").write_text(md)


if __name__ == "__main__":
    main()
