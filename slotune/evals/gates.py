"""Quality gates: a candidate config must not lose quality against its unquantized baseline.

Kinds (a tuning spec lists them under `quality_gates:`): agreement (top-1 agreement and mean KL on
real-text prompts, slotune/evals/agreement.py), lm_eval (the drop in a bundled task's metric, with a paired
standard error) and perplexity (the increase on a bundled loglikelihood_rolling task). The baseline is
the same config with 16-bit-or-better everything and no drafts (`baseline_config`), cached per item
(slotune/evals/baseline.py) so candidates are compared pairwise on the same items.

Lifecycle: `evaluate_gates(config, gates, llm=trial_llm)` -> for each gate: baseline from the
cache (or computed on a lazily loaded baseline engine) -> candidate on `llm` -> `stats.judge`.
A gate that raises is recorded as failed with the error as its reason, never raised.
More on the kinds and the cache key: docs/design/evals-gates.md.
"""

from __future__ import annotations

import json
import logging
import time
from importlib import resources
from pathlib import Path

from pydantic import ValidationError
from rich.console import Console
from rich.table import Table

from slotune.engine.config import EngineConfig
from slotune.evals.baseline import Baseline, default_cache_dir
from slotune.evals.gate_spec import GateReport, GateResult, GateSpec
from slotune.evals.stats import judge, paired_drop, paired_perplexity_drop
from slotune.evals.tasks import run_task, task_fingerprint
from slotune.tuner.spec.yaml_reader import SpecError, load_yaml

log = logging.getLogger(__name__)


def _task_gate(gate: GateSpec, llm, base: Baseline) -> GateResult:
    metric = gate.metric_name
    key = task_key(gate)
    cand = None
    if base.is_candidate:  # one run serves both sides
        cand = run_task(llm, gate.task, gate.limit)
        ref = base.cached(key, lambda: cand["per_doc"])
    else:
        ref = base.cached(key, lambda: run_task(base.llm, gate.task, gate.limit)["per_doc"])
    if metric not in ref:
        raise ValueError(f"gate '{gate.name}': task {gate.task} has no metric '{metric}' (has: {', '.join(ref)})")
    if cand is None:
        cand = run_task(llm, gate.task, gate.limit)
    return judge_task(gate, ref, cand)


def task_key(gate: GateSpec) -> dict:
    """What a task's baseline depends on, besides the model and its config: task, data and limit."""
    return {"kind": gate.kind, "task": gate.task, "data": task_fingerprint(gate.task), "limit": gate.limit}


def judge_task(gate: GateSpec, ref: dict, cand: dict) -> GateResult:
    """A task gate's verdict: the candidate's run (`run_task`) against the baseline's per-document
    values (`ref`: metric -> doc id -> value), paired by document."""
    metric = gate.metric_name
    b = {int(k): v for k, v in ref[metric].items()}
    c = cand["per_doc"][metric]
    if gate.kind == "perplexity":  # lower is better: drop = candidate - baseline
        b_val, c_val, se, n = paired_perplexity_drop(b, c)
        drop = c_val - b_val
    else:
        drop, se, n = paired_drop(b, c)
        b_val = sum(b[i] for i in c if i in b) / max(n, 1)
        c_val = b_val - drop
    margin = gate.margin(b_val)
    v = judge(
        drop,
        se,
        margin,
        gate.mode,
        gate.confidence,
        what=f"{metric} drop" if gate.kind != "perplexity" else f"{metric} increase",
    )
    return GateResult(
        name=gate.name,
        kind=gate.kind,
        passed=v.passed,
        baseline=b_val,
        candidate=c_val,
        stderr=se,
        drop=drop,
        reason=v.reason,
        metric=metric,
        margin=margin,
        num_items=n,
        seconds=cand["seconds"],
        details={"task": gate.task, "bound": v.bound, "metrics": cand["metrics"]},
    )


def evaluate_gates(
    config, gates: list[GateSpec], *, llm=None, cache_dir: str | Path | None = None, baseline_llm=None
) -> GateReport:
    """Run every gate for `config` against its cached baseline.

    Args:
        config: the candidate EngineConfig.
        gates: validated gate specs (`GateSpec.model_validate(d)` for each dict).
        llm: a loaded, idle `slotune.engine.LLM` for `config` (saves a model load in trials).
        cache_dir: baseline cache folder (default `slotune/engine/paths.py: cache_root()`/baselines).
        baseline_llm: a loaded engine for `baseline_config(config)`, used when a baseline number
            is not cached (default: loaded on demand, or `llm` itself when config is its own baseline).
    Returns:
        GateReport: one GateResult per gate, in order; `report.passed`, `report.to_dict()`.
        A gate that errors is a failed GateResult whose reason starts with "error:".
    """
    if llm is None:
        from slotune.engine import LLM  # imports torch: only when the caller brings no engine

        llm = LLM(config)
    base = Baseline(llm, Path(cache_dir) if cache_dir else default_cache_dir(), baseline_llm)
    results = []
    for g in gates:
        t0 = time.perf_counter()
        try:
            if g.kind == "agreement":
                from slotune.evals.agreement import agreement_gate  # imports torch: agreement gates only

                r = agreement_gate(g, llm, base)
            else:
                r = _task_gate(g, llm, base)
        except Exception as e:  # recorded, not raised: a failed gate makes a trial infeasible, not the study crash
            log.exception("gate %s errored", g.name)
            r = GateResult(
                name=g.name,
                kind=g.kind,
                passed=False,
                baseline=None,
                candidate=None,
                stderr=None,
                drop=None,
                reason=f"error: {type(e).__name__}: {e}",
                metric=g.metric_name,
            )
        r.details["wall_s"] = time.perf_counter() - t0
        results.append(r)
    return GateReport(results)


# --- built-in gates and the `tune eval` command -----------------------------------------------
def builtin_gates_path() -> Path:
    return Path(str(resources.files("slotune.evals") / "tasks" / "default_gates.yaml"))


def load_gates(path: Path | None) -> list[GateSpec]:
    """A gates YAML: a list of gates, or a mapping with `quality_gates:` (a tuning spec works too).

    Read by the one plain-YAML reader (slotune/tuner/spec/yaml_reader.py). Raises MissingFileError, or SpecError naming
    the file and each bad gate's field (`quality_gates[1].margin: ...`).
    """
    path = Path(path) if path else builtin_gates_path()
    data = load_yaml(path, "gates file")
    key = ""
    if isinstance(data, dict):
        key = "quality_gates" if "quality_gates" in data else "gates"
        data = data.get(key)
    if not isinstance(data, list):
        raise SpecError("expected a list of gates (or a mapping with 'quality_gates:')", source=path)
    gates, problems = [], []
    for i, g in enumerate(data):
        try:
            gates.append(GateSpec.model_validate(g))
        except ValidationError as exc:
            problems += SpecError.from_validation(exc, path, prefix=f"{key}[{i}]").problems
    if problems:
        raise SpecError(problems=problems)
    return gates


def render_report(report: GateReport, title: str = "quality gates"):
    t = Table(title=f"{title}: {'[green]PASS[/green]' if report.passed else '[red]FAIL[/red]'}")
    for c in ("gate", "metric", "baseline", "candidate", "drop", "stderr", "margin", "n", "s", "result"):
        t.add_column(c, justify="right" if c not in ("gate", "metric", "result") else "left")
    f = lambda v: "-" if v is None else f"{v:.4g}"  # noqa: E731
    for r in report.gates:
        t.add_row(
            r.name,
            r.metric,
            f(r.baseline),
            f(r.candidate),
            f(r.drop),
            f(r.stderr),
            f(r.margin),
            str(r.num_items),
            f"{r.seconds:.1f}",
            ("[green]" if r.passed else "[red]") + r.reason,
        )
    return t


def eval_command(config: Path | None, gates: Path | None, json_out: Path | None) -> GateReport:
    """`tune eval CONFIG --gates GATES.yaml [--json OUT]`: run gates alone and print a table."""
    cfg = EngineConfig.from_yaml(config) if config else EngineConfig()
    specs = load_gates(gates)
    report = evaluate_gates(cfg, specs)
    Console().print(render_report(report))
    if json_out:
        Path(json_out).write_text(json.dumps(report.to_dict(), indent=1))
    return report
