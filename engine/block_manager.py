"""Paged KV-cache bookkeeping: fixed-size blocks, block tables, free list, refcounts, prefix cache.

Prefix caching (vLLM's automatic prefix caching): every *full* block gets a hash chained
from its parent's, so equal hashes mean equal prefixes. Freed blocks keep their hash and
stay findable until reused; the free list is LRU-ordered, so the least recently freed
block is evicted first. Pure Python: no torch.
"""

from __future__ import annotations

from collections import OrderedDict

from slotune.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False) -> None:
        assert num_blocks > 0 and block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.hash_to_block: dict[int, int] = {}
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.peak_blocks_used = 0
        self.num_prefix_queries = 0  # prompt tokens looked up
        self.num_prefix_hits = 0  # prompt tokens found

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # --- prefix cache -------------------------------------------------------------------
    def _chain_hash(self, parent: int | None, tokens: list[int]) -> int:
        return hash((parent, tuple(tokens)))

    def match_prefix(self, seq: Sequence) -> None:
        """Attach cached blocks for the longest cached prefix of a fresh sequence.

        At least one prompt token is always left to compute, so the step still yields logits.
        """
        if not self.enable_prefix_caching or seq.num_computed_tokens > 0:
            return
        bs = self.block_size
        max_blocks = (seq.num_tokens - 1) // bs
        self.num_prefix_queries += seq.num_tokens
        parent = None
        for i in range(max_blocks):
            tokens = seq.token_ids[i * bs : (i + 1) * bs]
            h = self._chain_hash(parent, tokens)
            block = self.hash_to_block.get(h)
            if block is None:
                break
            if self.ref_counts[block] == 0:
                del self.free[block]
            self.ref_counts[block] += 1
            seq.block_table.append(block)
            seq.block_hashes.append(h)
            parent = h
        n = len(seq.block_table) * bs
        seq.num_computed_tokens = seq.num_cached_tokens = n
        seq.metrics.num_cached_prompt_tokens = n
        self.num_prefix_hits += n
        self._track_peak()

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register hashes for blocks that became full of computed tokens."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        num_full = min(seq.num_computed_tokens // bs, len(seq.block_table))
        parent = seq.block_hashes[-1] if seq.block_hashes else None
        for i in range(len(seq.block_hashes), num_full):
            h = self._chain_hash(parent, seq.token_ids[i * bs : (i + 1) * bs])
            seq.block_hashes.append(h)
            block = seq.block_table[i]
            if h not in self.hash_to_block:
                self.hash_to_block[h] = block
                self.block_hash[block] = h
            parent = h

    # --- allocation ---------------------------------------------------------------------
    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        need = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        return need <= len(self.free)

    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Grow seq's block table to hold num_new_tokens more; False (nothing changed) if short."""
        need = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        if need > len(self.free):
            return False
        for _ in range(need):
            block, _ = self.free.popitem(last=False)  # LRU eviction
            h = self.block_hash[block]
            if h is not None:
                if self.hash_to_block.get(h) == block:
                    del self.hash_to_block[h]
                self.block_hash[block] = None
            self.ref_counts[block] = 1
            seq.block_table.append(block)
        self._track_peak()
        return True

    def free_seq(self, seq: Sequence) -> None:
        # Tail blocks first into the LRU queue: they are the least likely to be shared.
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            assert self.ref_counts[block] >= 0
            if self.ref_counts[block] == 0:
                if self.block_hash[block] is None:
                    self.free[block] = None
                    self.free.move_to_end(block, last=False)  # unhashed: reuse first
                else:
                    self.free[block] = None
        seq.block_table = []
        seq.block_hashes = []

    def _track_peak(self) -> None:
        used = self.num_blocks - len(self.free)
        if used > self.peak_blocks_used:
            self.peak_blocks_used = used
