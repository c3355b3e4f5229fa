"""Kernel tests: TRITON_INTERPRET (default 1) picks Triton's interpreter on CPU (1) or compiled kernels
on a CUDA GPU (0, when torch sees one: every test then runs with "cuda" as torch's default device).

The interpreter's bf16 dot and int<->bf16 casts are broken (see interpreter_bf16.py); we patch them so
the bf16 kernels (the GPU configuration) are checked as written.
"""

import os

import pytest
import torch

from tests.kernels_tests.device import DEV, GPU

if os.environ["TRITON_INTERPRET"] == "1":
    from tests.kernels_tests.interpreter_bf16 import patch_interpreter_bf16

    patch_interpreter_bf16()


@pytest.fixture(autouse=True)
def default_device():
    """Plain torch.randn/zeros/tensor/arange create tensors on DEV (per test: other folders keep CPU)."""
    if not GPU:
        yield
        return
    previous = torch.get_default_device()
    torch.set_default_device(DEV)
    try:
        yield
    finally:
        torch.set_default_device(previous)
