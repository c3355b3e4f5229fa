"""Memory read bandwidth of this machine, the denominator of every roofline in bench/.

A streaming read (torch's float32 sum, which reads faster here than a hand-written AVX-512 load loop:
53 against 45 GB/s side by side on a 2-vCPU EPYC) over 4x the last-level cache and at least 512 MiB,
on every thread torch uses; best of `repeats`, the machine's capability. Run it in the same session,
right before the measurement it divides: these shared VMs read 30-50 GB/s from one minute to the next,
partly as the hypervisor moves the two vCPUs between cores that share an L3 and cores that do not
(bench/tuner/host_drift.py).
"""

from __future__ import annotations

import functools
import time
from pathlib import Path

import torch


def last_level_cache_bytes() -> int:
    """Size of the largest CPU cache sysfs reports for cpu0 (0 if it reports none)."""
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = f.read_text().strip()
        mult = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        sizes.append(int(text.rstrip("KMG")) * mult)
    return max(sizes, default=0)


@functools.cache
def _buffer() -> torch.Tensor:
    x = torch.ones(max(4 * last_level_cache_bytes(), 512 * 2**20) // 4)
    x.sum()  # fault the pages in
    return x


def read_bandwidth_gbs(repeats: int = 7) -> float:
    """GB/s (1e9 bytes) read by a float32 sum over max(4 x LLC, 512 MiB), best of `repeats`."""
    x = _buffer()
    nbytes = x.numel() * 4
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return nbytes / best / 1e9


if __name__ == "__main__":
    print(f"read bandwidth {read_bandwidth_gbs():.1f} GB/s ({torch.get_num_threads()} threads)")
