"""Write new K/V rows into the paged cache at slot_mapping, quantizing to int8/fp8 with
per-(token, head) scales when the cache is quantized (kv_quant.py's format). Slot -1 is skipped."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from slotune.kernels.kv_quant import QMAX


@triton.jit
def _kv_store_kernel(
    k_ptr,
    v_ptr,
    kc_ptr,
    vc_ptr,
    ks_ptr,
    vs_ptr,
    slot_ptr,
    n_heads,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cs,
    stride_ch,
    stride_ss,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    QUANT: tl.constexpr,
    QMAX: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    if slot >= 0:
        h = tl.arange(0, HEADS_PAD)[:, None]
        d = tl.arange(0, HEAD_DIM)[None, :]
        hm = h < n_heads
        k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=hm, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=hm, other=0.0).to(tl.float32)
        dst = slot * stride_cs + h * stride_ch + d
        if QUANT:
            hs = tl.arange(0, HEADS_PAD)
            ksc = tl.maximum(tl.max(tl.abs(k), axis=1), 1e-8) / QMAX
            vsc = tl.maximum(tl.max(tl.abs(v), axis=1), 1e-8) / QMAX
            kq = k / ksc[:, None]
            vq = v / vsc[:, None]
            if QMAX == 127.0:  # int8: round to nearest
                kq = tl.floor(kq + 0.5)
                vq = tl.floor(vq + 0.5)
            kq = tl.minimum(tl.maximum(kq, -QMAX), QMAX)
            vq = tl.minimum(tl.maximum(vq, -QMAX), QMAX)
            tl.store(kc_ptr + dst, kq.to(kc_ptr.dtype.element_ty), mask=hm)
            tl.store(vc_ptr + dst, vq.to(vc_ptr.dtype.element_ty), mask=hm)
            tl.store(ks_ptr + slot * stride_ss + hs, ksc, mask=hs < n_heads)
            tl.store(vs_ptr + slot * stride_ss + hs, vsc, mask=hs < n_heads)
        else:
            tl.store(kc_ptr + dst, k.to(kc_ptr.dtype.element_ty), mask=hm)
            tl.store(vc_ptr + dst, v.to(vc_ptr.dtype.element_ty), mask=hm)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """k, v: [T, Hkv, D]; caches: [NB, BS, Hkv, D]; scales: [NB, BS, Hkv] or None; slots: [T] int64."""
    T, H, D = k.shape
    assert k_cache.shape[2:] == (H, D) and v.shape == k.shape and slots.shape == (T,)
    quant = k_scale is not None
    qmax = QMAX["int8"] if k_cache.dtype == torch.int8 else QMAX["fp8"]
    kc, vc = k_cache.view(-1, H, D), v_cache.view(-1, H, D)
    ks = k_scale.view(-1, H) if quant else kc
    vs = v_scale.view(-1, H) if quant else vc
    if T:
        _kv_store_kernel[(T,)](
            k,
            v,
            kc,
            vc,
            ks,
            vs,
            slots,
            H,
            k.stride(0),
            k.stride(1),
            v.stride(0),
            v.stride(1),
            kc.stride(0),
            kc.stride(1),
            ks.stride(0) if quant else 0,
            HEAD_DIM=D,
            HEADS_PAD=triton.next_power_of_2(H),
            QUANT=quant,
            QMAX=qmax,
        )
