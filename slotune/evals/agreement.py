"""Baseline-agreement gate: top-1 next-token agreement and mean KL(baseline || candidate).

Prompts: `slotune/evals/data/agreement_prompts.jsonl` (32 passages of real English, tasks/SOURCES.md), each
cut to its first PROMPT_LEN tokens; every position after the first is compared through the paged KV
cache (`PagedScorer`), so KV-cache precision counts as well as weights. KL is computed over the
baseline's cached top-K tokens plus one bucket for the rest: a lower bound of the full KL, tight for
a 49k vocabulary, at ~1 MB of cache (docs/design/evals-gates.md). Prompts, not positions, are the
unit of the standard errors (positions are correlated).
"""

from __future__ import annotations

import hashlib
import json
import time
from importlib import resources
from pathlib import Path

import torch

from slotune.evals.baseline import Baseline
from slotune.evals.gate_spec import GateResult, GateSpec
from slotune.evals.scoring import PagedScorer
from slotune.evals.stats import judge, mean, mean_stderr

TOP_K = 32
PROMPT_LEN = 64
DEFAULT_NUM_PROMPTS = 16


def prompts_path() -> Path:
    return Path(str(resources.files("slotune.evals") / "data" / "agreement_prompts.jsonl"))


def agreement_prompts(tokenizer, n: int | None = None) -> list[list[int]]:
    """The first n shipped passages (all 32 when n is None), each as its first PROMPT_LEN tokens."""
    rows = [json.loads(line) for line in prompts_path().read_text().splitlines() if line.strip()]
    if n is not None:
        # Alternate sources so a small n still mixes both kinds of text.
        kjv = [r for r in rows if r["source"] == "KJV"]
        gpl = [r for r in rows if r["source"] != "KJV"]
        rows = [r for pair in zip(kjv, gpl) for r in pair][:n]
    return [tokenizer.encode(r["text"], add_special_tokens=True)[:PROMPT_LEN] for r in rows]


def truncated_kl(ref_idx: torch.Tensor, ref_lp: torch.Tensor, cand_lp: torch.Tensor) -> torch.Tensor:
    """Per-position KL(p || q) over the baseline's top-K plus a tail bucket.

    ref_idx, ref_lp: [T, K] baseline top-K token ids and log-probs; cand_lp: [T, V] -> [T].
    """
    q_top = cand_lp.gather(1, ref_idx)
    p = ref_lp.exp()
    kl = (p * (ref_lp - q_top)).sum(-1)
    p_tail = (1 - p.sum(-1)).clamp_min(1e-12)
    q_tail = (1 - q_top.exp().sum(-1)).clamp_min(1e-12)
    return (kl + p_tail * (p_tail.log() - q_tail.log())).clamp_min(0)


def _top_k(i: int, logits: torch.Tensor) -> dict:
    top = torch.log_softmax(logits, -1).topk(TOP_K, dim=-1)
    return {"idx": top.indices.tolist(), "lp": top.values.tolist()}


def agreement_gate(gate: GateSpec, llm, base: Baseline) -> GateResult:
    """Top-1 agreement must stay >= min_top1 (drop = 1 - top1 <= 1 - min_top1, or <= max_abs_drop)
    and mean KL <= max_mean_kl; in non_inferiority mode each with its one-sided bound."""
    n = gate.limit or DEFAULT_NUM_PROMPTS
    prompts = agreement_prompts(llm.tokenizer, n)
    reqs = [(ids, len(ids) - 1) for ids in prompts]
    digest = hashlib.sha256(json.dumps(prompts).encode()).hexdigest()[:16]
    key = {"kind": "agreement", "prompts": digest, "k": TOP_K}
    t0 = time.perf_counter()
    fresh = []
    if base.is_candidate:
        ref = base.cached(key, lambda: fresh.append(1) or PagedScorer(llm).map_logits(reqs, _top_k))
    else:
        ref = base.cached(key, lambda: PagedScorer(base.llm).map_logits(reqs, _top_k))
        t0 = time.perf_counter()

    def compare(i: int, logits: torch.Tensor) -> tuple[float, float]:
        dev = logits.device
        idx, lp = torch.tensor(ref[i]["idx"], device=dev), torch.tensor(ref[i]["lp"], device=dev)  # [T-1, K] each
        cand = torch.log_softmax(logits, -1)
        top1 = (cand.argmax(-1) == idx[:, 0]).float().mean().item()
        return top1, truncated_kl(idx, lp, cand).mean().item()

    if fresh:  # the baseline was just computed on this very engine: identical by definition
        per_prompt = [(1.0, 0.0)] * len(reqs)
    else:
        per_prompt = PagedScorer(llm).map_logits(reqs, compare)
    seconds = time.perf_counter() - t0
    weights = [len(ids) - 1 for ids in prompts]
    top1 = sum(w * a for w, (a, _) in zip(weights, per_prompt)) / sum(weights)
    mean_kl = sum(w * k for w, (_, k) in zip(weights, per_prompt)) / sum(weights)
    se_top1 = mean_stderr([a for a, _ in per_prompt])
    se_kl = mean_stderr([k for _, k in per_prompt])

    verdicts = []
    top1_margin = None
    if gate.min_top1 is not None or gate.max_abs_drop is not None:
        top1_margin = min(
            m for m in (None if gate.min_top1 is None else 1 - gate.min_top1, gate.max_abs_drop) if m is not None
        )
        verdicts.append(judge(1 - top1, se_top1, top1_margin, gate.mode, gate.confidence, what="top-1 disagreement"))
    if gate.max_mean_kl is not None:
        verdicts.append(judge(mean_kl, se_kl, gate.max_mean_kl, gate.mode, gate.confidence, what="mean KL"))
    passed = all(v.passed for v in verdicts)
    reason = "; ".join(v.reason for v in verdicts)
    return GateResult(
        name=gate.name,
        kind="agreement",
        passed=passed,
        baseline=1.0,
        candidate=top1,
        stderr=se_top1,
        drop=1.0 - top1,
        reason=reason,
        metric="top1",
        margin=top1_margin,
        num_items=len(prompts),
        seconds=seconds,
        details={
            "top1": top1,
            "mean_kl": mean_kl,
            "mean_kl_stderr": se_kl,
            "positions": sum(weights),
            "mean_prompt_top1": mean([a for a, _ in per_prompt]),
        },
    )
