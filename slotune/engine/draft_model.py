"""A separate draft model (a quantized copy of the target, or another local model sharing the
tokenizer) with its own paged KV cache, kept in step with the target's sequences."""

from __future__ import annotations

import torch

from slotune.engine.block_manager import BlockManager
from slotune.engine.config import EngineConfig
from slotune.engine.model_runner import ModelRunner
from slotune.engine.scheduler import ScheduledSeq
from slotune.engine.sequence import Sequence
from slotune.engine.sampler import Sampler
from slotune.engine.speculative import DraftSampler, decoding, draft_budget


class _Mirror:
    """The draft cache's view of one target sequence (shares the token list)."""

    def __init__(self, seq: Sequence) -> None:
        self.seq_id = seq.seq_id
        self.token_ids = seq.token_ids
        self.block_table: list[int] = []
        self.num_computed_tokens = 0
        self.spec_token_ids: list[int] = []
        self.block_hashes: list[int] = []
        self.fed_start = 0  # position of the first draft token fed to the draft model last round
        self.fed: list[int] = []  # those draft tokens (their KV is in the draft cache)

    def sync(self) -> None:
        """Drafts that the target accepted (or re-drew by chance) keep their draft KV: KV at a
        position depends only on the tokens up to it. The rest is stale."""
        match = 0
        for i, t in enumerate(self.fed):
            p = self.fed_start + i
            if p >= len(self.token_ids) or self.token_ids[p] != t:
                break
            match += 1
        if self.fed:
            self.num_computed_tokens = self.fed_start + match
        self.num_computed_tokens = min(self.num_computed_tokens, len(self.token_ids) - 1)
        self.fed = []

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


class DraftModelProposer:
    """Drafts with its own ModelRunner and KV cache. A mirror per target sequence tracks how
    much of it the draft cache holds. Each round costs k draft forward passes: the first feeds
    whatever the draft has not seen (usually just the bonus token, as accepted drafts keep their
    KV) and yields draft 1; each later pass feeds draft j and yields draft j+1."""

    def __init__(self, cfg: EngineConfig, target_vocab_size: int, sampler: Sampler) -> None:
        sc = cfg.speculative
        self.k = sc.num_speculative_tokens
        self.max_model_len = cfg.max_model_len
        if sc.method == "quantized":
            draft_cfg = cfg.with_updates({"quantization": sc.draft_quantization, "speculative.method": "none"})
        else:
            draft_cfg = cfg.with_updates(
                {"model": sc.draft_model, "quantization": "none", "speculative.method": "none"}
            )
        self.runner = ModelRunner(draft_cfg)
        if self.runner.model_cfg.vocab_size != target_vocab_size:
            raise ValueError(
                f"speculative.draft_model vocab ({self.runner.model_cfg.vocab_size}) differs from the "
                f"target's ({target_vocab_size}); a draft must share the tokenizer"
            )
        self.bm = BlockManager(self.runner.num_blocks, cfg.block_size)
        self.mirrors: dict[int, _Mirror] = {}
        self.drafts = DraftSampler(sampler)
        self.draft_probs = self.drafts.draft_probs

    def _sync(self, live: set[int]) -> None:
        for sid in [s for s in self.mirrors if s not in live]:  # finished / aborted / preempted
            self.bm.free_seq(self.mirrors.pop(sid))

    @torch.inference_mode()
    def propose(self, running: list[Sequence]) -> None:
        """running: every sequence the target runs (mirrors of the others are freed)."""
        self.drafts.reset()
        self._sync({s.seq_id for s in running})
        active, ks = [], []
        for seq in decoding(running):
            seq.spec_token_ids = []
            k = draft_budget(seq, self.k, self.max_model_len)
            m = self.mirrors.get(seq.seq_id)
            if m is None:
                m = self.mirrors[seq.seq_id] = _Mirror(seq)
            m.sync()
            catch_up = seq.num_tokens - 1 - m.num_computed_tokens
            if k and self.bm.allocate(m, catch_up + 1 + k):
                active.append((seq, m))
                ks.append(k)
        if not active:
            return
        # Step 1: everything the draft has not seen, up to and including the last token, in one
        # batch (extend rows for catch-up, decode rows otherwise) -> the first draft.
        first = [ScheduledSeq(m, seq.num_tokens - m.num_computed_tokens) for seq, m in active]
        result = self.runner.execute(first)
        rows = torch.tensor([r0 for r0, _ in result.row_ranges], device=result.logits.device)
        toks = self.drafts.choose([seq for seq, _ in active], result.logits[rows])
        pos = []
        for (seq, m), t in zip(active, toks):
            m.num_computed_tokens = seq.num_tokens
            seq.spec_token_ids.append(t)
            pos.append(seq.num_tokens)
        # Steps 2..k: one token per sequence; draft j is fed to produce draft j+1.
        for j in range(1, max(ks)):
            live = [i for i, k in enumerate(ks) if j < k]
            logits = self.runner.run_decode(
                [active[i][1].block_table for i in live], [toks[i] for i in live], [pos[i] for i in live]
            )
            for i, t in zip(live, self.drafts.choose([active[i][0] for i in live], logits)):
                active[i][0].spec_token_ids.append(t)
                toks[i], pos[i] = t, pos[i] + 1
        for (seq, m), k in zip(active, ks):
            m.fed_start, m.fed = seq.num_tokens, seq.spec_token_ids[: k - 1]
