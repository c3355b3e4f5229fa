"""The CUDA-graph decode step's host staging (slotune/engine/cuda_graph.py), checked on CPU: the graph
itself needs a GPU (bench/gpu/run_all.py compares graph and eager tokens there)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from slotune.engine.cuda_graph import stage_decode_rows
from slotune.engine.layers.attn_metadata import slot_mapping


def _scheduled(tokens: list[int], computed: int, table: list[int]):
    return SimpleNamespace(seq=SimpleNamespace(token_ids=tokens, num_computed_tokens=computed, block_table=table))


def test_rows_hold_each_sequence_then_padding():
    bs, width = 4, 6
    batch = [_scheduled(list(range(100, 110)), 9, [7, 2, 5]), _scheduled([5, 6], 1, [3])]
    rows = np.full((4, 4 + width), 99, dtype=np.int64)  # stale values from an earlier, larger step
    stage_decode_rows(batch, rows, bs)
    assert rows[0, :4].tolist() == [109, 9, slot_mapping([7, 2, 5], 9, 1, bs)[0], 10]
    assert rows[0, 4:].tolist() == [7, 2, 5, 0, 0, 0]
    assert rows[1].tolist() == [6, 1, 13, 2, 3, 0, 0, 0, 0, 0]
    assert rows[2:].tolist() == [[0, 0, -1, 1] + [0] * width] * 2  # padding: no KV write, one token of context
