"""Gate statistics: exact values on small hand-checked inputs."""

from __future__ import annotations

import math

import pytest

from slotune.evals.stats import judge, mean_stderr, one_sided_z, paired_drop, paired_perplexity_drop, perplexity


def test_mean_stderr():
    assert mean_stderr([1.0]) is None
    # values 0,1,0,1: sample sd = sqrt(1/3), se = sd / 2
    assert mean_stderr([0, 1, 0, 1]) == pytest.approx(math.sqrt(1 / 3) / 2)


def test_paired_drop_uses_common_items_and_removes_shared_variance():
    base = {0: 1.0, 1: 0.0, 2: 1.0, 3: 1.0, 9: 1.0}
    cand = {0: 1.0, 1: 0.0, 2: 0.0, 3: 1.0, 7: 0.0}
    drop, se, n = paired_drop(base, cand)
    assert n == 4 and drop == pytest.approx(0.25)
    assert se == pytest.approx(mean_stderr([0, 0, 1, 0]))
    # identical answers: zero paired SE, although each accuracy alone has a large one
    assert paired_drop(base, base)[1] == 0.0


def test_perplexity_matches_lm_eval_weighted_form():
    pairs = [(-10.0, 5.0), (-30.0, 15.0)]
    assert perplexity(pairs) == pytest.approx(math.exp(40 / 20))


def test_paired_perplexity_drop():
    base = {0: (-10.0, 5.0), 1: (-20.0, 5.0), 2: (-15.0, 5.0)}
    cand = {0: (-11.0, 5.0), 1: (-21.0, 5.0), 2: (-16.5, 5.0)}
    ppl_b, ppl_c, se, n = paired_perplexity_drop(base, cand)
    assert n == 3
    assert ppl_b == pytest.approx(math.exp(45 / 15)) and ppl_c == pytest.approx(math.exp(48.5 / 15))
    d = [1.0, 1.0, 1.5]  # ll_b - ll_c per document
    se_log_ratio = math.sqrt(3) * math.sqrt(sum((x - 3.5 / 3) ** 2 for x in d) / 2) / 15
    assert se == pytest.approx(ppl_c * se_log_ratio)


def test_threshold_rule():
    assert judge(0.05, 0.01, 0.05, "threshold", 0.95).passed
    assert not judge(0.051, 0.5, 0.05, "threshold", 0.95).passed
    assert not judge(math.nan, None, 1.0, "threshold", 0.95).passed


def test_non_inferiority_fails_only_when_confidently_worse_than_margin():
    z = one_sided_z(0.95)
    assert z == pytest.approx(1.6449, abs=1e-4)
    # drop 0.10 with se 0.04: lower bound 0.034 <= margin 0.05 -> noise could explain it: pass
    v = judge(0.10, 0.04, 0.05, "non_inferiority", 0.95)
    assert v.passed and v.bound == pytest.approx(0.10 - z * 0.04)
    # drop 0.20 with se 0.04: lower bound 0.134 > 0.05 -> worse beyond the margin: fail
    assert not judge(0.20, 0.04, 0.05, "non_inferiority", 0.95).passed
    # higher confidence demands more evidence before failing
    assert judge(0.13, 0.04, 0.05, "non_inferiority", 0.99).passed
    assert not judge(0.13, 0.04, 0.05, "non_inferiority", 0.9).passed
    # no stderr: falls back to the threshold rule
    assert not judge(0.06, None, 0.05, "non_inferiority", 0.95).passed
