"""The parts of a trial particular to an external server: its launch, and its quality gates judged
through its API against the spec's reference launch, which is started here, once per study, when
its answers are not cached: greedy_match (slotune/evals/greedy_match.py) and lm-eval generation tasks over
`local-completions` (slotune/evals/tasks.py: `run_task_api`)."""

from __future__ import annotations

import logging
import tempfile
import time
from pathlib import Path
from typing import Any

from slotune.engine.paths import resolve_model_path
from slotune.evals.baseline import cached_value, model_identity
from slotune.evals.gates import judge_task, task_key
from slotune.evals.gate_spec import GateReport, GateResult, GateSpec
from slotune.evals.greedy_match import (
    DEFAULT_MAX_TOKENS,
    gate_prompts,
    greedy_answers,
    greedy_match_gate,
    reference_key,
)
from slotune.evals.tasks import run_task_api
from slotune.tuner.measure.external_server import ExternalServer, ServerFailure
from slotune.tuner.measure.in_process_replay import load_tokenizer
from slotune.tuner.spec.server import ServerConfig

log = logging.getLogger(__name__)


def external_server(cfg: ServerConfig, log_path: Path) -> ExternalServer:
    """The server of one launch, its prompts tokenized by the model's own tokenizer."""
    binary = cfg.resolved_binary()
    if binary is None:
        raise ServerFailure(f"failed to start: `{cfg.binary or cfg.description().binary}` is not there")
    model = str(resolve_model_path(cfg.model))
    return ExternalServer(
        cfg.description(), cfg.knobs, binary=binary, model=model, tokenizer=load_tokenizer(model), log_path=log_path
    )


def answers(server: ExternalServer, gates: list[GateSpec]) -> dict[str, Any]:
    """What each gate judges, from the running `server`: greedy answers, or an lm-eval task's run."""
    out: dict[str, Any] = {}
    for g in gates:
        if g.kind == "greedy_match":
            prompts = gate_prompts(server.tokenizer, g)
            out[g.name] = greedy_answers(server.url, prompts, g.max_tokens or DEFAULT_MAX_TOKENS, model=server.model_id)
        else:
            out[g.name] = run_task_api(server.url, server.model_id, g.task, g.limit)
    return out


def judge_gates(
    cfg: ServerConfig,
    reference: ServerConfig,
    gates: list[GateSpec],
    candidate: dict[str, Any],
    tokenizer,
    cache_dir: Path,
) -> GateReport:
    """Every gate of the candidate's answers against the reference launch's (cached, else launched
    now). A gate that errors is a failed result with the error as its reason, as in slotune/evals/gates.py."""
    model_file = resolve_model_path(reference.model)
    launch = reference.model_dump(mode="json")

    def reference_run(g: GateSpec) -> Any:  # the candidate is its own reference when it is the reference launch
        return candidate[g.name] if cfg == reference else _reference_run(reference, g)

    results = []
    for g in gates:
        t0 = time.perf_counter()
        try:
            if g.kind == "greedy_match":
                key = reference_key(g, model_file, launch, gate_prompts(tokenizer, g))
                ref = cached_value(cache_dir, key, lambda g=g: reference_run(g))
                r = greedy_match_gate(g, candidate[g.name], ref, tokenizer)
            else:
                key = {**task_key(g), "model": model_identity(model_file), "launch": launch}
                ref = cached_value(cache_dir, key, lambda g=g: reference_run(g)["per_doc"])
                r = judge_task(g, ref, candidate[g.name])
        except Exception as exc:  # recorded, not raised: a failed gate makes the trial infeasible
            log.exception("gate %s errored", g.name)
            r = GateResult(
                g.name, g.kind, False, None, None, None, None, f"error: {type(exc).__name__}: {exc}", g.metric_name
            )
        r.details["wall_s"] = time.perf_counter() - t0
        results.append(r)
    return GateReport(results)


def _reference_run(reference: ServerConfig, gate: GateSpec) -> Any:
    with tempfile.TemporaryDirectory(prefix="slotune-reference-") as d:
        with external_server(reference, Path(d) / "server.log") as server:
            return answers(server, [gate])[gate.name]
