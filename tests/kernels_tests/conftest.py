"""Kernel tests run Triton's interpreter on CPU (set before triton is imported anywhere)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
