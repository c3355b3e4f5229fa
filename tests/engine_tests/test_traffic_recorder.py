"""TrafficRecorder: what `tune serve --record-traffic` writes loads back as the trace it served
(tuner/traces.py), holds no text, rotates and stays within its bound, and never blocks a caller."""

from __future__ import annotations

import json

import pytest

from slotune.engine.outputs import RequestMetrics, RequestOutput
from slotune.engine.traffic_recorder import KEY_ENV, TrafficRecorder
from slotune.tuner.traces import block_hash_ids, load_trace

SYSTEM = list(range(1000, 1128))  # a 128-token shared start: two full 64-token blocks


def _finished(i: int, prompt: list[int], n_out: int, t0: float, reason: str = "length") -> RequestOutput:
    m = RequestMetrics(arrival_time=t0 + i * 0.01, finish_time=t0 + i * 0.01 + 0.5, num_cached_prompt_tokens=64 * (i > 0))
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
