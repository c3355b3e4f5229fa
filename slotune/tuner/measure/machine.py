"""The machine a measurement was taken on, in the words its numbers need.

A TTFT measured on one CPU is not a promise on another (the same config's lead over llama-server
differs between two 2-core CPUs: docs/design/tuner-measure.md). Every trial records `describe()`'s
words (user attribute `machine`, beside `host`), so best_metrics.json, the MLflow runs, the report
and the bench scripts say which machine measured what. Read from /proc (Linux); else `platform`.
"""

from __future__ import annotations

import functools
import os
import platform
import re
from pathlib import Path

# The extensions the kernels pick between (slotune/kernels/cpu_decode.c, llama.cpp's builds), widest last.
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile")


@functools.cache
def describe() -> dict[str, object]:
    """{"cpu": model name, "cpus": logical CPUs, "isa": [ISA_FLAGS present], "mem_gib": total memory}."""
    cpu, flags = platform.processor() or platform.machine() or "unknown CPU", set()
    try:
        info = Path("/proc/cpuinfo").read_text()
        m = re.search(r"^model name\s*:\s*(.+)$", info, re.M)
        cpu = m.group(1).strip() if m else cpu
        m = re.search(r"^flags\s*:\s*(.+)$", info, re.M)
        flags = set(m.group(1).split()) if m else set()
    except OSError:
        pass
    mem_gib = None
    try:
        m = re.search(r"^MemTotal:\s+(\d+) kB", Path("/proc/meminfo").read_text(), re.M)
        mem_gib = round(int(m.group(1)) / 2**20, 1) if m else None
    except OSError:
        pass
    return {"cpu": cpu, "cpus": os.cpu_count() or 1, "isa": [f for f in ISA_FLAGS if f in flags], "mem_gib": mem_gib}


def words(info: dict[str, object] | None = None) -> str:
    """'Intel(R) Xeon(R) Processor, 2 CPUs, avx2/fma/avx512f/avx512_vnni/avx512_bf16/amx_tile, 23.4 GiB'."""
    d = info or describe()
    parts = [str(d["cpu"]), f"{d['cpus']} CPUs", "/".join(d["isa"]) or "no AVX2"]
    if d.get("mem_gib"):
        parts.append(f"{d['mem_gib']} GiB")
    return ", ".join(parts)


def label(info: dict[str, object] | None = None) -> str:
    """A file-name slug: 'intel-r-xeon-r-processor-2c'."""
    d = info or describe()
    return re.sub(r"[^a-z0-9]+", "-", str(d["cpu"]).lower()).strip("-") + f"-{d['cpus']}c"
