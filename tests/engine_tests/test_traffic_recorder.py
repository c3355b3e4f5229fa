"""TrafficRecorder: what `tune serve --record-traffic` writes loads back as the trace it served
(slotune/tuner/spec/traces.py), holds no text, rotates and stays within its bound, and never blocks a caller."""

from __future__ import annotations

import json

import pytest

from slotune.engine.outputs import RequestMetrics, RequestOutput
from slotune.engine.serving.traffic_recorder import KEY_ENV, TrafficRecorder
from slotune.tuner.spec.traces import block_hash_ids
from slotune.tuner.spec.trace_reader import load_trace

SYSTEM = list(range(1000, 1128))  # a 128-token shared start: two full 64-token blocks


def _finished(i: int, prompt: list[int], n_out: int, t0: float, reason: str = "length") -> RequestOutput:
    m = RequestMetrics(
        arrival_time=t0 + i * 0.01, finish_time=t0 + i * 0.01 + 0.5, num_cached_prompt_tokens=64 * (i > 0)
    )
    return RequestOutput(f"r{i}", prompt, list(range(n_out)), "never recorded", True, reason, m)


def test_a_recording_loads_back_as_the_traffic_served(tmp_path, monkeypatch):
    monkeypatch.delenv(KEY_ENV, raising=False)
    rec = TrafficRecorder(tmp_path / "rec", block_size=64)
    prompts = [SYSTEM + [7 + i] * (10 + i) for i in range(20)]
    t0 = 1000.0
    for i, p in enumerate(prompts):
        assert rec.record(_finished(i, p, 5 + i, t0), chat=i % 2 == 0, max_tokens=5 + i)
    rec.close()
    assert (rec.num_recorded, rec.num_dropped, rec.num_errors) == (20, 0, 0)
    text = "".join(f.read_text() for f in (tmp_path / "rec").glob("*.jsonl"))
    assert "never recorded" not in text and "1000, 1001" not in text  # no text, no token ids
    trace = load_trace(tmp_path / "rec")
    assert [r.prompt_tokens for r in trace.requests] == [len(p) for p in prompts]
    assert [r.output_tokens for r in trace.requests] == [5 + i for i in range(20)]
    assert [r.is_chat for r in trace.requests] == [i % 2 == 0 for i in range(20)]
    assert trace.requests[5].arrival_s == pytest.approx(0.05, abs=1e-3)  # gaps kept (perf_counter -> unix)
    assert trace.requests[3].e2e_s == pytest.approx(0.5, abs=1e-3)
    ids = [r.hash_ids for r in trace.requests]
    assert all(h[:2] == ids[0][:2] for h in ids)  # the shared system prompt: same first two blocks
    key = (tmp_path / "rec" / ".traffic-key").read_bytes()
    assert list(ids[0]) == block_hash_ids(prompts[0], 64, key=key)
    assert block_hash_ids(prompts[0], 64) != list(ids[0])  # keyed: unkeyed guesses do not match


def test_the_key_is_shared_through_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(KEY_ENV, "ab" * 16)
    lines = []
    for name in ("a", "b"):  # two replicas, one key: equal prompts, equal hashes
        rec = TrafficRecorder(tmp_path / name, block_size=64)
        rec.record(_finished(0, SYSTEM, 1, 5.0), chat=False, max_tokens=None)
        rec.close()
        lines.append(json.loads(next((tmp_path / name).glob("*.jsonl")).read_text()))
    assert lines[0]["hash_ids"] == lines[1]["hash_ids"] == block_hash_ids(SYSTEM, 64, key=bytes.fromhex("ab" * 16))
    monkeypatch.setenv(KEY_ENV, "not hex")
    with pytest.raises(ValueError, match=KEY_ENV):
        TrafficRecorder(tmp_path / "c")


def test_files_rotate_and_the_folder_stays_bounded(tmp_path, monkeypatch):
    monkeypatch.delenv(KEY_ENV, raising=False)
    rec = TrafficRecorder(tmp_path, block_size=64, max_file_mib=2 / 1024, max_total_mib=6 / 1024)  # 2 KiB / 6 KiB
    for i in range(300):
        rec.record(_finished(i, SYSTEM + [i], 3, 1.0), chat=False, max_tokens=3)
    rec.close()
    files = sorted(tmp_path.glob("traffic-*.jsonl"))
    assert len(files) >= 3
    assert sum(f.stat().st_size for f in files) <= 8 * 1024  # max_total + one open file
    for f in files:  # whole lines only
        assert all(json.loads(line) for line in f.read_text().splitlines())
    assert rec.num_recorded == 300


def test_after_close_records_are_dropped_and_counted(tmp_path):
    rec = TrafficRecorder(tmp_path)
    rec.close()
    assert not rec.record(_finished(0, SYSTEM, 1, 1.0), chat=False, max_tokens=1)
    assert rec.num_dropped == 1


def test_tune_serve_records_what_tune_bench_url_sent(tmp_path):
    """A real `tune serve --record-traffic` subprocess, driven by the real `tune bench --url` client
    (shared-prefix workload): after SIGTERM the recording loads as a trace with every request,
    its lengths, its arrival gaps and its shared prefix blocks; /metrics counted the lines."""
    import signal
    import subprocess
    import sys

    import httpx

    from slotune.engine.loader import resolve_model_path
    from slotune.engine.tokenizer import Tokenizer
    from slotune.tuner.measure.http_replay import run_http_replay, wait_ready
    from slotune.tuner.spec.workload_spec import WorkloadSpec

    with __import__("socket").socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = tmp_path / "c.yaml"
    cfg.write_text("num_kv_blocks: 128\nmax_model_len: 512\nmax_num_seqs: 4\n")
    rec_dir = tmp_path / "traffic"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "slotune.tuner.cli_main",
            "serve",
            str(cfg),
            "--port",
            str(port),
            "--record-traffic",
            str(rec_dir),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base, timeout_s=60, proc=proc)
        wl = WorkloadSpec.load(
            {
                "arrivals": "poisson",
                "rate": 4.0,
                "num_requests": 12,
                "warmup_requests": 0,
                "prompt_len": {"kind": "uniform", "min": 20, "max": 60},
                "output_len": {"kind": "fixed", "value": 6},
                "shared_prefix": {"num_tokens": 128, "fraction": 1.0},
                "seed": 3,
            }
        )
        tok = Tokenizer.from_model_path(resolve_model_path("smollm2-135m"))
        res = run_http_replay(base, wl, tokenizer=tok)
        assert res.metrics["num_failed"] == 0
        metrics = httpx.get(base + "/metrics").text
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    trace = load_trace(rec_dir)
    assert len(trace.requests) == 12
    sent = sorted(res.records, key=lambda r: r.arrival_s)
    assert [r.prompt_tokens for r in trace.requests] == [r.prompt_tokens for r in sent]
    assert all(r.output_tokens == 6 and r.is_chat is False for r in trace.requests)
    gaps = [b.arrival_s - a.arrival_s for a, b in zip(trace.requests, trace.requests[1:])]
    sent_gaps = [b.arrival_s - a.arrival_s for a, b in zip(sent, sent[1:])]
    assert max(abs(g - h) for g, h in zip(gaps, sent_gaps)) < 0.25  # server clock vs client clock
    first_blocks = {r.hash_ids[:2] for r in trace.requests}  # the 128-token shared prefix = two 64-token blocks
    assert len(first_blocks) == 1
    assert 'slotune_traffic_records_total{outcome="dropped"} 0.0' in metrics
