import pytest

from slotune.tuner.metrics import RequestRecord, summarize


def _r(i, ttft, tpot, n=10, reason="length"):
    return RequestRecord(f"r{i}", 5, n, ttft, tpot, ttft + tpot * (n - 1), 0.0, [tpot] * (n - 1), reason)


def test_percentiles_throughput_and_goodput():
    recs = [_r(i, ttft=0.1 * (i + 1), tpot=0.01) for i in range(10)]
    m = summarize(recs, duration_s=2.0, ttft_limit_s=0.55)
    assert m["ttft_p50"] == pytest.approx(0.55)
    assert m["ttft_p99"] == pytest.approx(0.991)
    assert m["output_tokens_per_s"] == pytest.approx(50.0)
    assert m["goodput_rps"] == pytest.approx(2.5)  # 5 of 10 under 0.55 s, over 2 s
    assert m["slo_attainment"] == pytest.approx(0.5)


def test_rejected_requests_count_against_goodput_not_throughput():
    recs = [_r(0, 0.1, 0.01), RequestRecord("x", 5, 0, None, None, None, None, [], "rejected")]
    m = summarize(recs, duration_s=1.0)
    assert m["num_completed"] == 1 and m["goodput_rps"] == 1 and m["slo_attainment"] == 0.5
