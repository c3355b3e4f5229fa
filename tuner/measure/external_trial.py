"""The parts of a trial particular to an external server: its launch, and its quality gates judged
through its API (evals/greedy_match.py) against the spec's reference launch, which is started here,
once per study, when its answers are not cached."""

from __future__ import annotations

import logging
import tempfile
import time
from pathlib import Path

from slotune.engine.paths import resolve_model_path
from slotune.evals.baseline import cached_value
from slotune.evals.gate_spec import GateReport, GateResult, GateSpec
from slotune.evals.greedy_match import (
    DEFAULT_MAX_TOKENS,
    gate_prompts,
    greedy_answers,
    greedy_match_gate,
    reference_key,
)
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


def answers(server: ExternalServer, gates: list[GateSpec]) -> dict[str, list[str]]:
    """Each gate's greedy answers from the running `server`."""
    return {
        g.name: greedy_answers(
            server.url, gate_prompts(server.tokenizer, g), g.max_tokens or DEFAULT_MAX_TOKENS, model=server.model_id
        )
        for g in gates
    }


def judge_gates(
    cfg: ServerConfig,
    reference: ServerConfig,
    gates: list[GateSpec],
    candidate: dict[str, list[str]],
    tokenizer,
    cache_dir: Path,
) -> GateReport:
    """Every gate of the candidate's answers against the reference launch's (cached, else launched
    now). A gate that errors is a failed result with the error as its reason, as in evals/gates.py."""
    model_file = resolve_model_path(reference.model)
    results = []
    for g in gates:
        t0 = time.perf_counter()
        try:
            key = reference_key(g, model_file, reference.model_dump(mode="json"), gate_prompts(tokenizer, g))
            ref = cached_value(
                cache_dir, key, lambda g=g: candidate[g.name] if cfg == reference else _reference_answers(reference, g)
            )
            r = greedy_match_gate(g, candidate[g.name], ref, tokenizer)
        except Exception as exc:  # recorded, not raised: a failed gate makes the trial infeasible
            log.exception("gate %s errored", g.name)
            r = GateResult(
                g.name, g.kind, False, None, None, None, None, f"error: {type(exc).__name__}: {exc}", "match"
            )
        r.details["wall_s"] = time.perf_counter() - t0
        results.append(r)
    return GateReport(results)


def _reference_answers(reference: ServerConfig, gate: GateSpec) -> list[str]:
    with tempfile.TemporaryDirectory(prefix="slotune-reference-") as d:
        with external_server(reference, Path(d) / "server.log") as server:
            return answers(server, [gate])[gate.name]
