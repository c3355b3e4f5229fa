"""A test seam: Triton's CPU interpreter patched for bf16 (tests and `bench/gpu/run_all.py smoke` only).

Triton's CPU interpreter (3.9) stores bfloat16 as raw uint16 bits and forgets that in two
places: `tl.dot` on bf16 operands multiplies the bit patterns, and int <-> bf16 casts
(`si_to_fp` and friends) convert the integer value as bits. Compiled kernels are unaffected.
`patch_interpreter_bf16` fixes both, so bf16 kernels (the GPU configuration) can be checked
on CPU as written; the kernel tests and `bench/gpu/run_all.py smoke` call it.
"""

from __future__ import annotations


def patch_interpreter_bf16() -> None:
    """Fix the interpreter's bf16 dot and int<->bf16 casts (idempotent; CPU interpreter only)."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter as it

    builder = it.InterpreterBuilder
    if getattr(builder, "_slotune_bf16_patched", False):
        return
    dot, cast = builder.create_dot, builder.cast_impl

    def to_f32(h):
        return it.TensorHandle(it._convert_float(h.data, tl.bfloat16, tl.float32, None).view(np.float32), tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        a = to_f32(a) if a.dtype.scalar == tl.bfloat16 else a
        b = to_f32(b) if b.dtype.scalar == tl.bfloat16 else b
        return dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    def cast_impl(self, src, dst_type):
        s, t = src.dtype.scalar, dst_type.scalar
        if t == tl.bfloat16 and s.is_int():
            src = it.TensorHandle(src.data.astype(np.float32), tl.float32)
        elif s == tl.bfloat16 and t.is_int():
            src = to_f32(src)
        return cast(self, src, dst_type)

    builder.create_dot, builder.cast_impl = create_dot, cast_impl
    for name in ("create_si_to_fp", "create_ui_to_fp", "create_fp_to_si", "create_fp_to_ui"):
        setattr(builder, name, lambda self, src, dst_type: self.cast_impl(src, dst_type))
    builder._slotune_bf16_patched = True
