"""Speculative decoding: a cheap draft proposes k tokens, the target verifies them in one pass.

Lifecycle: after each engine step `propose(running)` sets `seq.spec_token_ids` for the running
sequences in their decode phase; the scheduler feeds [last token, drafts...]; `verify_batch`
turns the k+1 target rows into accepted drafts + one bonus/correction token. Proposers are built
with what they read (`llm_engine.build_proposer`: the config, the target's runner, block manager
and sampler), never the engine object. The draft-model proposer lives in draft_model.py.

Verification is standard rejection sampling (Leviathan et al. 2023), per draft position i with
target distribution p_i and draft distribution q_i:
  accept d_i with probability min(1, p_i(d_i) / q_i(d_i));
  on the first rejection, emit a token from norm(max(p_i - q_i, 0)) and stop;
  if all k drafts are accepted, emit a bonus token from p_{k+1}.
The emitted tokens are then distributed exactly as sampling from the target one by one.
Model drafts (early exit, quantized copy, draft model) sample d_i from q_i, the draft's logits
under the request's own temperature/top-k/top-p, and record q_i; n-gram drafts are point
masses (q_i = one-hot), for which the rule reduces to "accept with p(d), else sample p without d".
Greedy requests accept while d == argmax p, so outputs equal non-speculative decoding exactly.
"""

from __future__ import annotations

import torch

from slotune.engine.block_manager import BlockManager
from slotune.engine.config import EngineConfig
from slotune.engine.model_runner import ModelRunner
from slotune.engine.sampler import Sampler
from slotune.engine.sequence import Sequence


def draft_budget(seq: Sequence, k: int, max_model_len: int) -> int:
    """Drafts must not run past max_tokens or max_model_len."""
    left = min(seq.params.max_tokens - seq.num_output_tokens, max_model_len - seq.num_tokens) - 1
    return max(0, min(k, left))


def decoding(running: list[Sequence]) -> list[Sequence]:
    """The running sequences a draft is proposed for: those with only their last token to feed."""
    return [s for s in running if s.num_uncomputed_tokens == 1]


class NgramProposer:
    """Prompt lookup: find the latest earlier occurrence of the longest suffix n-gram, copy what followed."""

    def __init__(self, cfg: EngineConfig) -> None:
        self.draft_probs: dict[int, list[torch.Tensor]] = {}  # point masses: nothing recorded
        self.k = cfg.speculative.num_speculative_tokens
        self.n_max, self.n_min = cfg.speculative.ngram_max, cfg.speculative.ngram_min
        self.max_model_len = cfg.max_model_len

    def draft(self, tokens: list[int], k: int) -> list[int]:
        L = len(tokens)
        for n in range(min(self.n_max, L - 1), self.n_min - 1, -1):
            suffix = tokens[L - n :]
            for start in range(L - n - 1, -1, -1):  # latest match first
                if tokens[start : start + n] == suffix:
                    return tokens[start + n : start + n + k]
        return []

    def propose(self, running: list[Sequence]) -> None:
        for seq in decoding(running):
            k = draft_budget(seq, self.k, self.max_model_len)
            seq.spec_token_ids = self.draft(seq.token_ids, k) if k else []


class DraftSampler:
    """Turns draft logits into draft tokens: argmax for greedy requests, a sample from the
    draft distribution q otherwise, remembering q for verification (keyed by seq_id)."""

    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler
        self.draft_probs: dict[int, list[torch.Tensor]] = {}  # seq_id -> k rows of [V]

    def reset(self) -> None:
        self.draft_probs.clear()  # the previous round is verified (or dropped) by now

    def choose(self, seqs: list, logits: torch.Tensor) -> list[int]:
        # logits: [B, V] -> one draft token per sequence
        toks = logits.argmax(-1)
        sampling = [i for i, s in enumerate(seqs) if not s.params.is_greedy]
        if sampling:
            sampler = self.sampler
            q = sampler.probs(logits[sampling].float(), [seqs[i].params for i in sampling])
            for row, i in enumerate(sampling):
                seq = seqs[i]
                g = sampler.seq_generator(seq.seq_id, seq.params)
                toks[i] = torch.multinomial(q[row], 1, generator=g)[0]
                self.draft_probs.setdefault(seq.seq_id, []).append(q[row])
        return toks.tolist()


class EarlyExitProposer:
    """Self-draft with the first `early_exit_layers` layers + final norm + LM head.

    The draft writes KV only in layers < L_e at the draft positions; verification rewrites
    the same positions with identical inputs, so the shared cache stays consistent.
    """

    def __init__(self, cfg: EngineConfig, runner: ModelRunner, block_manager: BlockManager, sampler: Sampler) -> None:
        self.k = cfg.speculative.num_speculative_tokens
        self.num_layers = min(cfg.speculative.early_exit_layers, runner.model_cfg.num_layers)
        self.max_model_len = cfg.max_model_len
        self.runner, self.block_manager = runner, block_manager
        self.drafts = DraftSampler(sampler)
        self.draft_probs = self.drafts.draft_probs

    def propose(self, running: list[Sequence]) -> None:
        self.drafts.reset()
        active, ks = [], []
        for seq in decoding(running):
            seq.spec_token_ids = []
            k = draft_budget(seq, self.k, self.max_model_len)
            if k and self.block_manager.allocate(seq, 1 + k):  # room for the last token + drafts, else skip drafting
                active.append(seq)
                ks.append(k)
        if not active:
            return
        toks = [s.token_ids[-1] for s in active]
        pos = [s.num_tokens - 1 for s in active]
        for j in range(max(ks)):
            live = [i for i, k in enumerate(ks) if j < k]
            logits = self.runner.run_decode(
                [active[i].block_table for i in live],
                [toks[i] for i in live],
                [pos[i] for i in live],
                num_layers=self.num_layers,
            )
            nxt = self.drafts.choose([active[i] for i in live], logits)
            for i, t in zip(live, nxt):
                active[i].spec_token_ids.append(t)
                toks[i], pos[i] = t, pos[i] + 1


def rejection_sample(
    probs: torch.Tensor,
    drafts: list[int],
    generator: torch.Generator | None = None,
    draft_probs: torch.Tensor | None = None,
) -> list[int]:
    """probs: [k+1, V] target distributions at the k draft positions + one bonus position;
    draft_probs: [k, V] the draft distributions the drafts were sampled from (None = point masses).

    Returns the accepted drafts followed by one corrected or bonus token.
    """
    out: list[int] = []
    u = torch.rand(len(drafts), generator=generator, device=probs.device) if drafts else None
    for i, d in enumerate(drafts):
        p = probs[i]
        q_d = draft_probs[i, d] if draft_probs is not None else 1.0
        if u[i] * q_d < p[d]:  # u < min(1, p(d) / q(d))
            out.append(d)
            continue
        if draft_probs is not None:
            residual = (p - draft_probs[i]).clamp_min(0)
        else:
            residual = p.clone()
            residual[d] = 0
        if residual.sum() <= 0:  # p == q up to rounding: any draw from p is exact
            residual = p
        out.append(int(torch.multinomial(residual / residual.sum(), 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(probs[len(drafts)], 1, generator=generator)))
    return out


def verify_batch(items: list[tuple], sampler: Sampler, draft_probs: dict[int, list[torch.Tensor]]) -> list[list[int]]:
    """items: (scheduled seq, its logits rows [k+1, V]); draft_probs: the proposer's recorded draft
    distributions by seq_id (consumed). Per sequence: accepted drafts + one token."""
    recorded = draft_probs
    out = []
    for s, logits in items:
        k = s.num_draft_tokens
        drafts = s.seq.spec_token_ids[:k]
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
            probs = sampler.probs(logits, [p] * logits.shape[0])
            q = recorded.pop(s.seq.seq_id, None)
            q = torch.stack(q[:k]).to(probs.device) if q is not None and len(q) >= k else None
            out.append(rejection_sample(probs, drafts, sampler.seq_generator(s.seq.seq_id, p), q))
    return out
