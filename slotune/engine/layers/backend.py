"""The kernel backend a model is built with: its attention, its pointwise ops, and the tiles its
quantized layers multiply with, chosen once from `EngineConfig.kernels` (never swapped later).

torch: plain torch everywhere (CPU; kernels.backend torch). triton: our kernels (slotune/kernels/) with
the config's tiles, chosen by kernels.backend triton, or auto on CUDA. The native CPU step
(kernels.backend auto|native on CPU) is not a model backend: the runner hands whole decode steps
to it and keeps a torch-built model for the rest.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from slotune.engine.config import KernelConfig
from slotune.engine.layers.attention import TorchAttentionBackend
from slotune.engine.layers.ops import TorchOps
from slotune.kernels.tiles import MatmulConfig


@dataclass(frozen=True, slots=True)
class Backend:
    name: Literal["torch", "triton"]
    attn: TorchAttentionBackend  # store_kv + attention over the paged cache; per model (holds per-step caches)
    ops: TorchOps  # rms_norm, silu_and_mul, rotary
    matmul: MatmulConfig | None = None  # Triton quantized-matmul tiles; None = torch matmuls


def backend_name(kernels: KernelConfig, device: torch.device) -> Literal["torch", "triton"]:
    return "triton" if kernels.backend == "triton" or (kernels.backend == "auto" and device.type == "cuda") else "torch"


def torch_backend(sliding_window: int | None = None, full_layers: tuple[int, ...] = ()) -> Backend:
    return Backend("torch", TorchAttentionBackend(sliding_window, full_layers), TorchOps())


def select_backend(
    kernels: KernelConfig, device: torch.device, sliding_window: int | None, full_layers: tuple[int, ...] = ()
) -> Backend:
    """A fresh backend for one model (attention backends keep per-step state and counters);
    `full_layers`: layers outside `sliding_window` (Gemma 3)."""
    if backend_name(kernels, device) == "triton":
        from slotune.engine.layers.triton_backend import triton_backend  # imports triton: only when chosen

        return triton_backend(kernels, sliding_window, full_layers)
    return torch_backend(sliding_window, full_layers)
