"""Bundled task data and YAMLs: valid, sourced, found by lm-eval without network or CWD tricks."""

from __future__ import annotations

import json

import pytest
import yaml

from slotune.evals.tasks import bundled_tasks, data_dir, task_fingerprint, tasks_dir

EXPECTED = {
    "slotune_arithmetic_1digit",
    "slotune_arithmetic_1digit_gen",
    "slotune_general_knowledge",
    "slotune_code_line_description",
    "slotune_kjv_perplexity",
}


def test_bundled_tasks():
    assert set(bundled_tasks()) == EXPECTED


@pytest.mark.parametrize("folder", sorted(p.name for p in data_dir().iterdir() if p.is_dir()))
def test_data_files_are_valid_small_and_sourced(folder):
    sources = (data_dir() / "SOURCES.md").read_text()
    for f in (data_dir() / folder).glob("*.jsonl"):
        assert f"{folder}/{f.name}" in sources, f"{folder}/{f.name} missing from SOURCES.md"
        assert f.stat().st_size < 100_000
        rows = [json.loads(x) for x in f.read_text().splitlines()]
        assert 10 <= len(rows) <= 300
        for r in rows:
            if "choices" in r:
                assert 0 <= r["label"] < len(r["choices"]) and r["choices"][r["label"]] == r["target"]
            else:
                assert len(r["text"]) > 100


def test_agreement_prompts_data():
    from slotune.evals.agreement import prompts_path

    rows = [json.loads(x) for x in prompts_path().read_text().splitlines()]
    assert len(rows) == 32 and {r["source"] for r in rows} == {"KJV", "GPL-3"}
    assert "data/agreement_prompts.jsonl" in (data_dir() / "SOURCES.md").read_text()


def test_templates_materialize_with_absolute_paths(tmp_path):
    out = tasks_dir(tmp_path)
    for t in EXPECTED:
        cfg = yaml.safe_load((out / t.removeprefix("slotune_") / "task.yaml").read_text())
        assert cfg["task"] == t
        path = cfg["dataset_kwargs"]["data_files"]["test"]
        assert path.startswith("/") and (data_dir() / path.split("/tasks/")[-1]).exists()
    tasks_dir(tmp_path)  # idempotent


def test_lm_eval_task_manager_finds_and_loads_them(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)  # data paths must not depend on the CWD
    from lm_eval.tasks import TaskManager

    tm = TaskManager(include_path=str(tasks_dir(tmp_path / "t")), include_defaults=False)
    assert EXPECTED <= set(tm.all_tasks)
    tasks = tm.load(["slotune_general_knowledge", "slotune_kjv_perplexity"])["tasks"]
    gk = tasks["slotune_general_knowledge"]
    docs = list(gk.test_docs())
    assert len(docs) == 70 and gk.doc_to_choice(docs[0])[gk.doc_to_target(docs[0])] == "four"


def test_fingerprint_tracks_data():
    a = task_fingerprint("slotune_general_knowledge")
    assert a == task_fingerprint("slotune_general_knowledge") != task_fingerprint("slotune_arithmetic_1digit")
    with pytest.raises(ValueError, match="unknown task"):
        task_fingerprint("slotune_nope")
