"""The canary verdict: a pure function of the policy, the clock and what was scraped.

Rule: a canary must become ready within `readyDeadlineSeconds` of its start (else roll back:
NeverReady); once ready it serves for `canaryDurationSeconds`, then its pods' histograms must
hold the SLO (pXX TTFT and TPOT under their limits) over at least `minRequests` requests.
Too little traffic is waited out for one more canary duration, then rolled back
(InsufficientTraffic): a config that was never shown to hold the SLO is not promoted.
The SLO itself is judged by `slotune.tuner.spec.slo.judge`, the tuner's own rule, with limits read
from the CRD by `SLOLimits.from_crd`; a limit the canary did not measure counts as missed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from slotune.operator.metrics import Histogram
from slotune.tuner.spec.slo import SLOLimits, judge as judge_slo, metric_key

Action = Literal["wait", "promote", "rollback"]


@dataclass(frozen=True, slots=True)
class Policy:
    """`spec.rollout` of a SLOTuning, with the CRD's defaults."""

    mode: str = "auto"
    canary_fraction: float = 0.1
    canary_duration_s: float = 300.0
    ready_deadline_s: float = 600.0
    slo: SLOLimits = SLOLimits()
    min_requests: int = 1

    @classmethod
    def from_spec(cls, rollout: dict[str, Any] | None) -> "Policy":
        r = dict(rollout or {})
        slo = r.get("slo") or {}
        return cls(
            mode=r.get("mode", "auto"),
            canary_fraction=float(r.get("canaryFraction", 0.1)),
            canary_duration_s=float(r.get("canaryDurationSeconds", 300)),
            ready_deadline_s=float(r.get("readyDeadlineSeconds", 600)),
            slo=SLOLimits.from_crd(slo),
            min_requests=int(slo.get("minRequests", 1)),
        )

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


def judge(
    policy: Policy, *, since_start_s: float, since_ready_s: float | None, histograms: dict[str, Histogram] | None
) -> Verdict:
    """Decide what to do with the canary now.

    Args:
        since_start_s: seconds since the canary was requested.
        since_ready_s: seconds since all canary pods were first seen ready; None if not ready.
        histograms: the canary pods' summed histograms (ttft/tpot), None if not scraped yet.
    """
    if since_ready_s is None:
        if since_start_s > policy.ready_deadline_s:
            return Verdict("rollback", "NeverReady", f"canary pods not ready within {policy.ready_deadline_s:g}s")
        return Verdict("wait", "CanaryStarting", "waiting for the canary pods to become ready")
    if since_ready_s < policy.canary_duration_s or histograms is None:
        return Verdict("wait", "CanaryObserving", f"observing the canary for {policy.canary_duration_s:g}s")
    ttft = histograms.get("ttft")
    num_requests = int(ttft.count) if ttft is not None else 0
    if num_requests < policy.min_requests:
        if since_ready_s > 2 * policy.canary_duration_s:
            return Verdict(
                "rollback",
                "InsufficientTraffic",
                f"canary served {num_requests} requests, fewer than minRequests={policy.min_requests}",
            )
        return Verdict("wait", "CanaryObserving", f"canary has {num_requests}/{policy.min_requests} requests")
    p = policy.slo.percentile
    quantiles = {
        metric_key(name, p): h.quantile(p / 100.0) for name, h in histograms.items() if name in ("ttft", "tpot")
    }
    quantiles = {k: v for k, v in quantiles.items() if v is not None}
    measured = {"requests": float(num_requests), **{k: round(v, 6) for k, v in quantiles.items()}}
    slo = judge_slo(quantiles, policy.slo, require_measured=True)
    if not slo.passed:
        return Verdict("rollback", "SLOViolated", "; ".join(slo.reasons), measured)
    return Verdict("promote", "SLOHeld", f"canary held the SLO over {num_requests} requests", measured)
