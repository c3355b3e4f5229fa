"""Tile configs of the Triton kernels: the one definition of each kernel's tiles.

Each kernel's launcher takes its config type from here, its `configs(shape)` enumerates the
values listed here (filtered by shape), and `EngineConfig.kernels` uses the same types, so a
tuned `best.yaml`, a search space and the kernel agree on what a tile can be: a value the
kernel does not offer is rejected when the config is validated (`tune validate` included),
with the allowed values in the message.

Torch- and Triton-free (pydantic only): `slotune/engine/config.py` imports it, and the operator image
validates configs with neither installed.

Defaults: the best measured at batch 64 on an H100 (bench/gpu/README.md lists the committed results).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

# What each kernel's configs() draws from.
DECODE_BLOCK_N = (16, 32, 64, 128)
DECODE_NUM_SPLITS = (1, 2, 4, 8, 16)
DECODE_NUM_WARPS = (1, 2, 4, 8)
DECODE_NUM_STAGES = (1, 2, 3)

PREFILL_BLOCK_M = (16, 32, 64, 128)
PREFILL_BLOCK_N = (16, 32, 64, 128)
PREFILL_NUM_WARPS = (2, 4, 8)
PREFILL_NUM_STAGES = (1, 2, 3)

MATMUL_BLOCK_M = (16, 32, 64, 128)
MATMUL_BLOCK_N = (32, 64, 128, 256)
MATMUL_BLOCK_K = (32, 64, 128, 256)
MATMUL_NUM_WARPS = (2, 4, 8)
MATMUL_NUM_STAGES = (2, 3, 4)
MATMUL_SPLIT_K = (1, 2, 4, 8)


class _Tiles(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)  # frozen: hashable, shared safely by launches


class DecodeAttentionConfig(_Tiles):
    """Tiles of the paged decode-attention kernel (slotune/kernels/decode_attention.py)."""

    block_n: Literal[DECODE_BLOCK_N] = 16  # keys per inner-loop tile
    num_splits: Literal[DECODE_NUM_SPLITS] = Field(8, description="flash-decoding split count over the context")
    num_warps: Literal[DECODE_NUM_WARPS] = 1
    num_stages: Literal[DECODE_NUM_STAGES] = 2


class PrefillAttentionConfig(_Tiles):
    """Tiles of the paged prefill/extend attention kernel (slotune/kernels/prefill_attention.py)."""

    block_m: Literal[PREFILL_BLOCK_M] = 64  # query rows per program
    block_n: Literal[PREFILL_BLOCK_N] = 64  # keys per inner-loop tile
    num_warps: Literal[PREFILL_NUM_WARPS] = 4
    num_stages: Literal[PREFILL_NUM_STAGES] = 2


class MatmulConfig(_Tiles):
    """Tiles of the weight-only quantized matmul kernel (slotune/kernels/quant_matmul.py)."""

    block_m: Literal[MATMUL_BLOCK_M] = 16
    block_n: Literal[MATMUL_BLOCK_N] = 64
    block_k: Literal[MATMUL_BLOCK_K] = 64
    num_warps: Literal[MATMUL_NUM_WARPS] = 4
    num_stages: Literal[MATMUL_NUM_STAGES] = 3
    split_k: Literal[MATMUL_SPLIT_K] = Field(1, description="K splits: more programs for skinny decode shapes")
