"""Serving metrics from per-request timestamps: percentiles, throughput, goodput.

Pure Python + numpy so the tuner can score results without importing torch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

PERCENTILES = (50, 90, 95, 99)


@dataclass(slots=True)
class RequestRecord:
    """What we keep of one finished request (seconds, relative or absolute perf_counter)."""

    request_id: str
    prompt_tokens: int
    output_tokens: int
    ttft: float | None
    tpot: float | None
    e2e: float | None
    queue_time: float | None
    itls: list[float]
    finish_reason: str | None
    cached_prompt_tokens: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


def percentile(values: list[float], p: float) -> float | None:
    v = [x for x in values if x is not None]
    return float(np.percentile(v, p)) if v else None


def meets_slo(r: RequestRecord, ttft_limit_s: float | None, tpot_limit_s: float | None) -> bool:
    if r.finish_reason not in ("stop", "length"):
        return False
    if ttft_limit_s is not None and (r.ttft is None or r.ttft > ttft_limit_s):
        return False
    if tpot_limit_s is not None and r.tpot is not None and r.tpot > tpot_limit_s:
        return False
    return True


def summarize(records: list[RequestRecord], duration_s: float, *, ttft_limit_s: float | None = None,
              tpot_limit_s: float | None = None, percentiles: tuple[int, ...] = PERCENTILES) -> dict[str, float]:
    """Flat metric dict: ttft_p95, tpot_p50, itl_p99, e2e_p90, queue_time_p50, output_tokens_per_s, ..."""
    m: dict[str, float] = {}
    series = {
        "ttft": [r.ttft for r in records],
        "tpot": [r.tpot for r in records],
        "e2e": [r.e2e for r in records],
        "queue_time": [r.queue_time for r in records],
        "itl": [x for r in records for x in r.itls],
    }
    for name, vals in series.items():
        for p in percentiles:
            v = percentile(vals, p)
            if v is not None:
                m[f"{name}_p{p}"] = v
        clean = [x for x in vals if x is not None]
        if clean:
            m[f"{name}_mean"] = float(np.mean(clean))
    done = [r for r in records if r.finish_reason in ("stop", "length")]
    out_tokens = sum(r.output_tokens for r in done)
    duration_s = max(duration_s, 1e-9)
    m["num_requests"] = float(len(records))
    m["num_completed"] = float(len(done))
    m["duration_s"] = duration_s
    m["output_tokens"] = float(out_tokens)
    m["output_tokens_per_s"] = out_tokens / duration_s
    m["total_tokens_per_s"] = (out_tokens + sum(r.prompt_tokens for r in done)) / duration_s
    m["requests_per_s"] = len(done) / duration_s
    good = [r for r in records if meets_slo(r, ttft_limit_s, tpot_limit_s)]
    m["goodput_rps"] = len(good) / duration_s
    m["slo_attainment"] = len(good) / len(records) if records else 0.0
    return m
