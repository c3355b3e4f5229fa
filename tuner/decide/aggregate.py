"""Several measurements of one config as one: the median over seeds (declaration), the mean over passes
(confirmation), and the Student-t half-width of a mean."""

from __future__ import annotations

import math
import statistics
from typing import Any

from slotune.tuner.measure.intervals import mean_half_width
from slotune.tuner.measure.metrics import CI_RATES, ci_keys
from slotune.tuner.spec.slo import COST_RATES


def half_width(values: list[float]) -> float | None:
    """The half-width of the 95% interval of the mean of `values` (Student's t, n - 1 degrees of
    freedom) as a fraction of the mean; None under 2 values or at a zero mean. Student's t, not the
    standard error alone: two measurements that happen to agree say little about the spread (one
    degree of freedom, t = 12.7), so a mean of two counts as precise only when they agree closely."""
    mean = statistics.fmean(values) if len(values) >= 2 else 0.0
    return mean_half_width(values) / abs(mean) if mean else None


def median_metrics(got: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Several measurements of one config on different seeds as one: the median of each numeric
    metric (with two, their mean), and an interval spanning all of theirs and their values
    (`_ci_low` the lowest, `_ci_high` the highest), for every metric that has intervals
    (`metrics.CI_RATES`, the costs, any with one measured). The median, as benchmark harnesses
    report (pyperf, asv): on a shared host one measurement in a moment when everything slowed
    (example 01 on the Xeon, 2026-11-27: 13.9, 15.8, 16.8, 39.4, 16.9, 17.6 ms p95 TPOT; the default
    beside the 39.4 ran 1.3x its usual) would move a mean by a quarter and moves the median by
    nothing. A measurement's own interval sees the spread across its requests only (none at all for
    a rate when every request added the same); the values of several measurements show the drift
    between runs. None when empty."""
    if not got:
        return None
    values = _common_numbers(got)
    out: dict[str, Any] = {
        k: min(v) if k.endswith("_ci_low") else max(v) if k.endswith("_ci_high") else statistics.median(v)
        for k, v in values.items()
    }
    for k, vals in values.items():
        lo, hi = ci_keys(k)
        if len(vals) > 1 and (k in CI_RATES or k in COST_RATES or any(lo in m for m in got)):
            out[lo] = min(vals + [m[lo] for m in got if isinstance(m.get(lo), (int, float))])
            out[hi] = max(vals + [m[hi] for m in got if isinstance(m.get(hi), (int, float))])
    return out


def declared_as(n: int) -> str:
    """What `median_metrics` makes of n measurements, in a word for the report."""
    return "median" if n > 2 else "mean"


def _common_numbers(got: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Each metric that every measurement in `got` has as a number: its values, in order."""
    values: dict[str, list[float]] = {}
    for k in set().union(*got):
        vals = [m[k] for m in got if isinstance(m.get(k), (int, float)) and not isinstance(m.get(k), bool)]
        if len(vals) == len(got):
            values[k] = vals
    return values


def pooled_metrics(got: list[dict[str, Any]]) -> dict[str, Any]:
    """Several passes' measurements of one config on one seed as one: the mean of each numeric metric,
    and for each with an interval in every pass, an interval around that mean with the wider of two
    half-widths on each side: the passes' own half-widths pooled as for a mean of independent
    measurements (sqrt(sum h^2) / n, narrowing as passes add requests), and 1.96 standard errors of
    the passes' values (drift between passes, when they disagree by more than their intervals say)."""
    n = len(got)
    out: dict[str, Any] = {
        k: sum(vals) / n for k, vals in _common_numbers(got).items() if not k.endswith(("_ci_low", "_ci_high"))
    }
    for k in list(out):
        lo, hi = ci_keys(k)
        if not all(isinstance(m.get(lo), (int, float)) and isinstance(m.get(hi), (int, float)) for m in got):
            continue
        spread = 1.96 * statistics.stdev([m[k] for m in got]) / math.sqrt(n)
        below = math.sqrt(sum((m[k] - m[lo]) ** 2 for m in got)) / n
        above = math.sqrt(sum((m[hi] - m[k]) ** 2 for m in got)) / n
        out[lo], out[hi] = out[k] - max(below, spread), out[k] + max(above, spread)
    return out
