"""A trace workload replayed on the real model, in process (`run_in_process_replay`) and over HTTP
(`run_http_replay` against `tune serve`): open loop at the traced times, traced lengths, and the
traced prefix sharing seen by the engine's prefix cache (warm-up leaves nothing a measured request finds)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from slotune.tuner.measure.http_replay import run_http_replay
from slotune.tuner.measure.in_process_replay import run_in_process_replay
from slotune.tuner.spec.workload_spec import WorkloadSpec

from tests.tuner_tests.test_http_replay import KEY, MODEL, server, tokenizer  # noqa: F401 (fixtures)

# Mooncake lines, 16-token blocks (the engine's default block size): req-1 shares req-0's first two blocks,
# req-3 repeats req-0 (its last, partial block too: the engine caches full blocks only) and produced no tokens.
LINES = [
    {"timestamp": 0, "input_length": 40, "output_length": 3, "hash_ids": [1, 2, 3]},
    {"timestamp": 100, "input_length": 48, "output_length": 3, "hash_ids": [1, 2, 4]},
    {"timestamp": 200, "input_length": 20, "output_length": 2, "hash_ids": [5, 6]},
    {"timestamp": 300, "input_length": 40, "output_length": 0, "hash_ids": [1, 2, 3]},
]


def _workload(tmp_path: Path) -> WorkloadSpec:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in LINES))
    return WorkloadSpec.load(
        {"name": "tiny-trace", "trace": {"path": str(path), "block_size": 16}, "warmup_requests": 1}
    )


def _by_id(records):
    return {r.request_id: r for r in records}


@pytest.fixture(scope="module")
def caching_llm():
    from slotune.engine import LLM, EngineConfig

    return LLM(EngineConfig(max_num_seqs=4, max_model_len=256, num_kv_blocks=64, enable_prefix_caching=True))


def test_in_process_replay_follows_the_trace(tmp_path, caching_llm):
    wl = _workload(tmp_path)
    res = run_in_process_replay(caching_llm.config, wl, llm=caching_llm)
    recs = _by_id(res.records)
    assert sorted(recs) == ["req-0", "req-1", "req-2", "req-3"] and res.metrics["num_completed"] == 4
    assert [round(recs[f"req-{i}"].arrival_s, 3) for i in range(4)] == [0.0, 0.1, 0.2, 0.3]
    assert [recs[f"req-{i}"].prompt_tokens for i in range(4)] == [40, 48, 20, 40]
    assert [recs[f"req-{i}"].output_tokens for i in range(4)] == [3, 3, 2, 1]  # no output -> 1 token
    # The prefix cache sees the traced sharing; the warm-up (req-0's lengths, fresh tokens) cached none of it.
    assert [recs[f"req-{i}"].cached_prompt_tokens for i in range(4)] == [0, 32, 0, 32]


def test_http_replay_follows_the_trace(tmp_path, server, tokenizer):  # noqa: F811 (fixtures)
    res = run_http_replay(server, _workload(tmp_path), tokenizer=tokenizer, api_key=KEY, model=MODEL)
    recs = _by_id(res.records)
    assert res.metrics["num_completed"] == 4 and res.metrics["num_failed"] == 0
    assert [round(recs[f"req-{i}"].arrival_s, 3) for i in range(4)] == [0.0, 0.1, 0.2, 0.3]
    assert [recs[f"req-{i}"].prompt_tokens for i in range(4)] == [40, 48, 20, 40]
    assert [recs[f"req-{i}"].output_tokens for i in range(4)] == [3, 3, 2, 1]
