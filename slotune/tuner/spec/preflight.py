"""Checks that need the file system or the model, run before a study: the model and its context length,
the trace rows, and that output and storage locations can be written."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from slotune.engine.checkpoint import ModelConfig, check_model, context_problem
from slotune.engine.config import EngineConfig
from slotune.engine.gguf_header import read_gguf_header
from slotune.engine.paths import resolve_model_path
from slotune.tuner.spec.server import ServerConfig
from slotune.tuner.spec.trace_reader import load_trace
from slotune.tuner.spec.tuning_spec import TuningSpec
from slotune.tuner.spec.workload_spec import (
    read_trace,
)
from slotune.tuner.spec.yaml_reader import Problem, SpecError


def preflight(spec: TuningSpec) -> None:
    """Checks a spec needs before a study runs, beyond its own text: the model (and draft) can be found
    and the bundled engine implements it (an external server's binary knows its flags instead),
    max_model_len fits the model's context, the trace rows are well formed, and the output and storage
    locations can be written. Reads model metadata only (no weights).

    Raises:
        SpecError with one problem per failed check.
    """
    problems: list[Problem] = []

    def run(field: str, check, *args) -> None:
        try:
            check(*args)
        except (SpecError, ValueError, OSError) as exc:
            msgs = [str(p) for p in exc.problems] if isinstance(exc, SpecError) else [str(exc)]
            problems.extend(Problem(m, field=field) for m in msgs)

    run("output_dir", _check_writable_dir, spec.resolved_output_dir())
    for field, url in (("storage", spec.resolved_storage()), ("mlflow_tracking_uri", spec.resolved_tracking_uri())):
        if url.startswith("sqlite:///") and url != "sqlite:///:memory:":
            run(field, _check_writable_file, Path(url[len("sqlite:///") :]))
    wl = spec.workload
    if wl.trace_source is not None:
        run("workload.trace", load_trace, wl.trace_source)
    elif wl.trace:
        run("workload.trace", read_trace, wl.trace)
    base = spec.base_config()
    if isinstance(base, ServerConfig):
        run("model", _model_context, base.model)
        for i, m in enumerate(spec.server.models if spec.server else []):
            run(f"server.models[{i}]", _model_context, m)
        launches = list(spec.search_base().launches.values()) if spec.servers else [base]
        for i, launch in enumerate(launches):
            where = f"servers[{i}]" if spec.servers else "server"
            problems += _check_server(launch, where)
            problems += _check_slot_context(spec, launch, where)
            for name, value in launch.knobs.items():
                if launch.description().knobs[name].type == "path":
                    run(f"{where}.knobs.{name}", _require_file, Path(str(value)))
    else:
        try:
            problems += _check_context(spec, base, check_model(base.model), _model_context(base.model)[1])
        except (SpecError, ValueError, OSError) as exc:
            problems.append(Problem(str(exc), field="model"))
        if base.speculative.method == "model":
            run("engine.speculative.draft_model", check_model, base.speculative.draft_model)
            run("engine.speculative.draft_model", _model_context, base.speculative.draft_model)
    if problems:
        raise SpecError(problems=problems)


def _first_existing(path: Path) -> Path:
    p = path.absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def _check_writable_dir(path: Path) -> None:
    anc = _first_existing(path)
    if not anc.is_dir():
        raise ValueError(f"cannot create {path}: {anc} is a file")
    try:
        fd, probe = tempfile.mkstemp(dir=anc, prefix=".slotune-probe-")
    except OSError as exc:
        raise ValueError(f"cannot write {path}: {anc} is not writable ({exc.strerror or exc})") from None
    os.close(fd)
    os.unlink(probe)


def _check_writable_file(path: Path) -> None:
    if path.is_dir():
        raise ValueError(f"{path} is a directory, not a database file")
    if path.exists():
        try:
            with path.open("ab"):
                pass
        except OSError as exc:
            raise ValueError(f"cannot write {path} ({exc.strerror or exc})") from None
        return
    _check_writable_dir(path.parent)


def _check_context(spec: TuningSpec, base: EngineConfig, model: ModelConfig, source: str) -> list[Problem]:
    """max_model_len (the engine's, and every value the space can sample) runs on the model: within
    its context, and within what its RoPE scaling computes exactly."""
    lens = {"engine.max_model_len": [base.max_model_len]}
    for k in spec.search_space.knobs:
        if k.name == "max_model_len":
            lens["search_space"] = list(k.choices) if k.type == "categorical" else [int(k.high)]
    problems = []
    for field, values in lens.items():
        for n in sorted({v for v in values if isinstance(v, int) and not isinstance(v, bool)}, reverse=True):
            if problem := context_problem(model, n, f" ({source})"):
                if field == "search_space":
                    head = "max_model_len "
                    knob = "knob 'max_model_len' can sample "
                    problem = knob + problem[len(head) :] if problem.startswith(head) else f"{knob}{n}: {problem}"
                problems.append(Problem(problem, field=field))
                break
    return problems


def _check_server(server: ServerConfig, where: str) -> list[Problem]:
    """The server's binary exists, and its own `--help` lists every flag and choice the engine file uses."""
    engine = server.description()
    binary = server.resolved_binary()
    if binary is None:
        place = "on PATH" if "/" not in (server.binary or engine.binary) else "there"
        return [
            Problem(
                f"`{server.binary or engine.binary}` is not {place}; install {engine.name} or set {where}.binary "
                "to its path",
                field=f"{where}.binary",
            )
        ]
    try:
        env = {**os.environ, "COLUMNS": "200"}  # rich (typer) cuts long flags to the terminal's width
        out = subprocess.run([binary, *engine.help], capture_output=True, text=True, timeout=60, env=env)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return [Problem(f"`{binary} {' '.join(engine.help)}` did not run: {exc}", field=f"{where}.binary")]
    return [Problem(p, field=f"{where}.engine") for p in engine.help_problems(out.stdout + out.stderr)]


def _check_slot_context(spec: TuningSpec, server: ServerConfig, where: str) -> list[Problem]:
    """Each server slot holds the workload's longest request (its prompt and output lengths' bounds)."""
    knob = server.description().slot_context
    ctx = server.knobs.get(knob) if knob else None
    longest = spec.workload.longest_request()
    if not isinstance(ctx, int) or longest is None or longest <= ctx:
        return []
    return [
        Problem(
            f"{knob} {ctx}: the workload's requests reach {longest} tokens (longest prompt and output); "
            f"raise it to at least {longest}",
            field=f"{where}.knobs",
        )
    ]


def _require_file(path: Path) -> None:
    if not path.is_file():
        raise FileNotFoundError(f"no file at {path}")


def _model_context(model: str) -> tuple[int | None, str]:
    """The model's context length from its metadata (GGUF `<arch>.context_length`, HF config.json
    `max_position_embeddings`), without loading weights. Raises FileNotFoundError if the model is absent."""
    path = resolve_model_path(model)
    if path.is_dir():
        cfg = _load_json(path / "config.json")
        n = cfg.get("max_position_embeddings") if isinstance(cfg, dict) else None
        return (n if isinstance(n, int) else None), f"{path / 'config.json'}: max_position_embeddings"
    meta = read_gguf_header(path, ("general.architecture",))
    key = f"{meta.get('general.architecture')}.context_length"
    n = read_gguf_header(path, (key,)).get(key)
    return (n if isinstance(n, int) else None), f"{path.name}: {key}"


def _load_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise SpecError(f"cannot read: {exc}", source=path) from None
