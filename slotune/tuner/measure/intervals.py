"""Uncertainty of a measurement: bootstrap intervals over requests, Student-t half-widths, ratio intervals."""

from __future__ import annotations

import math
import statistics

import numpy as np
from slotune.tuner.measure.metrics import (
    CI_LEVEL,
    CI_PERCENTILES,
    CI_RATES,
    CI_SEED,
    NUM_RESAMPLES,
    RequestRecord,
    ci_keys,
    series,
)
from slotune.tuner.spec.slo import SLOLimits, meets_slo, metric_key


def bootstrap_intervals(
    records: list[RequestRecord],
    duration_s: float,
    *,
    ttft_limit_s: float | None = None,
    tpot_limit_s: float | None = None,
    percentiles: tuple[float, ...] = CI_PERCENTILES,
    num_resamples: int = NUM_RESAMPLES,
    level: float = CI_LEVEL,
    seed: int = CI_SEED,
) -> dict[str, float]:
    """Bootstrap confidence intervals of a run's metrics, over its requests (percentile bootstrap).

    The resampling unit is the request (ITL: a request with all its gaps; the rates: every record,
    rejected and aborted ones included, over the run's `duration_s`); a fixed `seed` gives the same
    interval for the same records. It sees the spread across requests, not across runs: drift
    between runs shows only in a re-measurement (slotune/tuner/decide/confirm.py). Details and cost:
    docs/design/tuner-measure.md.

    Args:
        records: every measured request (as for `summarize`).
        duration_s: wall time of the run.
        ttft_limit_s, tpot_limit_s: per-request limits for goodput (as for `summarize`).
        percentiles: the pXX of ttft/tpot/itl/e2e that get an interval.
        num_resamples, level, seed: the bootstrap's size, coverage and seed.

    Returns:
        {'tpot_p95_ci_low': ..., 'tpot_p95_ci_high': ..., 'output_tokens_per_s_ci_low': ..., ...} for
        the CI_RATES and each series' `percentiles`; a series (or the rates) with fewer than two
        requests gets none (one request says nothing about the spread), nor does a statistic
        equal in every resample.
    """
    rng = np.random.default_rng(seed)
    tail = (1 - level) / 2 * 100
    bounds = (tail, 100 - tail)
    ps = list(dict.fromkeys(percentiles))
    out: dict[str, float] = {}

    def put(key: str, stats: np.ndarray) -> None:  # stats: [num_resamples]
        lo, hi = np.percentile(stats, bounds)
        if lo < hi:  # equal ends: every request adds the same, so resampling them cannot see a spread
            out.update(zip(ci_keys(key), (float(lo), float(hi))))

    done = [r for r in records if r.is_completed]
    per_request = series(records)
    for name in ("ttft", "tpot", "e2e"):
        vals = np.asarray(per_request[name], dtype=float)  # [n]
        if len(vals) < 2:
            continue
        resampled = vals[rng.integers(0, len(vals), size=(num_resamples, len(vals)))]  # [B, n]
        stats = np.percentile(resampled, ps, axis=1)  # [P, B]
        for p, st in zip(ps, stats):
            put(metric_key(name, p), st)
    gaps = [r.itls for r in done if r.itls]
    if len(gaps) >= 2:
        for p, st in zip(ps, _pooled_percentiles(gaps, ps, num_resamples, rng)):
            put(metric_key("itl", p), st)
    if len(records) >= 2:
        limits = SLOLimits(ttft_s=ttft_limit_s, tpot_s=tpot_limit_s)
        per = np.array(
            [
                [
                    r.output_tokens if r.is_completed else 0,  # [n, 4]: what each request adds to the rates
                    (r.output_tokens + r.prompt_tokens) if r.is_completed else 0,
                    r.is_completed,
                    meets_slo(r, limits),
                ]
                for r in records
            ],
            dtype=float,
        )
        rates = _draw_counts(len(records), num_resamples, rng) @ per / max(duration_s, 1e-9)  # [B, 4]
        for key, st in zip(CI_RATES, rates.T):
            put(key, st)
    return out


def mean_half_width(values: list[float]) -> float:
    """The half-width of the 95% interval of the mean of `values` (at least 2): Student's t with n - 1
    degrees of freedom times the standard error."""
    from scipy.stats import t

    n = len(values)
    return float(t.ppf(0.975, n - 1)) * statistics.stdev(values) / math.sqrt(n)


def ratio_interval(ratios: list[float]) -> tuple[float, float] | None:
    """95% interval of the geometric mean of per-pair ratios (Student's t on their logarithms), or None
    under 3 pairs. For A/B measurements alternated in pairs (bench/serve_vs_trial, bench/peers/overhead.py)."""
    if len(ratios) < 3:
        return None
    logs = [math.log(r) for r in ratios]
    m, hw = statistics.fmean(logs), mean_half_width(logs)
    return math.exp(m - hw), math.exp(m + hw)


def _draw_counts(n: int, num_resamples: int, rng: np.random.Generator) -> np.ndarray:
    """[num_resamples, n]: how often each of n items is drawn in each resample of n with replacement."""
    idx = rng.integers(0, n, size=(num_resamples, n)) + n * np.arange(num_resamples)[:, None]
    return np.bincount(idx.ravel(), minlength=num_resamples * n).reshape(num_resamples, n).astype(float)


def _pooled_percentiles(
    groups: list[list[float]], ps: list[float], num_resamples: int, rng: np.random.Generator
) -> np.ndarray:
    """[P, B]: pXX of the values of resampled groups, pooled (a group drawn twice counts twice).

    Per resample, the weighted inverted-CDF percentile: the first of the sorted values whose
    cumulative weight reaches p% of the resample's total. Exact, in two steps so no [B, all values]
    array is made (docs/design/tuner-measure.md): the cumulative weight at the start of
    each block of sorted values (one product) finds the block, a cumulative sum inside it the value.
    """
    values = np.concatenate([np.asarray(g, dtype=float) for g in groups])  # [M]
    owner = np.repeat(np.arange(len(groups)), [len(g) for g in groups])  # [M]
    order = np.argsort(values, kind="stable")
    values, owner = values[order], owner[order]
    size, n = len(values), len(groups)
    block = -(-size // 512)  # values per block: at most 512 blocks
    num_blocks = -(-size // block)
    per_block = np.bincount(np.arange(size) // block * n + owner, minlength=num_blocks * n).reshape(num_blocks, n)
    before = np.vstack(
        [np.zeros((1, n)), np.cumsum(per_block, axis=0)]
    )  # [blocks + 1, n]: values of each group before a block
    counts = _draw_counts(n, num_resamples, rng)  # [B, n]
    weight_before = counts @ before.T  # [B, blocks + 1]; the last column is each resample's total
    rows = np.arange(num_resamples)[:, None]
    out = np.empty((len(ps), num_resamples))
    for i, p in enumerate(ps):
        target = weight_before[:, -1] * (p / 100)  # [B]
        j = np.maximum((weight_before[:, :-1] < target[:, None]).sum(axis=1) - 1, 0)  # [B]: the block it is in
        idx = j[:, None] * block + np.arange(block)  # [B, block]
        inside = idx < size
        w = np.where(inside, counts[rows, owner[np.minimum(idx, size - 1)]], 0.0)
        cum = weight_before[np.arange(num_resamples), j][:, None] + np.cumsum(w, axis=1)
        out[i] = values[np.minimum(j * block + (cum < target[:, None]).sum(axis=1), size - 1)]
    return out
