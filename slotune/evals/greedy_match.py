"""The greedy_match gate: a server's greedy answers against those of a reference launch, over the API.

An external server exposes no logits to compare, so quality is judged on what a client gets: each
agreement prompt (the first 64 tokens of a shipped passage, slotune/evals/agreement.py) is completed
greedily, `max_tokens` tokens, by the candidate and by the reference (the engine's default launch:
16-bit KV cache, no drafts). A prompt scores the share of the reference answer's tokens that the
candidate reproduces before it first differs; the gate passes when the mean score is at least
`min_match`. The reference answers are cached per model, launch and prompts (slotune/evals/baseline.py:
`cached_value`), so a study launches the reference once.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from slotune.evals.baseline import model_identity
from slotune.evals.gate_spec import GateResult, GateSpec

DEFAULT_MAX_TOKENS = 32


def gate_prompts(tokenizer, gate: GateSpec) -> list[list[int]]:
    from slotune.evals.agreement import agreement_prompts  # imports torch: the trial process has it loaded

    return agreement_prompts(tokenizer, gate.limit)


def greedy_answers(
    url: str, prompts: list[list[int]], max_tokens: int, concurrency: int = 1, model: str | None = None
) -> list[str]:
    """Each prompt (token ids) completed greedily by the server at `url` (OpenAI /v1/completions).
    One at a time by default: batched with others, llama-server's greedy answers change with the batch
    (bench/tuner/greedy_match_noise.py), and the gate would judge that noise. `model`: the id requests
    name (OpenAI's API requires one; llama-server ignores it)."""

    def one(prompt: list[int]) -> str:
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **({"model": model} if model else {})}
        req = urllib.request.Request(
            f"{url}/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=300) as r:
            return json.loads(r.read())["choices"][0]["text"]

    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, prompts))


def match_score(reference: list[int], candidate: list[int]) -> float:
    """The share of `reference`'s tokens `candidate` reproduces before they first differ (1 when both are empty)."""
    if not reference:
        return 1.0 if not candidate else 0.0
    n = 0
    for a, b in zip(reference, candidate):
        if a != b:
            break
        n += 1
    return n / len(reference)


def reference_key(gate: GateSpec, model_file: Path, launch: dict[str, Any], prompts: list[list[int]]) -> dict[str, Any]:
    """What the reference's answers depend on: model, reference launch, prompts and answer length."""
    return {
        "kind": gate.kind,
        "model": model_identity(model_file),
        "launch": launch,
        "prompts": hashlib.sha256(json.dumps(prompts).encode()).hexdigest()[:16],
        "max_tokens": gate.max_tokens or DEFAULT_MAX_TOKENS,
    }


def greedy_match_gate(gate: GateSpec, candidate: list[str], reference: list[str], tokenizer) -> GateResult:
    """Judge the candidate's answers against the reference's, prompt by prompt, in the model's tokens."""
    scores = [match_score(tokenizer.encode(r), tokenizer.encode(c)) for r, c in zip(reference, candidate, strict=True)]
    mean = statistics.fmean(scores)
    se = statistics.stdev(scores) / len(scores) ** 0.5 if len(scores) > 1 else 0.0
    passed = mean >= gate.min_match
    exact = sum(s == 1.0 for s in scores)
    return GateResult(
        name=gate.name,
        kind=gate.kind,
        passed=passed,
        baseline=1.0,
        candidate=mean,
        stderr=se,
        drop=1.0 - mean,
        reason=(
            f"greedy answers match the reference for {mean:.1%} of their tokens (min {gate.min_match:.0%}); "
            f"{exact} of {len(scores)} identical"
        ),
        metric="match",
        margin=1.0 - gate.min_match,
        num_items=len(scores),
        details={"scores": scores, "max_tokens": gate.max_tokens or DEFAULT_MAX_TOKENS},
    )
