"""`tune bench` end to end on the real model with a tiny workload."""

import json

from typer.testing import CliRunner

from slotune.tuner.bench import run_benchmark
from slotune.tuner.cli import app
from slotune.tuner.workload import WorkloadSpec

TINY = {"num_requests": 4, "warmup_requests": 0, "concurrency": 2,
        "prompt_len": {"kind": "fixed", "value": 16}, "output_len": {"kind": "fixed", "value": 4}}


def test_run_benchmark_measures_every_request(llm):
    res = run_benchmark(llm.config, WorkloadSpec(**TINY), llm=llm, ttft_limit_s=1e9)
    m = res.metrics
    assert m["num_completed"] == 4 and m["output_tokens"] == 16
    assert 0 < m["ttft_p50"] <= m["ttft_p99"] and m["output_tokens_per_s"] > 0
    assert m["goodput_rps"] == m["requests_per_s"] and m["peak_kv_blocks"] >= 2
    assert res.to_dict()["records"][0]["output_tokens"] == 4


def test_should_stop_ends_a_hopeless_run_early(llm):
    res = run_benchmark(llm.config, WorkloadSpec(**{**TINY, "num_requests": 8}), llm=llm, should_stop=lambda recs: len(recs) >= 1)
    assert res.early_stopped and res.metrics["num_completed"] < 8
    assert not llm.engine.has_unfinished_requests()


def test_cli_bench_writes_json(tmp_path):
    (tmp_path / "w.yaml").write_text(json.dumps(TINY))
    (tmp_path / "c.yaml").write_text("max_num_seqs: 2\nnum_kv_blocks: 64\n")
    out = tmp_path / "r.json"
    r = CliRunner().invoke(app, ["bench", str(tmp_path / "c.yaml"), "--workload", str(tmp_path / "w.yaml"),
                                 "--json", str(out), "--set", "scheduling=static"])
    assert r.exit_code == 0, r.output
    d = json.loads(out.read_text())
    assert d["config"]["scheduling"] == "static" and d["metrics"]["num_completed"] == 4


def test_cli_bench_bad_override_is_a_clean_error(tmp_path):
    r = CliRunner().invoke(app, ["bench", "--set", "max_num_seqs=0"])
    assert r.exit_code == 2 and "max_num_seqs" in r.output
