"""Helpers for study tests: tiny specs written to tmp dirs."""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path

import pytest
import yaml

TINY_WORKLOAD = {
    "num_requests": 3,
    "warmup_requests": 0,
    "concurrency": 2,
    "prompt_len": {"kind": "fixed", "value": 12},
    "output_len": {"kind": "fixed", "value": 4},
}


_EMPTY_STORE: list[Path] = []


def _empty_tracking_store() -> Path:
    """An empty MLflow tracking store, made by MLflow once per test session: creating one runs its
    69 schema migrations (about 2 s on 2 cores), which every study of a fresh output folder would
    pay again."""
    if not _EMPTY_STORE:
        from mlflow.tracking import MlflowClient

        folder = tempfile.mkdtemp(prefix="slotune-mlflow-")
        atexit.register(shutil.rmtree, folder, True)
        path = Path(folder) / "mlflow.db"
        MlflowClient(f"sqlite:///{path}").search_experiments()
        _EMPTY_STORE.append(path)
    return _EMPTY_STORE[0]


def write_spec(tmp: Path, *, fresh_tracking_store: bool = False, **over) -> Path:
    """A tiny spec in `tmp`, its sections updated from `over`. Unless `fresh_tracking_store`, the spec's
    default MLflow store (out/mlflow.db) starts as a copy of one empty store made by MLflow, where none
    is there yet: tests of creating a store (concurrently, or not at all) ask for a fresh one."""
    spec = {
        "name": "t",
        "workload": TINY_WORKLOAD,
        "objective": {"kind": "latency", "metric": "tpot", "percentile": 95, "ttft_limit_s": 30.0},
        "search_space": {
            "name": "tiny",
            "knobs": [
                {"name": "max_num_seqs", "type": "int", "low": 1, "high": 8},
                {"name": "quantization", "type": "categorical", "choices": ["none", "int8"]},
            ],
        },
        "budget": {"n_trials": 3, "trial_timeout_s": 120},
        "output_dir": str(tmp / "out"),
        "sampler": "random",
    }
    for k, v in over.items():
        spec[k] = {**spec[k], **v} if isinstance(spec.get(k), dict) and isinstance(v, dict) else v
    path = tmp / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    store = tmp / "out" / "mlflow.db"
    if not fresh_tracking_store and not {"output_dir", "mlflow_tracking_uri"} & over.keys() and not store.exists():
        store.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(_empty_tracking_store(), store)
    return path


@pytest.fixture
def fake_trials(monkeypatch):
    """Study-mechanics tests replace the engine measurement with a cheap deterministic function
    of the config: the stand-in trial process tests/tuner_tests/fake_trial_runner.py, passed as
    `run_command(..., trial_runner=fake_trials)` — a stand-in, said here. Its behaviour
    (FAKE_TRIAL_SLEEP, FAKE_TRIAL_FAULT) defaults to an instant, healthy trial."""
    from tests.tuner_tests.fake_trial_runner import FAKE_RUNNER

    monkeypatch.delenv("FAKE_TRIAL_FAULT", raising=False)
    monkeypatch.setenv("FAKE_TRIAL_SLEEP", "0")
    return FAKE_RUNNER
