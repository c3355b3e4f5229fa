"""Hostile and careless specs: every one is refused with a `path: field: message` line (exit 2 from
the CLI, never a traceback), or means the same from any working directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError
from safetensors.numpy import save_file
from slotune.tuner.cli import app
from slotune.tuner.spec.preflight import preflight
from slotune.tuner.spec.tuning_spec import TuningSpec
from slotune.tuner.spec.workload_spec import WorkloadSpec, read_trace
from slotune.tuner.spec.yaml_reader import MAX_YAML_NODES, MissingFileError, SpecError, error_lines, parse_yaml
from typer.testing import CliRunner

BASE = "name: h\nobjective: {kind: latency, metric: ttft}\n"
BASE_DICT = {"name": "h", "objective": {"kind": "latency", "metric": "ttft"}}


def write(path: Path, text: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


def cli(*args: str):
    r = CliRunner().invoke(app, list(args))
    return r.exit_code, r.stdout, r.stderr


def assert_clear_error(code: int, stderr: str, path: Path | str, *needles: str) -> None:
    assert code == 2, stderr
    assert "Traceback" not in stderr
    lines = stderr.splitlines()
    assert lines and all(ln.startswith(str(path)) for ln in lines), stderr  # every line: `path: ...`
    for n in needles:
        assert n in stderr, stderr


def billion_laughs(levels: int = 9) -> str:
    out = ['a0: &a0 ["lol"]'] + [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, levels)]
    return "\n".join(out) + "\n"


# --- 1. the CLI: every bad input is `path: message` lines and exit 2 ---------------------------------
HOSTILE_YAML = {
    "syntax": (BASE + "budget: {n_trials: 3\n", [":4:1: while parsing a flow mapping"]),
    "tabs": ("name: x\nobjective:\n\tkind: latency\n", [":3:1:", "not tabs"]),
    "python-tag": (
        BASE + "sampler: !!python/object/apply:os.system ['echo pwned']\n",
        [":3:10: tag '!!python/object/apply:os.system' is not allowed"],
    ),
    "nul": (BASE.encode() + b"seed: 1\x00\n", [":3: contains a NUL byte"]),
    "non-utf8": (BASE.encode() + b"description: \xff\n", [":3: not UTF-8"]),
    "deep-nesting": (BASE + "engine: " + "[" * 20000 + "]" * 20000 + "\n", ["nested more than 64 levels"]),
    "alias-bomb": (BASE + billion_laughs(), [f"more than {MAX_YAML_NODES} values"]),
    "recursive-alias": (BASE + "engine: &e {kernels: *e}\n", ["recursive alias"]),
    "duplicate-key": (BASE + "sampler: tpe\nsampler: random\n", [":4:1: duplicate key 'sampler' (first on line 3)"]),
    "two-documents": (BASE + "---\nname: y\n", ["expected a single document"]),
    "top-level-list": ("- 1\n", ["must hold a mapping", "got a list"]),
    "empty": ("", ["got an empty file"]),
    "storage-not-a-url": (BASE + "storage: not a url\n", ["storage: 'not a url' is not a database URL"]),
    "storage-unknown-dialect": (BASE + "storage: 'nosuchdb://u@h/db'\n", ["unknown database kind 'nosuchdb'"]),
}


@pytest.mark.parametrize("case", sorted(HOSTILE_YAML))
def test_validate_turns_hostile_yaml_into_path_message_lines(tmp_path, case):
    text, needles = HOSTILE_YAML[case]
    spec = write(tmp_path / "spec.yaml", text)
    code, _, err = cli("validate", str(spec))
    assert_clear_error(code, err, spec, *needles)


def test_validate_a_directory_or_a_missing_file(tmp_path):
    code, _, err = cli("validate", str(tmp_path))
    assert_clear_error(code, err, tmp_path, "is a directory")
    code, _, err = cli("validate", str(tmp_path / "nope.yaml"))
    assert_clear_error(code, err, tmp_path / "nope.yaml", "spec file not found")


def _read_only_dir() -> Path:
    """A folder no one can create files under (root ignores file modes, so not a chmod-ed tmp dir)."""
    for d in (Path("/sys"), Path("/proc")):
        try:
            (d / ".slotune-probe").touch()
        except OSError:
            return d
    pytest.skip("no read-only folder on this machine")


@pytest.mark.parametrize("field", ["storage", "output_dir", "mlflow_tracking_uri"])
def test_validate_refuses_a_store_location_that_cannot_be_written(tmp_path, field):
    ro = _read_only_dir() / "slotune-test"
    value = str(ro / "out") if field == "output_dir" else f"sqlite:///{ro}/study.db"
    spec = write(tmp_path / "spec.yaml", BASE + f"{field}: '{value}'\n")
    code, _, err = cli("validate", str(spec))
    assert_clear_error(code, err, spec, f"{field}: cannot write")
    # a file where a folder must be
    write(tmp_path / "afile", "x")
    spec = write(tmp_path / "spec.yaml", BASE + "output_dir: afile/out\n")
    code, _, err = cli("validate", str(spec))
    assert_clear_error(code, err, spec, "output_dir: cannot create", "is a file")


def test_run_checks_the_spec_before_opening_a_study(tmp_path):
    ro = _read_only_dir() / "slotune-test"
    spec = write(tmp_path / "spec.yaml", BASE + f"storage: 'sqlite:///{ro}/study.db'\n")
    code, _, err = cli("run", str(spec), "--no-progress")
    assert_clear_error(code, err, spec, "storage: cannot write")
    spec = write(tmp_path / "spec.yaml", BASE + "seed: !!python/name:os.system\n")
    code, _, err = cli("run", str(spec), "--no-progress")
    assert_clear_error(code, err, spec, "tag '!!python/name:os.system' is not allowed")


def test_other_commands_read_user_yaml_the_same_way(tmp_path):
    cfg = write(tmp_path / "cfg.yaml", "max_num_seqs: 4\nmax_num_seqs: 8\n")
    for args in (["bench", str(cfg)], ["eval", str(cfg)], ["serve", str(cfg)], ["k8s", "render", str(cfg)]):
        code, _, err = cli(*args)
        assert_clear_error(code, err, cfg, "duplicate key 'max_num_seqs'")
    gates = write(tmp_path / "gates.yaml", "quality_gates: !!python/object:os.system {}\n")
    code, _, err = cli("eval", "--gates", str(gates))
    assert_clear_error(code, err, gates, "is not allowed")


def test_traceback_only_with_debug(tmp_path):
    """The real CLI in a subprocess: one line and exit 2; `--debug` adds the traceback."""
    spec = write(tmp_path / "spec.yaml", BASE + "sampler: !!python/object/apply:os.system ['echo pwned']\n")
    cmd = [sys.executable, "-m", "slotune.tuner.cli_main"]
    plain = subprocess.run([*cmd, "validate", str(spec)], capture_output=True, text=True, timeout=120)
    assert plain.returncode == 2 and "Traceback" not in plain.stderr and "pwned" not in plain.stdout
    assert plain.stderr.startswith(f"{spec}:3:10: tag"), plain.stderr
    debug = subprocess.run([*cmd, "--debug", "validate", str(spec)], capture_output=True, text=True, timeout=120)
    assert debug.returncode == 2 and "Traceback (most recent call last)" in debug.stderr


def test_an_internal_error_is_one_line_and_exit_1(monkeypatch, tmp_path):
    import slotune.tuner.commands as commands

    def boom(_):
        raise ZeroDivisionError("bug")

    monkeypatch.setattr(commands, "validate_command", boom)
    code, _, err = cli("validate", str(tmp_path / "x.yaml"))
    assert code == 1 and "Traceback" not in err and "internal error: ZeroDivisionError" in err and "--debug" in err


# --- 2. one YAML reader: aliases bounded, duplicate keys named -----------------------------------------
def test_yaml_reader_bounds_aliases_and_names_duplicate_keys():
    with pytest.raises(SpecError, match="more than 100000 values"):
        parse_yaml(billion_laughs(), "f.yaml")
    assert parse_yaml("a: &x [1, 2]\nb: *x\n") == {"a": [1, 2], "b": [1, 2]}  # a few aliases are fine
    with pytest.raises(SpecError) as exc:
        parse_yaml("objective:\n  kind: latency\n  kind: throughput\n", "s.yaml")
    assert str(exc.value) == "s.yaml:3:3: duplicate key 'kind' (first on line 2); keep one"
    # merge keys override without being duplicates
    assert parse_yaml("b: &b {x: 1, y: 2}\nd: {<<: *b, y: 3}\n")["d"] == {"x": 1, "y": 3}


def test_workload_and_space_files_use_the_same_reader(tmp_path):
    write(tmp_path / "wl.yaml", "name: w\nnum_requests: 2\nnum_requests: 3\n")
    write(tmp_path / "sp.yaml", "knobs: &k [{name: max_num_seqs, type: int, low: 1, high: 2}]\nforbidden: !!set {}\n")
    with pytest.raises(ValidationError, match=r"wl.yaml:3:1: duplicate key 'num_requests'"):
        TuningSpec.from_yaml(write(tmp_path / "s1.yaml", BASE + "workload: wl.yaml\n"))
    with pytest.raises(ValidationError, match=r"sp.yaml:2:12: tag '!!set' is not allowed"):
        TuningSpec.from_yaml(write(tmp_path / "s2.yaml", BASE + "search_space: sp.yaml\n"))
    with pytest.raises(SpecError, match="duplicate key"):
        WorkloadSpec.load(tmp_path / "wl.yaml")


# --- 3. relative paths resolve against the spec's folder ------------------------------------------
def _project(tmp_path: Path) -> Path:
    d = tmp_path / "project"
    write(d / "spaces" / "s.yaml", "knobs:\n  - {name: max_num_seqs, type: int, low: 1, high: 2}\n")
    write(d / "wl" / "w.yaml", "name: w\ntrace: t.jsonl\nnum_requests: 2\nwarmup_requests: 0\n")
    write(d / "wl" / "t.jsonl", '{"prompt_len": 8, "output_len": 4}\n')
    write(d / "data" / "inline.jsonl", '{"prompt_len": 5, "output_len": 2}\n')
    return d


def test_every_relative_path_resolves_against_the_spec_folder(tmp_path, monkeypatch):
    d = _project(tmp_path)
    write(d / "models" / "tiny" / "config.json", "{}")
    spec_path = write(
        d / "spec.yaml",
        BASE + "model: models/tiny\nsearch_space: spaces/s.yaml\nworkload: wl/w.yaml\n"
        "output_dir: out\nstorage: sqlite:///out/study.db\nmlflow_tracking_uri: sqlite:///out/ml.db\n"
        "sampler: grid\n",
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    spec = TuningSpec.from_yaml(os.path.relpath(spec_path))
    assert spec.model == str(d / "models" / "tiny")
    assert spec.output_dir == str(d / "out")
    assert spec.storage == f"sqlite:///{d / 'out' / 'study.db'}"
    assert spec.mlflow_tracking_uri == f"sqlite:///{d / 'out' / 'ml.db'}"
    assert spec.search_space.grid() == {"max_num_seqs": [1, 2]}
    assert spec.workload.trace == str(d / "wl" / "t.jsonl")
    from slotune.tuner.search.study import make_sampler

    assert type(make_sampler(spec)).__name__ == "GridSampler"  # sampler: grid from another directory
    inline = TuningSpec.from_yaml(write(d / "inline.yaml", BASE + "workload: {trace: data/inline.jsonl}\n"))
    assert inline.workload.trace == str(d / "data" / "inline.jsonl")
    # built-in names stay names, absolute paths stay absolute
    named = TuningSpec.from_yaml(write(d / "named.yaml", BASE + f"workload: chat-small\noutput_dir: {tmp_path}/abs\n"))
    assert (
        named.workload.name == "chat-small" and named.model == "smollm2-135m" and named.output_dir == f"{tmp_path}/abs"
    )


def test_validate_cli_from_another_directory(tmp_path, monkeypatch):
    d = _project(tmp_path)
    write(d / "spec.yaml", BASE + "search_space: spaces/s.yaml\nworkload: wl/w.yaml\nsampler: grid\noutput_dir: out\n")
    monkeypatch.chdir(tmp_path)
    code, out, err = cli("validate", "project/spec.yaml")
    assert code == 0, err
    assert "workload: w (closed_loop, 2 requests)" in out and "sampler: grid" in out


def test_relative_references_that_do_not_exist_name_the_resolved_path(tmp_path):
    with pytest.raises(ValidationError, match=r"workload\n.*/sub/none.yaml: workload file not found"):
        TuningSpec.from_yaml(write(tmp_path / "sub" / "s.yaml", BASE + "workload: none.yaml\n"))
    with pytest.raises(ValidationError, match=r"search_space\n.*/sub/none.yaml: search space file not found"):
        TuningSpec.from_yaml(write(tmp_path / "sub" / "s.yaml", BASE + "search_space: none.yaml\n"))
    with pytest.raises(ValidationError, match="not a file next to the spec, and not a built-in"):
        TuningSpec.from_yaml(write(tmp_path / "sub" / "s.yaml", BASE + "workload: chat-smal\n"))


# --- 4. engine.model ------------------------------------------------------------------------------------
def test_engine_model_is_refused_not_replaced():
    with pytest.raises(ValidationError, match=r"engine.model: the model is the top-level `model:` field"):
        TuningSpec.model_validate({**BASE_DICT, "engine": {"model": "/models/other.gguf"}})
    spec = TuningSpec.model_validate({**BASE_DICT, "model": "/m/x.gguf", "engine": {"max_num_seqs": 4}})
    assert spec.base_config().model == "/m/x.gguf"  # the top-level field is the model


# --- 6. numbers, seeds, gates, files -------------------------------------------------------------------
NON_FINITE = [
    ("objective", {"kind": "latency", "metric": "ttft", "ttft_limit_s": float("nan")}, "objective.ttft_limit_s"),
    (
        "objective",
        {"kind": "throughput", "metric": "goodput_rps", "tpot_limit_s": float("inf")},
        "objective.tpot_limit_s",
    ),
    (
        "objective",
        {"kind": "latency", "metric": "ttft", "min_output_tokens_per_s": float("inf")},
        "objective.min_output_tokens_per_s",
    ),
    ("budget", {"trial_timeout_s": float("inf")}, "budget.trial_timeout_s"),
    ("budget", {"timeout_s": float("nan")}, "budget.timeout_s"),
    ("budget", {"trial_memory_gb": float("inf")}, "budget.trial_memory_gb"),
    ("early_stop", {"factor": float("inf")}, "early_stop.factor"),
    ("workload", {"arrivals": "poisson", "rate": float("inf")}, "workload"),
    ("workload", {"duration_s": float("nan")}, "workload"),
    ("engine", {"kv_cache_memory_gb": float("inf")}, "engine"),
    ("engine", {"kv_cache_memory_gb": float("nan")}, "engine"),
]


@pytest.mark.parametrize("field,value,where", NON_FINITE, ids=[f"{w}-{i}" for i, (_, _, w) in enumerate(NON_FINITE)])
def test_nan_and_inf_are_refused_everywhere(field, value, where):
    with pytest.raises(ValidationError) as exc:
        TuningSpec.model_validate({**BASE_DICT, field: value})
    lines = error_lines(exc.value, "s.yaml")
    assert any(ln.startswith(f"s.yaml: {where}") and ("finite" in ln or "NaN" in ln) for ln in lines), lines


def test_nan_in_yaml_reaches_the_field_message(tmp_path):
    spec = write(tmp_path / "s.yaml", "name: x\nobjective: {kind: latency, metric: tpot, ttft_limit_s: .nan}\n")
    code, _, err = cli("validate", str(spec))
    assert_clear_error(code, err, spec, "objective.ttft_limit_s: must be a finite number")


@pytest.mark.parametrize(
    "field,value",
    [("seed", -1), ("seed", 2**32), ("seed", 10**30), ("robustness_seed", -5), ("robustness_seed", 2**40)],
)
def test_seeds_are_bounded(field, value):
    with pytest.raises(ValidationError, match=field):
        TuningSpec.model_validate({**BASE_DICT, field: value})
    with pytest.raises(ValidationError, match="seed"):
        WorkloadSpec(seed=value)
    assert TuningSpec.model_validate({**BASE_DICT, field: 2**32 - 1})


def test_gate_metrics_must_exist_and_gate_names_be_unique():
    gate = {"name": "g", "kind": "lm_eval", "task": "slotune_arithmetic_1digit", "max_abs_drop": 0.1}
    assert TuningSpec.model_validate({**BASE_DICT, "quality_gates": [{**gate, "metric": "acc_norm"}]})
    with pytest.raises(
        ValidationError,
        match=r"metric 'accuracy' is not reported by task 'slotune_arithmetic_1digit' "
        r"\(its metrics: acc, acc_norm\)",
    ):
        TuningSpec.model_validate({**BASE_DICT, "quality_gates": [{**gate, "metric": "accuracy"}]})
    with pytest.raises(ValidationError, match="metric 'acc' is not reported by task 'slotune_kjv_perplexity'"):
        TuningSpec.model_validate(
            {**BASE_DICT, "quality_gates": [{"name": "p", "kind": "perplexity", "metric": "acc", "max_rel_drop": 0.1}]}
        )
    agree = {"name": "a", "kind": "agreement", "min_top1": 0.9}
    with pytest.raises(ValidationError, match=r"\[1\]: gate name 'a' used twice"):
        TuningSpec.model_validate({**BASE_DICT, "quality_gates": [agree, {**agree, "max_mean_kl": 0.1}]})


def test_pareto_with_is_refused_twice_or_equal_to_the_metric():
    obj = {"kind": "latency", "metric": "ttft"}
    with pytest.raises(ValidationError, match="'output_tokens_per_s' listed twice"):
        TuningSpec.model_validate({**BASE_DICT, "objective": {**obj, "pareto_with": ["output_tokens_per_s"] * 2}})
    with pytest.raises(ValidationError, match="'ttft' is already the objective's metric"):
        TuningSpec.model_validate({**BASE_DICT, "objective": {**obj, "pareto_with": ["ttft"]}})


def test_missing_trace_is_refused_at_load(tmp_path):
    with pytest.raises(ValidationError, match=r"workload.trace: trace file not found: .*/nope.jsonl"):
        TuningSpec.from_yaml(write(tmp_path / "s.yaml", BASE + "workload: {trace: nope.jsonl}\n"))
    write(tmp_path / "w.yaml", "trace: gone.jsonl\n")
    with pytest.raises(MissingFileError, match=r"w.yaml: trace: trace file not found: .*/gone.jsonl"):
        WorkloadSpec.load(tmp_path / "w.yaml")


def test_trace_rows_are_checked_by_validate(tmp_path):
    write(tmp_path / "t.jsonl", '{"prompt_len": 8, "output_len": 4}\n{"prompt_len": -3, "output_len": 4}\n')
    spec = write(tmp_path / "s.yaml", BASE + "workload: {trace: t.jsonl}\n")
    code, _, err = cli("validate", str(spec))
    assert_clear_error(code, err, spec, f"workload.trace: {tmp_path / 't.jsonl'}:2: prompt_len must be a whole number")
    write(tmp_path / "t.jsonl", '{"prompt_len": 8, "output_len": 4}\nnot json\n')
    with pytest.raises(SpecError, match=r"t.jsonl:2: not a JSON object"):
        read_trace(tmp_path / "t.jsonl")


def test_missing_model_and_draft_are_refused_by_validate(tmp_path):
    spec = write(tmp_path / "s.yaml", BASE + "model: ./no-such-model\n")
    code, _, err = cli("validate", str(spec))
    assert_clear_error(code, err, spec, f"model: model '{tmp_path / 'no-such-model'}': not a bundled name")
    spec = write(tmp_path / "s.yaml", BASE + "engine: {speculative: {method: model, draft_model: ./draft}}\n")
    code, _, err = cli("validate", str(spec))
    assert_clear_error(code, err, spec, f"engine.speculative.draft_model: model '{tmp_path / 'draft'}'")


def test_max_model_len_beyond_the_model_context(tmp_path):
    # the bundled GGUF: llama.context_length 8192, read from the header only
    spec = TuningSpec.model_validate({**BASE_DICT, "engine": {"max_model_len": 10000, "max_num_batched_tokens": 10000}})
    with pytest.raises(
        SpecError,
        match=r"engine.max_model_len: max_model_len 10000, beyond the model's context of 8192 "
        r"tokens \(SmolLM2-135M-Instruct.Q4_1.gguf: llama.context_length\)",
    ):
        preflight(spec)
    preflight(TuningSpec.model_validate({**BASE_DICT, "engine": {"max_model_len": 8192}}))
    # an HF checkpoint dir: config.json's max_position_embeddings; a knob that can sample past it
    llama = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}
    write(
        tmp_path / "m" / "config.json",
        json.dumps({**llama, "num_attention_heads": 4, "vocab_size": 256, "max_position_embeddings": 1024}),
    )
    save_file({"model.embed_tokens.weight": np.zeros((256, 64), np.float32)}, str(tmp_path / "m" / "model.safetensors"))
    write(tmp_path / "m" / "tokenizer.json", "{}")  # the check reads only that it is there
    space = {"knobs": [{"name": "max_model_len", "type": "categorical", "choices": [512, 4096]}]}
    spec = TuningSpec.model_validate(
        {
            **BASE_DICT,
            "model": str(tmp_path / "m"),
            "engine": {"max_model_len": 512},
            "search_space": space,
            "output_dir": str(tmp_path / "out"),
        }
    )
    with pytest.raises(
        SpecError,
        match=r"search_space: knob 'max_model_len' can sample 4096, beyond the model's "
        r"context of 1024",
    ):
        preflight(spec)


def test_example_and_builtin_specs_pass_preflight(tmp_path, monkeypatch):
    """examples/05-own-model is left out: its `model: ./my-model` is a placeholder the README replaces."""
    root = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(tmp_path)  # default output dirs (runs/<name>) are probed for writing here
    for path in [
        *sorted((root / "examples").glob("0[1-4]*/spec.yaml")),
        root / "slotune" / "tuner" / "specs" / "quickstart.yaml",
    ]:
        preflight(TuningSpec.from_yaml(path))


def test_run_passes_force_new_and_resume_anyway(tmp_path, monkeypatch):
    """The flags StudySpecChanged's message names exist on `tune run` (the study itself is study.py's tests)."""
    import slotune.tuner.run as run

    seen = {}
    monkeypatch.setattr(run, "run_command", lambda spec, **kw: seen.update(kw))
    spec = write(tmp_path / "spec.yaml", BASE + f"output_dir: {tmp_path / 'out'}\n")
    code, _, err = cli("run", str(spec), "--force-new", "--resume-anyway", "--no-progress")
    assert code == 0, err
    assert seen["force_new"] and seen["resume_anyway"] and seen["progress"] is False
