"""The native matmul kernels alone: bytes/s against the read bandwidth, MACs/s against the VNNI ceiling.

Per weight format (int8 and int4-g32, both with int8 activations) and row count, `slotune_matmul` runs
over SmolLM2-135M-sized projections in two ways, interleaved: `hot`, one 3072 x 576 weight again and
again (it stays in L2/L3: the kernel's own speed), and `cold`, 30 distinct ones in turn (90-130 MB, far
past the last-level cache: what a decode step sees). Rates are weight bytes (as stored, scales included)
and multiply-adds per second; best of `--repeats`. The ceilings beside them, measured in the same run:
the read bandwidth (bench/bandwidth.py) and `slotune_vnni_peak` (16 independent vpdpbusd chains per
thread, in the profiling build), and with `--amx` `slotune_amx_peak` (tdpbsud on tiles in registers) beside
this build's AMX kernels on and off (`no-amx`). `--against FILE.c` builds another version of slotune/kernels/cpu_decode.c
(e.g. `git show REV:slotune/kernels/cpu_decode.c > /tmp/old.c`) and times it beside, on the same repacked layouts.

    .venv/bin/python bench/engine/kernel_rate.py --rows 1,4,16,64 [--against /tmp/old.c] [--amx]
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from slotune.engine.native_step import native_linear  # noqa: E402
from slotune.engine.quantize import Int4Linear, Int8Linear  # noqa: E402
from slotune.kernels import cpu_decode as cd  # noqa: E402

from bench.bandwidth import read_bandwidth_gbs  # noqa: E402

N, K, COLD = 3072, 576, 30  # SmolLM2-135M's gate_up; one per layer


def build(source: Path) -> ctypes.CDLL:
    lib = cd.load_library(source=source.resolve())
    if isinstance(lib, str):
        sys.exit(lib)
    return lib


def peak(name: str, lib=None) -> float:
    """MACs/s of the profiling build's (or `lib`'s) `slotune_<name>_peak` (vnni, amx), best of 3; 0
    without it."""
    lib = cd.load_library(profile=True) if lib is None else lib
    fn = None if isinstance(lib, str) else getattr(lib, f"slotune_{name}_peak", None)
    if fn is None:
        return 0.0
    fn.restype, fn.argtypes = ctypes.c_double, [ctypes.c_int64, ctypes.c_int]
    return max(fn(2_000_000, torch.get_num_threads()) for _ in range(3))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,4,16,64")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--against", type=Path, default=None, help="another cpu_decode.c to time beside this one")
    ap.add_argument("--amx", action="store_true", help="time this build with its AMX kernels off beside them on")
    ap.add_argument("--act-group", type=int, default=32, help="inputs per int8 activation scale (32-256)")
    args = ap.parse_args()
    threads = torch.get_num_threads()
    libs = {"this": cd.load_library()}
    if args.against:
        libs["against"] = build(args.against)
    if args.amx:
        if not cd.set_amx(True):
            sys.exit("this build, CPU or kernel has no AMX")
        libs["no-amx"] = libs["this"]
    bw, vpeak, apeak = read_bandwidth_gbs(), peak("vnni"), peak("amx") if args.amx else 0.0
    amx_ceiling = f", tdpbsud ceiling {apeak / 1e9:.0f} GMAC/s" if apeak else ""
    print(
        f"read bandwidth {bw:.1f} GB/s, vpdpbusd ceiling {vpeak / 1e9:.0f} GMAC/s{amx_ceiling}, {threads} threads, "
        f"activation groups of {args.act_group}"
    )
    torch.manual_seed(0)
    for fmt in ("int8", "int4-g32"):
        mods = [
            Int8Linear(torch.randn(N, K)) if fmt == "int8" else Int4Linear(torch.randn(N, K), 32) for _ in range(COLD)
        ]
        nbytes = mods[0].weight_bytes()
        keep: list[torch.Tensor] = []
        # every build compared reads the layouts repacked at load (int4 since 3a77e04 on VNNI, ecc2aae on AVX2)
        lins = [cd._lin(native_linear(m), keep, True) for m in mods]
        for rows in map(int, args.rows.split(",")):
            x = torch.randn(rows, K)
            xq, xs, xsum = (
                torch.zeros(rows, K, dtype=torch.int8),
                torch.zeros(rows, K // 32),
                torch.zeros(rows, K // 32),
            )
            md = cd._Model(
                max_k=K,
                xq=xq.data_ptr(),
                xscale=xs.data_ptr(),
                xsum=xsum.data_ptr(),
                int8_activations=1,
                act_group=args.act_group,
            )
            out = torch.empty(rows, N)
            best = {(name, way): float("inf") for name in libs for way in ("hot", "cold")}
            for _ in range(args.repeats):
                for name, lib in libs.items():
                    if args.amx:
                        cd.set_amx(name != "no-amx")
                    for way in ("hot", "cold"):
                        seq = [lins[0]] * COLD if way == "hot" else lins
                        t = time.perf_counter()
                        for lin in seq:
                            lib.slotune_matmul(
                                ctypes.byref(md), ctypes.byref(lin), x.data_ptr(), out.data_ptr(), rows, threads
                            )
                        best[name, way] = min(best[name, way], (time.perf_counter() - t) / COLD)
            for (name, way), s in best.items():
                gbs, gmacs = nbytes / s / 1e9, rows * N * K / s / 1e9
                roof = f"{gbs / bw:4.0%} of read bw" if way == "cold" else "            "
                ceil = f"{gmacs * 1e9 / vpeak:4.0%} of VNNI ceiling" if vpeak else ""
                if apeak and name == "this" and rows >= 16:  # whole 16-row tiles go through AMX
                    ceil += f", {gmacs * 1e9 / apeak:4.0%} of AMX's"
                print(
                    f"{fmt:8s} rows {rows:3d} {name:7s} {way:4s}: {gbs:6.1f} GB/s {roof}  {gmacs:6.1f} GMAC/s {ceil}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
