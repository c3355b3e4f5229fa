"""Canary metrics: scrape the pods' Prometheus /metrics and turn histograms into quantiles.

The metric names are the ones `tune serve` exports (slotune/engine/serving/server.py); they live here, in
one place, so the operator and the server stay aligned (a test scrapes a real server).
"""

from __future__ import annotations

import math
import urllib.request
from dataclasses import dataclass, field

TTFT_METRIC = "slotune_time_to_first_token_seconds"
TPOT_METRIC = "slotune_time_per_output_token_seconds"
E2E_METRIC = "slotune_e2e_request_latency_seconds"
HISTOGRAMS = {"ttft": TTFT_METRIC, "tpot": TPOT_METRIC, "e2e": E2E_METRIC}


@dataclass(slots=True)
class Histogram:
    """Cumulative bucket counts (upper bound -> count), summed over every scraped pod."""

    buckets: dict[float, float] = field(default_factory=dict)
    count: float = 0.0
    total: float = 0.0

    def add(self, other: "Histogram") -> None:
        for le, c in other.buckets.items():
            self.buckets[le] = self.buckets.get(le, 0.0) + c
        self.count += other.count
        self.total += other.total

    def quantile(self, q: float) -> float | None:
        """Prometheus' histogram_quantile: linear interpolation inside the bucket holding q."""
        if self.count <= 0 or not self.buckets:
            return None
        bounds = sorted(self.buckets)
        rank = q * self.buckets[bounds[-1]]
        prev_le, prev_c = 0.0, 0.0
        for le in bounds:
            c = self.buckets[le]
            if c >= rank:
                if math.isinf(le):  # beyond the last finite bucket: its bound is the best guess
                    return prev_le
                if c == prev_c:
                    return le
                return prev_le + (le - prev_le) * (rank - prev_c) / (c - prev_c)
            prev_le, prev_c = le, c
        return bounds[-1]

    @property
    def mean(self) -> float | None:
        return self.total / self.count if self.count else None


def parse(text: str) -> dict[str, Histogram]:
    """Histograms in a Prometheus text exposition, keyed by short name (ttft, tpot, e2e)."""
    from prometheus_client.parser import text_string_to_metric_families

    wanted = {v: k for k, v in HISTOGRAMS.items()}
    out: dict[str, Histogram] = {}
    for family in text_string_to_metric_families(text):
        short = wanted.get(family.name)
        if short is None:
            continue
        h = out.setdefault(short, Histogram())
        for s in family.samples:
            if s.name.endswith("_bucket"):
                le = float(s.labels["le"])
                h.buckets[le] = h.buckets.get(le, 0.0) + s.value
            elif s.name.endswith("_count"):
                h.count += s.value
            elif s.name.endswith("_sum"):
                h.total += s.value
    return out


def scrape(urls: list[str], timeout_s: float = 3.0) -> tuple[dict[str, Histogram], list[str]]:
    """Scrape every URL and sum the histograms; returns (histograms, errors)."""
    total: dict[str, Histogram] = {}
    errors: list[str] = []
    for url in urls:
        try:
            with urllib.request.urlopen(url, timeout=timeout_s) as resp:
                text = resp.read().decode()
        except OSError as exc:
            errors.append(f"{url}: {exc}")
            continue
        for short, h in parse(text).items():
            total.setdefault(short, Histogram()).add(h)
    return total, errors
