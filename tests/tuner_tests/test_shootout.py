"""An engine shoot-out (`servers:`): llama.cpp's llama-server and slotune's own engine, served by
`tune serve` and launched as a command (engine file slotune/tuner/engines/slotune.yaml), searched in one
study under one SLO and one gate. The study runs the real binaries (skipped where llama-server is
not on PATH)."""

from __future__ import annotations

import json
import shutil

import mlflow
import optuna
import pytest
import yaml
from pydantic import ValidationError

from slotune.tuner.run import run_command
from slotune.tuner.spec.server import ServerConfig
from slotune.tuner.spec.tuning_spec import TuningSpec, resolved_dict

from tests.tuner_tests.conftest import TINY_WORKLOAD

LLAMA_SERVER = shutil.which("llama-server")
LLAMA = {
    "engine": "llama-server",
    "knobs": {"threads": 2, "ctx_per_slot": 512},
    "search_space": {
        "name": "slots",
        "engine": "llama-server",
        "knobs": [{"name": "parallel", "type": "categorical", "choices": [1, 2]}],
    },
}
SLOTUNE = {
    "engine": "slotune",
    "search_space": {
        "name": "seqs",
        "engine": "slotune",
        "knobs": [{"name": "max_num_seqs", "type": "categorical", "choices": [1, 4]}],
        "starts": [
            {"name": "one", "why": "one sequence per step", "objectives": ["latency"], "params": {"max_num_seqs": 1}}
        ],
    },
}
GATE = {"name": "same", "kind": "greedy_match", "min_match": 0.5, "limit": 2, "max_tokens": 4}


def _spec(tmp_path, **over) -> dict:
    spec = {
        "name": "so",
        "servers": [LLAMA, SLOTUNE],
        "workload": TINY_WORKLOAD,
        "objective": {"kind": "latency", "metric": "tpot", "percentile": 95, "ttft_limit_s": 30.0},
        "quality_gates": [GATE],
        "output_dir": str(tmp_path / "out"),
    }
    return {**spec, **over}


def test_the_servers_spaces_become_one_space_under_a_server_choice(tmp_path):
    spec = TuningSpec.model_validate(_spec(tmp_path))
    space = spec.search_space
    assert [k.name for k in space.knobs] == ["server", "llama-server.parallel", "slotune.max_num_seqs"]
    assert space.knobs[2].when == {"server": ["slotune"]}  # sampled only when slotune is chosen
    assert [(s.name, s.params) for s in space.starts] == [
        ("slotune: one", {"server": "slotune", "slotune.max_num_seqs": 1})
    ]
    default = spec.base_config()  # the first server's launch: what is run today
    assert isinstance(default, ServerConfig) and (default.engine, default.name) == ("llama-server", "llama-server")
    trial = spec.search_base().with_updates({"server": "slotune", "slotune.max_num_seqs": 4})
    assert (trial.engine, trial.knobs, trial.value_at("server")) == ("slotune", {"max_num_seqs": 4}, "slotune")
    assert trial.value_at("slotune.max_num_seqs") == 4 and trial.value_at("llama-server.parallel") is None
    again = TuningSpec.model_validate(resolved_dict(spec))  # as a trial process reads it
    assert again.search_space.model_dump() == space.model_dump()


@pytest.mark.parametrize(
    ("over", "message"),
    [
        ({"servers": [LLAMA]}, "a shoot-out lists two or more servers; for one, use `server:`"),
        ({"servers": [LLAMA, LLAMA]}, "llama-server named twice; give each a `name:`"),
        (
            {"servers": [LLAMA, {**SLOTUNE, "search_space": LLAMA["search_space"]}]},
            "servers[1] 'slotune': search_space 'slots' tunes llama-server, not slotune",
        ),
        ({"server": {"engine": "llama-server"}}, "server and servers: a study launches one server or a shoot-out"),
        ({"search_space": "latency-int8"}, "with servers: each server names its own search_space"),
        (
            {"quality_gates": [{"name": "a", "kind": "agreement", "min_top1": 0.9}]},
            "quality_gates[0] 'a': kind agreement needs the bundled engine; llama-server is judged through its API",
        ),
    ],
)
def test_a_shootout_that_cannot_run_is_refused_by_name(tmp_path, over, message):
    with pytest.raises(ValidationError) as exc:
        TuningSpec.model_validate(_spec(tmp_path, **over))
    assert message in str(exc.value)


def test_two_builds_of_one_engine_are_told_apart_by_name(tmp_path):
    other = {**LLAMA, "name": "llama-other", "binary": "/opt/llama.cpp/bin/llama-server"}
    spec = TuningSpec.model_validate(_spec(tmp_path, servers=[LLAMA, other]))
    assert spec.search_space.knobs[0].choices == ["llama-server", "llama-other"]
    assert spec.search_base().with_updates({"server": "llama-other"}).binary == "/opt/llama.cpp/bin/llama-server"


@pytest.mark.skipif(LLAMA_SERVER is None, reason="needs llama.cpp's llama-server on PATH")
def test_a_shootout_names_the_best_server_and_each_ones_best(tmp_path):
    """Four trials: llama-server's default launch, slotune's default, slotune's start, one sampled;
    every server's best re-measured in the confirmation beside the others; the report, best_metrics.json
    and the MLflow parent run name the best server and each one's ratio to the winner."""
    path = tmp_path / "spec.yaml"
    data = _spec(tmp_path, budget={"n_trials": 4, "trial_timeout_s": 300}, sampler="random")
    path.write_text(yaml.safe_dump({**data, "confirm": {"candidates": 1, "seeds": 1}}))
    summary = run_command(path, progress=False)
    study = optuna.load_study(study_name="so", storage=f"sqlite:///{tmp_path / 'out' / 'study.db'}")
    t = study.trials
    assert t[0].user_attrs["tag"] == "default" and t[0].user_attrs["config"]["name"] == "llama-server"
    assert t[1].user_attrs["tag"] == "default slotune" and t[1].params == {"server": "slotune"}
    assert t[1].user_attrs["config"]["knobs"] == {}  # slotune as `tune serve` runs it with nothing set
    assert t[2].user_attrs["start"] == "slotune: one" and t[2].user_attrs["config"]["knobs"] == {"max_num_seqs": 1}
    measured = [x for x in t if x.state.name == "COMPLETE"]
    assert {x.user_attrs["config"]["engine"] for x in measured} == {"llama-server", "slotune"}
    assert all("candidate" in x.user_attrs["gates"]["gates"][0] for x in measured)  # one gate, every engine
    servers = json.loads((tmp_path / "out" / "best_metrics.json").read_text())["servers"]
    assert sorted(s["server"] for s in servers) == ["llama-server", "slotune"]
    first = servers[0]
    assert first["held"] and first["vs_winner"] == pytest.approx(1.0) and first["trial"] == summary["trial"]
    assert all(s["vs_winner"] >= 1.0 for s in servers if s["vs_winner"] is not None)
    report = (tmp_path / "out" / "report.md").read_text()
    assert "## Servers compared" in report and f"The best server is {first['server']}" in report
    best = yaml.safe_load((tmp_path / "out" / "best.yaml").read_text())
    assert best["name"] == first["server"]
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'out' / 'mlflow.db'}")
    parent = mlflow.get_run(summary["mlflow_run_id"])
    assert parent.data.tags["slotune.best_server"] == first["server"]
    assert all(f"server_{s['server']}_tpot_p95" in parent.data.metrics for s in servers if s["value"] is not None)
