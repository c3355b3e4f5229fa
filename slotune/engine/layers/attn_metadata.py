"""A step's attention inputs (`AttentionMetadata`) and their one builder: cache slots, block
tables and masks.

A step's tokens are laid out sequence by sequence: first the "extend" sequences (prefill
chunks and speculative verification, query length > 1), then the decode sequences (query
length 1), so each group is one contiguous slice.

Every path that runs the model over the paged cache describes its sequences as `SeqSpan`s and
gets its `AttentionMetadata` here: serving steps and teacher-forced scoring
(ModelRunner._prepare), draft steps at explicit positions (ModelRunner.run_decode), cache-free
logits (`scratch_metadata`), and the slots the native CPU step and the CUDA-graph staging copy
(`slot_mapping`). Sliding-window masks are derived here too (`window_masks`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64, -1 = do not store
    num_extend_tokens: int  # tokens [0, num_extend_tokens) belong to extend sequences
    # extend group
    extend_query_lens: list[int]
    extend_context_lens: list[int]  # total keys after this step (cached + new)
    extend_block_tables: torch.Tensor | None  # [Be, max_blocks] int32
    extend_mask: torch.Tensor | None  # [Be, 1, Qmax, Lmax] bool, None when a plain causal prefill
    # decode group
    decode_block_tables: torch.Tensor | None  # [Bd, max_blocks] int32
    decode_context_lens: torch.Tensor | None  # [Bd] int32
    decode_mask: torch.Tensor | None  # [Bd, 1, 1, Lmax] bool
    block_size: int = 16
    # Known on the host when the batch is built: some slot_mapping entries are -1 (not stored).
    # Reading it from the tensor instead cost a host sync in every layer.
    has_skipped_slots: bool = False
    # A static upper bound on every context length of the step (CUDA graphs: the same launch on
    # every replay, no host sync); None = the decode block tables' width.
    max_context: int | None = None


@dataclass(slots=True)
class SeqSpan:
    """One sequence's new tokens in a step: positions [start, start + num_tokens) of the sequence
    whose KV blocks are `block_table` (covering at least start + num_tokens positions)."""

    block_table: list[int]
    start: int
    num_tokens: int

    @property
    def context_len(self) -> int:  # keys after this step: cached + new
        return self.start + self.num_tokens


def slot_mapping(block_table: list[int], start: int, num_tokens: int, block_size: int) -> list[int]:
    """Flat cache slots of positions [start, start + num_tokens)."""
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, start + num_tokens)]


def block_tables(tables: list[list[int]], width: int | None = None) -> torch.Tensor:
    """[B, width] int32, each row zero-padded (width: the longest table by default)."""
    width = max(len(t) for t in tables) if width is None else width
    bt = torch.zeros(len(tables), width, dtype=torch.int32)
    for i, t in enumerate(tables):
        bt[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
    return bt


def build_metadata(
    extend: list[SeqSpan], decode: list[SeqSpan], block_size: int, device: torch.device
) -> AttentionMetadata:
    """Metadata of a step whose rows are the `extend` spans' tokens, then one row per `decode` span.

    An extend group that is one fresh prompt (nothing cached) gets no block table and no mask: it
    attends over its own K/V (causal SDPA / FlashAttention). Otherwise extend rows get [Be, 1, Qmax, L]
    causal masks over their whole context and decode rows [Bd, 1, 1, L] masks over theirs.
    """
    slots: list[int] = []
    for s in extend + decode:
        slots += slot_mapping(s.block_table, s.start, s.num_tokens, block_size)
    q_lens = [s.num_tokens for s in extend]
    ctx_lens = [s.context_len for s in extend]
    ebt = emask = None
    if extend and not (len(extend) == 1 and extend[0].start == 0):
        ebt = block_tables([s.block_table for s in extend])
        length = ebt.shape[1] * block_size
        j = torch.arange(length)[None, None, :]
        i = torch.arange(max(q_lens))[None, :, None]
        start = torch.tensor([s.start for s in extend])[:, None, None]
        ql = torch.tensor(q_lens)[:, None, None]
        emask = (j <= start + i) & (i < ql)
        emask |= (i >= ql) & (j == 0)  # padded query rows: keep one key so softmax stays finite
        emask = emask[:, None].to(device, non_blocking=True)
        ebt = ebt.to(device, non_blocking=True)
    dbt = dctx = dmask = None
    if decode:
        dbt = block_tables([s.block_table for s in decode])
        ctx = torch.tensor([s.context_len for s in decode], dtype=torch.int32)
        dmask = (torch.arange(dbt.shape[1] * block_size)[None, :] < ctx[:, None])[:, None, None, :]
        dmask = dmask.to(device, non_blocking=True)
        dbt, dctx = dbt.to(device, non_blocking=True), ctx.to(device, non_blocking=True)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64).to(device, non_blocking=True),
        num_extend_tokens=sum(q_lens),
        extend_query_lens=q_lens,
        extend_context_lens=ctx_lens,
        extend_block_tables=ebt,
        extend_mask=emask,
        decode_block_tables=dbt,
        decode_context_lens=dctx,
        decode_mask=dmask,
        block_size=block_size,
    )


def scratch_metadata(num_tokens: int, block_size: int, device: torch.device) -> AttentionMetadata:
    """One fresh sequence attending over its own K/V only, storing nothing in the cache."""
    return AttentionMetadata(
        slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=device),
        num_extend_tokens=num_tokens,
        extend_query_lens=[num_tokens],
        extend_context_lens=[num_tokens],
        extend_block_tables=None,
        extend_mask=None,
        decode_block_tables=None,
        decode_context_lens=None,
        decode_mask=None,
        block_size=block_size,
        has_skipped_slots=True,
    )


def static_decode_metadata(
    slots: torch.Tensor, tables: torch.Tensor, context_lens: torch.Tensor, block_size: int
) -> AttentionMetadata:
    """Decode metadata over preallocated buffers a CUDA graph reads on every replay. slots: [B]
    (-1 = padded row, not stored); tables: [B, max_blocks] int32; context_lens: [B]. The context
    bound is static (max_blocks * block_size): no host sync, the same launch every replay."""
    return AttentionMetadata(
        slot_mapping=slots,
        num_extend_tokens=0,
        extend_query_lens=[],
        extend_context_lens=[],
        extend_block_tables=None,
        extend_mask=None,
        decode_block_tables=tables,
        decode_context_lens=context_lens,
        decode_mask=None,
        block_size=block_size,
        has_skipped_slots=True,
        max_context=tables.shape[1] * block_size,
    )


def window_masks(meta: AttentionMetadata, window: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """meta's (decode mask, extend mask) with keys older than the window masked out: a query at
    position q keeps keys k > q - window. A fresh prompt (no extend mask: causal SDPA) longer than
    the window gets its own [T, T] mask."""
    dmask = meta.decode_mask
    if dmask is not None:  # [Bd, 1, 1, L]; the query sits at position context_len - 1
        j = torch.arange(dmask.shape[-1], device=dmask.device)
        first = meta.decode_context_lens.to(torch.int64)[:, None] - window  # [Bd, 1] oldest key kept
        dmask = dmask & (j[None, :] >= first)[:, None, None, :]
    emask = meta.extend_mask
    if emask is not None:  # [Be, 1, Qmax, L]; row i of sequence b sits at position ctx_b - qlen_b + i
        _, _, qmax, length = emask.shape
        i = torch.arange(qmax)[None, :, None]
        j = torch.arange(length)[None, None, :]
        q_lens = torch.tensor(meta.extend_query_lens)[:, None, None]
        pos = torch.tensor([c - n for c, n in zip(meta.extend_context_lens, meta.extend_query_lens)])[:, None, None] + i
        keep = (j > pos - window) | (i >= q_lens)  # padded rows keep their one key (finite softmax)
        emask = emask & keep[:, None].to(emask.device, non_blocking=True)
    elif meta.num_extend_tokens > window:
        i = torch.arange(meta.num_extend_tokens, device=meta.slot_mapping.device)
        emask = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)  # [T, T]
    return dmask, emask
