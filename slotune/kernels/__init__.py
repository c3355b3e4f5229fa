"""Triton kernels (one file per op) with plain-torch references in `reference.py`, and the
native CPU decode step (`cpu_decode.c`, loaded by `cpu_decode.py`).

The Triton kernels run on CPU only under Triton's interpreter (TRITON_INTERPRET=1); the engine
uses them on CUDA (kernels.backend: auto|triton). On CPU, kernels.backend auto|native runs every
decode step as one call into `cpu_decode.c`, compiled on first use with the machine's gcc.
"""
