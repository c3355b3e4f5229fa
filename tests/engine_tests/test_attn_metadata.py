"""The one builder of attention inputs (slotune/engine/layers/attn_metadata.py): slots, block tables, masks."""

from __future__ import annotations

import torch

from slotune.engine.layers.attn_metadata import SeqSpan, build_metadata, scratch_metadata, slot_mapping

CPU = torch.device("cpu")


def test_slots_follow_the_block_table_across_block_boundaries():
    assert slot_mapping([5, 2], start=3, num_tokens=3, block_size=4) == [23, 8, 9]


def test_a_mixed_step_lays_out_extend_rows_then_decode_rows():
    """A 3-token prefill chunk over 2 cached tokens (blocks 1, 3, 6) and a decode at position 1 (block 0)."""
    meta = build_metadata([SeqSpan([1, 3, 6], 2, 3)], [SeqSpan([0], 1, 1)], block_size=2, device=CPU)
    assert meta.slot_mapping.tolist() == [6, 7, 12, 1]  # extend positions 2, 3, 4; then the decode's position 1
    assert meta.num_extend_tokens == 3 and meta.extend_query_lens == [3] and meta.extend_context_lens == [5]
    assert meta.extend_block_tables.tolist() == [[1, 3, 6]] and meta.decode_block_tables.tolist() == [[0]]
    # query row i sits at position 2 + i and sees keys 0..2+i of the 6 slots its table spans
    t, f = True, False
    assert meta.extend_mask[0, 0].tolist() == [[t, t, t, f, f, f], [t, t, t, t, f, f], [t, t, t, t, t, f]]
    assert meta.decode_context_lens.tolist() == [2] and meta.decode_mask[0, 0, 0].tolist() == [True, True]


def test_a_lone_fresh_prompt_attends_over_its_own_kv_and_scratch_stores_nothing():
    meta = build_metadata([SeqSpan([4, 5], 0, 3)], [], block_size=2, device=CPU)
    assert meta.extend_mask is None and meta.extend_block_tables is None and meta.decode_block_tables is None
    assert meta.slot_mapping.tolist() == [8, 9, 10]
    scratch = scratch_metadata(3, block_size=2, device=CPU)
    assert scratch.slot_mapping.tolist() == [-1, -1, -1] and scratch.has_skipped_slots
