"""Decode steps captured as CUDA graphs at bucketed batch sizes (Triton backend on CUDA).

A 135M-parameter decode step is ~600 small kernels; launched from Python that is mostly
launch overhead. Capturing the whole step once per batch-size bucket turns it into one
graph replay. Inputs go through static buffers (one host->device copy of a staging tensor
per step); padded rows write to slot -1 (skipped) and attend over one token.
"""

from __future__ import annotations

import numpy as np
import torch

from slotune.engine.layers.attn_metadata import slot_mapping, static_decode_metadata

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


class DecodeGraphs:
    def __init__(self, runner, max_batch: int) -> None:
        self.runner = runner
        model, dev, bs = runner.model, runner.device, runner.block_size
        self.buckets = [b for b in BUCKETS if b <= max_batch] or [1]
        if self.buckets[-1] < max_batch:
            self.buckets.append(max_batch)
        n = self.buckets[-1]
        self.max_blocks = -(-runner.cfg.max_model_len // bs)
        self.ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.pos = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slots = torch.full((n,), -1, dtype=torch.int64, device=dev)
        self.ctx = torch.ones(n, dtype=torch.int32, device=dev)
        self.bt = torch.zeros(n, self.max_blocks, dtype=torch.int32, device=dev)
        # host staging: [ids, pos, slots, ctx, block table] rows, copied in one go
        self.staging = torch.zeros(n, 4 + self.max_blocks, dtype=torch.int64, pin_memory=True)
        self.staging_rows = self.staging.numpy()  # filled through numpy: a torch element write costs ~3 us
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        pool = None
        for b in reversed(self.buckets):  # largest first, so smaller graphs reuse its pool
            meta = static_decode_metadata(self.slots[:b], self.bt[:b], self.ctx[:b], bs)
            with torch.inference_mode():
                for _ in range(2):  # warm up: Triton autotune/compile outside capture
                    model.compute_logits(model(self.ids[:b], self.pos[:b], runner.kv_cache, meta))
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool):
                    self.outputs[b] = model.compute_logits(model(self.ids[:b], self.pos[:b], runner.kv_cache, meta))
            pool = g.pool()
            self.graphs[b] = g
        torch.cuda.synchronize()

    def can_run(self, batch) -> bool:
        return len(batch) <= self.buckets[-1] and all(s.num_new_tokens == 1 and not s.num_draft_tokens for s in batch)

    def run(self, batch) -> torch.Tensor:
        """Decode one token for each scheduled sequence. -> logits [B, V]."""
        B = len(batch)
        b = next(x for x in self.buckets if x >= B)
        stage_decode_rows(batch, self.staging_rows[:b], self.runner.block_size)
        dev = self.staging[:b].to(self.runner.device, non_blocking=True)
        self.ids[:b].copy_(dev[:, 0])
        self.pos[:b].copy_(dev[:, 1])
        self.slots[:b].copy_(dev[:, 2])
        self.ctx[:b].copy_(dev[:, 3])
        self.bt[:b].copy_(dev[:, 4:])
        self.graphs[b].replay()
        return self.outputs[b][:B]


def stage_decode_rows(batch, rows: np.ndarray, block_size: int) -> None:
    """Fill `rows` [bucket, 4 + max_blocks] with [token, position, slot, context length, block table]
    per scheduled sequence; rows past the batch are padding: token 0 at position 0, slot -1 (not
    stored), a context of one token."""
    rows.fill(0)
    rows[len(batch) :, 2] = -1
    rows[len(batch) :, 3] = 1
    for row, s in zip(rows, batch):
        seq = s.seq
        p = seq.num_computed_tokens
        table = seq.block_table
        row[:4] = (seq.token_ids[p], p, slot_mapping(table, p, 1, block_size)[0], p + 1)
        row[4 : 4 + len(table)] = table
