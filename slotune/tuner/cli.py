"""`tune`: the command-line entry point.

Only this layer turns errors into exit codes: a problem with the user's input is one `path: field:
message` line on stderr and exit code 2; an unexpected error is one line and exit code 1 (the
traceback with `tune --debug` or SLOTUNE_DEBUG=1). Each command imports its own module when it runs,
marked `# per command`, so `tune --help` loads no torch, mlflow, lm_eval or optuna (docs/design/tuner-cli.md).
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Literal, Optional

import click
import typer
import yaml
from slotune.tuner.spec.yaml_reader import error_lines, load_yaml

app = typer.Typer(
    name="tune",
    help="slotune: tune LLM serving configs against a workload SLO, then serve and roll them out.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
k8s_app = typer.Typer(help="Kubernetes helpers.", no_args_is_help=True)
app.add_typer(k8s_app, name="k8s")
workload_app = typer.Typer(help="Workloads: fit one to the traffic you serve.", no_args_is_help=True)
app.add_typer(workload_app, name="workload")


# Problems with what the user gave (files, values, the environment): exit 2. ValueError covers
# pydantic's ValidationError and SpecError; OSError unreadable or unwritable paths.
_USER_ERRORS = (ValueError, OSError, KeyError, yaml.YAMLError, RecursionError, ImportError)
_options = {"debug": False}


@app.callback()
def _main(
    debug: Annotated[
        bool, typer.Option("--debug", envvar="SLOTUNE_DEBUG", help="print the traceback of an error")
    ] = False,
) -> None:
    _options["debug"] = debug


def _fail(exc: BaseException, source: Path | str | None = None) -> None:
    """Print `exc` as `path: field: message` lines on stderr and exit: 2 for a user error, 1 otherwise."""
    if _options["debug"]:
        traceback.print_exception(exc, file=sys.stderr)
    lines = error_lines(exc, source)
    is_user = isinstance(exc, _USER_ERRORS)
    if not is_user:
        lines[0] = f"{lines[0]} (internal error: {type(exc).__name__}; `tune --debug ...` prints the traceback)"
    for line in lines:
        typer.echo(line, err=True)
    raise typer.Exit(2 if is_user else 1)


@contextmanager
def _reading(source: Path | str | None) -> Iterator[None]:
    """Run a command's body; any error becomes `_fail` lines (problems without a file name `source`)."""
    try:
        yield
    except (click.exceptions.Exit, click.exceptions.Abort, click.ClickException, KeyboardInterrupt):
        raise
    except Exception as exc:  # noqa: BLE001 - the CLI is where every error becomes an exit code
        _fail(exc, source)


@app.command()
def bench(
    config: Annotated[
        Optional[Path], typer.Argument(help="EngineConfig YAML (or a tuner best.yaml); default config if omitted")
    ] = None,
    workload: Annotated[
        Optional[Path], typer.Option("--workload", "-w", help="workload YAML; default: built-in 'chat-small'")
    ] = None,
    json_out: Annotated[Optional[Path], typer.Option("--json", help="write the full result as JSON here")] = None,
    set_: Annotated[
        Optional[list[str]], typer.Option("--set", help="override a config field: --set max_num_seqs=8")
    ] = None,
    seed: Annotated[Optional[int], typer.Option(help="override the workload seed")] = None,
    url: Annotated[
        Optional[str],
        typer.Option(
            "--url", help="measure this OpenAI-compatible server (http://host:port) instead of building an engine"
        ),
    ] = None,
    api_key: Annotated[
        Optional[str],
        typer.Option("--api-key", envvar="SLOTUNE_API_KEY", help="with --url: send 'Authorization: Bearer KEY'"),
    ] = None,
    model: Annotated[
        Optional[str],
        typer.Option("--model", help="with --url: model id to request; default: the first of GET /v1/models"),
    ] = None,
    api: Annotated[
        Optional[Literal["completions", "chat"]],
        typer.Option(
            "--api",
            help="with --url: completions (token-id prompts, exact lengths) or chat (text as a user message); "
            "default: completions",
        ),
    ] = None,
    tokenizer: Annotated[
        Optional[str],
        typer.Option(
            "--tokenizer",
            help="with --url: model whose tokenizer makes the "
            "prompts ('smollm2-135m', a .gguf, an HF dir); "
            "default: CONFIG's model",
        ),
    ] = None,
    usd_per_hour: Annotated[
        Optional[float],
        typer.Option(
            "--usd-per-hour",
            help="price of the measured replica per hour (USD): also report $ per 1M output and total tokens",
        ),
    ] = None,
) -> None:
    """Replay a workload against the engine (or a server, --url) and report TTFT/TPOT/ITL/e2e, tokens/s, goodput."""
    with _reading(config):
        _check_yaml(config)  # a workload file is read by WorkloadSpec.load, which uses the same reader
        from slotune.tuner.commands import bench_command  # per command

        bench_command(
            config=config,
            workload=workload,
            json_out=json_out,
            overrides=set_ or [],
            seed=seed,
            url=url,
            api_key=api_key,
            model=model,
            api=api,
            tokenizer=tokenizer,
            usd_per_hour=usd_per_hour,
        )


@app.command()
def validate(spec: Annotated[Path, typer.Argument(help="tuning spec YAML")]) -> None:
    """Check a tuning spec and print what it resolves to."""
    with _reading(spec):
        from slotune.tuner.commands import validate_command  # per command

        validate_command(spec)


@app.command()
def run(
    spec: Annotated[
        Optional[Path], typer.Argument(help="tuning spec YAML; default: the built-in quickstart spec")
    ] = None,
    n_trials: Annotated[Optional[int], typer.Option("--n-trials", help="override budget.n_trials")] = None,
    storage: Annotated[
        Optional[str], typer.Option(envvar="SLOTUNE_STORAGE", help="Optuna storage URL override")
    ] = None,
    output_dir: Annotated[Optional[Path], typer.Option("--output-dir", "-o", help="override output_dir")] = None,
    worker: Annotated[
        bool, typer.Option("--worker", help="join an existing study as an extra worker (no report)")
    ] = False,
    no_progress: Annotated[
        bool, typer.Option("--no-progress", help="plain log lines instead of a live display")
    ] = False,
    force_new: Annotated[
        bool,
        typer.Option(
            "--force-new", help="start a fresh study under the spec's name (an existing one is kept under another name)"
        ),
    ] = False,
    resume_anyway: Annotated[
        bool, typer.Option("--resume-anyway", help="continue a stored study although its spec changed")
    ] = False,
    no_tracking: Annotated[
        bool,
        typer.Option("--no-tracking", help="no MLflow: the study database and the report still hold every trial"),
    ] = False,
    trial_runner: Annotated[
        Optional[str],
        typer.Option(
            "--trial-runner",
            hidden=True,
            help="the trial process (a .py file or a module) instead of slotune's: "
            "tests of study mechanics pass a stand-in measurement",
        ),
    ] = None,
) -> None:
    """Run (or resume) the tuning study of SPEC and write best.yaml and the report."""
    with _reading(spec):
        from slotune.tuner.spec.preflight import preflight  # per command
        from slotune.tuner.spec.tuning_spec import TuningSpec, default_spec_path

        # Every check `tune validate` makes, before a study is opened or a trial is spent.
        checked = TuningSpec.from_yaml(spec if spec is not None else default_spec_path())
        if output_dir is not None:
            checked.output_dir = str(output_dir)
        if storage:
            checked.storage = storage
        preflight(checked)
        from slotune.tuner.measure.trial_process import trial_runner_command  # per command
        from slotune.tuner.run import run_command  # per command

        run_command(
            spec,
            n_trials=n_trials,
            storage=storage,
            output_dir=output_dir,
            worker=worker,
            progress=not no_progress,
            force_new=force_new,
            resume_anyway=resume_anyway,
            trial_runner=trial_runner_command(trial_runner),
            tracking=not no_tracking,
        )


@app.command("eval")
def eval_(
    config: Annotated[Optional[Path], typer.Argument(help="EngineConfig YAML; default config if omitted")] = None,
    gates: Annotated[
        Optional[Path], typer.Option("--gates", help="gates YAML (list of gates); default: built-in gates")
    ] = None,
    json_out: Annotated[Optional[Path], typer.Option("--json", help="write results as JSON here")] = None,
) -> None:
    """Run the quality gates for CONFIG against the unquantized baseline."""
    with _reading(config):
        _check_yaml(config)  # a gates file is read by load_gates, which uses the same reader
        from slotune.evals.gates import eval_command  # per command

        eval_command(config=config, gates=gates, json_out=json_out)


@app.command()
def serve(
    config: Annotated[
        Optional[Path], typer.Argument(help="EngineConfig YAML (or best.yaml); default config if omitted")
    ] = None,
    host: Annotated[str, typer.Option(envvar="SLOTUNE_HOST")] = "127.0.0.1",
    port: Annotated[int, typer.Option(envvar="SLOTUNE_PORT")] = 8000,
    api_key: Annotated[
        Optional[str], typer.Option(envvar="SLOTUNE_API_KEY", help="require 'Authorization: Bearer KEY'")
    ] = None,
    served_model_name: Annotated[Optional[str], typer.Option(help="model id reported by /v1/models")] = None,
    record_traffic: Annotated[
        Optional[Path],
        typer.Option(
            help="record every finished request into this folder (lengths, timing, keyed prefix hashes; no text) "
            "for `tune workload fit` and trace workloads"
        ),
    ] = None,
    record_traffic_max_mib: Annotated[float, typer.Option(min=1, help="bound of the recording folder")] = 256,
    model: Annotated[
        Optional[str], typer.Option(help="serve this model instead of CONFIG's: a bundled name or a path")
    ] = None,
    set_: Annotated[
        Optional[list[str]], typer.Option("--set", help="override a config field: --set max_num_seqs=8")
    ] = None,
) -> None:
    """Serve CONFIG over an OpenAI-compatible HTTP API (an external server's best.yaml: start that server)."""
    with _reading(config):
        _check_yaml(config)
        from slotune.tuner.launch import serve_command  # per command

        serve_command(
            config,
            host=host,
            port=port,
            api_key=api_key,
            served_model_name=served_model_name,
            record_traffic=record_traffic,
            record_traffic_max_mib=record_traffic_max_mib,
            model=model,
            overrides=set_ or [],
        )


@app.command()
def sweep(
    config: Annotated[Path, typer.Argument(help="EngineConfig YAML (or a tuner best.yaml)")],
    workload: Annotated[
        str,
        typer.Option("--workload", "-w", help="workload YAML or built-in name: its shapes are kept, its load swept"),
    ],
    steps: Annotated[int, typer.Option("--steps", min=2, max=16, help="load points, at most")] = 6,
    ttft_limit: Annotated[Optional[float], typer.Option("--ttft-limit", help="p95 TTFT limit in seconds")] = None,
    tpot_limit: Annotated[Optional[float], typer.Option("--tpot-limit", help="p95 TPOT limit in seconds")] = None,
    peak_rps: Annotated[
        Optional[float],
        typer.Option("--peak-rps", help="requests/s at peak: how many replicas serve it within the limits"),
    ] = None,
    json_out: Annotated[Optional[Path], typer.Option("--json", help="write the sweep as JSON here")] = None,
    html_out: Annotated[
        Optional[Path], typer.Option("--html", help="write a page with the latency-throughput curve here")
    ] = None,
) -> None:
    """Measure CONFIG at rising load up to saturation: latency against throughput, capacity within the limits."""
    with _reading(config):
        _check_yaml(config)  # a workload file is read by WorkloadSpec.load, which uses the same reader
        from slotune.tuner.commands import sweep_command  # per command

        sweep_command(
            config,
            workload,
            steps=steps,
            ttft_limit_s=ttft_limit,
            tpot_limit_s=tpot_limit,
            peak_rps=peak_rps,
            json_out=json_out,
            html_out=html_out,
        )


@workload_app.command("fit")
def workload_fit(
    trace: Annotated[
        Path,
        typer.Argument(
            help="a trace file (recorded JSONL, Mooncake JSONL, Azure or BurstGPT CSV) "
            "or a directory of recorded *.jsonl files"
        ),
    ],
    output: Annotated[Path, typer.Option("--output", "-o", help="the WorkloadSpec YAML to write")],
    format_: Annotated[
        Optional[Literal["recorded", "mooncake", "azure", "burstgpt"]],
        typer.Option("--format", help="the trace's format; default: detected from the file"),
    ] = None,
    block_size: Annotated[
        Optional[int], typer.Option("--block-size", help="tokens per hash id (mooncake; default 512)")
    ] = None,
    time_scale: Annotated[
        Optional[float], typer.Option("--time-scale", help="multiply every gap: 2.0 = half the rate")
    ] = None,
    window: Annotated[
        Optional[tuple[float, float]],
        typer.Option(
            "--window",
            metavar="START END",
            help="keep requests arriving in [START, END) seconds since the trace's first request",
        ),
    ] = None,
    max_requests: Annotated[
        Optional[int], typer.Option("--max-requests", help="keep the first this many (after --window)")
    ] = None,
    empirical: Annotated[
        bool,
        typer.Option(
            "--empirical",
            help="replay the traced lengths (written beside the "
            "YAML as NAME.lengths.jsonl) instead of "
            "fitted lognormals",
        ),
    ] = False,
) -> None:
    """Summarize TRACE (lengths, rates, burstiness, concurrency, prefix sharing) and write a WorkloadSpec like it."""
    with _reading(trace):
        from slotune.tuner.commands import fit_command  # per command

        fit_command(
            trace,
            output,
            empirical=empirical,
            format=format_,
            block_size=block_size,
            time_scale=time_scale,
            window=window,
            max_requests=max_requests,
        )


@k8s_app.command("render")
def k8s_render(
    spec: Annotated[Path, typer.Argument(help="tuning spec YAML")],
    name: Annotated[Optional[str], typer.Option(help="resource name; default from the spec file name")] = None,
    namespace: Annotated[str, typer.Option()] = "default",
) -> None:
    """Print the SLOTuning custom resource for SPEC."""
    with _reading(spec):
        _check_yaml(spec)
        from slotune.operator.render import render_command  # per command; imports kubernetes

        render_command(spec, name=name, namespace=namespace)


def _check_yaml(*paths: Path | None) -> None:
    """Read each given file with the one plain-YAML reader first (tags, duplicate keys, alias bombs,
    size and depth refused, naming file and line), for commands whose loaders do not use it yet."""
    for p in paths:
        if p is not None:
            load_yaml(p)


def main() -> None:  # pragma: no cover
    app()
