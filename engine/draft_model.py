"""A separate draft model (a quantized copy of the target, or another local model sharing the
tokenizer) with its own paged KV cache, kept in step with the target's sequences."""

from __future__ import annotations

import torch

from slotune.engine.block_manager import BlockManager
from slotune.engine.config import EngineConfig
from slotune.engine.model_runner import ModelRunner
from slotune.engine.scheduler import ScheduledSeq
from slotune.engine.sequence import Sequence
from slotune.engine.speculative import DraftSampler, _budget


class _Mirror:
    """The draft cache's view of one target sequence (shares the token list)."""

    def __init__(self, seq: Sequence) -> None:
        self.seq_id = seq.seq_id
        self.token_ids = seq.token_ids
        self.block_table: list[int] = []
        self.num_computed_tokens = 0
        self.spec_token_ids: list[int] = []
        self.block_hashes: list[int] = []

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


class DraftModelProposer:
    """Drafts with its own ModelRunner and KV cache. A mirror per target sequence tracks how
    much of it the draft cache holds; after verification the draft catches up on the accepted
    tokens in one extend batch, then runs k single-token steps."""

    def __init__(self, cfg: EngineConfig, engine) -> None:
        sc = cfg.speculative
        self.k = sc.num_speculative_tokens
        self.engine = engine
        if sc.method == "quantized":
            draft_cfg = cfg.with_updates({"quantization": sc.draft_quantization, "speculative.method": "none"})
        else:
            draft_cfg = cfg.with_updates({"model": sc.draft_model, "quantization": "none", "speculative.method": "none"})
        self.runner = ModelRunner(draft_cfg)
        if self.runner.model_cfg.vocab_size != engine.runner.model_cfg.vocab_size:
            raise ValueError(f"speculative.draft_model vocab ({self.runner.model_cfg.vocab_size}) differs from the "
                             f"target's ({engine.runner.model_cfg.vocab_size}); a draft must share the tokenizer")
        self.bm = BlockManager(self.runner.num_blocks, cfg.block_size)
        self.mirrors: dict[int, _Mirror] = {}
        self.drafts = DraftSampler(engine)

    def _sync(self, live: set[int]) -> None:
        for sid in [s for s in self.mirrors if s not in live]:  # finished / aborted / preempted
            self.bm.free_seq(self.mirrors.pop(sid))

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence]) -> None:
        self.drafts.reset()
        self._sync({s.seq_id for s in self.engine.scheduler.running})
        active, ks = [], []
        for seq in seqs:
            seq.spec_token_ids = []
            k = _budget(self.engine, seq, self.k)
            m = self.mirrors.get(seq.seq_id)
            if m is None:
                m = self.mirrors[seq.seq_id] = _Mirror(seq)
            m.num_computed_tokens = min(m.num_computed_tokens, seq.num_tokens - 1)  # rejected drafts are stale
            catch_up = seq.num_tokens - 1 - m.num_computed_tokens
            if k and self.bm.allocate(m, catch_up + 1 + k):
                active.append((seq, m, catch_up))
                ks.append(k)
        if not active:
            return
        # Catch up: feed everything the draft has not seen except the last token (one extend batch).
        pending = [ScheduledSeq(m, c) for _, m, c in active if c > 0]
        if pending:
            self.runner.execute(pending)
            for s in pending:
                s.seq.num_computed_tokens += s.num_new_tokens
        mirrors = [m for _, m, _ in active]
        toks = [s.token_ids[-1] for s, _, _ in active]
        pos = [s.num_tokens - 1 for s, _, _ in active]
        for j in range(max(ks)):
            live = [i for i, k in enumerate(ks) if j < k]
            logits = self.runner.run_decode([mirrors[i] for i in live], [toks[i] for i in live], [pos[i] for i in live])
            for i, t in zip(live, self.drafts.choose([active[i][0] for i in live], logits)):
                active[i][0].spec_token_ids.append(t)
                toks[i], pos[i] = t, pos[i] + 1
        for m in mirrors:
            m.num_computed_tokens += 1  # the last real token is now in the draft cache
