"""Resident memory of this process: the peak during a replay (`MemoryTracker`)."""

from __future__ import annotations

import os
import resource


def rss_mb() -> float:
    """Current resident set size of this process (Linux /proc, psutil elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        import psutil

        return psutil.Process().memory_info().rss / 2**20


class MemoryTracker:
    """Peak memory over a run: sampled RSS on CPU, `torch.cuda.max_memory_allocated` on CUDA.

    `ru_maxrss` is a whole-process high-water mark (it includes model loading and earlier
    runs), so on CPU we sample RSS as the run goes and report both.
    """

    def __init__(self, device: str) -> None:
        self.is_cuda = device.startswith("cuda")
        self.peak_rss_mb = rss_mb()
        if self.is_cuda:
            import torch

            torch.cuda.reset_peak_memory_stats()

    def sample(self) -> None:
        self.peak_rss_mb = max(self.peak_rss_mb, rss_mb())

    def metrics(self) -> dict[str, float]:
        self.sample()
        m = {
            "peak_rss_mb": self.peak_rss_mb,
            "process_max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,  # Linux: KiB
        }
        if self.is_cuda:
            import torch

            m["peak_cuda_memory_mb"] = torch.cuda.max_memory_allocated() / 2**20
        m["peak_memory_mb"] = m.get("peak_cuda_memory_mb", self.peak_rss_mb)
        return m
