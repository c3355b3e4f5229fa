"""A study stored before the tuner's redesign (data/pre_redesign, made at commit 758a977) still resumes
and warm-starts with today's `tune run`. The trial process is the stand-in of fake_trial_runner.py, as
these tests are about the study's stored state, not the engine's measurements."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import optuna
import yaml

FIXTURE = Path(__file__).parent / "data" / "pre_redesign"
FAKE_RUNNER = Path(__file__).parent / "fake_trial_runner.py"
OLD_STUDY = "pre-redesign"


def _copy_fixture(tmp_path: Path) -> Path:
    """The fixture's spec and study, in a folder of their own (the spec's paths are relative to it)."""
    folder = tmp_path / "study"
    folder.mkdir()
    for name in ("spec.yaml", "study.db"):
        shutil.copy(FIXTURE / name, folder / name)
    return folder


def _tune_run(spec: Path, *args: str) -> subprocess.CompletedProcess:
    """`tune run SPEC --no-progress ARGS` with the stand-in trial process."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FAKE_TRIAL_") and k != "SLOTUNE_STORAGE"}
    env["FAKE_TRIAL_SLEEP"] = "0"
    cmd = [sys.executable, "-m", "slotune.tuner.cli_main", "run", str(spec), "--no-progress"]
    cmd += [*args, "--trial-runner", str(FAKE_RUNNER)]
    return subprocess.run(cmd, cwd=spec.parent, env=env, capture_output=True, text=True, timeout=600)


def _load(folder: Path, name: str):
    return optuna.load_study(study_name=name, storage=f"sqlite:///{folder / 'study.db'}")


def _matches(best: dict, stored: dict) -> bool:
    """best.yaml's config agrees with a trial's stored config on every field that config stored
    (nested sections too: a field added since, such as one in `kernels`, is not compared)."""
    return all(
        isinstance(best.get(k), dict) and _matches(best[k], v) if isinstance(v, dict) else best.get(k) == v
        for k, v in stored.items()
    )


def test_a_pre_redesign_study_resumes_with_its_trials_intact(tmp_path):
    """Resume with the budget raised by 2: the stored spec fingerprint is accepted (no "spec changed"
    refusal), the old trials are kept as they were, 2 new configs are measured, and a winner is written."""
    folder = _copy_fixture(tmp_path)
    old = {t.number: (t.state, t.params, t.values, t.user_attrs) for t in _load(folder, OLD_STUDY).trials}
    assert len(old) == 6 and all(s == optuna.trial.TrialState.COMPLETE for s, *_ in old.values())
    n_trials = yaml.safe_load((folder / "spec.yaml").read_text())["budget"]["n_trials"] + 2

    r = _tune_run(folder / "spec.yaml", "--n-trials", str(n_trials))

    output = r.stdout + r.stderr
    assert "different spec" not in output and "--force-new" not in output, output[-4000:]
    assert r.returncode == 0, output[-4000:]
    trials = _load(folder, OLD_STUDY).trials
    assert {n: (t.state, t.params, t.values, t.user_attrs) for n, t in enumerate(trials) if n in old} == old
    new = trials[len(old) :]
    states = [(t.number, t.state.name, t.params) for t in new]
    assert new and all(t.state == optuna.trial.TrialState.COMPLETE for t in new), states
    # A sampled config measured before is a repeat (no measurement, no budget slot): 2 new configs.
    old_configs = [params for _, params, _, _ in old.values()]
    new_configs = [t.params for t in new if t.params not in old_configs]
    assert len(new_configs) == 2 and new_configs[0] != new_configs[1], states

    out = folder / "out"
    best = yaml.safe_load((out / "best.yaml").read_text())
    assert isinstance(best, dict) and best.get("max_num_seqs"), best
    stored = [t.user_attrs["config"] for t in trials if isinstance(t.user_attrs.get("config"), dict)]
    assert any(_matches(best, cfg) for cfg in stored), best
    summary = json.loads((out / "best_metrics.json").read_text())
    assert isinstance(summary, dict) and summary, summary


def test_a_new_study_warm_starts_from_the_pre_redesign_winner(tmp_path):
    """A new study in the same storage, same model and objective, another workload (a re-tune on new
    traffic), enqueues the pre-redesign study's declared winner (its stored `winner_trial`) as an early trial."""
    folder = _copy_fixture(tmp_path)
    earlier = _load(folder, OLD_STUDY)
    winner = earlier.trials[earlier.user_attrs["winner_trial"]]
    assert winner.user_attrs.get("tag") is None  # not a reference config, which is enqueued anyway
    spec = yaml.safe_load((folder / "spec.yaml").read_text())
    spec["name"] = "after-redesign"
    spec["output_dir"] = "out-after"
    spec["workload"]["num_requests"] = 5
    spec["budget"]["n_trials"] = 3  # the default, the naive config and one more
    # The fixture's seed (7) samples the old winner's config third anyway; with 8 it samples another.
    spec["seed"] = 8
    (folder / "after.yaml").write_text(yaml.safe_dump(spec))

    r = _tune_run(folder / "after.yaml")

    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    trials = _load(folder, "after-redesign").trials
    early = [(t.number, t.params, t.user_attrs) for t in trials[:3]]
    warm = [
        t
        for t in trials[:3]
        if t.params == winner.params and "warm" in json.dumps(t.user_attrs) and OLD_STUDY in json.dumps(t.user_attrs)
    ]
    assert len(warm) == 1, early
    assert warm[0].state == optuna.trial.TrialState.COMPLETE
