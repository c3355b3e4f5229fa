"""Triton kernels (one file per op) with plain-torch references in `reference.py`.

On CPU they run only under Triton's interpreter (TRITON_INTERPRET=1); the engine uses them
on CUDA (kernels.backend: auto|triton).
"""
