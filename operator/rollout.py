"""The canary verdict: a pure function of the policy, the clock and what was scraped.

Rule: a canary must become ready within `readyDeadlineSeconds` of its start (else roll back:
NeverReady); once ready it serves for `canaryDurationSeconds`, then its pods' histograms must
hold the SLO (pXX TTFT and TPOT under their limits) over at least `minRequests` requests.
Too little traffic is waited out for one more canary duration, then rolled back
(InsufficientTraffic): a config that was never shown to hold the SLO is not promoted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from slotune.operator.metrics import Histogram

Action = Literal["wait", "promote", "rollback"]


@dataclass(frozen=True, slots=True)
class Policy:
    """`spec.rollout` of a SLOTuning, with the CRD's defaults."""

    mode: str = "auto"
    canary_fraction: float = 0.1
    canary_duration_s: float = 300.0
    ready_deadline_s: float = 600.0
    percentile: int = 95
    ttft_limit_s: float | None = None
    tpot_limit_s: float | None = None
    min_requests: int = 1

    @classmethod
    def from_spec(cls, rollout: dict[str, Any] | None) -> "Policy":
        r = dict(rollout or {})
        slo = r.get("slo") or {}
        return cls(mode=r.get("mode", "auto"), canary_fraction=float(r.get("canaryFraction", 0.1)),
                   canary_duration_s=float(r.get("canaryDurationSeconds", 300)),
                   ready_deadline_s=float(r.get("readyDeadlineSeconds", 600)),
                   percentile=int(slo.get("percentile", 95)),
                   ttft_limit_s=slo.get("ttftSeconds"), tpot_limit_s=slo.get("tpotSeconds"),
                   min_requests=int(slo.get("minRequests", 1)))

    def canary_replicas(self, replicas: int) -> int:
        """Replicas that give the canary about `canary_fraction` of a Service's pods."""
        f = min(max(self.canary_fraction, 0.0), 0.99)
        return max(1, round(f * replicas / (1.0 - f)))


@dataclass(frozen=True, slots=True)
class Verdict:
    action: Action
    reason: str  # CamelCase, for the Event and the condition
    message: str
    measured: dict[str, float] | None = None


def judge(policy: Policy, *, since_start_s: float, since_ready_s: float | None,
          histograms: dict[str, Histogram] | None) -> Verdict:
    """Decide what to do with the canary now.

    Args:
        since_start_s: seconds since the canary was requested.
        since_ready_s: seconds since all canary pods were first seen ready; None if not ready.
        histograms: the canary pods' summed histograms (ttft/tpot), None if not scraped yet.
    """
    if since_ready_s is None:
        if since_start_s > policy.ready_deadline_s:
            return Verdict("rollback", "NeverReady",
                           f"canary pods not ready within {policy.ready_deadline_s:g}s")
        return Verdict("wait", "CanaryStarting", "waiting for the canary pods to become ready")
    if since_ready_s < policy.canary_duration_s or histograms is None:
        return Verdict("wait", "CanaryObserving", f"observing the canary for {policy.canary_duration_s:g}s")
    q = policy.percentile / 100.0
    ttft, tpot = histograms.get("ttft"), histograms.get("tpot")
    num_requests = int(ttft.count) if ttft is not None else 0
    if num_requests < policy.min_requests:
        if since_ready_s > 2 * policy.canary_duration_s:
            return Verdict("rollback", "InsufficientTraffic",
                           f"canary served {num_requests} requests, fewer than minRequests={policy.min_requests}")
        return Verdict("wait", "CanaryObserving", f"canary has {num_requests}/{policy.min_requests} requests")
    measured = {"requests": float(num_requests)}
    problems = []
    for short, h, limit in (("ttft", ttft, policy.ttft_limit_s), ("tpot", tpot, policy.tpot_limit_s)):
        value = h.quantile(q) if h is not None else None
        if value is not None:
            measured[f"{short}_p{policy.percentile}"] = round(value, 6)
        if limit is not None and (value is None or value > limit):
            shown = "no data" if value is None else f"{value:.4g}s"
            problems.append(f"{short} p{policy.percentile} {shown} > {limit:g}s")
    if problems:
        return Verdict("rollback", "SLOViolated", "; ".join(problems), measured)
    return Verdict("promote", "SLOHeld", f"canary held the SLO over {num_requests} requests", measured)
