"""`tune`: the command-line entry point.

Only this layer turns errors into exit codes and prints `field: message` lines. Every
heavy import (torch, mlflow, lm_eval, optuna) happens inside a command, so `tune --help`
stays fast.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal, Optional

import typer

app = typer.Typer(
    name="tune",
    help="slotune: tune LLM serving configs against a workload SLO, then serve and roll them out.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
k8s_app = typer.Typer(help="Kubernetes helpers.", no_args_is_help=True)
app.add_typer(k8s_app, name="k8s")


def _fail(exc: BaseException) -> None:
    """Print a user-facing error (one line per pydantic problem) and exit 2."""
    from rich.console import Console

    from slotune.tuner.errors import format_error

    Console(stderr=True).print(f"[red]error:[/red] {format_error(exc)}", highlight=False)
    raise typer.Exit(2)


_USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, FileNotFoundError, KeyError)


@app.command()
def bench(
    config: Annotated[Optional[Path], typer.Argument(help="EngineConfig YAML (or a tuner best.yaml); default config if omitted")] = None,
    workload: Annotated[Optional[Path], typer.Option("--workload", "-w", help="workload YAML; default: built-in 'chat-small'")] = None,
    json_out: Annotated[Optional[Path], typer.Option("--json", help="write the full result as JSON here")] = None,
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="override a config field: --set max_num_seqs=8")] = None,
    seed: Annotated[Optional[int], typer.Option(help="override the workload seed")] = None,
    url: Annotated[Optional[str], typer.Option("--url", help="measure this OpenAI-compatible server (http://host:port) "
                                                             "instead of building an engine")] = None,
    api_key: Annotated[Optional[str], typer.Option("--api-key", envvar="SLOTUNE_API_KEY",
                                                   help="with --url: send 'Authorization: Bearer KEY'")] = None,
    model: Annotated[Optional[str], typer.Option("--model", help="with --url: model id to request; "
                                                                  "default: the first of GET /v1/models")] = None,
    api: Annotated[Optional[Literal["completions", "chat"]], typer.Option(
        "--api", help="with --url: completions (token-id prompts, exact lengths) or chat (text as a user message); "
                      "default: completions")] = None,
    tokenizer: Annotated[Optional[str], typer.Option("--tokenizer", help="with --url: model whose tokenizer makes the "
                                                                          "prompts ('smollm2-135m', a .gguf, an HF dir); "
                                                                          "default: CONFIG's model")] = None,
) -> None:
    """Replay a workload against the engine (or a server, --url) and report TTFT/TPOT/ITL/e2e, tokens/s, goodput."""
    try:
        from slotune.tuner.bench import bench_command
    except ImportError as exc:  # pragma: no cover - install problem
        _fail(exc)
    try:
        bench_command(config=config, workload=workload, json_out=json_out, overrides=set_ or [], seed=seed, url=url,
                      api_key=api_key, model=model, api=api, tokenizer=tokenizer)
    except _USER_ERRORS as exc:
        _fail(exc)


@app.command()
def validate(spec: Annotated[Path, typer.Argument(help="tuning spec YAML")]) -> None:
    """Check a tuning spec and print what it resolves to."""
    from slotune.tuner.spec import validate_command

    try:
        validate_command(spec)
    except _USER_ERRORS as exc:
        _fail(exc)


@app.command()
def run(
    spec: Annotated[Optional[Path], typer.Argument(help="tuning spec YAML; default: the built-in quickstart spec")] = None,
    n_trials: Annotated[Optional[int], typer.Option("--n-trials", help="override budget.n_trials")] = None,
    storage: Annotated[Optional[str], typer.Option(envvar="SLOTUNE_STORAGE", help="Optuna storage URL override")] = None,
    output_dir: Annotated[Optional[Path], typer.Option("--output-dir", "-o", help="override output_dir")] = None,
    worker: Annotated[bool, typer.Option("--worker", help="join an existing study as an extra worker (no report)")] = False,
    no_progress: Annotated[bool, typer.Option("--no-progress", help="plain log lines instead of a live display")] = False,
) -> None:
    """Run (or resume) the tuning study of SPEC and write best.yaml and the report."""
    from slotune.tuner.study import run_command

    try:
        run_command(spec, n_trials=n_trials, storage=storage, output_dir=output_dir, worker=worker, progress=not no_progress)
    except _USER_ERRORS as exc:
        _fail(exc)


@app.command("eval")
def eval_(
    config: Annotated[Optional[Path], typer.Argument(help="EngineConfig YAML; default config if omitted")] = None,
    gates: Annotated[Optional[Path], typer.Option("--gates", help="gates YAML (list of gates); default: built-in gates")] = None,
    json_out: Annotated[Optional[Path], typer.Option("--json", help="write results as JSON here")] = None,
) -> None:
    """Run the quality gates for CONFIG against the unquantized baseline."""
    from slotune.evals.gates import eval_command

    try:
        eval_command(config=config, gates=gates, json_out=json_out)
    except _USER_ERRORS as exc:
        _fail(exc)


@app.command()
def serve(
    config: Annotated[Optional[Path], typer.Argument(help="EngineConfig YAML (or best.yaml); default config if omitted")] = None,
    host: Annotated[str, typer.Option(envvar="SLOTUNE_HOST")] = "127.0.0.1",
    port: Annotated[int, typer.Option(envvar="SLOTUNE_PORT")] = 8000,
    api_key: Annotated[Optional[str], typer.Option(envvar="SLOTUNE_API_KEY", help="require 'Authorization: Bearer KEY'")] = None,
    served_model_name: Annotated[Optional[str], typer.Option(help="model id reported by /v1/models")] = None,
) -> None:
    """Serve CONFIG over an OpenAI-compatible HTTP API."""
    from slotune.engine.server import serve_command

    try:
        serve_command(config=config, host=host, port=port, api_key=api_key, served_model_name=served_model_name)
    except _USER_ERRORS as exc:
        _fail(exc)


@k8s_app.command("render")
def k8s_render(
    spec: Annotated[Path, typer.Argument(help="tuning spec YAML")],
    name: Annotated[Optional[str], typer.Option(help="resource name; default from the spec file name")] = None,
    namespace: Annotated[str, typer.Option()] = "default",
) -> None:
    """Print the SLOTuning custom resource for SPEC."""
    from slotune.operator.render import render_command

    try:
        render_command(spec, name=name, namespace=namespace)
    except _USER_ERRORS as exc:
        _fail(exc)


def main() -> None:  # pragma: no cover
    app()
