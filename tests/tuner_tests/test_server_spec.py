"""A spec that tunes an external server (`server:`, slotune/tuner/spec/server.py): what it accepts and refuses,
the trial config it makes, `tune validate`'s checks of the binary, and a real study of llama.cpp's
llama-server (skipped where it is not on PATH; .ci/run builds it)."""

from __future__ import annotations

import shlex
import shutil
import stat
import sys
from pathlib import Path

import optuna
import pytest
import yaml
from pydantic import ValidationError

from slotune.engine.config import EngineConfig
from slotune.engine.paths import resolve_model_path
from slotune.search_spaces.schema import SearchSpace
from slotune.tuner.run import run_command
from slotune.tuner.spec.preflight import preflight
from slotune.tuner.spec.server import ServerConfig, parse_config
from slotune.tuner.spec.tuning_spec import TuningSpec
from slotune.tuner.spec.yaml_reader import SpecError

from tests.tuner_tests.conftest import TINY_WORKLOAD

LLAMA_SERVER = shutil.which("llama-server")
OBJECTIVE = {"kind": "latency", "metric": "tpot", "percentile": 95, "ttft_limit_s": 30.0}


def _spec(tmp_path, **over) -> dict:
    spec = {
        "name": "ls",
        "server": {"engine": "llama-server", "knobs": {"threads": 2, "ctx_per_slot": 512}},
        "workload": TINY_WORKLOAD,
        "objective": OBJECTIVE,
        "search_space": "llama-server-cpu",
        "output_dir": str(tmp_path / "out"),
    }
    return {**spec, **over}


def _problem(data: dict) -> str:
    with pytest.raises(ValidationError) as exc:
        TuningSpec.model_validate(data)
    return str(exc.value)


def test_a_server_spec_makes_launch_configs_of_its_engine(tmp_path):
    spec = TuningSpec.model_validate(_spec(tmp_path))
    base = spec.base_config()
    assert isinstance(base, ServerConfig) and base.model == "smollm2-135m"
    assert base.knobs == {"threads": 2, "ctx_per_slot": 512}
    trial = base.with_updates({"parallel": 4, "cache_type_k": "q8_0"})
    assert trial.knobs == {"threads": 2, "ctx_per_slot": 512, "parallel": 4, "cache_type_k": "q8_0"}
    assert trial.value_at("flash_attn") == "auto" and trial.value_at("batch_size") is None  # the engine's own
    assert parse_config(trial.model_dump(mode="json")) == trial
    assert isinstance(parse_config(EngineConfig().model_dump(mode="json")), EngineConfig)
    with pytest.raises(ValueError, match="a quantized V cache needs flash attention"):
        trial.with_updates({"cache_type_v": "q8_0", "flash_attn": "off"})
    with pytest.raises(ValueError, match="ctx_size is set from parallel \\* ctx_per_slot"):
        trial.with_updates({"ctx_size": 4096})


def test_best_yaml_holds_the_launch_command_with_the_model_file():
    cfg = ServerConfig(
        engine="llama-server", model="smollm2-135m", knobs={"threads": 2, "parallel": 4, "ctx_per_slot": 512}
    )
    text = cfg.to_yaml()
    launch = shlex.split(text.splitlines()[0].removeprefix("# launch: "))
    assert launch[launch.index("--model") + 1] == str(resolve_model_path("smollm2-135m"))
    assert launch[launch.index("--parallel") + 1] == "4" and launch[launch.index("--ctx-size") + 1] == "2048"
    assert ServerConfig.model_validate(yaml.safe_load(text)) == cfg
    with pytest.raises(ValueError, match="external server llama-server .* the command on its `# launch:` line"):
        EngineConfig.from_dict(yaml.safe_load(text))  # `tune serve best.yaml` says how to start it instead


@pytest.mark.parametrize(
    ("over", "message"),
    [
        ({"search_space": "latency"}, "search_space 'latency' tunes the bundled engine, not llama-server"),
        (
            {"server": None},
            "search_space 'llama-server-cpu' names llama-server knobs; add `server: {engine: llama-server}`",
        ),
        ({"server": {"engine": "vllm"}}, "no built-in engine 'vllm'; built in: llama-server"),
        ({"server": {"engine": "llama-server", "knobs": {"parallel": 0}}}, "knobs: parallel: 0 is below 1"),
        ({"server": {"engine": "llama-server", "knobs": {"slots": 2}}}, "'slots' is not a knob of llama-server"),
        ({"engine": {"max_num_seqs": 4}}, "engine with server.engine llama-server: the bundled engine's fields"),
        (
            {"quality_gates": [{"name": "a", "kind": "agreement", "min_top1": 0.9}]},
            "quality_gates[0] 'a': kind agreement needs the bundled engine; llama-server is judged through its "
            "API by greedy_match, lm_eval",
        ),
        (
            {
                "server": None,
                "search_space": "latency",
                "quality_gates": [{"name": "g", "kind": "greedy_match", "min_match": 0.9}],
            },
            "quality_gates[0] 'g': greedy_match judges an external server",
        ),
        ({"quality_gates": [{"name": "g", "kind": "greedy_match"}]}, "greedy_match needs min_match"),
        (
            {
                "quality_gates": [
                    {"name": "mc", "kind": "lm_eval", "task": "slotune_general_knowledge", "max_abs_drop": 0.1}
                ]
            },
            "quality_gates[0] 'mc': task slotune_general_knowledge is scored by multiple_choice, which needs the "
            "model's log-probabilities; llama-server is judged through its API on generation tasks "
            "(slotune_arithmetic_1digit_gen)",
        ),
        ({"budget": {"measure": "in_process"}}, "budget.measure with server.engine llama-server"),
        (
            {"server": {"engine": "llama-server", "knobs": {"spec_type": "draft-simple"}}},
            "spec_type draft-simple drafts with a second model: set draft_model to its GGUF",
        ),
    ],
)
def test_a_spec_that_does_not_fit_its_server_is_refused_by_name(tmp_path, over, message):
    assert message in _problem(_spec(tmp_path, **over))


def test_a_space_for_a_server_names_only_its_engines_knobs():
    def problem(knob: dict) -> str:
        with pytest.raises(ValidationError) as exc:
            SearchSpace.model_validate({"engine": "llama-server", "knobs": [knob]})
        return str(exc.value)

    assert "knob 'max_num_seqs': not a llama-server knob (its knobs: model, threads" in problem(
        {"name": "max_num_seqs", "type": "int", "low": 1, "high": 4}
    )
    assert "not a llama-server knob" in problem({"name": "ctx_size", "type": "int", "low": 512, "high": 4096})
    assert "a float knob on a whole-number field" in problem({"name": "parallel", "type": "float", "low": 1, "high": 4})
    assert "'q9' is not one of" in problem({"name": "cache_type_k", "type": "categorical", "choices": ["f16", "q9"]})


def test_server_models_become_the_weights_knob(tmp_path):
    """server.models: the study chooses the weights among the spec's model and these files."""
    (tmp_path / "q8.gguf").write_bytes(resolve_model_path("smollm2-135m").read_bytes())
    path = tmp_path / "spec.yaml"
    data = _spec(tmp_path, server={"engine": "llama-server", "knobs": {"threads": 2}, "models": ["q8.gguf"]})
    path.write_text(yaml.safe_dump(data))
    spec = TuningSpec.from_yaml(path)
    knob = spec.search_space.knobs[0]
    assert knob.name == "model" and knob.choices == ["smollm2-135m", str(tmp_path / "q8.gguf")]
    launch = spec.base_config().with_updates({"model": knob.choices[1], "parallel": 2})
    assert launch.value_at("model") == knob.choices[1] and launch.knobs == {"threads": 2, "parallel": 2}
    assert launch.argv()[launch.argv().index("--model") + 1] == str(tmp_path / "q8.gguf")
    assert TuningSpec.model_validate(spec.model_dump()).search_space == spec.search_space  # read back as it was
    both = {**data, "search_space": {"engine": "llama-server", "knobs": [knob.model_dump(exclude_none=True)]}}
    assert "server.models and search_space knob 'model' both list the weights" in _problem(both)
    if LLAMA_SERVER:
        (tmp_path / "q8.gguf").unlink()
        with pytest.raises(SpecError, match=r"server.models\[0\]: .*q8.gguf"):
            preflight(TuningSpec.from_yaml(path))


@pytest.mark.skipif(LLAMA_SERVER is None, reason="needs llama.cpp's llama-server on PATH")
def test_validate_names_a_slot_context_shorter_than_the_longest_request(tmp_path):
    workload = {
        **TINY_WORKLOAD,
        "prompt_len": {"kind": "uniform", "min": 8, "max": 500},
        "output_len": {"kind": "fixed", "value": 64},
    }
    spec = TuningSpec.model_validate(_spec(tmp_path, workload=workload))
    with pytest.raises(SpecError, match="server.knobs: ctx_per_slot 512: the workload's requests reach 564 tokens"):
        preflight(spec)


def _fake_binary(tmp_path, help_text: str) -> str:
    """A stand-in executable that prints `help_text` for --help: a build of llama-server whose flags
    differ from the engine file's cannot be had here otherwise."""
    path = tmp_path / "llama-server"
    path.write_text(f"#!/bin/sh\ncat <<'EOF'\n{help_text}\nEOF\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def test_validate_names_a_missing_binary_and_flags_its_help_lacks(tmp_path):
    missing = _spec(tmp_path, server={"engine": "llama-server", "binary": str(tmp_path / "nope")})
    with pytest.raises(
        SpecError, match=r"server.binary: `.*nope` is not there; install llama-server or set server.binary"
    ):
        preflight(TuningSpec.model_validate(missing))
    old = _fake_binary(tmp_path, "-t,    --threads N    threads\n-np,   --parallel N   slots\n")
    with pytest.raises(SpecError) as exc:
        preflight(TuningSpec.model_validate(_spec(tmp_path, server={"engine": "llama-server", "binary": old})))
    text = str(exc.value)
    assert "server.engine: cache_type_k: `llama-server` does not know --cache-type-k" in text
    assert "--threads" not in text.replace("--threads-batch", "")


@pytest.mark.skipif(LLAMA_SERVER is None, reason="needs llama.cpp's llama-server on PATH")
def test_the_real_binary_knows_every_flag_of_its_engine_file(tmp_path):
    preflight(TuningSpec.model_validate(_spec(tmp_path)))


@pytest.mark.skipif(LLAMA_SERVER is None, reason="needs llama.cpp's llama-server on PATH")
def test_a_study_of_llama_server_measures_its_launches_and_writes_the_winners_command(tmp_path):
    """Three trials, each a real llama-server launched with its flags, the default launch first; each
    judged by a greedy_match gate against the default's answers; the best confirmed on a fresh seed;
    best.yaml the winner's launch."""
    space = {
        "name": "two",
        "engine": "llama-server",
        "knobs": [
            {"name": "parallel", "type": "categorical", "choices": [1, 2]},
            {"name": "cache_type_k", "type": "categorical", "choices": ["f16", "q8_0"]},
        ],
    }
    gate = {"name": "same", "kind": "greedy_match", "min_match": 0.5, "limit": 4, "max_tokens": 8}
    data = _spec(
        tmp_path,
        search_space=space,
        budget={"n_trials": 3, "trial_timeout_s": 300},
        sampler="random",
        quality_gates=[gate],
    )
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump({**data, "confirm": {"candidates": 1, "seeds": 1}}))
    summary = run_command(path, progress=False)
    assert summary is not None and summary["metrics"]["tpot_p95"] > 0
    assert summary["references"]["default"]["tpot_p95"] > 0
    study = optuna.load_study(study_name="ls", storage=f"sqlite:///{tmp_path / 'out' / 'study.db'}")
    default = study.trials[0]  # the engine's own defaults with the spec's knobs: no knob sampled
    assert default.user_attrs["tag"] == "default" and default.params == {}
    assert default.user_attrs["config"]["knobs"] == {"threads": 2, "ctx_per_slot": 512}
    same = default.user_attrs["gates"]["gates"][0]  # the default is the gate's reference launch
    assert same["passed"] and same["candidate"] == 1.0 and same["num_items"] == 4
    assert len(list((tmp_path / "out" / "cache").glob("greedy_match-*.json"))) == 1  # its answers, kept for the rest
    measured = [t for t in study.trials if t.state.name == "COMPLETE"]
    assert all(0 <= t.user_attrs["gates"]["gates"][0]["candidate"] <= 1 for t in measured)
    assert len(measured) == 3 and all(t.user_attrs["config"]["engine"] == "llama-server" for t in measured)
    best = (tmp_path / "out" / "best.yaml").read_text()
    winner = ServerConfig.model_validate(yaml.safe_load(best))
    assert winner.knobs == {"threads": 2, "ctx_per_slot": 512, **summary["params"]}  # the default may win
    launch = best.splitlines()[1]
    assert launch.startswith("# launch: ") and "--threads 2" in launch
    assert all(f"--parallel {v}" in launch for k, v in summary["params"].items() if k == "parallel")


def test_greedy_match_scores_the_reference_tokens_reproduced_before_the_first_difference():
    from slotune.evals.gate_spec import GateSpec
    from slotune.evals.greedy_match import greedy_match_gate, match_score

    assert match_score([1, 2, 3, 4], [1, 2, 9, 4]) == 0.5
    assert match_score([1, 2], [1, 2, 3]) == 1.0 and match_score([], []) == 1.0 and match_score([], [1]) == 0.0

    class Chars:  # one token per character: the scores are then easy to read
        def encode(self, text):
            return [ord(c) for c in text]

    gate = GateSpec(name="g", kind="greedy_match", min_match=0.8)
    r = greedy_match_gate(gate, ["abcd", "abxx"], ["abcd", "abcd"], Chars())
    assert r.candidate == 0.75 and not r.passed and "1 of 2 identical" in r.reason
    assert greedy_match_gate(gate, ["abcd", "abcd"], ["abcd", "abcd"], Chars()).passed


SLOTUNE_SERVE_ENGINE = """
name: slotune-serve
binary: tune
command: ["{binary}", "serve", "--model", "{model}", "--host", "{host}", "--port", "{port}"]
ready_path: /ready
help: [serve, --help]
knobs:
  max_num_seqs: {flag: --set, format: "max_num_seqs={}", type: int, low: 1}
  quantization: {flag: --set, format: "quantization={}", type: choice, choices: [none, int8, int4]}
gates: [greedy_match]
counters:
  path: /metrics
  fields: {steps: slotune_engine_steps_total, generated_tokens: slotune_generation_tokens_total}
"""


def test_a_second_engine_is_one_data_file(tmp_path):
    """An engine file written here, for slotune's own `tune serve` launched as a command, and nothing
    else: validate checks its flags against `tune serve --help`, and a study tunes it through its API,
    gated by greedy_match against its default launch."""
    (tmp_path / "slotune-serve.yaml").write_text(SLOTUNE_SERVE_ENGINE)
    tune = str(Path(sys.executable).parent / "tune")
    space = {
        "name": "seqs",
        "engine": "slotune-serve.yaml",
        "knobs": [{"name": "max_num_seqs", "type": "categorical", "choices": [1, 4]}],
    }
    gate = {"name": "same", "kind": "greedy_match", "min_match": 0.5, "limit": 2, "max_tokens": 4}
    data = _spec(
        tmp_path,
        server={"engine": "slotune-serve.yaml", "binary": tune},
        search_space=space,
        budget={"n_trials": 2, "trial_timeout_s": 300},
        sampler="random",
        quality_gates=[gate],
        confirm={"candidates": 1, "seeds": 1},
    )
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(data))
    spec = TuningSpec.from_yaml(path)
    assert spec.server.engine == str(tmp_path / "slotune-serve.yaml")  # relative to the spec
    preflight(spec)  # every flag is in `tune serve --help`
    summary = run_command(path, progress=False)
    assert summary is not None and summary["metrics"]["tpot_p95"] > 0
    study = optuna.load_study(study_name="ls", storage=f"sqlite:///{tmp_path / 'out' / 'study.db'}")
    measured = [t for t in study.trials if t.state.name == "COMPLETE"]
    assert len(measured) == 2 and measured[0].params == {}
    assert measured[1].user_attrs["config"]["knobs"]["max_num_seqs"] in (1, 4)
    assert measured[0].user_attrs["gates"]["gates"][0]["candidate"] == 1.0
    assert all(t.user_attrs["metrics"]["server_generated_tokens"] > 0 for t in measured)
    launch = (tmp_path / "out" / "best.yaml").read_text().splitlines()[1]
    assert launch.startswith(f"# launch: {tune} serve --model ")


@pytest.mark.skipif(LLAMA_SERVER is None, reason="needs llama.cpp's llama-server on PATH")
def test_a_draft_gguf_given_in_the_spec_drafts_when_the_study_turns_drafting_on(tmp_path):
    """server.knobs.draft_model, relative to the spec, is checked by validate and passed to every
    launch; the launches whose spec_type is draft-simple draft with it (the model drafting for itself
    here: the one real GGUF with its vocabulary), the default does not."""
    shutil.copy(resolve_model_path("smollm2-135m"), tmp_path / "draft.gguf")
    space = {
        "name": "draft",
        "engine": "llama-server",
        "knobs": [{"name": "spec_type", "type": "categorical", "choices": ["draft-simple"]}],
    }
    data = _spec(tmp_path, search_space=space, budget={"n_trials": 2, "trial_timeout_s": 300})
    data["server"]["knobs"]["draft_model"] = "draft.gguf"
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump({**data, "confirm": {"candidates": 1, "seeds": 1}}))
    (tmp_path / "missing.yaml").write_text(path.read_text().replace("draft.gguf", "nowhere.gguf"))
    with pytest.raises(SpecError, match=r"server.knobs.draft_model: no file at .*nowhere.gguf"):
        preflight(TuningSpec.from_yaml(tmp_path / "missing.yaml"))
    run_command(path, progress=False)
    study = optuna.load_study(study_name="ls", storage=f"sqlite:///{tmp_path / 'out' / 'study.db'}")
    default, drafting = (t.user_attrs["metrics"] for t in study.trials[:2])
    assert study.trials[1].params == {"spec_type": "draft-simple"}
    assert default.get("server_draft_tokens", 0) == 0
    assert drafting["server_accepted_draft_tokens"] > 0.9 * drafting["server_draft_tokens"] > 0
