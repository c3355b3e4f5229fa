"""Kernel tests run Triton's interpreter on CPU (set before triton is imported anywhere).

Its bf16 dot and int<->bf16 casts are broken (see interpreter_bf16.py); we patch them so the
bf16 kernels (the GPU configuration) are checked as written.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")


if os.environ["TRITON_INTERPRET"] == "1":
    from tests.kernels_tests.interpreter_bf16 import patch_interpreter_bf16

    patch_interpreter_bf16()
