import pytest

from slotune.operator.metrics import Histogram
import os
import subprocess
import sys

from slotune.operator.rollout import Policy, judge
from slotune.tuner.spec.slo import SLOLimits

POLICY = Policy(canary_duration_s=60, ready_deadline_s=120, slo=SLOLimits(ttft_s=0.5, tpot_s=0.05), min_requests=10)


def hist(value: float, n: int) -> Histogram:
    bounds = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, float("inf")]
    return Histogram({b: float(n) if value <= b else 0.0 for b in bounds}, count=n, total=value * n)


def test_waits_for_readiness_then_rolls_back_never_ready():
    assert judge(POLICY, since_start_s=10, since_ready_s=None, histograms=None).action == "wait"
    v = judge(POLICY, since_start_s=121, since_ready_s=None, histograms=None)
    assert (v.action, v.reason) == ("rollback", "NeverReady")


def test_observes_for_the_canary_duration():
    good = {"ttft": hist(0.1, 50), "tpot": hist(0.02, 50)}
    assert judge(POLICY, since_start_s=30, since_ready_s=30, histograms=good).action == "wait"
    v = judge(POLICY, since_start_s=90, since_ready_s=61, histograms=good)
    assert (v.action, v.reason) == ("promote", "SLOHeld") and v.measured["requests"] == 50


def test_slo_violation_names_the_metric():
    v = judge(POLICY, since_start_s=90, since_ready_s=61, histograms={"ttft": hist(0.1, 50), "tpot": hist(0.2, 50)})
    assert (v.action, v.reason) == ("rollback", "SLOViolated")
    assert "p95 TPOT" in v.message and "TTFT" not in v.message
    assert v.message.startswith("p95 TPOT ") and "> limit 50 ms (+" in v.message


def test_an_unmeasured_limit_is_not_promoted():
    """The tuner lets a missing TPOT pass (one-token outputs); the canary must show every limit held."""
    v = judge(POLICY, since_start_s=90, since_ready_s=61, histograms={"ttft": hist(0.1, 50)})
    assert (v.action, v.reason) == ("rollback", "SLOViolated") and "p95 TPOT not measured" in v.message


def test_too_little_traffic_waits_one_more_duration_then_rolls_back():
    few = {"ttft": hist(0.1, 3), "tpot": hist(0.02, 3)}
    assert judge(POLICY, since_start_s=90, since_ready_s=61, histograms=few).action == "wait"
    assert judge(POLICY, since_start_s=200, since_ready_s=121, histograms=few).reason == "InsufficientTraffic"


@pytest.mark.parametrize("fraction,replicas,expected", [(0.1, 2, 1), (0.1, 20, 2), (0.5, 4, 4), (0.2, 4, 1)])
def test_canary_replicas(fraction, replicas, expected):
    assert Policy(canary_fraction=fraction).canary_replicas(replicas) == expected


def test_policy_defaults_from_an_empty_spec():
    p = Policy.from_spec({})
    assert (p.mode, p.canary_duration_s, p.ready_deadline_s, p.slo.percentile) == ("auto", 300.0, 600.0, 95)


def test_policy_reads_the_slo_from_the_crd():
    p = Policy.from_spec({"slo": {"percentile": 99, "ttftSeconds": 0.5, "minRequests": 7}})
    assert p.slo == SLOLimits(percentile=99, ttft_s=0.5) and p.min_requests == 7


def test_the_rollout_imports_no_torch():
    """The operator image judges canaries with slotune/tuner/spec/slo.py; that must not pull the engine in."""
    code = "import slotune.operator.rollout, sys; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, env=os.environ.copy())
