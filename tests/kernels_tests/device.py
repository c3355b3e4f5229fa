"""Where the kernel tests run, decided once (conftest and the tests import it).

TRITON_INTERPRET=1 (the default): Triton's interpreter on CPU tensors. TRITON_INTERPRET=0 with CUDA
available: compiled kernels on the GPU, with "cuda" the default device during each test (conftest).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported anywhere

import torch  # noqa: E402

GPU = os.environ["TRITON_INTERPRET"] == "0" and torch.cuda.is_available()
DEV = "cuda" if GPU else "cpu"
