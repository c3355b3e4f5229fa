"""`run_in_process_replay` and `tune bench` end to end on the real model with tiny workloads."""

import json
from pathlib import Path

import pytest
from slotune.tuner.cli import app
from slotune.tuner.commands import parse_overrides
from slotune.tuner.measure.in_process_replay import run_in_process_replay
from slotune.tuner.measure.metrics import ReplayResult
from slotune.tuner.spec.workload_spec import WorkloadSpec
from typer.testing import CliRunner

ROOT = Path(__file__).resolve().parents[2]
TINY = {
    "num_requests": 4,
    "warmup_requests": 0,
    "concurrency": 2,
    "prompt_len": {"kind": "fixed", "value": 16},
    "output_len": {"kind": "fixed", "value": 4},
}


def test_run_benchmark_measures_every_request(llm):
    seen = []
    res = run_in_process_replay(
        llm.config,
        WorkloadSpec(**TINY),
        llm=llm,
        ttft_limit_s=1e9,
        percentiles=(80,),
        on_progress=lambda done, total: seen.append((done, total)),
    )
    m = res.metrics
    assert m["num_completed"] == 4 and m["output_tokens"] == 16 and seen[-1] == (4, 4)
    assert 0 < m["ttft_p50"] <= m["ttft_p99"] and "ttft_p80" in m and m["output_tokens_per_s"] > 0
    assert 0 < m["tpot_p50"] and 0 < m["itl_p50"] and m["e2e_p50"] >= m["ttft_p50"] and m["queue_time_p50"] >= 0
    assert m["goodput_rps"] == m["requests_per_s"] and m["peak_kv_blocks"] >= 2 and m["peak_memory_mb"] > 100
    assert m["weight_bytes"] > 1e8 and m["num_preemptions"] == 0 and not res.early_stopped
    rec = res.records[0]
    assert rec.output_tokens == 4 and len(rec.itls) == 3 and rec.prompt_tokens == 16
    again = ReplayResult.from_dict(json.loads(json.dumps(res.to_dict())))
    assert again.records == res.records and again.metrics == m and again.device == res.device
    assert res.latency("ttft", 75) is not None


def test_closed_loop_keeps_concurrency_in_flight(llm):
    res = run_in_process_replay(llm.config, WorkloadSpec(**{**TINY, "num_requests": 6, "concurrency": 3}), llm=llm)
    arrivals = sorted(r.arrival_s for r in res.records)
    assert arrivals[2] < 0.05  # first three sent at once
    assert arrivals[3] > arrivals[2]  # the fourth only when one finished


def test_open_loop_arrival_is_the_scheduled_time(llm):
    wl = WorkloadSpec(**{**TINY, "arrivals": "fixed_rate", "rate": 20.0, "num_requests": 3})
    res = run_in_process_replay(llm.config, wl, llm=llm)
    assert [round(r.arrival_s, 3) for r in sorted(res.records, key=lambda r: r.arrival_s)] == [0.0, 0.05, 0.1]
    assert all(r.ttft >= r.queue_time >= 0 for r in res.records)


def test_duration_stops_a_closed_loop_run(llm):
    wl = WorkloadSpec(**{**TINY, "num_requests": None, "duration_s": 0.5})
    res = run_in_process_replay(llm.config, wl, llm=llm)
    assert res.metrics["num_completed"] >= 2 and all(r.arrival_s < 0.5 for r in res.records)
    assert not llm.engine.has_unfinished_requests()


def test_warmup_is_excluded(llm):
    res = run_in_process_replay(llm.config, WorkloadSpec(**{**TINY, "warmup_requests": 2}), llm=llm)
    assert res.metrics["num_requests"] == 4 and all(r.request_id.startswith("req-") for r in res.records)


def test_rejected_requests_are_recorded_not_raised(llm):
    wl = WorkloadSpec(**{**TINY, "prompt_len": {"kind": "fixed", "value": 2000}})  # > max_model_len 1024
    res = run_in_process_replay(llm.config, wl, llm=llm)
    assert res.metrics["num_rejected"] == 4 and res.metrics["num_rejected_prompt_too_long"] == 4
    assert res.metrics["goodput_rps"] == 0
    timed = run_in_process_replay(llm.config, wl.model_copy(update={"num_requests": None, "duration_s": 0.3}), llm=llm)
    assert timed.metrics["num_rejected"] >= 1 and timed.metrics["duration_s"] < 5  # ends despite no progress


def test_should_stop_ends_a_hopeless_run_early(llm):
    res = run_in_process_replay(
        llm.config, WorkloadSpec(**{**TINY, "num_requests": 8}), llm=llm, should_stop=lambda recs: len(recs) >= 1
    )
    assert res.early_stopped and res.metrics["num_completed"] < 8
    assert not llm.engine.has_unfinished_requests()


def test_parse_overrides():
    assert parse_overrides(
        ["max_num_seqs=8", "speculative.method=ngram", "enable_prefix_caching=true", "kv_cache_memory_gb=0.5"]
    ) == {"max_num_seqs": 8, "speculative.method": "ngram", "enable_prefix_caching": True, "kv_cache_memory_gb": 0.5}
    with pytest.raises(ValueError, match="key=value"):
        parse_overrides(["max_num_seqs"])


def test_cli_bench_example_workload_with_overrides_writes_json(tmp_path):
    (tmp_path / "c.yaml").write_text("max_num_seqs: 2\nnum_kv_blocks: 64\n")
    out = tmp_path / "r.json"
    r = CliRunner().invoke(
        app,
        [
            "bench",
            str(tmp_path / "c.yaml"),
            "--workload",
            str(ROOT / "examples/workloads/tiny.yaml"),
            "--json",
            str(out),
            "--set",
            "scheduling=static",
            "--usd-per-hour",
            "2.5",
        ],
    )
    assert r.exit_code == 0, r.output
    assert "ttft" in r.output and "output tokens/s" in r.output and "$ per 1M output tokens" in r.output
    d = json.loads(out.read_text())
    assert d["config"]["scheduling"] == "static" and d["config"]["max_num_seqs"] == 2
    m = d["metrics"]
    assert d["workload"]["name"] == "tiny" and m["num_completed"] == 4
    # priced at the measured throughput, and every latency percentile judged comes with its interval
    assert m["usd_per_1m_output_tokens"] == pytest.approx(2.5 / 3600 / m["output_tokens_per_s"] * 1e6)
    assert m["usd_per_1m_total_tokens"] == pytest.approx(2.5 / 3600 / m["total_tokens_per_s"] * 1e6)
    assert m["ttft_p95_ci_low"] <= m["ttft_p95"] <= m["ttft_p95_ci_high"]


def test_cli_bench_bad_override_is_a_clean_error(tmp_path):
    r = CliRunner().invoke(app, ["bench", "--set", "max_num_seqs=0"])
    assert r.exit_code == 2 and "max_num_seqs" in r.output
    r = CliRunner().invoke(app, ["bench", "--workload", str(tmp_path / "nope.yaml")])
    assert r.exit_code == 2 and "nope.yaml" in r.output
    r = CliRunner().invoke(app, ["bench", "--usd-per-hour", "0"])
    assert r.exit_code == 2 and "--usd-per-hour" in r.output and "> 0" in r.output
