"""Serving metrics from per-request timestamps: percentiles, throughput, goodput, engine stats.

Pure Python + numpy so the tuner can score results without importing torch (torch is only
touched, lazily, to read CUDA peak memory). Definitions, per request:
  ttft        first_token_time - arrival_time (arrival is the *scheduled* arrival, so queueing counts)
  tpot        (last token time - first token time) / (output tokens - 1); None for one token
  itl         every gap between consecutive output tokens (pooled over requests)
  e2e         finish_time - arrival_time
  queue_time  first scheduled - arrival_time
Goodput counts requests whose *own* TTFT and TPOT are within the limits (per-request SLO,
`slo.meets_slo`), divided by the run's duration. Metric keys are `slo.metric_key`'s.
`cost_metrics`: $ per 1M tokens at the measured throughput, for a price per hour. How sure each
number is: measure/intervals.py; the typed view with intervals: measure/measurement.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import numpy as np
from slotune.tuner.spec.slo import COST_RATES, SLOLimits, breaks_slo_early, meets_slo, metric_key

PERCENTILES: tuple[float, ...] = (50, 90, 95, 99)
LATENCY_SERIES = ("ttft", "tpot", "itl", "e2e", "queue_time")
COMPLETED = ("stop", "length")
# Intervals (`bootstrap_intervals`): these latency percentiles at least (a trial adds its objective's),
# these rates, a 95% interval from 1000 resamples of the requests with a fixed seed.
CI_PERCENTILES: tuple[float, ...] = (50, 95)
CI_RATES = ("output_tokens_per_s", "total_tokens_per_s", "requests_per_s", "goodput_rps")
NUM_RESAMPLES, CI_LEVEL, CI_SEED = 1000, 0.95, 0


@dataclass(slots=True)
class RequestRecord:
    """What we keep of one finished request (durations in seconds)."""

    request_id: str
    prompt_tokens: int
    output_tokens: int
    ttft: float | None
    tpot: float | None
    e2e: float | None
    queue_time: float | None
    itls: list[float]
    finish_reason: str | None  # stop | length | abort | rejected | error (over HTTP: the request broke)
    cached_prompt_tokens: int = 0
    num_preemptions: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    arrival_s: float | None = None  # relative to the run's start

    @property
    def is_completed(self) -> bool:
        return self.finish_reason in COMPLETED

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "RequestRecord":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})

    @classmethod
    def from_output(cls, out: Any, t0: float | None = None) -> "RequestRecord":
        """From an engine `RequestOutput` (duck-typed: `.metrics` is a `RequestMetrics`)."""
        m = out.metrics
        return cls(
            request_id=out.request_id,
            prompt_tokens=len(out.prompt_token_ids),
            output_tokens=len(out.output_token_ids),
            ttft=m.ttft,
            tpot=m.tpot,
            e2e=m.e2e,
            queue_time=m.queue_time,
            itls=list(m.itls),
            finish_reason=out.finish_reason,
            cached_prompt_tokens=m.num_cached_prompt_tokens,
            num_preemptions=m.num_preemptions,
            num_draft_tokens=m.num_draft_tokens,
            num_accepted_tokens=m.num_accepted_tokens,
            arrival_s=None if t0 is None else m.arrival_time - t0,
        )

    @classmethod
    def rejected(cls, request_id: str, prompt_tokens: int, reason: str = "rejected") -> "RequestRecord":
        return cls(request_id, prompt_tokens, 0, None, None, None, None, [], reason)


def percentile(values: list[float | None], p: float) -> float | None:
    v = [x for x in values if x is not None]
    return float(np.percentile(v, p)) if v else None


def series(records: list[RequestRecord]) -> dict[str, list[float]]:
    """Latency samples by name (completed requests only; ITL pooled over them)."""
    done = [r for r in records if r.is_completed]
    return {
        "ttft": [r.ttft for r in done if r.ttft is not None],
        "tpot": [r.tpot for r in done if r.tpot is not None],
        "itl": [x for r in done for x in r.itls],
        "e2e": [r.e2e for r in done if r.e2e is not None],
        "queue_time": [r.queue_time for r in done if r.queue_time is not None],
    }


def summarize(
    records: list[RequestRecord],
    duration_s: float,
    *,
    ttft_limit_s: float | None = None,
    tpot_limit_s: float | None = None,
    percentiles: tuple[float, ...] = PERCENTILES,
) -> dict[str, float]:
    """Flat metric dict over one run.

    Args:
        records: every measured request, including rejected/aborted ones.
        duration_s: wall time of the run (first arrival to last completion).
        ttft_limit_s, tpot_limit_s: per-request limits for goodput and SLO attainment.
        percentiles: which pXX to report (any float, e.g. 99.9).
    Returns:
        {'ttft_p95': ..., 'tpot_mean': ..., 'output_tokens_per_s': ..., 'goodput_rps': ...,
         'slo_attainment': ..., 'num_completed': ..., ...}; latency keys are absent when no
        request produced a sample (e.g. every request was rejected).
    """
    m: dict[str, float] = {}
    for name, vals in series(records).items():
        if not vals:
            continue
        arr = np.asarray(vals, dtype=float)
        for p, v in zip(percentiles, np.percentile(arr, list(percentiles))):
            m[metric_key(name, p)] = float(v)
        m[f"{name}_mean"] = float(arr.mean())
        m[f"{name}_max"] = float(arr.max())
    done = [r for r in records if r.is_completed]
    out_tokens = sum(r.output_tokens for r in done)
    duration_s = max(duration_s, 1e-9)
    limits = SLOLimits(ttft_s=ttft_limit_s, tpot_s=tpot_limit_s)
    good = [r for r in records if meets_slo(r, limits)]
    m.update(
        num_requests=float(len(records)),
        num_completed=float(len(done)),
        num_rejected=float(sum(r.finish_reason == "rejected" for r in records)),
        num_aborted=float(sum(r.finish_reason == "abort" for r in records)),
        num_errors=float(sum(r.finish_reason == "error" for r in records)),
        duration_s=duration_s,
        prompt_tokens=float(sum(r.prompt_tokens for r in done)),
        output_tokens=float(out_tokens),
        output_tokens_per_s=out_tokens / duration_s,
        total_tokens_per_s=(out_tokens + sum(r.prompt_tokens for r in done)) / duration_s,
        requests_per_s=len(done) / duration_s,
        goodput_rps=len(good) / duration_s,
        slo_attainment=len(good) / len(records) if records else 0.0,
    )
    return m


def ci_keys(key: str) -> tuple[str, str]:
    """The interval's keys of a metric: 'tpot_p95' -> ('tpot_p95_ci_low', 'tpot_p95_ci_high')."""
    return f"{key}_ci_low", f"{key}_ci_high"


def cost_metrics(metrics: Mapping[str, Any], usd_per_hour: float) -> dict[str, float]:
    """What a run's throughput costs at `usd_per_hour` (one replica / accelerator for an hour).

    usd_per_1m_output_tokens = usd_per_hour / 3600 / output_tokens_per_s * 1e6, and
    usd_per_1m_total_tokens likewise from total_tokens_per_s (prompt + output). The interval, when
    the throughput has one, is the price of its ends (the high throughput gives the low cost).

    Args:
        metrics: a flat metric dict (`summarize`'s, with `bootstrap_intervals`' when measured).
        usd_per_hour: the price, > 0 (the spec's `cost.usd_per_hour`, `tune bench --usd-per-hour`).

    Returns:
        {'usd_per_1m_output_tokens': ..., 'usd_per_1m_total_tokens': ..., and their `_ci_low` /
        `_ci_high`}; a cost whose throughput was not measured or is 0 (nothing produced: no price
        per token) is left out.
    """
    if not usd_per_hour > 0:
        raise ValueError(f"usd_per_hour: must be > 0, got {usd_per_hour}")

    def price(tokens_per_s: float) -> float:
        return usd_per_hour / 3600 / tokens_per_s * 1e6

    out: dict[str, float] = {}
    for cost_key, rate_key in COST_RATES.items():
        rate = metrics.get(rate_key)
        if not isinstance(rate, (int, float)) or not rate > 0:
            continue
        out[cost_key] = price(rate)
        lo, hi = (metrics.get(k) for k in ci_keys(rate_key))
        if isinstance(lo, (int, float)) and isinstance(hi, (int, float)) and lo > 0:
            out.update(zip(ci_keys(cost_key), (price(hi), price(lo))))
    return out


def breaks_slo_so_far(records: list[RequestRecord], objective: dict[str, Any], es: dict[str, Any]) -> bool:
    """The early-stop rule: at least `es.min_requests` requests have finished (aborted and broken
    ones do not count) and their pXX already misses a latency limit by `es.factor` x
    (`slo.breaks_slo_early`).

    Used by both replays: `run_in_process_replay`'s should_stop in slotune/tuner/measure/trial_runner.py, the HTTP
    client's in slotune/tuner/measure/http_replay.py `main`.
    """
    done = [r for r in records if r.finish_reason not in ("abort", "error")]
    return len(done) >= es["min_requests"] and breaks_slo_early(
        summarize(done, 1.0, percentiles=(objective["percentile"],)), objective, es["factor"]
    )


@dataclass
class ReplayResult:
    """One measured run: the config and workload it used, flat metrics, per-request records."""

    config: dict[str, Any]
    workload: dict[str, Any]
    metrics: dict[str, float]
    records: list[RequestRecord] = field(default_factory=list)
    early_stopped: bool = False
    device: str = ""
    started_at: str = ""  # UTC ISO time

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": self.config,
            "workload": self.workload,
            "metrics": self.metrics,
            "records": [r.to_dict() for r in self.records],
            "early_stopped": self.early_stopped,
            "device": self.device,
            "started_at": self.started_at,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ReplayResult":
        return cls(
            d["config"],
            d["workload"],
            d["metrics"],
            [RequestRecord.from_dict(r) for r in d.get("records", [])],
            d.get("early_stopped", False),
            d.get("device", ""),
            d.get("started_at", ""),
        )

    def latency(self, name: str, p: float) -> float | None:
        """Any percentile of ttft/tpot/itl/e2e/queue_time, from the records if not precomputed."""
        key = metric_key(name, p)
        if key not in self.metrics:
            self.metrics.update(
                {
                    k: v
                    for k, v in summarize(self.records, self.metrics.get("duration_s", 1.0), percentiles=(p,)).items()
                    if k == key
                }
            )
        return self.metrics.get(key)


def engine_stats_delta(before: Any, after: Any) -> dict[str, float]:
    """Engine counters over a run, from two `EngineStats` snapshots (duck-typed).

    Returns peak_kv_blocks / kv_block_usage (the peak since `after`'s engine last started a stats
    window: `LLMEngine.start_stats_window`),
    prefix_cache_hit_rate, spec_acceptance_rate, spec_mean_accepted_length (tokens emitted per
    verification, bonus token included), num_preemptions and rejected counts by reason.
    """

    def d(name: str) -> int:
        return getattr(after, name, 0) - getattr(before, name, 0)

    q, drafts, verifs = d("prefix_cache_queries"), d("num_draft_tokens"), d("num_spec_verifications")
    acc = d("num_accepted_tokens")
    m = {
        "peak_kv_blocks": float(after.window_peak_blocks),
        "num_kv_blocks": float(after.num_total_blocks),
        "kv_block_usage": after.window_peak_blocks / after.num_total_blocks if after.num_total_blocks else 0.0,
        "prefix_cache_hit_rate": d("prefix_cache_hits") / q if q else 0.0,
        "spec_acceptance_rate": acc / drafts if drafts else 0.0,
        "spec_mean_accepted_length": (acc + verifs) / verifs if verifs else 0.0,
        "num_draft_tokens": float(drafts),
        "num_preemptions": float(d("num_preemptions")),
        "num_engine_steps": float(d("num_steps")),
    }
    rej_before, rej_after = getattr(before, "num_rejected", {}) or {}, getattr(after, "num_rejected", {}) or {}
    for reason, n in rej_after.items():
        if n - rej_before.get(reason, 0):
            m[f"num_rejected_{reason}"] = float(n - rej_before.get(reason, 0))
    # Every fallback the backend can have is reported, 0 included: a trial whose tile or backend
    # lever ran on another path says so (num_kernel_fallback_<reason>).
    fb_before, fb_after = getattr(before, "kernel_fallbacks", {}) or {}, getattr(after, "kernel_fallbacks", {}) or {}
    for reason, n in fb_after.items():
        m[f"num_kernel_fallback_{reason}"] = float(n - fb_before.get(reason, 0))
    return m
