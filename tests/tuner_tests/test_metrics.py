import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
from slotune.tuner.measure import intervals
from slotune.tuner.measure.intervals import bootstrap_intervals
from slotune.tuner.measure.memory import MemoryTracker
from slotune.tuner.measure.metrics import RequestRecord, cost_metrics, engine_stats_delta, summarize
from slotune.tuner.spec.slo import SLOLimits, meets_slo, metric_key


def _r(i, ttft, tpot, n=10, reason="length"):
    return RequestRecord(f"r{i}", 5, n, ttft, tpot, ttft + tpot * (n - 1), 0.0, [tpot] * (n - 1), reason)


def test_percentiles_throughput_and_goodput():
    recs = [_r(i, ttft=0.1 * (i + 1), tpot=0.01) for i in range(10)]
    m = summarize(recs, duration_s=2.0, ttft_limit_s=0.55)
    assert m["ttft_p50"] == pytest.approx(0.55)
    assert m["ttft_p99"] == pytest.approx(0.991)
    assert m["ttft_mean"] == pytest.approx(0.55) and m["ttft_max"] == pytest.approx(1.0)
    assert m["itl_p50"] == pytest.approx(0.01) and m["tpot_p95"] == pytest.approx(0.01)
    assert m["output_tokens_per_s"] == pytest.approx(50.0)
    assert m["total_tokens_per_s"] == pytest.approx(75.0)
    assert m["requests_per_s"] == pytest.approx(5.0)
    assert m["goodput_rps"] == pytest.approx(2.5)  # 5 of 10 under 0.55 s, over 2 s
    assert m["slo_attainment"] == pytest.approx(0.5)


def test_any_percentile():
    recs = [_r(i, ttft=float(i), tpot=0.01) for i in range(101)]
    m = summarize(recs, 1.0, percentiles=(80, 99.9))
    assert m["ttft_p80"] == pytest.approx(80.0) and m[metric_key("ttft", 99.9)] == pytest.approx(99.9)
    assert metric_key("ttft", 95.0) == "ttft_p95" and "ttft_p50" not in m


def test_goodput_is_per_request_on_both_limits():
    fast_first_slow_decode = _r(0, ttft=0.1, tpot=0.5)
    slow_first_fast_decode = _r(1, ttft=2.0, tpot=0.01)
    good = _r(2, ttft=0.1, tpot=0.01)
    one_token = RequestRecord("r3", 5, 1, 0.1, None, 0.1, 0.0, [], "length")  # no TPOT: judged on TTFT
    m = summarize(
        [fast_first_slow_decode, slow_first_fast_decode, good, one_token], 1.0, ttft_limit_s=1.0, tpot_limit_s=0.1
    )
    assert m["goodput_rps"] == 2 and m["slo_attainment"] == 0.5
    assert meets_slo(good, SLOLimits()) and not meets_slo(RequestRecord.rejected("x", 3), SLOLimits())
    assert meets_slo(one_token, SLOLimits(ttft_s=1.0, tpot_s=0.1)) and not meets_slo(
        fast_first_slow_decode, SLOLimits(tpot_s=0.1)
    )


def test_rejected_and_aborted_count_against_goodput_not_latency():
    aborted = RequestRecord("a", 5, 2, 9.0, 9.0, 9.0, 0.0, [9.0], "abort")
    recs = [_r(0, 0.1, 0.01), RequestRecord.rejected("x", 5), aborted]
    m = summarize(recs, duration_s=1.0)
    assert m["num_completed"] == 1 and m["goodput_rps"] == 1 and m["slo_attainment"] == pytest.approx(1 / 3)
    assert m["num_rejected"] == 1 and m["num_aborted"] == 1
    assert m["ttft_max"] == pytest.approx(0.1) and m["output_tokens"] == 10


def test_no_completed_requests_gives_no_latency_keys():
    m = summarize([RequestRecord.rejected("x", 5)], 1.0)
    assert "ttft_p50" not in m and m["output_tokens_per_s"] == 0 and m["slo_attainment"] == 0


def test_record_from_engine_output_and_round_trip():
    met = SimpleNamespace(
        ttft=0.2,
        tpot=0.05,
        e2e=0.3,
        queue_time=0.01,
        itls=[0.05, 0.05],
        arrival_time=10.5,
        num_cached_prompt_tokens=16,
        num_preemptions=1,
        num_draft_tokens=4,
        num_accepted_tokens=3,
    )
    out = SimpleNamespace(
        request_id="q", prompt_token_ids=[1] * 20, output_token_ids=[2] * 3, finish_reason="length", metrics=met
    )
    r = RequestRecord.from_output(out, t0=10.0)
    assert (r.prompt_tokens, r.output_tokens, r.cached_prompt_tokens, r.arrival_s) == (20, 3, 16, 0.5)
    assert RequestRecord.from_dict({**r.to_dict(), "future_field": 1}) == r


def test_engine_stats_delta():
    def st(**kw):
        base = dict(
            peak_blocks_used=90,
            window_peak_blocks=0,
            num_total_blocks=100,
            prefix_cache_queries=0,
            prefix_cache_hits=0,
            num_draft_tokens=0,
            num_accepted_tokens=0,
            num_spec_verifications=0,
            num_preemptions=0,
            num_steps=0,
            num_rejected={},
        )
        return SimpleNamespace(**{**base, **kw})

    before = st(prefix_cache_queries=10, prefix_cache_hits=10, num_rejected={"queue_full": 1})
    after = st(
        window_peak_blocks=40,
        prefix_cache_queries=20,
        prefix_cache_hits=15,
        num_draft_tokens=40,
        num_accepted_tokens=30,
        num_spec_verifications=10,
        num_preemptions=2,
        num_steps=7,
        num_rejected={"queue_full": 3, "never_fits": 1},
    )
    m = engine_stats_delta(before, after)
    assert m["peak_kv_blocks"] == 40 and m["kv_block_usage"] == 0.4  # this run's window, not the lifetime 90
    assert m["prefix_cache_hit_rate"] == 0.5  # 5 hits of 10 queries in this run
    assert m["spec_acceptance_rate"] == 0.75 and m["spec_mean_accepted_length"] == 4.0
    assert m["num_preemptions"] == 2 and m["num_engine_steps"] == 7
    assert m["num_rejected_queue_full"] == 2 and m["num_rejected_never_fits"] == 1
    fb = engine_stats_delta(
        st(kernel_fallbacks={"native_rows_to_torch": 5}), st(kernel_fallbacks={"native_rows_to_torch": 12})
    )
    assert fb["num_kernel_fallback_native_rows_to_torch"] == 7


def test_memory_tracker_on_cpu():
    mt = MemoryTracker("cpu")
    hog = bytearray(64 * 2**20)
    hog[::4096] = b"x" * len(hog[::4096])  # touch every page
    mt.sample()
    del hog
    m = mt.metrics()
    assert m["peak_memory_mb"] == m["peak_rss_mb"] >= 64 and m["process_max_rss_mb"] >= m["peak_rss_mb"] * 0.9


def test_metrics_module_does_not_import_torch():
    code = (
        "import sys, slotune.tuner.measure.metrics, slotune.tuner.spec.workload_spec; assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# --- uncertainty intervals and cost ---------------------------------------------------------------

CI_KEYS = (
    "ttft_p50",
    "ttft_p95",
    "tpot_p50",
    "tpot_p95",
    "itl_p50",
    "itl_p95",
    "e2e_p95",
    "output_tokens_per_s",
    "total_tokens_per_s",
    "requests_per_s",
    "goodput_rps",
)


def _population(n, seed=7):
    """n requests from one skewed distribution: varied lengths and latencies, one in ten rejected."""
    rng = np.random.default_rng(seed)
    recs = []
    for i in range(n):
        if i % 10 == 9:
            recs.append(RequestRecord.rejected(f"r{i}", 20))
            continue
        out = int(rng.integers(2, 40))
        itls = list(rng.lognormal(np.log(0.02), 0.5, out - 1))
        ttft = float(rng.lognormal(np.log(0.2), 0.6))
        recs.append(
            RequestRecord(
                f"r{i}",
                int(rng.integers(10, 200)),
                out,
                ttft,
                float(np.mean(itls)),
                ttft + float(np.sum(itls)),
                0.0,
                itls,
                "stop",
            )
        )
    return recs


def test_bootstrap_intervals_bracket_the_estimate_and_narrow_with_more_requests():
    widths = {}
    for n in (40, 400):
        recs = _population(n)
        duration = n / 8  # the same offered load: 8 requests/s
        point = summarize(recs, duration, ttft_limit_s=0.25)
        ci = bootstrap_intervals(recs, duration, ttft_limit_s=0.25)
        assert ci == bootstrap_intervals(recs, duration, ttft_limit_s=0.25)  # a fixed seed: reproducible
        for key in CI_KEYS:
            lo, hi = ci[f"{key}_ci_low"], ci[f"{key}_ci_high"]
            assert lo <= point[key] <= hi and lo < hi, (n, key, lo, point[key], hi)
        widths[n] = {key: ci[f"{key}_ci_high"] - ci[f"{key}_ci_low"] for key in CI_KEYS}
    for key in CI_KEYS:  # ten times the requests: about a third of the width (1/sqrt(10))
        assert widths[400][key] < 0.7 * widths[40][key], (key, widths[40][key], widths[400][key])


def test_intervals_only_where_resampling_can_see_a_spread():
    same = [_r(i, ttft=0.1 * (i + 1), tpot=0.01) for i in range(10)]  # equal lengths, all completed
    ci = bootstrap_intervals(same, 2.0, percentiles=(95,))
    assert "ttft_p95_ci_low" in ci and "ttft_p50_ci_low" not in ci
    assert "output_tokens_per_s_ci_low" not in ci and "tpot_p95_ci_low" not in ci  # every resample equal
    assert bootstrap_intervals(same[:1], 1.0) == {}  # one request says nothing about the spread


def test_pooled_itl_percentile_is_the_weighted_percentile_of_each_resample():
    """ITL resamples whole requests; per resample the pooled pXX (inverted CDF) of their gaps,
    checked against pooling each resample's gaps explicitly."""
    rng = np.random.default_rng(3)
    groups = [list(rng.lognormal(-4, 0.4 + 0.1 * (i % 5), int(rng.integers(1, 60)))) for i in range(30)]
    got = intervals._pooled_percentiles(groups, [50, 95, 99], 50, np.random.default_rng(11))
    counts = intervals._draw_counts(len(groups), 50, np.random.default_rng(11))
    for b in range(50):
        pooled = np.concatenate([np.repeat(g, int(c)) for g, c in zip(groups, counts[b]) if c])
        want = np.percentile(pooled, [50, 95, 99], method="inverted_cdf")
        assert np.allclose(got[:, b], want), b


def test_cost_is_the_price_of_the_measured_throughput():
    m = {
        "output_tokens_per_s": 100.0,
        "total_tokens_per_s": 400.0,
        "output_tokens_per_s_ci_low": 80.0,
        "output_tokens_per_s_ci_high": 125.0,
    }
    c = cost_metrics(m, usd_per_hour=3.6)
    assert c["usd_per_1m_output_tokens"] == pytest.approx(10.0)  # $0.001/s for 100 tok/s: $10 per 1M
    assert c["usd_per_1m_total_tokens"] == pytest.approx(2.5)
    # the interval is the price of the throughput's ends: the high throughput is the low cost
    assert c["usd_per_1m_output_tokens_ci_low"] == pytest.approx(8.0)
    assert c["usd_per_1m_output_tokens_ci_high"] == pytest.approx(12.5)
    assert "usd_per_1m_total_tokens_ci_low" not in c
    assert cost_metrics({"output_tokens_per_s": 0.0}, 1.0) == {}  # nothing produced: no price per token
    with pytest.raises(ValueError, match="usd_per_hour"):
        cost_metrics(m, 0.0)


def test_ratio_interval_brackets_the_geometric_mean_of_paired_ratios():
    """A/B pairs (bench/peers/overhead.py --pool, bench/serve_vs_trial): the interval is symmetric on
    the log scale around the geometric mean, narrows as pairs agree, and needs 3 pairs."""
    import math
    import statistics

    from slotune.tuner.measure.intervals import ratio_interval

    assert ratio_interval([0.9, 1.1]) is None
    spread = [0.93, 0.97, 0.99, 1.01, 0.95, 0.98]
    lo, hi = ratio_interval(spread)
    gm = statistics.geometric_mean(spread)
    assert lo < gm < hi
    assert math.isclose(math.log(gm) - math.log(lo), math.log(hi) - math.log(gm))
    lo2, hi2 = ratio_interval(spread * 4)
    assert lo < lo2 < hi2 < hi
