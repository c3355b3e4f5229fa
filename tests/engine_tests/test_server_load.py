"""Load and fault test of a real `tune serve` subprocess on loopback (bench/server/run.py).

Concurrent streaming clients with random disconnects and invalid requests: zero 5xx, every
valid request completes or gets 429, every KV block free afterwards, RSS flat, SIGTERM
exits 0. The default variant is short; the soak (two 60 s rounds) is marked slow.
"""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path

import pytest

_RUN = Path(__file__).resolve().parents[2] / "bench" / "server" / "run.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("slotune_bench_server_run", _RUN)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses resolve string annotations through sys.modules
    spec.loader.exec_module(mod)
    return mod


def _check_round(res, scrape_after: dict) -> None:
    assert res.failures == [], res.failures
    assert res.num_5xx == 0 and scrape_after.get('slotune_http_responses_total{status="5xx"}', 0.0) == 0
    assert res.num_completed > 0
    assert scrape_after["slotune_kv_blocks_used"] == 0
    assert scrape_after["slotune_num_requests_running"] == 0 and scrape_after["slotune_num_requests_waiting"] == 0


def test_load_with_disconnects_and_invalid_requests(bench, tmp_path):
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(bench.SERVER_CONFIG)
    port = bench.free_port()
    base = f"http://127.0.0.1:{port}"
    proc = bench.start_server(cfg, port, tmp_path / "serve.log")
    try:
        warm = asyncio.run(bench.run_load(base, duration_s=3, concurrency=6, max_tokens_range=(4, 12), seed=7))
        _check_round(warm, bench.wait_idle(base))
        rss_before = bench.rss_mib(proc.pid)
        res = asyncio.run(
            bench.run_load(
                base,
                duration_s=12,
                concurrency=10,
                disconnect_prob=0.3,
                invalid_prob=0.25,
                max_tokens_range=(4, 16),
                seed=1,
            )
        )
        after = bench.wait_idle(base)
        rss_after = bench.rss_mib(proc.pid)
        print(f"\nload: {res.summary()}\nRSS {rss_before:.1f} -> {rss_after:.1f} MiB")
        _check_round(res, after)
        assert res.num_rejected_429 > 0  # 10 clients against 4 slots + 4 queued: overload was exercised
        assert res.num_disconnected > 0 and res.num_invalid_4xx > 0
        assert after.get('slotune_requests_rejected_total{reason="queue_full"}', 0) > 0
        assert rss_after - rss_before < 64, f"server RSS grew {rss_after - rss_before:.1f} MiB under load"
    finally:
        code = bench.stop_server(proc)
    assert code == 0
    assert "Tell me a story" not in (tmp_path / "serve.log").read_text()  # no prompt text in logs


@pytest.mark.slow
def test_load_soak(bench, tmp_path):
    rep = bench.run_rounds(tmp_path, duration_s=60, concurrency=12, warmup_s=10)
    for r in rep["rounds"]:
        assert r["failures"] == [] and r["num_5xx"] == 0 and r["server_5xx_total"] == 0
        assert r["kv_blocks_used_after"] == 0 and r["running_after"] == 0 and r["waiting_after"] == 0
    assert rep["rounds"][1]["rss_mib_after"] - rep["rounds"][0]["rss_mib_after"] < 32
    assert rep["exit_code_on_sigterm"] == 0
