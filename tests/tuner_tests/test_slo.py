"""SLO constraint values and the early-stop rules (pure functions, no engine)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from slotune.tuner.slo import (CONSTRAINT_KEYS, breaks_slo_early, certain_violations, constraint_values, is_feasible,
                               slo_violations)

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
    return SimpleNamespace(metrics=SimpleNamespace(arrival_time=arrival, first_token_time=first),
                           params=SimpleNamespace(max_tokens=max_tokens))


def test_in_flight_requests_that_must_miss_the_slo_are_counted():
    obj = {"ttft_limit_s": 1.0, "tpot_limit_s": 0.1}
    now = 100.0
    seqs = [_seq(96.0),              # no token after 4 s > 3 x 1 s: certain TTFT miss
            _seq(98.0),              # 2 s: may still make it
            _seq(90.0, first=95.0),  # 5 s over 10 remaining steps = 0.5 s/token > 3 x 0.1: certain
            _seq(99.0, first=99.5)]  # 0.05 s/token so far: fine
    assert certain_violations(seqs, now, obj, factor=3.0) == 2
    assert certain_violations(seqs, now, {}, factor=3.0) == 0
