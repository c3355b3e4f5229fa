"""The bodies of `tune validate`, `tune bench`, `tune sweep` and `tune workload fit` (`tune run` is run.py).
Each imports what it needs when it runs, so `tune --help` stays light."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console
from rich.table import Table
from slotune.engine.config import EngineConfig
from slotune.tuner.measure.in_process_replay import DEFAULT_WORKLOAD, load_tokenizer, run_in_process_replay
from slotune.tuner.measure.intervals import bootstrap_intervals
from slotune.tuner.measure.load_sweep import SweepResult, run_sweep
from slotune.tuner.measure.metrics import CI_PERCENTILES, ReplayResult, cost_metrics
from slotune.tuner.measure.trial_process import trials_die_with_this_process
from slotune.tuner.report.markdown import write_atomic
from slotune.tuner.report.sweep_figures import capacity_line, point_line, points_table, render_page, report_sections
from slotune.tuner.report.terminal import print_result, summary_table
from slotune.tuner.spec.preflight import preflight
from slotune.tuner.spec.sections import ObjectiveSpec
from slotune.tuner.spec.slo import SLOLimits
from slotune.tuner.spec.trace_reader import load_trace
from slotune.tuner.spec.tuning_spec import TuningSpec, resolved_dict
from slotune.tuner.spec.workload_spec import WorkloadSpec
from slotune.tuner.spec.yaml_reader import parse_yaml
from slotune.tuner.sweep import write_json
from slotune.tuner.workload.fit import TraceSummary, fit, summarize
from slotune.tuner.workload.requests import describe_replay


def validate_command(spec: Path) -> TuningSpec:
    """`tune validate`: load and check SPEC (`from_yaml`, then `preflight`), then print what it resolves to.

    Args:
        spec: path of the tuning spec YAML.

    Returns:
        The validated TuningSpec. Raises pydantic.ValidationError / SpecError (a ValueError) /
        MissingFileError for bad input (the CLI prints them as `path: field: message` lines).
    """
    from rich.console import Console
    from rich.syntax import Syntax

    s = TuningSpec.from_yaml(spec)
    preflight(s)
    space, wl = s.search_space, s.workload
    obj = s.objective
    c = Console()
    c.print(
        f"[green]ok[/green] {spec}: study '{s.name}', {obj.kind} objective {obj.direction()} {obj.metric_key()}"
        + (f" (Pareto with {', '.join(obj.metric_key(m) for m in obj.pareto_with)})" if obj.pareto_with else ""),
        highlight=False,
    )
    replay = describe_replay(wl)
    requests = f"{wl.num_requests} requests" if replay is None else "the trace's requests"
    c.print(
        f"  workload: {wl.name} ({wl.arrivals}, {requests}); search space: {space.name} "
        f"({len(space.knobs)} knobs); gates: {len(s.quality_gates)}; sampler: {s.sampler}; "
        f"budget: {s.budget.n_trials} trials, measured {s.budget.measure.replace('_', ' ')}, "
        + (
            f"the best {s.confirm.candidates} confirmed on {s.confirm.seeds} fresh seed{'s' if s.confirm.seeds > 1 else ''}"
            if s.confirm.candidates
            else "no confirmation"
        )
        + (f"; price ${s.cost.usd_per_hour:g}/hour" if s.cost else ""),
        highlight=False,
    )
    if replay is not None:
        c.print(f"  traffic: {replay}", highlight=False)
    for label, server in [("server", s.server)] if s.server else [(x.label, x) for x in s.servers or []]:
        c.print(f"  {label}: {server.engine} ({server.resolved_binary()}; every flag in its --help)", highlight=False)
    text = yaml.safe_dump(resolved_dict(s), sort_keys=False)
    if c.is_terminal:  # wrapped, never cropped at the terminal's width
        c.print(Syntax(text, "yaml", theme="ansi_dark", background_color="default", word_wrap=True))
    else:  # piped: the YAML as it is, one line per line, usable as a file
        sys.stdout.write(text)
    return s


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """`key=value` items -> {dotted.key: value}, values parsed as plain YAML (8 -> int, true -> bool) by the
    one YAML reader (slotune/tuner/spec/yaml_reader.py: no tags; a problem names `--set KEY`)."""
    out: dict[str, Any] = {}
    for item in items:
        k, sep, v = item.partition("=")
        if not sep or not k.strip():
            raise ValueError(f"--set expects key=value (e.g. max_num_seqs=8 or speculative.method=ngram), got '{item}'")
        out[k.strip()] = parse_yaml(v, f"--set {k.strip()}")
    return out


def bench_command(
    config: Path | None,
    workload: Path | str | None,
    json_out: Path | None,
    overrides: list[str],
    seed: int | None,
    ttft_limit_s: float | None = None,
    tpot_limit_s: float | None = None,
    *,
    url: str | None = None,
    api_key: str | None = None,
    model: str | None = None,
    api: str | None = None,
    tokenizer: str | None = None,
    usd_per_hour: float | None = None,
) -> ReplayResult:
    """`tune bench`: load config (+ overrides) and workload, replay, print tables, write JSON.

    With `url`, no engine is built: the workload is replayed against that OpenAI-compatible
    server (slotune/tuner/measure/http_replay.py), its prompts made with the tokenizer of `tokenizer` (a model
    reference), else of CONFIG's model, else of the default model. The metrics carry their 95%
    intervals (`metrics.bootstrap_intervals`) and, with `usd_per_hour` (the server's price per
    hour), the cost per 1M output and total tokens (`metrics.cost_metrics`).
    """
    if usd_per_hour is not None and not 0 < usd_per_hour < float("inf"):
        raise ValueError(f"--usd-per-hour: must be a price > 0, got {usd_per_hour}")
    if url is None:
        for flag, value in (("--model", model), ("--api", api), ("--tokenizer", tokenizer)):
            if value is not None:
                raise ValueError(f"{flag}: only applies with --url (measuring a running server)")
    elif overrides:
        raise ValueError(
            f"--set: changes the engine config, but --url measures a running server; configure that "
            f"server instead (got {', '.join(overrides)})"
        )
    cfg = EngineConfig.from_yaml(config) if config else EngineConfig()
    if overrides:
        cfg = cfg.with_updates(parse_overrides(overrides))
    wl = WorkloadSpec.load(workload if workload else DEFAULT_WORKLOAD)
    total = wl.num_requests
    where = f" @ {url}" if url else ""
    with Console(stderr=True).status(f"replaying {wl.name}{where}") as status:

        def progress(done: int, n: int | None) -> None:
            status.update(f"replaying {wl.name}{where}: {done}/{n if n else '?'} requests")

        if url is None:
            res = run_in_process_replay(
                cfg, wl, seed=seed, ttft_limit_s=ttft_limit_s, tpot_limit_s=tpot_limit_s, on_progress=progress
            )
        else:
            # Imported here: aiohttp is only needed with --url.
            from slotune.tuner.measure.http_replay import run_http_replay

            status.update(f"loading the tokenizer of {tokenizer or cfg.model}")
            tok = load_tokenizer(tokenizer or cfg.model)
            res = run_http_replay(
                url,
                wl,
                tokenizer=tok,
                api_key=api_key,
                model=model,
                api=api or "completions",
                seed=seed,
                ttft_limit_s=ttft_limit_s,
                tpot_limit_s=tpot_limit_s,
                on_progress=progress,
            )
    res.metrics.update(
        bootstrap_intervals(
            res.records,
            res.metrics["duration_s"],
            ttft_limit_s=ttft_limit_s,
            tpot_limit_s=tpot_limit_s,
            percentiles=CI_PERCENTILES,
        )
    )
    if usd_per_hour is not None:
        res.metrics.update(cost_metrics(res.metrics, usd_per_hour))
    print_result(res, title=f"tune bench: {wl.name}" + (f" ({total} requests)" if total else "") + where)
    if json_out:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(res.to_dict(), indent=1))
    return res


def fit_command(trace_path: Path, out: Path, *, empirical: bool = False, **options) -> TraceSummary:
    """`tune workload fit TRACE -o workload.yaml`: load, summarize, fit, write the YAML; print the summary.

    Args:
        trace_path: a trace file, or a directory of recorded *.jsonl files.
        out: the WorkloadSpec YAML to write.
        empirical: replay the traced lengths (written beside `out` as NAME.lengths.jsonl) instead of lognormals.
        options: load_trace's (format, block_size, time_scale, window, max_requests); None ones are left out.
    Returns:
        The source's TraceSummary. Raises SpecError / MissingFileError for the trace, ValueError when it
        cannot be fitted, OSError when `out` cannot be written.
    """
    from rich.console import Console

    trace = load_trace(trace_path, **{k: v for k, v in options.items() if v is not None})
    summary = summarize(trace)
    lengths = out.with_suffix(".lengths.jsonl") if empirical else None
    doc = fit(trace, name=out.stem, lengths_path=lengths)
    if lengths is not None:
        doc["trace"] = lengths.name  # WorkloadSpec.load resolves it against the YAML's folder
    out.write_text(yaml.safe_dump(doc, sort_keys=False, width=100))
    console = Console()
    console.print(summary_table(summary, title=f"{trace.source} ({trace.format} trace)"))
    console.print(
        f"wrote {out}"
        + (f" and {lengths}" if lengths is not None else "")
        + f": {doc['arrivals']} arrivals at {doc['rate']:g}/s",
        highlight=False,
        soft_wrap=True,
    )
    return summary


def sweep_command(
    config: Path,
    workload: str,
    *,
    steps: int = 6,
    ttft_limit_s: float | None = None,
    tpot_limit_s: float | None = None,
    peak_rps: float | None = None,
    json_out: Path | None = None,
    html_out: Path | None = None,
) -> SweepResult:
    """`tune sweep`: sweep CONFIG's offered load on WORKLOAD, print the points and the capacity, write
    the JSON (and a page with the curve).

    Raises ValueError / SpecError / MissingFileError for bad input (the CLI prints `path: field: message`).
    """
    cfg = EngineConfig.from_yaml(config)
    wl = WorkloadSpec.load(workload)
    objective = ObjectiveSpec(kind="latency", metric="ttft", ttft_limit_s=ttft_limit_s, tpot_limit_s=tpot_limit_s)
    spec = TuningSpec(
        name="sweep",
        model=cfg.model,
        workload=wl,
        objective=objective,
        peak_rps=peak_rps,
        sweep={"enabled": True, "steps": steps},
    )
    limits = SLOLimits.from_objective(objective)
    err = Console(stderr=True)
    with trials_die_with_this_process(), err.status(f"sweeping {config.name} on {wl.name}"):
        curve = run_sweep(
            spec,
            cfg,
            name=config.stem,
            on_point=lambda n, load, p: err.print(point_line(n, load, p, limits), highlight=False),
        )
    result = SweepResult(wl.name, limits, (curve,), peak_rps)
    out = Console()
    # One config: no config column; the verdict's reasons are in the lines above (stderr).
    rows = [r[1:-1] + [r[-1].split(":")[0]] for r in points_table(result)]
    table = Table(title=f"tune sweep: {config.name} on {wl.name} (SLO {limits.latency_only.describe()})")
    for h in rows[0]:
        table.add_column(h)
    for r in rows[1:]:
        table.add_row(*r)
    out.print(table)
    out.print(capacity_line(result, curve), highlight=False)
    if json_out:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        write_json(result, json_out)
    if html_out:
        html_out.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(html_out, render_page(f"slotune load sweep: {config.name} on {wl.name}", report_sections(result)))
    return result
