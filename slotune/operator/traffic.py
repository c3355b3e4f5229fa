"""Tuning on the traffic a SLOServing actually serves: `spec.traffic` of a SLOTuning, and drift.

A SLOServing with `spec.recordTraffic` records every pod into /traffic/<serving>/<pod name>/ on its
claim; a SLOTuning with `spec.traffic.fromServing` mounts the claim read-only, and its Job's publisher
(publish.py) snapshots the last `window` of all pods' recordings into one file that the tuning spec's
workload replays, so every trial replays the same requests. Drift of a summary from the tuned-on
traffic (`status.tunedTraffic`, what the last result was tuned on) is the largest of the relative
changes of meanRate and the prompt/output P50/P95 and the absolute change of cacheableShare; the
inter-arrival CV is reported, not compared. Pure functions; the operator and the Job share them.
Why each of these choices: docs/design/operator-traffic.md.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from typing import Any

from slotune.operator import schedule

DEFAULT_WINDOW = "24h"
DEFAULT_DRIFT_THRESHOLD = 0.15
RELATIVE_FIELDS = ("meanRate", "promptP50", "promptP95", "outputP50", "outputP95")
ABSOLUTE_FIELDS = ("cacheableShare",)
SUMMARY_FIELDS = ("requests", *RELATIVE_FIELDS, "cv", *ABSOLUTE_FIELDS)  # in status.traffic, besides window


@dataclass(frozen=True, slots=True)
class Plan:
    """What one run needs to tune on recorded traffic (spec.traffic, resolved against the SLOServing)."""

    serving: str  # whose recording
    claim: str  # the PersistentVolumeClaim it records on
    window_s: int
    drift_threshold: float
    time_scale: float
    source_hash: str  # the tuning spec and traffic source the tuned-on traffic must share (`source_hash`)
    tuned_traffic: dict[str, Any] | None = None  # the summary the last result was tuned on, if comparable


def settings(spec: dict[str, Any]) -> dict[str, Any] | None:
    """`spec.traffic` with its defaults (fromServing: the rollout target), None when unset."""
    traffic = spec.get("traffic")
    if not traffic:
        return None
    return {
        "fromServing": traffic.get("fromServing") or (spec.get("target") or {}).get("servingName"),
        "window": str(traffic.get("window") or DEFAULT_WINDOW),
        "driftThreshold": float(traffic.get("driftThreshold", DEFAULT_DRIFT_THRESHOLD)),
        "timeScale": float(traffic.get("timeScale", 1.0)),
    }


def problem(spec: dict[str, Any]) -> tuple[str, str] | None:
    """(field, message) for the first thing wrong with spec.traffic, or None."""
    t = settings(spec)
    if t is None:
        return None
    try:
        window = schedule.parse_duration(t["window"])
    except schedule.ScheduleError as exc:
        return "spec.traffic.window", f"spec.traffic.window: {exc}"
    if window.total_seconds() <= 0:
        return "spec.traffic.window", f"spec.traffic.window '{t['window']}' must be longer than 0s"
    if not (math.isfinite(t["driftThreshold"]) and t["driftThreshold"] >= 0):
        return "spec.traffic.driftThreshold", f"spec.traffic.driftThreshold {t['driftThreshold']} must be >= 0"
    if not (math.isfinite(t["timeScale"]) and t["timeScale"] > 0):
        return "spec.traffic.timeScale", f"spec.traffic.timeScale {t['timeScale']} must be > 0"
    if int(spec.get("workers", 1)) > 1:
        # each pod would snapshot its own window, at its own time: workers sharing one study
        # must replay the same requests
        return (
            "spec.traffic",
            "spec.traffic with workers > 1: each worker would snapshot its own window; use workers: 1",
        )
    return None


def source_hash(spec: dict[str, Any]) -> str:
    """What the tuned-on traffic must have been tuned with to be compared: the tuning spec and traffic source."""
    t = settings(spec) or {}
    key = {
        "tuning": spec.get("tuning"),
        "fromServing": t.get("fromServing"),
        "window": t.get("window"),
        "timeScale": t.get("timeScale"),
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:10]


def make_plan(spec: dict[str, Any], claim: str, tuned_traffic: dict[str, Any] | None) -> Plan:
    """The Plan of a run; `tuned_traffic` (status.tunedTraffic) is kept only if tuned on the same source."""
    t = settings(spec)
    assert t is not None and problem(spec) is None, "check spec.traffic (problem) first"
    digest = source_hash(spec)
    comparable = tuned_traffic if tuned_traffic and tuned_traffic.get("sourceHash") == digest else None
    return Plan(
        serving=t["fromServing"],
        claim=claim,
        window_s=int(schedule.parse_duration(t["window"]).total_seconds()),
        drift_threshold=t["driftThreshold"],
        time_scale=t["timeScale"],
        source_hash=digest,
        tuned_traffic={k: comparable.get(k) for k in ("run", *SUMMARY_FIELDS)} if comparable else None,
    )


@dataclass(frozen=True, slots=True)
class Drift:
    value: float  # the largest change (a fraction: 0.04 is 4%)
    field: str  # the field that changed most


def drift(new: dict[str, Any], old: dict[str, Any]) -> Drift:
    """How far summary `new` moved from `old` (module docstring); fields missing on either side
    (no rate with one request, no cacheable share without hash ids) or zero in `old` (no output
    at all) are left out."""
    changes = {}
    for key in RELATIVE_FIELDS:
        a, b = old.get(key), new.get(key)
        if _is_number(a) and _is_number(b) and a > 0:
            changes[key] = abs(b - a) / a
    for key in ABSOLUTE_FIELDS:
        a, b = old.get(key), new.get(key)
        if _is_number(a) and _is_number(b):
            changes[key] = abs(b - a)
    if not changes:
        return Drift(0.0, "none")
    key = max(changes, key=changes.get)
    return Drift(changes[key], key)


def describe(d: Drift, threshold: float, tuned_run: Any = None) -> str:
    """ "traffic drift 4% < threshold 15% (largest: promptP95, vs run 3)"."""
    op = "<" if is_skipped(d, threshold) else ">="
    vs = f", vs run {tuned_run}" if tuned_run is not None else ""
    return f"traffic drift {_percent(d.value)} {op} threshold {_percent(threshold)} (largest: {d.field}{vs})"


def is_skipped(d: Drift, threshold: float) -> bool:
    """The rule: a run whose traffic drifted less than the threshold does not re-tune (0: always)."""
    return d.value < threshold


def _percent(x: float) -> str:
    return f"{x * 100:.0f}%"


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
