"""Several measurements of one config on different workload seeds as one: their median."""

from __future__ import annotations

import statistics
from slotune.tuner.measure.measurement import Measurement
from slotune.tuner.measure.metrics import CI_RATES
from slotune.tuner.spec.slo import COST_RATES


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


def _common_numbers(got: list[Measurement]) -> dict[str, list[float]]:
    """Each metric that every measurement in `got` has as a number: its values, in order."""
    numbers = [m.numbers() for m in got]
    return {
        k: [n[k] for n in numbers] for k in dict.fromkeys(k for n in numbers for k in n) if all(k in n for n in numbers)
    }
