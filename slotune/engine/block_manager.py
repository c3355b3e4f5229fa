"""Paged KV-cache bookkeeping: fixed-size blocks, block tables, free list, refcounts, prefix cache.

Prefix caching (vLLM's automatic prefix caching): every *full* block gets a key chained from
its parent's, SHA-256 of (parent key, the block's token ids), as vLLM after GHSA-rm76-4mrf-v9r8
(Python's `hash` of a tuple is cheap to collide on purpose, and a collision hands one client's
KV to another). A key only finds a candidate: each cached block also keeps its token ids and
the serial number of the cached block it followed, and a hit must match both, so a hit is an
exact prefix match whatever `hash_fn` does (a test injects a constant one). Serial numbers are
never reused, so a parent evicted and cached again no longer vouches for its old children.
Freed blocks keep their key and stay findable until reused; the free list is LRU-ordered, so
the least recently freed block is evicted first. Pure Python: no torch.
"""

from __future__ import annotations

import hashlib
import itertools
from array import array
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from slotune.engine.sequence import Sequence

BlockHashFn = Callable[[Hashable | None, tuple[int, ...]], Hashable]


def sha256_block_key(parent: bytes | None, token_ids: tuple[int, ...]) -> bytes:
    """SHA-256 of the parent's key (32 bytes, or none for a first block) and the ids as int64."""
    return hashlib.sha256((parent or b"") + array("q", token_ids).tobytes()).digest()


@dataclass(slots=True)
class CachedBlock:
    """What a full block holds, as the prefix cache knows it (never changed once made)."""

    key: Hashable
    serial: int | None  # None: not in the cache (its key was taken by other contents), nor are its children
    parent_serial: int | None
    token_ids: tuple[int, ...]


_ROOT = CachedBlock(key=None, serial=0, parent_serial=None, token_ids=())  # the parent of every first block


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = False,
        *,
        hash_fn: BlockHashFn = sha256_block_key,
    ) -> None:
        assert num_blocks > 0 and block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_fn = hash_fn
        self.ref_counts = [0] * num_blocks
        self.cached: list[CachedBlock | None] = [None] * num_blocks
        self.hash_to_block: dict[Hashable, int] = {}
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._serials = itertools.count(1)
        self.peak_blocks_used = 0  # since the engine started
        self.window_peak_blocks = 0  # since `start_peak_window` (a measured run)
        self.num_prefix_queries = 0  # prompt tokens looked up
        self.num_prefix_hits = 0  # prompt tokens found
        self.num_hash_collisions = 0  # a key matched but the tokens or parent did not: refused, counted

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # --- prefix cache -------------------------------------------------------------------
    def match_prefix(self, seq: Sequence) -> None:
        """Attach cached blocks for the longest cached prefix of a fresh sequence.

        At least one prompt token is always left to compute, so the step still yields logits.
        """
        if not self.enable_prefix_caching or seq.num_computed_tokens > 0:
            return
        bs = self.block_size
        max_blocks = (seq.num_tokens - 1) // bs
        self.num_prefix_queries += seq.num_tokens
        parent = _ROOT
        for i in range(max_blocks):
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            block = self.hash_to_block.get(self.hash_fn(parent.key, tokens))
            if block is None:
                break
            entry = self.cached[block]
            if entry.parent_serial != parent.serial or entry.token_ids != tokens:
                self.num_hash_collisions += 1
                break
            if self.ref_counts[block] == 0:
                del self.free[block]
            self.ref_counts[block] += 1
            seq.block_table.append(block)
            seq.block_hashes.append(entry)
            parent = entry
        n = len(seq.block_table) * bs
        seq.num_computed_tokens = seq.num_cached_tokens = n
        seq.metrics.num_cached_prompt_tokens = n
        self.num_prefix_hits += n
        self._track_peak()

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register blocks that became full of computed tokens."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        num_full = min(seq.num_computed_tokens // bs, len(seq.block_table))
        parent = seq.block_hashes[-1] if seq.block_hashes else _ROOT
        for i in range(len(seq.block_hashes), num_full):
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            parent = self._register(seq.block_table[i], parent, tokens)
            seq.block_hashes.append(parent)

    def _register(self, block: int, parent: CachedBlock, tokens: tuple[int, ...]) -> CachedBlock:
        key = self.hash_fn(parent.key, tokens)
        if parent.serial is None:  # an uncached parent: nothing could reach this block
            return CachedBlock(key, None, None, tokens)
        holder = self.hash_to_block.get(key)
        if holder is None:
            entry = CachedBlock(key, next(self._serials), parent.serial, tokens)
            self.hash_to_block[key] = block
            self.cached[block] = entry
            return entry
        other = self.cached[holder]
        if other.parent_serial == parent.serial and other.token_ids == tokens:
            return other  # the same contents, computed twice (two requests at once): one cache entry
        self.num_hash_collisions += 1
        return CachedBlock(key, None, None, tokens)

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
            entry = self.cached[block]
            if entry is not None:
                del self.hash_to_block[entry.key]
                self.cached[block] = None
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
                self.free[block] = None
                if self.cached[block] is None:
                    self.free.move_to_end(block, last=False)  # uncached: reuse first
        seq.block_table = []
        seq.block_hashes = []

    def start_peak_window(self) -> None:
        """Measure the KV-block peak afresh from now (the lifetime peak is kept)."""
        self.window_peak_blocks = self.num_blocks - len(self.free)

    def _track_peak(self) -> None:
        used = self.num_blocks - len(self.free)
        if used > self.peak_blocks_used:
            self.peak_blocks_used = used
        if used > self.window_peak_blocks:
            self.window_peak_blocks = used
