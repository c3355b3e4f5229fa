"""The SLO, in one place: metric keys, the limits, and the verdict.

Everything that judges latency or throughput against a limit calls `judge`: the trial's Optuna
constraints, the report, the MLflow tags and the operator's canary. `SLOLimits.from_objective` and
`SLOLimits.from_crd` are the only translations from the spec's `ObjectiveSpec` and the CRD's
`rollout.slo`. Violations are relative to each limit (0.5 = 50% over; <= 0 met), one scale for TTFT,
TPOT and throughput, as Optuna's constraint values. Standard library only, so the operator imports
it without numpy or torch; slotune/tuner/measure/metrics.py builds on it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

# One key per constraint; `early_stop` and `quality_gates` are 0/1 flags set by the trial.
CONSTRAINT_KEYS = ("ttft", "tpot", "throughput", "early_stop", "quality_gates")
SLO_KEYS = ("ttft", "tpot", "throughput")  # the constraints `judge` decides
THROUGHPUT_KEY = "output_tokens_per_s"
# The price metrics (slotune/tuner/measure/metrics.py: cost_metrics): $ per 1M tokens -> the throughput they are priced at.
COST_RATES = {"usd_per_1m_output_tokens": "output_tokens_per_s", "usd_per_1m_total_tokens": "total_tokens_per_s"}

# The objective's metrics by kind (`ObjectiveSpec.metric`; a search space's `Start.metrics` names them too).
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2e")
THROUGHPUT_METRICS = ("output_tokens_per_s", "goodput_rps", "requests_per_s")
COST_METRICS = tuple(COST_RATES)  # usd_per_1m_output_tokens, usd_per_1m_total_tokens (need cost.usd_per_hour)
METRICS_OF_KIND = {"latency": LATENCY_METRICS, "throughput": THROUGHPUT_METRICS, "cost": COST_METRICS}

# SLOLimits field -> the spec's ObjectiveSpec field, and -> the CRD's `rollout.slo` field. The CRD
# has no throughput floor: a canary serves whatever traffic comes, so its tokens/s says nothing.
OBJECTIVE_FIELDS = {
    "percentile": "percentile",
    "ttft_s": "ttft_limit_s",
    "tpot_s": "tpot_limit_s",
    "min_output_tokens_per_s": "min_output_tokens_per_s",
}
CRD_FIELDS = {"percentile": "percentile", "ttft_s": "ttftSeconds", "tpot_s": "tpotSeconds"}
DEFAULT_PERCENTILE = 95  # the spec's and the CRD's default

_KEY = re.compile(r"^(?P<name>[a-z][a-z0-9_]*?)_p(?P<p>\d+(?:\.\d+)?)$")


def metric_key(name: str, p: float) -> str:
    """Metric key of a percentile: metric_key('ttft', 95) -> 'ttft_p95', ('itl', 99.9) -> 'itl_p99.9'."""
    return f"{name}_p{p:g}"


def parse_metric_key(key: str) -> tuple[str, float] | None:
    """The inverse of `metric_key`: 'ttft_p95' -> ('ttft', 95.0); None for other keys ('ttft_mean')."""
    m = _KEY.match(key)
    return (m["name"], float(m["p"])) if m else None


def percentile_label(p: float) -> str:
    """How reports name a percentile: 95 -> 'p95', 99.9 -> 'p99.9'."""
    return f"p{p:g}"


@dataclass(frozen=True, slots=True)
class SLOLimits:
    """The limits a config must hold. None: not set (never violated).

    Attributes:
        percentile: which pXX of TTFT and TPOT is judged.
        ttft_s, tpot_s: upper limits on that percentile, in seconds.
        min_output_tokens_per_s: throughput floor over the whole run.
    """

    percentile: float = DEFAULT_PERCENTILE
    ttft_s: float | None = None
    tpot_s: float | None = None
    min_output_tokens_per_s: float | None = None

    @classmethod
    def from_objective(cls, objective: Mapping[str, Any] | Any) -> "SLOLimits":
        """From the spec's `ObjectiveSpec` (the model, or it dumped to a dict)."""
        d = objective if isinstance(objective, Mapping) else objective.model_dump()
        return cls._from(d, OBJECTIVE_FIELDS)

    @classmethod
    def from_crd(cls, slo: Mapping[str, Any] | None) -> "SLOLimits":
        """From a SLOTuning's `spec.rollout.slo` (camelCase; `minRequests` is the canary's, not a limit)."""
        return cls._from(slo or {}, CRD_FIELDS)

    @classmethod
    def _from(cls, d: Mapping[str, Any], names: Mapping[str, str]) -> "SLOLimits":
        kw = {ours: d.get(theirs) for ours, theirs in names.items()}
        p = kw.pop("percentile")
        # 0 means "not set" in both sources, as it always has (a zero limit can't be met anyway).
        return cls(
            percentile=DEFAULT_PERCENTILE if p is None else p, **{k: (float(v) if v else None) for k, v in kw.items()}
        )

    def to_objective(self) -> dict[str, Any]:
        return {theirs: getattr(self, ours) for ours, theirs in OBJECTIVE_FIELDS.items()}

    def to_crd(self) -> dict[str, Any]:
        """The CRD's `rollout.slo` limits (unset ones left out; the throughput floor has no field)."""
        return {theirs: getattr(self, ours) for ours, theirs in CRD_FIELDS.items() if getattr(self, ours) is not None}

    @property
    def latency_only(self) -> "SLOLimits":
        return SLOLimits(self.percentile, self.ttft_s, self.tpot_s)

    def describe(self) -> str:
        """'p95 TTFT <= 2 s, p95 TPOT <= 100 ms, output tokens/s >= 50', or 'none'."""
        pl = percentile_label(self.percentile)
        parts = [
            f"{pl} TTFT <= {seconds(self.ttft_s)}" if self.ttft_s else "",
            f"{pl} TPOT <= {seconds(self.tpot_s)}" if self.tpot_s else "",
            f"output tokens/s >= {self.min_output_tokens_per_s:g}" if self.min_output_tokens_per_s else "",
        ]
        return ", ".join(x for x in parts if x) or "none"


def seconds(v: float) -> str:
    """A latency in words: '86.4 ms' below a second, '2.31 s' from one."""
    return f"{v * 1e3:.3g} ms" if abs(v) < 1 else f"{v:.3g} s"


@dataclass(frozen=True, slots=True)
class Check:
    """One limit judged: `violation` > 0 means missed (relative: 0.15 = 15% beyond the limit)."""

    name: str  # ttft | tpot | throughput (a CONSTRAINT_KEYS entry)
    key: str  # the metric judged: 'ttft_p95', 'output_tokens_per_s'
    value: float | None  # None: not measured
    limit: float
    violation: float

    @property
    def passed(self) -> bool:
        return self.violation <= 0

    @property
    def label(self) -> str:
        """'p95 TTFT', 'output tokens/s'."""
        if self.name == "throughput":
            return "output tokens/s"
        parsed = parse_metric_key(self.key)
        return f"{percentile_label(parsed[1])} {self.name.upper()}" if parsed else self.key

    @property
    def text(self) -> str:
        """In words: 'p95 TTFT 2.31 s > limit 2 s (+15%)', 'p95 TPOT 86.4 ms > limit 80 ms (+8%)',
        'output tokens/s 25 < minimum 50 (-50%)'."""
        if self.value is None:
            limit = f"{self.limit:g}" if self.name == "throughput" else seconds(self.limit)
            return f"{self.label} not measured (limit {limit})"
        if self.name == "throughput":
            op = "<" if self.value < self.limit else ">="
            return f"{self.label} {self.value:.3g} {op} minimum {self.limit:g} ({self.value / self.limit - 1:+.0%})"
        op = ">" if self.value > self.limit else "<="
        return (
            f"{self.label} {seconds(self.value)} {op} limit {seconds(self.limit)} ({self.value / self.limit - 1:+.0%})"
        )


@dataclass(frozen=True, slots=True)
class Verdict:
    """`judge`'s answer: one Check per limit that is set."""

    checks: tuple[Check, ...]

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    @property
    def violations(self) -> dict[str, float]:
        """`{ttft, tpot, throughput}` relative violations, 0.0 for limits that are not set."""
        out = dict.fromkeys(SLO_KEYS, 0.0)
        out.update({c.name: c.violation for c in self.checks})
        return out

    @property
    def reasons(self) -> list[str]:
        """Each missed limit in words, e.g. 'p95 TTFT 2.31 s > limit 2 s (+15%)'."""
        return [c.text for c in self.checks if not c.passed]


def judge(metrics: Mapping[str, float], limits: SLOLimits, *, require_measured: bool = False) -> Verdict:
    """Judge measured metrics against the limits.

    Args:
        metrics: flat metric dict (`ttft_p95`, `tpot_p95`, `output_tokens_per_s`, ...).
        limits: what must hold.
        require_measured: count an unmeasured TPOT as a full violation too. Off for trials:
            requests of one output token have no TPOT, and that is no failure. The canary turns
            it on: a config never shown to hold a limit is not promoted.

    Returns:
        A Verdict: value / limit - 1 for latency limits, 1 - value / minimum for the throughput
        floor. An unmeasured TTFT (no request produced a first token) is a full violation (1.0);
        so is an unmeasured throughput (0 tokens/s).
    """
    checks = []
    for name, limit in (("ttft", limits.ttft_s), ("tpot", limits.tpot_s)):
        if not limit:
            continue
        key = metric_key(name, limits.percentile)
        v = metrics.get(key)
        if v is None:
            missed = 1.0 if (name == "ttft" or require_measured) else 0.0
        else:
            missed = v / limit - 1
        checks.append(Check(name, key, v, limit, missed))
    if limits.min_output_tokens_per_s:
        v = metrics.get(THROUGHPUT_KEY)
        checks.append(
            Check(
                "throughput",
                THROUGHPUT_KEY,
                v,
                limits.min_output_tokens_per_s,
                1 - (v or 0.0) / limits.min_output_tokens_per_s,
            )
        )
    return Verdict(tuple(checks))


class RequestTimes(Protocol):
    """What the per-request check reads (slotune/tuner/measure/metrics.py: RequestRecord)."""

    ttft: float | None
    tpot: float | None

    @property
    def is_completed(self) -> bool: ...


def meets_slo(r: RequestTimes, limits: SLOLimits) -> bool:
    """Per request (goodput): completed, its own TTFT within the limit, its TPOT (if any) too."""
    if not r.is_completed:
        return False
    if limits.ttft_s and (r.ttft is None or r.ttft > limits.ttft_s):
        return False
    if limits.tpot_s and r.tpot is not None and r.tpot > limits.tpot_s:
        return False
    return True


def slo_violations(metrics: Mapping[str, float], objective: Mapping[str, Any]) -> dict[str, float]:
    """`{ttft, tpot, throughput}` violations of an ObjectiveSpec dumped to a dict (see `judge`)."""
    return judge(metrics, SLOLimits.from_objective(objective)).violations


def constraint_values(violations: Mapping[str, float]) -> dict[str, float]:
    """All CONSTRAINT_KEYS, in order, missing ones as 0.0 (feasible)."""
    return {k: float(violations.get(k, 0.0)) for k in CONSTRAINT_KEYS}


def is_feasible(violations: Mapping[str, float]) -> bool:
    return all(v <= 0 for v in violations.values())


def breaks_slo_early(partial_metrics: Mapping[str, float], objective: Mapping[str, Any], factor: float) -> bool:
    """True when the first requests already miss a latency limit by more than `factor` x.

    Only latency limits are judged: throughput over a handful of requests says little.
    """
    v = judge(partial_metrics, SLOLimits.from_objective(objective).latency_only)
    return any(c.violation > factor - 1 for c in v.checks)


def certain_violations(in_flight, now: float, objective: Mapping[str, Any], factor: float) -> int:
    """How many unfinished requests will miss a latency limit by more than `factor` x, whatever
    happens next (their clocks only grow). Judges requests a completion-based check cannot see
    yet: queued behind a static batch, or stuck behind long prefills.

    Args:
        in_flight: objects with `.metrics` (arrival_time, first_token_time) and
            `.params.max_tokens` (the engine's Sequence).
        now: the current `time.perf_counter()`.
    """
    limits = SLOLimits.from_objective(objective)
    n = 0
    for seq in in_flight:
        m = seq.metrics
        if m.first_token_time is None:
            if limits.ttft_s and now - m.arrival_time > factor * limits.ttft_s:
                n += 1
        elif limits.tpot_s:
            # TPOT at finish = (finish - first token) / (max_tokens - 1) >= this lower bound.
            if (now - m.first_token_time) / max(1, seq.params.max_tokens - 1) > factor * limits.tpot_s:
                n += 1
    return n
