"""Baseline-agreement gate: top-1 next-token agreement and mean KL(baseline || candidate).

The baseline's top-K log-probs per position are cached (K=32), and KL is computed over those
K tokens plus one bucket for the remaining mass: exact to within the tail's contribution,
which for a 49k vocabulary is what keeps the cache small.
"""

from __future__ import annotations

import math

import torch

from slotune.evals.gates import GateResult, GateSpec

TOP_K = 32
PROMPT_LEN = 64


def agreement_prompts(tokenizer, n: int) -> list[list[int]]:
    """n windows of real English text (the workload corpus), evenly spaced, fixed forever."""
    from slotune.tuner.workload import corpus_token_ids

    ids = corpus_token_ids(tokenizer)
    step = max(1, (len(ids) - PROMPT_LEN) // max(n, 1))
    return [ids[i * step : i * step + PROMPT_LEN] for i in range(n)]


def _truncated_kl(ref_idx: torch.Tensor, ref_lp: torch.Tensor, cand_lp: torch.Tensor) -> torch.Tensor:
    """Per-position KL(p || q) over the baseline's top-K plus a tail bucket. Shapes [T, K], [T, K], [T, V]."""
    q_top = cand_lp.gather(1, ref_idx)
    p = ref_lp.exp()
    kl = (p * (ref_lp - q_top)).sum(-1)
    p_tail = (1 - p.sum(-1)).clamp_min(1e-12)
    q_tail = (1 - q_top.exp().sum(-1)).clamp_min(1e-12)
    return (kl + p_tail * (p_tail.log() - q_tail.log())).clamp_min(0)


def agreement_gate(gate: GateSpec, llm, base) -> GateResult:
    from slotune.evals.gates import baseline_config

    n = gate.limit or 16
    prompts = agreement_prompts(llm.tokenizer, n)
    if baseline_config(llm.config) == llm.config:
        base._llm = llm  # the candidate is the baseline: no second model

    def compute():
        rows = []
        for ids in prompts:
            top = torch.log_softmax(base.llm.logits(ids), -1).topk(TOP_K, dim=-1)
            rows.append({"idx": top.indices.tolist(), "lp": top.values.tolist()})
        return rows

    ref = base.cached({"gate": "agreement", "n": n, "k": TOP_K, "len": PROMPT_LEN, "v": 1}, compute)
    matches, kls = [], []
    for ids, r in zip(prompts, ref):
        cand = torch.log_softmax(llm.logits(ids), -1)
        idx, lp = torch.tensor(r["idx"]), torch.tensor(r["lp"])
        matches.append((cand.argmax(-1) == idx[:, 0]).float())
        kls.append(_truncated_kl(idx, lp, cand))
    m, k = torch.cat(matches), torch.cat(kls)
    top1, mean_kl = m.mean().item(), k.mean().item()
    stderr = math.sqrt(max(top1 * (1 - top1), 1e-12) / len(m))
    problems = []
    if gate.min_top1 is not None and top1 < gate.min_top1:
        problems.append(f"top-1 agreement {top1:.4f} < {gate.min_top1}")
    if gate.max_mean_kl is not None and mean_kl > gate.max_mean_kl:
        problems.append(f"mean KL {mean_kl:.4g} > {gate.max_mean_kl}")
    reason = ("failed: " + "; ".join(problems)) if problems else f"ok: top-1 {top1:.4f}, mean KL {mean_kl:.4g}"
    return GateResult(name=gate.name, kind="agreement", passed=not problems, baseline=1.0, candidate=top1,
                      stderr=stderr, drop=1.0 - top1, reason=reason,
                      details={"top1": top1, "mean_kl": mean_kl, "positions": len(m)})
