"""Linear layers. `Linear` keeps a dense weight; quantized variants (slotune/engine/quantize.py)
replace it in place with the same `forward(x)` contract, so the model never branches on format."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # [N, K]
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)  # [N] (Qwen2's q/k/v)

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def weight_bytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()
