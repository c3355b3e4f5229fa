"""Iteration-level (continuous) batching with chunked prefill and preemption by recompute.

Each step hands every running sequence the tokens it needs next (1 for decode, 1 + drafts
for speculative verification, a chunk for prefill), within `max_num_batched_tokens`, then
admits waiting sequences while seats (`max_num_seqs`), tokens and KV blocks remain, in the
order of `policy`: "fcfs" (arrival order) or "shortest_prompt_first" (fewest tokens still to
prefill first, which cuts the mean and p95 TTFT of mixed prompt lengths; preempted sequences
go first under both, and a request passed over `MAX_BYPASS` times goes next, so a long
prompt waits a bounded number of admissions, never forever).
When blocks run out, the newest running sequence is preempted: its blocks are freed and it
is recomputed later from its tokens (prompt + output so far). `static` mode is the baseline:
a batch is admitted only when the previous batch has fully finished. Pure Python.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from slotune.engine.block_manager import BlockManager
from slotune.engine.config import EngineConfig, SchedulingPolicy
from slotune.engine.sequence import Sequence, SequenceStatus

MAX_BYPASS = 64  # shortest_prompt_first: admissions a waiting request may be passed over


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # tokens fed to the model this step (includes draft tokens)
    num_draft_tokens: int = 0


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_chunked_prefill: bool = True,
        static_batching: bool = False,
        policy: SchedulingPolicy = "fcfs",
    ) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.static_batching = static_batching
        self.policy = policy
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._bypassed: dict[int, int] = {}  # seq_id -> later arrivals admitted first (shortest_prompt_first)

    @classmethod
    def from_config(cls, block_manager: BlockManager, cfg: EngineConfig) -> Scheduler:
        """The engine's scheduler: every scheduling knob of EngineConfig is read here, and only here."""
        return cls(
            block_manager,
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            enable_chunked_prefill=cfg.enable_chunked_prefill,
            static_batching=cfg.scheduling == "static",
            policy=cfg.scheduling_policy,
        )

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        bm = self.block_manager

        # 1) Running sequences, oldest first; preempt from the newest end when blocks run out.
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_draft = len(seq.spec_token_ids)
            num_new = seq.num_uncomputed_tokens + num_draft
            if num_draft and num_new > budget:  # drafts are all-or-nothing
                seq.spec_token_ids = []
                num_draft = 0
                num_new = seq.num_uncomputed_tokens
            num_new = min(num_new, budget)
            if not self.enable_chunked_prefill and num_new < seq.num_uncomputed_tokens:
                break
            while not bm.allocate(seq, num_new):
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is seq:
                    break
            if seq.status != SequenceStatus.RUNNING:  # preempted itself
                break
            out.scheduled.append(ScheduledSeq(seq, num_new, num_draft))
            budget -= num_new
            i += 1

        # 2) Admit waiting sequences in policy order.
        # Static: a batch forms while none of its members has produced a token, then closes.
        if self.static_batching and any(s.num_output_tokens > 0 for s in self.running):
            return out
        if self.policy == "shortest_prompt_first" and len(self.waiting) > 1:
            self._order_shortest_first()
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not out.preempted:
            seq = self.waiting[0]
            bm.match_prefix(seq)
            num_new = seq.num_uncomputed_tokens
            if num_new > budget:
                if not self.enable_chunked_prefill:
                    break
                num_new = budget
            if not bm.allocate(seq, num_new):
                break
            self.waiting.popleft()
            self._bypassed.pop(seq.seq_id, None)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, num_new))
            budget -= num_new
        return out

    def _order_shortest_first(self) -> None:
        """Reorder `waiting`: preempted sequences (they hold progress) and requests passed over
        MAX_BYPASS times first, in their current order; then the rest by tokens left to prefill,
        ties by arrival. Everyone moved behind a later arrival counts one more bypass."""

        def key(item: tuple[int, Sequence]) -> tuple[bool, int, int]:
            i, seq = item
            is_due = seq.metrics.num_preemptions > 0 or self._bypassed.get(seq.seq_id, 0) >= MAX_BYPASS
            return (not is_due, 0 if is_due else seq.num_uncomputed_tokens, i)

        order = sorted(enumerate(self.waiting), key=key)
        for new_pos, (old_pos, seq) in enumerate(order):
            if new_pos > old_pos:
                self._bypassed[seq.seq_id] = self._bypassed.get(seq.seq_id, 0) + 1
        self.waiting = deque(seq for _, seq in order)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.block_manager.free_seq(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_cached_tokens = 0
        seq.spec_token_ids = []
        seq.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        out.preempted.append(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        self._bypassed.pop(seq.seq_id, None)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        if seq in self.running:
            self.running.remove(seq)
        else:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        self.block_manager.free_seq(seq)
