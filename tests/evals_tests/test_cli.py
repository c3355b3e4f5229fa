"""`tune eval CONFIG --gates GATES.yaml --json OUT`: gates alone, a table, JSON results."""

from __future__ import annotations

import json

import yaml
from typer.testing import CliRunner

from slotune.tuner.cli import app


def test_tune_eval(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # baselines cached here
    cfg = tmp_path / "config.yaml"
    cfg.write_text(yaml.safe_dump({"device": "cpu", "quantization": "int8", "num_kv_blocks": 32, "max_model_len": 256}))
    gates = tmp_path / "gates.yaml"
    gates.write_text(
        yaml.safe_dump(
            {
                "quality_gates": [
                    {"name": "agree", "kind": "agreement", "min_top1": 0.8, "limit": 2},
                    {"name": "strict", "kind": "agreement", "max_mean_kl": 1e-9, "limit": 2},
                ]
            }
        )
    )
    out = tmp_path / "report.json"
    res = CliRunner().invoke(app, ["eval", str(cfg), "--gates", str(gates), "--json", str(out)])
    assert res.exit_code == 0, res.output
    assert "quality gates" in res.output and "agree" in res.output
    report = json.loads(out.read_text())
    assert report["passed"] is False  # int8 cannot have zero KL
    by_name = {g["name"]: g for g in report["gates"]}
    assert by_name["agree"]["passed"] and not by_name["strict"]["passed"]
    assert by_name["agree"]["candidate"] > 0.8 and by_name["strict"]["details"]["mean_kl"] > 1e-9
    assert list((tmp_path / "cache" / "slotune" / "baselines").glob("agreement-*.json"))


def test_tune_eval_bad_gates_file(tmp_path):
    gates = tmp_path / "gates.yaml"
    gates.write_text(yaml.safe_dump([{"name": "g", "kind": "lm_eval", "task": "nope", "max_abs_drop": 0.1}]))
    res = CliRunner().invoke(app, ["eval", "--gates", str(gates)])
    assert res.exit_code != 0
    assert "unknown task 'nope'" in res.output
