"""What a trace looks like (`summarize`), and a WorkloadSpec that looks like it (`fit`).

The same definitions (rates, burstiness, peak concurrency, cacheable share) serve a source trace and
the requests generated from a fitted spec, so the two can be compared line by line (`tune workload
fit`). Each definition in full: docs/design/tuner-workload.md.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict
from slotune.tuner.spec.traces import Trace, TraceRequest, block_hash_ids
from slotune.tuner.spec.workload_spec import LogNormal, WorkloadSpec
from slotune.tuner.spec.yaml_reader import SpecError
from slotune.tuner.workload.requests import WorkloadRequest

POISSON_CV_TOLERANCE = 0.25  # |CV - 1| within this: Poisson (CV 1) describes the arrivals
EVEN_CV = 0.05  # CV below this: fixed rate (gamma's shape would be 1/CV^2 > 400, i.e. even gaps)
DEFAULT_PREFILL_TOKENS_PER_S = 5000.0  # service-time estimate when a trace has no finish times
DEFAULT_TPOT_S = 0.03
PEAK_WINDOWS_S = (1.0, 10.0)


class LengthStats(BaseModel):
    model_config = ConfigDict(frozen=True)

    p50: float
    p95: float
    p99: float
    mean: float
    min: int
    max: int


class TraceSummary(BaseModel):
    """A trace in a few numbers (each defined in docs/design/tuner-workload.md)."""

    model_config = ConfigDict(frozen=True)

    num_requests: int
    duration_s: float  # first to last arrival
    prompt_tokens: LengthStats
    output_tokens: LengthStats
    mean_rate: float | None  # requests/s, 1 / mean gap; None with fewer than two distinct arrival times
    peak_rate_1s: float  # most arrivals in any [t_i, t_i + 1 s), per second
    peak_rate_10s: float
    interarrival_cv: float | None  # burstiness: std / mean of the gaps (Poisson 1, even 0)
    peak_concurrency: int  # most requests in flight, each over [arrival, arrival + service time)
    concurrency_source: Literal["measured", "estimated"]  # service times: every e2e_s, or all estimated
    cacheable_share: float | None  # of hashed prompt tokens, those in blocks an earlier request had
    cached_share: float | None  # of prompt tokens, what the server's prefix cache did serve (recordings only)
    block_size: int | None
    chat_share: float | None  # of requests whose format says; None when none does
    num_zero_output: int  # requests that produced no tokens (failed or aborted)


def summarize(
    trace: Trace, *, prefill_tokens_per_s: float = DEFAULT_PREFILL_TOKENS_PER_S, tpot_s: float = DEFAULT_TPOT_S
) -> TraceSummary:
    """Lengths, rates, burstiness, concurrency and prefix sharing of a trace.

    Args:
        trace: from `load_trace` or `requests_to_trace`.
        prefill_tokens_per_s, tpot_s: the serving speed assumed for the service-time estimate, used
            only when some request has no measured `e2e_s`.
    Returns:
        A TraceSummary. Raises ValueError for an empty trace.
    """
    reqs = trace.requests
    if not reqs:
        raise ValueError(f"{trace.source}: the trace has no requests")
    arrivals = np.array([r.arrival_s for r in reqs], dtype=float)
    gaps = np.diff(arrivals)
    duration = float(arrivals[-1] - arrivals[0])
    mean_gap = float(gaps.mean()) if len(gaps) else 0.0
    if all(r.e2e_s is not None for r in reqs):
        service, source = np.array([r.e2e_s for r in reqs], dtype=float), "measured"
    else:
        service = np.array([r.prompt_tokens / prefill_tokens_per_s + r.output_tokens * tpot_s for r in reqs])
        source = "estimated"
    chat = [r.is_chat for r in reqs if r.is_chat is not None]
    return TraceSummary(
        num_requests=len(reqs),
        duration_s=duration,
        prompt_tokens=_length_stats([r.prompt_tokens for r in reqs]),
        output_tokens=_length_stats([r.output_tokens for r in reqs]),
        mean_rate=1.0 / mean_gap if mean_gap > 0 else None,
        peak_rate_1s=_peak_rate(arrivals, PEAK_WINDOWS_S[0]),
        peak_rate_10s=_peak_rate(arrivals, PEAK_WINDOWS_S[1]),
        interarrival_cv=float(gaps.std() / mean_gap) if mean_gap > 0 else None,
        peak_concurrency=_peak_concurrency(arrivals, arrivals + service),
        concurrency_source=source,
        cacheable_share=_cacheable_share(trace),
        block_size=trace.block_size,
        cached_share=(
            sum(r.cached_tokens for r in reqs) / sum(r.prompt_tokens for r in reqs)
            if all(r.cached_tokens is not None for r in reqs)
            else None
        ),
        chat_share=sum(chat) / len(chat) if chat else None,
        num_zero_output=sum(r.output_tokens == 0 for r in reqs),
    )


def requests_to_trace(requests: Sequence[WorkloadRequest], *, block_size: int, source: str = "generated") -> Trace:
    """The measured requests of a generated workload as a Trace, hash ids from their token ids.

    Args:
        requests: from slotune/tuner/workload/requests.py: generate_requests (warm-up requests are left out).
        block_size: tokens per hash id; use the source trace's, to compare cacheable shares.
    """
    reqs = [
        TraceRequest(
            r.arrival_offset_s,
            len(r.prompt_token_ids),
            r.output_len,
            tuple(block_hash_ids(r.prompt_token_ids, block_size)),
        )
        for r in requests
        if not r.is_warmup
    ]
    return Trace(reqs, source, "recorded", block_size)


def fit(
    trace: Trace,
    *,
    name: str | None = None,
    num_requests: int | None = None,
    seed: int = 0,
    lengths_path: str | Path | None = None,
) -> dict[str, Any]:
    """A WorkloadSpec document whose generated traffic resembles `trace`.

    - lengths: lognormal (median and sigma from the mean and std of the logs, clipped to the traced
      min..max); with `lengths_path`, the traced lengths themselves instead, written there as the
      JSONL that WorkloadSpec's `trace` field replays (prompt and output lengths stay paired);
    - arrivals: Poisson at the mean rate; when the inter-arrival CV is far from 1 (beyond
      POISSON_CV_TOLERANCE), gamma gaps at the mean rate with burstiness 1/CV^2 (the same CV); near 0
      (below EVEN_CV), a fixed rate;
    - shared prefix: one prefix of whole blocks on a fraction of requests, keeping the mean cacheable
      tokens per request; the rest of each prompt is fitted as the lengths above (the rule in full:
      docs/design/tuner-workload.md);
    - mode 'completion': traced prompt lengths already include any chat template.

    Args:
        trace: the source; needs at least two distinct arrival times.
        name: the spec's name (default: the trace file's stem, "-fit").
        num_requests: default: as many as the trace has.
        seed: the spec's seed.
        lengths_path: write empirical lengths here (JSONL) instead of fitting lognormals.
    Returns:
        A mapping that `WorkloadSpec.load` accepts (checked here).
    """
    s = summarize(trace)
    if s.mean_rate is None:
        raise SpecError(
            "fitting arrivals needs two or more distinct arrival times (widen the window or the request cap?)",
            source=trace.source,
        )
    cacheable = _cacheable_per_request(trace)
    bs = trace.block_size or 1
    has_prefix = cacheable > 0
    # Whole blocks, so that the prefix is cacheable at the trace's block size; its fraction keeps the
    # expected cacheable tokens per request (and so, with `bodies`, the mean prompt) at the trace's.
    prefix_len = max(1, int(round(cacheable[has_prefix].mean() / bs))) * bs if has_prefix.any() else 0
    prefix_fraction = min(1.0, float(cacheable.mean()) / prefix_len) if prefix_len else 0.0
    prompts = np.array([r.prompt_tokens for r in trace.requests])
    bodies = np.maximum(1, prompts - cacheable)  # what each request adds past its cacheable part
    outputs = np.maximum(1, np.array([r.output_tokens for r in trace.requests]))
    notes = [
        f"Fitted to {s.num_requests} requests of {Path(trace.source).name} ({trace.format} trace, "
        f"{s.duration_s:.0f} s): mean rate {s.mean_rate:.3g}/s, peak {s.peak_rate_1s:.3g}/s over 1 s and "
        f"{s.peak_rate_10s:.3g}/s over 10 s; prompt p50 {s.prompt_tokens.p50:.0f}, output p50 "
        f"{s.output_tokens.p50:.0f} tokens."
    ]
    doc: dict[str, Any] = {
        "name": name or f"{Path(trace.source).stem}-fit",
        "description": "",
        "mode": "completion",
        "arrivals": "poisson",
        "rate": _round(s.mean_rate),
        "num_requests": num_requests or s.num_requests,
        "warmup_requests": 1,
        "seed": seed,
    }
    cv = s.interarrival_cv
    if cv is not None and cv < EVEN_CV:
        doc.update(arrivals="fixed_rate")
        notes.append(f"Inter-arrival CV {cv:.2g}: evenly spaced, fixed rate.")
    elif cv is not None and abs(cv - 1) > POISSON_CV_TOLERANCE:
        doc.update(arrivals="gamma", burstiness=_round(1 / cv**2))
        notes.append(
            f"Inter-arrival CV {cv:.2f} (Poisson has 1; {'burstier' if cv > 1 else 'more even'}): "
            f"gamma gaps, burstiness 1/CV^2."
        )
    if lengths_path is not None:
        path = Path(lengths_path)
        path.write_text(
            "".join(json.dumps({"prompt_len": int(p), "output_len": int(o)}) + "\n" for p, o in zip(bodies, outputs))
        )
        doc["trace"] = str(path)
    else:
        doc["prompt_len"] = _lognormal(bodies)
        doc["output_len"] = _lognormal(outputs)
    if prefix_len > 0:
        doc["shared_prefix"] = {"num_tokens": prefix_len, "fraction": _round(prefix_fraction)}
        notes.append(
            f"Cacheable share {s.cacheable_share:.2f} (blocks of {trace.block_size} tokens seen before; "
            f"{has_prefix.mean():.0%} of requests have some), as one shared prefix."
        )
    if s.num_zero_output:
        notes.append(f"{s.num_zero_output} requests produced no tokens; fitted as 1-token answers.")
    if s.chat_share:
        notes.append(f"{s.chat_share:.0%} were chat requests; lengths include their template, so mode is completion.")
    doc["description"] = " ".join(notes)
    WorkloadSpec.load(doc)  # raises if this module and WorkloadSpec disagree
    return doc


# --- helpers -----------------------------------------------------------------------------------------
def _length_stats(values: Sequence[int]) -> LengthStats:
    a = np.asarray(values, dtype=float)
    p50, p95, p99 = np.percentile(a, [50, 95, 99])
    return LengthStats(p50=p50, p95=p95, p99=p99, mean=a.mean(), min=int(a.min()), max=int(a.max()))


def _peak_rate(arrivals: np.ndarray, window_s: float) -> float:
    ends = np.searchsorted(arrivals, arrivals + window_s, side="left")  # arrivals sorted
    return float((ends - np.arange(len(arrivals))).max() / window_s)


def _peak_concurrency(starts: np.ndarray, ends: np.ndarray) -> int:
    # +1 at a start, -1 at an end; at equal times ends first ([start, end) intervals).
    times = np.concatenate([starts, ends])
    steps = np.concatenate([np.ones(len(starts), dtype=np.int64), -np.ones(len(ends), dtype=np.int64)])
    order = np.lexsort((steps, times))  # by time, then -1 before +1
    return int(np.cumsum(steps[order]).max())


def _cacheable_per_request(trace: Trace) -> np.ndarray:
    """Tokens of each request in blocks whose id an earlier request had (0 without hash ids)."""
    bs, seen = trace.block_size, set()
    out = np.zeros(len(trace.requests), dtype=np.int64)
    for i, r in enumerate(trace.requests):
        if not r.hash_ids:
            continue
        out[i] = sum(min(bs, r.prompt_tokens - j * bs) for j, h in enumerate(r.hash_ids) if h in seen)
        seen.update(r.hash_ids)
    return out


def _cacheable_share(trace: Trace) -> float | None:
    hashed = [i for i, r in enumerate(trace.requests) if r.hash_ids is not None]
    if not hashed or trace.block_size is None:
        return None
    total = sum(trace.requests[i].prompt_tokens for i in hashed)
    return float(_cacheable_per_request(trace)[hashed].sum() / total)


def _lognormal(values: np.ndarray) -> dict[str, Any]:
    logs = np.log(values.astype(float))
    return LogNormal(
        mean=_round(float(np.exp(logs.mean()))),
        sigma=_round(min(float(logs.std()), 10.0)),
        min=int(values.min()),
        max=int(values.max()),
    ).model_dump()


def _round(x: float) -> float:
    return float(f"{x:.4g}")
