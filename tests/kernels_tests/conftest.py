"""Kernel tests run Triton's interpreter on CPU (set before triton is imported anywhere).

The interpreter (Triton 3.9) stores bfloat16 as raw uint16 bits and forgets that in two
places: `tl.dot` on bf16 operands multiplies the bit patterns, and int -> bf16 casts
(`si_to_fp`) write the integer value as bits. Compiled kernels are unaffected. We patch both
here, test-only, so the bf16 kernels (the GPU configuration) are checked as written.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")


def _patch_interpreter_bf16() -> None:
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


if os.environ["TRITON_INTERPRET"] == "1":
    _patch_interpreter_bf16()
