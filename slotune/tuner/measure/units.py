"""Numbers with their units, and metric names, as the reports show them.

'tpot_p95' 0.04509 -> 'p95 TPOT' '45.1 ms'; 'output_tokens_per_s' -> 'tok/s'; 'weight_bytes'
1.35e8 -> '129 MiB'; 'slo_attainment' 1.0 -> '100%'. Used by report.md, report.html and
their plots (`axis_unit`), so the same number reads the same everywhere. Standard library only.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from slotune.tuner.measure.measurement import Measurement
from slotune.tuner.measure.metrics import LATENCY_SERIES
from slotune.tuner.spec.slo import parse_metric_key, percentile_label

_LABELS = {
    "output_tokens_per_s": "output tokens/s",
    "total_tokens_per_s": "total tokens/s",
    "goodput_rps": "goodput",
    "requests_per_s": "requests/s",
    "slo_attainment": "requests within the SLO",
    "weight_bytes": "weights",
    "peak_kv_blocks": "peak KV blocks",
    "num_kv_blocks": "KV blocks",
    "peak_memory_mb": "peak memory",
    "load_time_s": "load time",
    "kv_block_usage": "KV block usage",
    "prefix_cache_hit_rate": "prefix cache hits",
    "spec_acceptance_rate": "draft acceptance",
    "usd_per_1m_output_tokens": "cost per 1M output tokens",
    "usd_per_1m_total_tokens": "cost per 1M tokens",
}
_SERIES_LABELS = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2e": "end-to-end latency", "queue_time": "queue time"}


def metric_label(key: str) -> str:
    """How the report names a metric: 'tpot_p95' -> 'p95 TPOT', 'ttft_mean' -> 'mean TTFT'."""
    if key in _LABELS:
        return _LABELS[key]
    parsed = parse_metric_key(key)
    if parsed and parsed[0] in _SERIES_LABELS:
        return f"{percentile_label(parsed[1])} {_SERIES_LABELS[parsed[0]]}"
    name, _, stat = key.rpartition("_")
    if name in _SERIES_LABELS and stat in ("mean", "max"):
        return f"{stat} {_SERIES_LABELS[name]}"
    return key.replace("_", " ")


def _is_seconds(key: str) -> bool:
    parsed = parse_metric_key(key)
    if parsed:
        return parsed[0] in LATENCY_SERIES
    name, _, stat = key.rpartition("_")
    return (name in LATENCY_SERIES and stat in ("mean", "max")) or (key.endswith("_s") and not key.endswith("_per_s"))


def number(x: float, sig: int = 3) -> str:
    """3 significant digits, no exponent for ordinary sizes: 0.0451, 63.9, 1,234."""
    if not math.isfinite(x):
        return str(x)
    if abs(x) >= 10**sig:
        return f"{x:,.0f}"
    return f"{x:.{sig}g}"


def format_params(params: dict[str, Any]) -> str:
    """A trial's searched values as `knob=value, ...`; a knob left to the engine's own default (None,
    a server flag left off) is not listed."""
    return ", ".join(f"{k}={v}" for k, v in params.items() if v is not None)


def seeds_words(seeds: Iterable[int]) -> str:
    """Workload seeds in words: "seed 1000", "seeds 1001, 1002"."""
    seeds = list(seeds)
    return f"seed{'s' if len(seeds) > 1 else ''} {', '.join(map(str, seeds))}"


def _unit(key: str, v: float) -> tuple[float, str, str]:
    """(factor, prefix, suffix) that show `v` of metric `key` in its unit, picked for v's size."""
    if _is_seconds(key):
        return (1e3, "", " ms") if abs(v) < 1 else (1.0, "", " s")
    if key.startswith("usd_per_1m_"):
        return 1.0, "$", ""  # the label says per what: 'cost per 1M output tokens'
    if key.endswith("tokens_per_s"):
        return 1.0, "", " tok/s"
    if key.endswith(("_rps", "requests_per_s")):
        return 1.0, "", " req/s"
    if key == "slo_attainment" or key.endswith(("_rate", "_usage", "_share")):
        return 100.0, "", "%"
    if key.endswith(("_bytes", "_mb")):
        b = v * (2**20 if key.endswith("_mb") else 1)
        scale = 2**20 if key.endswith("_mb") else 1
        return (scale / 2**30, "", " GiB") if abs(b) >= 2**30 else (scale / 2**20, "", " MiB")
    return 1.0, "", ""


def format_value(key: str, v: Any, ci: tuple[float, float] | None = None) -> str:
    """A metric's value in its unit: ('tpot_p95', 0.04509) -> '45.1 ms'; with an interval
    (low, high) -> '45.1 ms ± 3.2'; None -> '–'."""
    if v is None:
        return "–"
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return str(v)
    if key.startswith("num_") or key.endswith("_blocks") or key in ("output_tokens", "prompt_tokens"):
        return f"{v:,.0f}"
    factor, prefix, suffix = _unit(key, v)
    text = f"{prefix}{number(v * factor)}{suffix}"
    if ci is not None:
        text += f" ± {number((ci[1] - ci[0]) / 2 * factor, 2)}"
    return text


def overlaps(a: tuple[float, float], b: tuple[float, float]) -> bool:
    """Two (low, high) intervals share a point: the two values are within noise of each other."""
    return a[0] <= b[1] and b[0] <= a[1]


def value_with_ci(metrics: Measurement | None, key: str) -> str:
    """A metric of `metrics` in its unit, with its interval when measured: '45.1 ms ± 3.2'; '–' when absent."""
    m = metrics if metrics is not None else Measurement()
    return format_value(key, m.get(key), m.interval(key))


def axis_unit(key: str, values: Iterable[float | None]) -> tuple[float, str]:
    """(factor, unit) for a plot axis of metric `key`, picked for the largest of `values`:
    ('tpot_p95', [0.045, 0.086]) -> (1000.0, 'ms')."""
    finite = [abs(v) for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    factor, prefix, suffix = _unit(key, max(finite, default=0.0))
    return factor, (prefix or suffix).strip()


def axis_title(key: str, values: Iterable[float | None]) -> tuple[float, str]:
    """(factor, 'p95 TPOT (ms)') for a plot axis of metric `key`."""
    factor, unit = axis_unit(key, values)
    return factor, metric_label(key) + (f" ({unit})" if unit else "")
