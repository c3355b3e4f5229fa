"""Host cost of staging one CUDA-graph decode step's inputs (slotune/engine/cuda_graph.py), on CPU:
per-element torch writes (before) against numpy rows (stage_decode_rows). No GPU needed.

    python bench/gpu/staging_cost.py
"""

from __future__ import annotations

import statistics
import time
from types import SimpleNamespace

import torch

from slotune.engine.cuda_graph import stage_decode_rows
from slotune.engine.layers.attn_metadata import slot_mapping


def torch_writes(batch, st: torch.Tensor, block_size: int) -> None:
    """The staging before: one torch element write per field."""
    b = len(batch)
    st[:b].zero_()
    st[:b, 2] = -1
    st[:b, 3] = 1
    for i, s in enumerate(batch):
        seq = s.seq
        p = seq.num_computed_tokens
        table = seq.block_table
        st[i, 0] = seq.token_ids[p]
        st[i, 1] = p
        st[i, 2] = slot_mapping(table, p, 1, block_size)[0]
        st[i, 3] = p + 1
        st[i, 4 : 4 + len(table)] = torch.tensor(table, dtype=torch.int64)


def per_call_us(fn, calls: int = 100, repeats: int = 7) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t) / calls)
    return statistics.median(times) * 1e6


if __name__ == "__main__":
    for B in (1, 64):  # 200 tokens of context each: 13 blocks of 16
        seq = SimpleNamespace(token_ids=list(range(300)), num_computed_tokens=200, block_table=list(range(13)))
        batch = [SimpleNamespace(seq=seq)] * B
        st = torch.zeros(B, 4 + 128, dtype=torch.int64)
        before = per_call_us(lambda: torch_writes(batch, st, 16))
        after = per_call_us(lambda: stage_decode_rows(batch, st.numpy(), 16))
        print(f"batch {B}: torch writes {before:.1f} us, numpy rows {after:.1f} us ({before / after:.1f}x)")
