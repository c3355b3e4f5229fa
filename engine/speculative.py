"""Speculative decoding: a cheap draft proposes k tokens, the target verifies them in one pass.

Drafts here are deterministic (n-gram lookup, greedy early-exit), i.e. the draft
distribution q is a point mass on the proposed token d. Standard rejection sampling
(Leviathan et al. 2023) then reads:
  accept d with probability min(1, p(d) / q(d)) = p(d);
  on rejection, sample from norm(max(p - q, 0)) = p with d removed, renormalised;
  if all k drafts are accepted, sample one bonus token from the target's next distribution.
Greedy requests accept while d == argmax p, so outputs equal non-speculative decoding exactly.
"""

from __future__ import annotations

import torch

from slotune.engine.config import EngineConfig
from slotune.engine.sequence import Sequence


def _budget(engine, seq: Sequence, k: int) -> int:
    """Drafts must not run past max_tokens or max_model_len."""
    left = min(seq.params.max_tokens - seq.num_output_tokens, engine.cfg.max_model_len - seq.num_tokens) - 1
    return max(0, min(k, left))


class NgramProposer:
    """Prompt lookup: find the latest earlier occurrence of the longest suffix n-gram, copy what followed."""

    def __init__(self, cfg: EngineConfig, engine) -> None:
        self.k = cfg.speculative.num_speculative_tokens
        self.n_max, self.n_min = cfg.speculative.ngram_max, cfg.speculative.ngram_min
        self.engine = engine

    def draft(self, tokens: list[int], k: int) -> list[int]:
        L = len(tokens)
        for n in range(min(self.n_max, L - 1), self.n_min - 1, -1):
            suffix = tokens[L - n:]
            for start in range(L - n - 1, -1, -1):  # latest match first
                if tokens[start:start + n] == suffix:
                    return tokens[start + n:start + n + k]
        return []

    def propose(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            k = _budget(self.engine, seq, self.k)
            seq.spec_token_ids = self.draft(seq.token_ids, k) if k else []


class EarlyExitProposer:
    """Self-draft with the first `early_exit_layers` layers + final norm + LM head.

    The draft writes KV only in layers < L_e at the draft positions; verification rewrites
    the same positions with identical inputs, so the shared cache stays consistent.
    """

    def __init__(self, cfg: EngineConfig, engine) -> None:
        self.k = cfg.speculative.num_speculative_tokens
        self.num_layers = min(cfg.speculative.early_exit_layers, engine.runner.model_cfg.num_layers)
        self.engine = engine

    def propose(self, seqs: list[Sequence]) -> None:
        bm = self.engine.block_manager
        active, ks = [], []
        for seq in seqs:
            seq.spec_token_ids = []
            k = _budget(self.engine, seq, self.k)
            if k and bm.allocate(seq, 1 + k):  # room for the last token + drafts, else skip drafting
                active.append(seq)
                ks.append(k)
        if not active:
            return
        toks = [s.token_ids[-1] for s in active]
        pos = [s.num_tokens - 1 for s in active]
        for j in range(max(ks)):
            live = [i for i, k in enumerate(ks) if j < k]
            logits = self.engine.runner.run_decode([active[i] for i in live], [toks[i] for i in live],
                                                   [pos[i] for i in live], num_layers=self.num_layers)
            nxt = logits.argmax(-1).tolist()
            for i, t in zip(live, nxt):
                active[i].spec_token_ids.append(t)
                toks[i], pos[i] = t, pos[i] + 1


def build_proposer(cfg: EngineConfig, engine):
    m = cfg.speculative.method
    if m == "ngram":
        return NgramProposer(cfg, engine)
    if m == "early_exit":
        return EarlyExitProposer(cfg, engine)
    from slotune.engine.draft_model import DraftModelProposer

    return DraftModelProposer(cfg, engine)


def rejection_sample(probs: torch.Tensor, drafts: list[int], generator: torch.Generator | None = None) -> list[int]:
    """probs: [k+1, V] target distributions at the k draft positions + one bonus position.

    Returns the accepted drafts followed by one corrected or bonus token.
    """
    out: list[int] = []
    u = torch.rand(len(drafts), generator=generator, device=probs.device) if drafts else None
    for i, d in enumerate(drafts):
        p = probs[i]
        if u[i] < p[d]:
            out.append(d)
            continue
        residual = p.clone()
        residual[d] = 0
        if residual.sum() <= 0:
            residual = p
        out.append(int(torch.multinomial(residual / residual.sum(), 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(probs[len(drafts)], 1, generator=generator)))
    return out


def verify_batch(engine, items: list[tuple]) -> list[list[int]]:
    """items: (scheduled seq, its logits rows [k+1, V]). Per sequence: accepted drafts + one token."""
    out = []
    for s, logits in items:
        drafts = s.seq.spec_token_ids[: s.num_draft_tokens]
        p = s.seq.params
        if p.is_greedy:
            target = logits.argmax(-1).tolist()
            acc = []
            for i, d in enumerate(drafts):
                if d != target[i]:
                    break
                acc.append(d)
            out.append(acc + [target[len(acc)]])
        else:
            probs = engine.sampler.probs(logits, [p] * logits.shape[0])
            out.append(rejection_sample(probs, drafts, engine.sampler.seq_generator(s.seq.seq_id, p)))
    return out
