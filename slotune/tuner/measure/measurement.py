"""A measurement's metrics, typed: values by metric key ("ttft_p95", "output_tokens_per_s") and their 95%
intervals as a field. The stored form (trial attributes, best_metrics.json, MLflow, the trial process's
JSON) is one flat dict with each interval as two keys, `<key>_ci_low` and `<key>_ci_high`; `from_dict`
and `to_dict` are the only places that know it."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from slotune.tuner.measure.metrics import ci_keys

_LOW, _HIGH = ci_keys("")  # the suffixes: "_ci_low", "_ci_high"


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass(frozen=True, eq=False)
class Measurement(Mapping[str, Any]):
    """Metrics of one measurement (or of several taken as one). A read-only mapping of its values, so
    `m["tpot_p95"]` and `m.get("ttft_p95")` read a value; `interval(key)` its (low, high) when measured.

    Equal to another Measurement, or to a dict in the stored form, with the same values and intervals.
    """

    values: Mapping[str, Any] = field(default_factory=dict)
    intervals: Mapping[str, tuple[float, float]] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> Measurement:
        """From the stored form (a Measurement as it is; None -> empty). An interval is a pair of numbers;
        a lone or non-numeric `_ci_low`/`_ci_high` key stays a value, so the stored form round-trips."""
        if isinstance(d, Measurement):
            return d
        d = d or {}
        intervals: dict[str, tuple[float, float]] = {}
        for k, lo in d.items():
            if k.endswith(_LOW):
                key = k[: -len(_LOW)]
                hi = d.get(key + _HIGH)
                if _is_number(lo) and _is_number(hi):
                    intervals[key] = (lo, hi)
        paired = {k for key in intervals for k in ci_keys(key)}
        return cls({k: v for k, v in d.items() if k not in paired}, intervals)

    def to_dict(self) -> dict[str, Any]:
        """The stored form: the values, then each interval as `<key>_ci_low`, `<key>_ci_high`."""
        out = dict(self.values)
        for key, (lo, hi) in self.intervals.items():
            out.update(zip(ci_keys(key), (lo, hi)))
        return out

    def interval(self, key: str) -> tuple[float, float] | None:
        """The metric's 95% interval (low, high), when measured."""
        ci = self.intervals.get(key)
        return (float(ci[0]), float(ci[1])) if ci is not None else None

    def numbers(self) -> dict[str, float]:
        """The values that are numbers (not flags, not words)."""
        return {k: v for k, v in self.values.items() if _is_number(v)}

    def __getitem__(self, key: str) -> Any:
        return self.values[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.values)

    def __len__(self) -> int:
        return len(self.values)

    def __bool__(self) -> bool:
        return bool(self.values or self.intervals)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Measurement):
            return self.to_dict() == other.to_dict()
        if isinstance(other, Mapping):
            return self.to_dict() == dict(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # mutable-looking values: not hashable, as a dict
