"""Several measurements of one config as one: the median over seeds (declaration), the mean over passes
(confirmation), and the Student-t half-width of a mean."""

from __future__ import annotations

import math
import statistics
from slotune.tuner.measure.intervals import mean_half_width
from slotune.tuner.measure.measurement import Measurement
from slotune.tuner.measure.metrics import CI_RATES
from slotune.tuner.spec.slo import COST_RATES


def half_width(values: list[float]) -> float | None:
    """The half-width of the 95% interval of the mean of `values` (Student's t, n - 1 degrees of
    freedom) as a fraction of the mean; None under 2 values or at a zero mean. Student's t, not the
    standard error alone: two measurements that happen to agree say little about the spread (one
    degree of freedom, t = 12.7), so a mean of two counts as precise only when they agree closely."""
    mean = statistics.fmean(values) if len(values) >= 2 else 0.0
    return mean_half_width(values) / abs(mean) if mean else None


def median_metrics(got: list[Measurement]) -> Measurement | None:
    """Several measurements of one config on different seeds as one: the median of each numeric
    metric (with two, their mean), and an interval spanning all of theirs and their values (the
    lowest low, the highest high), for every metric that has intervals (`metrics.CI_RATES`, the
    costs, any with one measured). The median, as benchmark harnesses report (pyperf, asv): on a
    shared host one measurement taken while everything slowed moves a mean by a quarter and the
    median by nothing (docs/design/confirmation.md). A measurement's own interval sees the spread
    across its requests only (none at all for a rate when every request added the same); the values
    of several measurements show the drift between runs. None when empty."""
    if not got:
        return None
    values = _common_numbers(got)
    intervals = {
        k: (min(m.intervals[k][0] for m in got), max(m.intervals[k][1] for m in got))
        for k in dict.fromkeys(k for m in got for k in m.intervals)
        if all(k in m.intervals for m in got)
    }
    for k, vals in values.items():
        if len(vals) > 1 and (k in CI_RATES or k in COST_RATES or any(k in m.intervals for m in got)):
            lows = [m.intervals[k][0] for m in got if k in m.intervals]
            highs = [m.intervals[k][1] for m in got if k in m.intervals]
            intervals[k] = (min(vals + lows), max(vals + highs))
    return Measurement({k: statistics.median(v) for k, v in values.items()}, intervals)


def declared_as(n: int) -> str:
    """What `median_metrics` makes of n measurements, in a word for the report."""
    return "median" if n > 2 else "mean"


def _common_numbers(got: list[Measurement]) -> dict[str, list[float]]:
    """Each metric that every measurement in `got` has as a number: its values, in order."""
    numbers = [m.numbers() for m in got]
    return {
        k: [n[k] for n in numbers] for k in dict.fromkeys(k for n in numbers for k in n) if all(k in n for n in numbers)
    }


def pooled_metrics(got: list[Measurement]) -> Measurement:
    """Several passes' measurements of one config on one seed as one: the mean of each numeric metric,
    and for each with an interval in every pass, an interval around that mean with the wider of two
    half-widths on each side: the passes' own half-widths pooled as for a mean of independent
    measurements (sqrt(sum h^2) / n, narrowing as passes add requests), and 1.96 standard errors of
    the passes' values (drift between passes, when they disagree by more than their intervals say)."""
    n = len(got)
    values = {k: sum(vals) / n for k, vals in _common_numbers(got).items()}
    intervals = {}
    for k, mean in values.items():
        if not all(k in m.intervals for m in got):
            continue
        spread = 1.96 * statistics.stdev([m[k] for m in got]) / math.sqrt(n)
        below = math.sqrt(sum((m[k] - m.intervals[k][0]) ** 2 for m in got)) / n
        above = math.sqrt(sum((m.intervals[k][1] - m[k]) ** 2 for m in got)) / n
        intervals[k] = (mean - max(below, spread), mean + max(above, spread))
    return Measurement(values, intervals)
