"""The SLO module: metric keys, limits (spec and CRD names), judge(), constraint values and the
early-stop rules (pure functions, no engine)."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
from slotune.tuner.spec.slo import (
    CONSTRAINT_KEYS,
    SLOLimits,
    breaks_slo_early,
    certain_violations,
    constraint_values,
    is_feasible,
    judge,
    metric_key,
    parse_metric_key,
    percentile_label,
    slo_violations,
)

OBJ = {"percentile": 95, "ttft_limit_s": 1.0, "tpot_limit_s": 0.1, "min_output_tokens_per_s": 50.0}


def test_violations_are_relative_to_each_limit():
    v = slo_violations({"ttft_p95": 1.5, "tpot_p95": 0.05, "output_tokens_per_s": 25.0}, OBJ)
    assert v == pytest.approx({"ttft": 0.5, "tpot": -0.5, "throughput": 0.5})
    assert not is_feasible(v)
    assert is_feasible(slo_violations({"ttft_p95": 0.5, "tpot_p95": 0.05, "output_tokens_per_s": 60.0}, OBJ))


def test_unset_limits_are_feasible_and_every_key_is_present():
    v = constraint_values(slo_violations({}, {"percentile": 50}))
    assert tuple(v) == CONSTRAINT_KEYS and all(x == 0.0 for x in v.values())


def test_missing_ttft_counts_as_violation():
    assert slo_violations({}, OBJ)["ttft"] > 0


def test_early_stop_needs_a_wide_margin_on_latency_only():
    obj = {"percentile": 95, "ttft_limit_s": 1.0, "min_output_tokens_per_s": 1e9}
    assert not breaks_slo_early({"ttft_p95": 2.5, "output_tokens_per_s": 0.0}, obj, factor=3.0)
    assert breaks_slo_early({"ttft_p95": 3.5}, obj, factor=3.0)


def _seq(arrival, first=None, max_tokens=11):
    return SimpleNamespace(
        metrics=SimpleNamespace(arrival_time=arrival, first_token_time=first),
        params=SimpleNamespace(max_tokens=max_tokens),
    )


def test_in_flight_requests_that_must_miss_the_slo_are_counted():
    obj = {"ttft_limit_s": 1.0, "tpot_limit_s": 0.1}
    now = 100.0
    seqs = [
        _seq(96.0),  # no token after 4 s > 3 x 1 s: certain TTFT miss
        _seq(98.0),  # 2 s: may still make it
        _seq(90.0, first=95.0),  # 5 s over 10 remaining steps = 0.5 s/token > 3 x 0.1: certain
        _seq(99.0, first=99.5),
    ]  # 0.05 s/token so far: fine
    assert certain_violations(seqs, now, obj, factor=3.0) == 2
    assert certain_violations(seqs, now, {}, factor=3.0) == 0


# --- judge(): the one verdict -------------------------------------------------------------


def test_judge_reasons_in_words_and_relative_violations():
    limits = SLOLimits(percentile=95, ttft_s=2.0, tpot_s=0.1, min_output_tokens_per_s=50.0)
    v = judge({"ttft_p95": 2.31, "tpot_p95": 0.05, "output_tokens_per_s": 25.0}, limits)
    assert not v.passed
    assert v.violations == pytest.approx({"ttft": 0.155, "tpot": -0.5, "throughput": 0.5})
    assert v.reasons == ["p95 TTFT 2.31 s > limit 2 s (+16%)", "output tokens/s 25 < minimum 50 (-50%)"]
    assert [c.key for c in v.checks] == ["ttft_p95", "tpot_p95", "output_tokens_per_s"]


def test_judge_with_no_limits_passes_anything():
    v = judge({}, SLOLimits())
    assert (
        v.passed
        and v.checks == ()
        and v.reasons == []
        and v.violations == {"ttft": 0.0, "tpot": 0.0, "throughput": 0.0}
    )


def test_judge_missing_metrics():
    limits = SLOLimits(percentile=99, ttft_s=1.0, tpot_s=0.1, min_output_tokens_per_s=10.0)
    v = judge({}, limits)
    # no first token: a full TTFT violation; no TPOT (one-token outputs): no violation; no throughput: 0 tokens/s
    assert v.violations == {"ttft": 1.0, "tpot": 0.0, "throughput": 1.0}
    assert v.reasons == ["p99 TTFT not measured (limit 1 s)", "output tokens/s not measured (limit 10)"]
    strict = judge({"ttft_p99": 0.5, "output_tokens_per_s": 20.0}, limits, require_measured=True)
    assert strict.reasons == ["p99 TPOT not measured (limit 100 ms)"] and strict.violations["tpot"] == 1.0


def test_judge_reads_the_percentile_it_is_given():
    limits = SLOLimits(percentile=50, ttft_s=1.0)
    assert judge({"ttft_p50": 0.5, "ttft_p95": 5.0}, limits).passed
    assert not judge({"ttft_p50": 1.5, "ttft_p95": 0.5}, limits).passed


def test_metric_keys_round_trip():
    assert metric_key("ttft", 95) == "ttft_p95" and metric_key("itl", 99.9) == "itl_p99.9"
    assert metric_key("queue_time", 50.0) == "queue_time_p50"
    for name, p in (("ttft", 95.0), ("queue_time", 99.9), ("e2e", 50.0)):
        assert parse_metric_key(metric_key(name, p)) == (name, p)
    assert parse_metric_key("ttft_mean") is None and parse_metric_key("output_tokens_per_s") is None
    assert percentile_label(95) == "p95" and percentile_label(99.9) == "p99.9"


def test_spec_and_crd_name_the_same_limits():
    objective = {
        "kind": "latency",
        "metric": "ttft",
        "percentile": 90,
        "ttft_limit_s": 0.5,
        "tpot_limit_s": 0.05,
        "min_output_tokens_per_s": None,
    }
    limits = SLOLimits.from_objective(objective)
    assert limits == SLOLimits(percentile=90, ttft_s=0.5, tpot_s=0.05)
    assert limits.to_crd() == {"percentile": 90, "ttftSeconds": 0.5, "tpotSeconds": 0.05}
    assert SLOLimits.from_crd(limits.to_crd()) == limits
    assert SLOLimits.from_objective(limits.to_objective()) == limits
    assert SLOLimits.from_crd({"percentile": 99, "ttftSeconds": 1, "minRequests": 20}) == SLOLimits(99, ttft_s=1.0)
    assert SLOLimits.from_crd(None) == SLOLimits() == SLOLimits.from_objective({})
    # the throughput floor has no CRD field: a canary's tokens/s follows its traffic
    assert SLOLimits(min_output_tokens_per_s=5.0).to_crd() == {"percentile": 95}


def test_limits_from_the_spec_model():
    from slotune.tuner.spec.sections import ObjectiveSpec

    obj = ObjectiveSpec(kind="throughput", metric="output_tokens_per_s", percentile=99, ttft_limit_s=2.0)
    assert SLOLimits.from_objective(obj) == SLOLimits(99, ttft_s=2.0)
    assert SLOLimits.from_objective(obj).describe() == "p99 TTFT <= 2 s"
    assert SLOLimits().describe() == "none"


def test_slo_module_imports_no_torch_and_no_engine():
    code = (
        "import sys, slotune.tuner.spec.slo; "
        "bad = [m for m in sys.modules if m == 'torch' or m.startswith(('slotune.engine', 'numpy'))]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env=os.environ.copy())
