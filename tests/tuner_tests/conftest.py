"""Helpers for study tests: tiny specs written to tmp dirs."""

from __future__ import annotations

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


def write_spec(tmp: Path, **over) -> Path:
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
