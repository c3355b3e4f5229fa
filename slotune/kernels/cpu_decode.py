"""A whole decode step in one native call on CPU (slotune/kernels/cpu_decode.c), for small batches.

The C source is compiled once per machine with the system gcc (`-O3 -march=native -fopenmp`: AVX-512 or
AVX2 + FMA, as `isa()` reports) into ~/.cache/slotune/native/ and loaded with ctypes; weights are repacked
for exactly that build. torch is imported first, so the library's `libgomp.so.1` is torch's: one OpenMP
thread pool in the process. ctypes releases the GIL, so the HTTP event loop runs while a step computes.
`NativeModel` / `NativeLayer` / `NativeLinear` name the plain tensors the kernel reads in place (the engine
fills them: slotune/engine/native_step.py); `CpuDecoder.unsupported` says why a model cannot run here, and the
runner then keeps the torch path. Speculative verification and draft steps stay on torch, over the same
KV cache. Measurements behind the row limits: docs/design/kernels-cpu-decode.md.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_decode.c")
# SLOTUNE_NATIVE_CFLAGS adds gcc flags: `-mno-avx512f` (with ATEN_CPU_CAPABILITY=avx2, so torch packs int4
# in AVX2's blocks too) builds the AVX2 kernels on an AVX-512 CPU, as tests do
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-fno-math-errno"]
CFLAGS += shlex.split(os.environ.get("SLOTUNE_NATIVE_CFLAGS", ""))
W_F32, W_BF16, W_INT8, W_INT4, W_INT8_VNNI, W_INT8_AVX2, W_INT4_VNNI, W_INT4_AVX2 = 0, 1, 2, 3, 4, 5, 6, 7
# slotune_isa() flags (cpu_decode.c): float kernels' ISA, and the int8-activation kernels compiled in
ISA_AVX512, ISA_AVX2, ISA_INT8_VNNI, ISA_INT8_AVX2, ISA_INT4_INT8ACT, ISA_AMX = 1, 2, 4, 8, 16, 32
MAX_HEAD_DIM = 512  # the kernel widens 16 K rows into a stack buffer of this size
SPLIT_THREADS, SPLIT_ROWS = 8, 2  # cpu_decode.c's: the scratch of int4 blocks and attention tasks split


@dataclass(slots=True)
class NativeLinear:
    """One projection as the kernel reads it, in place: y = x @ W^T (+ bias).

    kind W_F32 / W_BF16: weight [N, K] dense, contiguous. W_INT8: weight [N, K] int8 codes,
    scales [N] bf16 per channel. W_INT4: weight is torch's CPU int4 pack
    (`_convert_weight_to_int4pack_for_cpu`, K padded to the group), scales its scales_and_zeros
    [K/group, N, 2]. k: the in-features x has (unpadded); bias [N] any float dtype or None.
    """

    kind: int
    n: int
    k: int
    weight: torch.Tensor
    scales: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    group: int = 0


@dataclass(slots=True)
class NativeLayer:
    input_norm: torch.Tensor  # [D]
    post_norm: torch.Tensor  # [D]
    qkv: NativeLinear  # [(H + 2 Hkv) * Dh, D]
    o: NativeLinear
    gate_up: NativeLinear  # [2 I, D] (gate | up)
    down: NativeLinear
    q_norm: torch.Tensor | None = None  # [Dh] per-head RMSNorm weights (Qwen3, Gemma 3), or None
    k_norm: torch.Tensor | None = None
    attn_out_norm: torch.Tensor | None = None  # [D] the attention's output normed (Gemma 3), or None
    mlp_out_norm: torch.Tensor | None = None  # [D] the MLP's output normed (Gemma 3), or None
    cos_sin: torch.Tensor | None = None  # [max_positions, rotary_dim] float32 cos | sin halves; None: NoPE
    window: int | None = None  # sliding window in keys, None: every key


@dataclass(slots=True)
class NativeModel:
    """A Llama-family decoder as plain tensors (embed and norms in the model dtype)."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    embed: torch.Tensor  # [V, D]
    norm: torch.Tensor  # [D]
    layers: list[NativeLayer]
    lm_head: NativeLinear
    rotary_dim: int  # RoPE on each head's first rotary_dim dims (head_dim but for Phi-3)
    attn_scale: float  # softmax scale
    embed_scale: float | None = None  # Gemma: embeddings times sqrt(hidden)
    gelu: bool = False  # the MLP's gate: GeGLU with tanh GELU (Gemma), else SwiGLU


class _Lin(ctypes.Structure):
    _fields_ = [
        ("kind", ctypes.c_int32),
        ("n", ctypes.c_int32),
        ("k", ctypes.c_int32),
        ("group", ctypes.c_int32),
        ("w", ctypes.c_void_p),
        ("scales", ctypes.c_void_p),
        ("bias", ctypes.c_void_p),
    ]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("input_norm", ctypes.c_void_p),
        ("post_norm", ctypes.c_void_p),
        ("qkv", _Lin),
        ("o", _Lin),
        ("gate_up", _Lin),
        ("down", _Lin),
        ("q_norm", ctypes.c_void_p),
        ("k_norm", ctypes.c_void_p),
        ("attn_out_norm", ctypes.c_void_p),
        ("mlp_out_norm", ctypes.c_void_p),
        ("cos_sin", ctypes.c_void_p),
        ("window", ctypes.c_int32),
    ]


class _Model(ctypes.Structure):
    _fields_ = [
        *[
            (n, ctypes.c_int32)
            for n in (
                "num_layers",
                "hidden",
                "num_heads",
                "num_kv_heads",
                "head_dim",
                "inter",
                "vocab",
                "dtype",
                "block_size",
            )
        ],
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("num_blocks", ctypes.c_int64),
        ("embed", ctypes.c_void_p),
        ("final_norm", ctypes.c_void_p),
        ("layers", ctypes.POINTER(_Layer)),
        ("lm_head", _Lin),
        ("k_cache", ctypes.c_void_p),
        ("v_cache", ctypes.c_void_p),
        *[(n, ctypes.c_void_p) for n in ("x", "res", "h", "qkv", "att", "gu", "act", "probs")],
        ("max_ctx", ctypes.c_int32),
        ("xq", ctypes.c_void_p),
        ("xscale", ctypes.c_void_p),
        ("xsum", ctypes.c_void_p),
        ("max_k", ctypes.c_int32),
        ("int8_activations", ctypes.c_int32),
        ("ctx_slots", ctypes.c_void_p),
        ("embed_scale", ctypes.c_float),
        ("rot_dim", ctypes.c_int32),
        ("gelu", ctypes.c_int32),
        ("act_group", ctypes.c_int32),
        ("split_part", ctypes.c_void_p),
        ("split_count", ctypes.c_void_p),
        ("split_att", ctypes.c_void_p),
    ]


def cache_dir() -> Path:
    """slotune/engine/paths.py's cache root + /native (kernels is the leaf: it cannot import engine)."""
    if os.environ.get("SLOTUNE_CACHE_DIR"):
        return Path(os.environ["SLOTUNE_CACHE_DIR"]) / "native"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "slotune" / "native"


def _cpu_flags() -> str:
    """The CPU's feature flags (the first `flags` line of /proc/cpuinfo), '' where unknown."""
    try:
        return next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        return ""


def _cpu_has_avx2() -> bool:
    flags = _cpu_flags() + " "
    return all(f" {f} " in flags for f in ("avx2", "fma", "f16c"))


@functools.cache
def load_library(profile: bool = False, source: Path = SOURCE) -> ctypes.CDLL | str:
    """The compiled kernel, or a string saying why it cannot be had on this machine. `profile`: a
    build that times each op of the step (`slotune_profile`; bench/engine/profile_step.py); `source`:
    another version of the C file, for benchmarks that time two side by side."""
    if not _cpu_has_avx2():  # every AVX-512 CPU has these too; the C source picks the wider ISA itself
        return "this CPU lacks AVX2 + FMA (the native step needs AVX2/FMA or AVX-512)"
    if not source.exists():
        return f"{source} is missing from this install"
    src = source.read_bytes()
    try:
        cc = subprocess.run(["gcc", "--version"], capture_output=True, text=True, check=True).stdout.splitlines()[0]
    except (OSError, subprocess.CalledProcessError) as e:
        return f"no working gcc ({e})"
    # -march=native: a cache shared by machines with other CPUs must not hand over this build
    flags = [*CFLAGS, "-DSLOTUNE_PROFILE"] if profile else CFLAGS
    key = hashlib.sha256(src + " ".join(flags).encode() + cc.encode() + _cpu_flags().encode()).hexdigest()[:16]
    out = cache_dir() / f"cpu_decode-{key}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        r = subprocess.run(["gcc", *flags, str(source), "-o", str(tmp), "-lm"], capture_output=True, text=True)
        if r.returncode != 0:
            return f"gcc failed to build {source.name}: {r.stderr.strip()[-2000:]}"
        tmp.replace(out)  # atomic: concurrent trials never load a half-written library
    lib = ctypes.CDLL(str(out))
    lib.slotune_decode_step.restype = None
    lib.slotune_decode_step.argtypes = [
        ctypes.POINTER(_Model),
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_int,
    ]
    lib.slotune_isa.restype = ctypes.c_int
    lib.slotune_isa.argtypes = []
    if hasattr(lib, "slotune_set_amx"):  # an older source, built by a benchmark to time beside, has none
        lib.slotune_set_amx.restype = ctypes.c_int
        lib.slotune_set_amx.argtypes = [ctypes.c_int]
        # AMX tiles for batches of 16+ rows where the CPU and Linux grant them; SLOTUNE_AMX=0 keeps VNNI
        lib.slotune_set_amx(int(os.environ.get("SLOTUNE_AMX", "1") != "0"))
    lib.slotune_int4_block.restype = ctypes.c_int
    lib.slotune_int4_block.argtypes = []
    lib.slotune_matmul.restype = None
    lib.slotune_matmul.argtypes = [
        ctypes.POINTER(_Model),
        ctypes.POINTER(_Lin),
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.c_int,
    ]
    return lib


def isa() -> int:
    """ISA_* flags of the loaded build (0 when there is none): what was compiled in, not what
    /proc/cpuinfo says, so a weight is only ever repacked for a kernel the library holds."""
    lib = load_library()
    return 0 if isinstance(lib, str) else lib.slotune_isa()


@functools.cache
def torch_int4_block() -> int:
    """Channels per block of torch's CPU int4 pack (`_convert_weight_to_int4pack_for_cpu`) in this
    process: torch lays it out for its own runtime ISA, blocks of 64 under AVX-512 (per k, low nibbles
    channels 0-31, high 32-63) and of 32 under AVX2 (0-15, 16-31); 0 for a layout neither."""
    q = torch.zeros(64, 64, dtype=torch.int32)
    q[16, 0] = 1  # channel 16, k = 0: block 64 -> byte 16 low nibble; block 32 -> byte 0 high nibble
    p = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1).flatten()
    changed = [(int(i), int(p[i])) for i in p.nonzero().flatten()]
    return {((16, 1),): 64, ((0, 16),): 32}.get(tuple(changed), 0)


def has_int8_activations() -> bool:
    """int8 x int8 kernels for int8 and int4 layers are compiled in (AVX512-VNNI/VBMI, or AVX2)."""
    return bool(isa() & ISA_INT4_INT8ACT)


def set_amx(on: bool) -> bool:
    """Turn the AMX int8 kernels (16+ rows; results identical to VNNI's) on or off; returns whether
    they are on: False where the build, the CPU or Linux has none."""
    lib = load_library()
    return not isinstance(lib, str) and bool(lib.slotune_set_amx(int(on)))


def matmul(w: NativeLinear, x: torch.Tensor, int8_activations: bool = False, act_group: int = 32) -> torch.Tensor:
    """x [M, K] float32 @ W^T through the native kernel for one projection -> [M, N]; with int8
    activations, one scale per `act_group` inputs."""
    lib = load_library()
    assert not isinstance(lib, str), lib
    keep: list[torch.Tensor] = []
    lin = _lin(w, keep, int8_activations)
    assert not isinstance(lin, str), lin
    x = x.float().contiguous()
    m, k = x.shape
    kp = -(-k // 32) * 32
    xq, xs = torch.zeros(m, kp, dtype=torch.int8), torch.zeros(m, kp // 32)
    xsum = torch.zeros(m, kp // 32)
    part, count = (
        torch.zeros(SPLIT_THREADS, SPLIT_THREADS, SPLIT_ROWS, 64),
        torch.zeros(SPLIT_THREADS, dtype=torch.int32),
    )
    md = _Model(
        max_k=kp,
        xq=xq.data_ptr(),
        xscale=xs.data_ptr(),
        xsum=xsum.data_ptr(),
        int8_activations=int(int8_activations),
        act_group=act_group,
        split_part=part.data_ptr(),
        split_count=count.data_ptr(),
    )
    out = torch.empty(m, lin.n)
    lib.slotune_matmul(ctypes.byref(md), ctypes.byref(lin), x.data_ptr(), out.data_ptr(), m, torch.get_num_threads())
    return out


def _dtype_code(t: torch.Tensor) -> int | None:
    return {torch.float32: W_F32, torch.bfloat16: W_BF16}.get(t.dtype)


def _lin(w: NativeLinear, keep: list[torch.Tensor] | None = None, int8_activations: bool = False) -> _Lin | str:
    """ctypes view of one projection, or why the kernel cannot read it. A bias is read as a float32
    copy appended to `keep` (the caller keeps it alive), and so is an int8 weight repacked for the
    build's int8 kernel (VNNI or AVX2) when `int8_activations` (the torch path keeps reading the original)."""
    problem = _unreadable(w)
    if problem is not None:
        return problem
    lin = _Lin(w.kind, w.n, w.k, w.group, w.weight.data_ptr(), None if w.scales is None else w.scales.data_ptr(), None)
    if lin.kind == W_INT8 and int8_activations and keep is not None and lin.k % 32 == 0:
        flags = isa()
        if flags & ISA_INT8_VNNI and lin.n % 16 == 0:
            keep.append(_vnni_int8(w.weight))
            lin.kind, lin.w = W_INT8_VNNI, keep[-1].data_ptr()
        elif flags & ISA_INT8_AVX2 and lin.n % 8 == 0:
            keep.append(_avx2_int8(w.weight))
            lin.kind, lin.w = W_INT8_AVX2, keep[-1].data_ptr()
    if lin.kind == W_INT4 and int8_activations and keep is not None and lin.k % 32 == 0 and lin.group % 32 == 0:
        flags = isa()
        kind = W_INT4_VNNI if flags & ISA_INT8_VNNI else W_INT4_AVX2 if flags & ISA_INT8_AVX2 else None
        if kind is not None:  # torch's pack, whose block _unreadable matched to the build's
            codes, scales = _int4_quads(w.weight, w.scales, w.n, torch_int4_block())
            keep += [codes, scales]
            lin.kind, lin.w, lin.scales = kind, codes.data_ptr(), scales.data_ptr()
    if w.bias is not None and keep is not None:
        b = w.bias.detach().float().contiguous()
        keep.append(b)
        lin.bias = b.data_ptr()
    return lin


def _vnni_int8(w: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] -> uint8 [N/16, K/4, 16, 4] holding w + 128: one 64-byte vector = 16 channels x 4
    inputs, what `vpdpbusd` (unsigned x signed bytes) takes against 4 broadcast activation codes."""
    n, k = w.shape
    return (w.view(n // 16, 16, k // 4, 4).permute(0, 2, 1, 3).to(torch.int16) + 128).to(torch.uint8).contiguous()


def _int4_quads(
    packed: torch.Tensor, scales_and_zeros: torch.Tensor, n: int, block: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's CPU int4 pack in blocks of `block` channels (64 under AVX-512, 32 under AVX2; per k,
    block/2 bytes: low nibbles the block's first half, high its second) -> uint8
    [N/block, K/32, 8, 2, block/4, 4]: for input 4q + i, byte (v, c, i) holds channel (block/4)v + c in
    its low nibble and block/2 + (block/4)v + c in its high one, so `and`s (VNNI: with 0x0f / 0xf0;
    AVX2: 0x0f after a shift) give `vpdpbusd`'s or `vpmaddubsw`'s operands directly; and
    scales_and_zeros [K/g, N, 2] -> [N/block, K/g, block, 2], block-major."""
    half, nb = block // 2, n // block
    p = packed.view(nb, -1, half)  # [N/block, K, block/2]
    k = p.shape[1]
    codes = torch.cat([p & 15, p >> 4], dim=-1)  # [N/block, K, block] channel order
    c = codes.view(nb, k // 32, 8, 4, block).permute(0, 1, 2, 4, 3)  # [., ., quad, channel, i]
    lo = c[:, :, :, :half].reshape(nb, k // 32, 8, 2, block // 4, 4)
    hi = c[:, :, :, half:].reshape(nb, k // 32, 8, 2, block // 4, 4)
    sz = scales_and_zeros.view(scales_and_zeros.shape[0], nb, block, 2).permute(1, 0, 2, 3)
    return (lo | (hi << 4)).contiguous(), sz.contiguous()


def _avx2_int8(w: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] -> int8 [N/8, K/4, 8, 4]: one 32-byte vector = 8 channels x 4 inputs, what
    `vpmaddubsw` (after moving the weight's sign onto the activation) takes against 4 broadcast codes."""
    n, k = w.shape
    return w.view(n // 8, 8, k // 4, 4).permute(0, 2, 1, 3).contiguous()


def _unreadable(w: NativeLinear) -> str | None:
    """Why the kernel cannot read this projection, or None."""
    if w.weight.device.type != "cpu":
        return f"a weight on {w.weight.device.type}"
    if w.kind in (W_F32, W_BF16):
        if _dtype_code(w.weight) != w.kind or not w.weight.is_contiguous():
            return f"dense weight of dtype {w.weight.dtype}"
        return None
    if w.kind == W_INT8:
        return None if w.weight.dtype == torch.int8 and w.scales is not None else "int8 weights without scales"
    if w.kind == W_INT4:
        lib, block = load_library(), torch_int4_block()
        if not isinstance(lib, str) and lib.slotune_int4_block() != block:
            return (
                f"torch packs int4 in blocks of {block or 'unknown'} channels here, the kernel built for this CPU "
                f"reads blocks of {lib.slotune_int4_block()} (ATEN_CPU_CAPABILITY set below the CPU's ISA?)"
            )
        if w.n % 64:
            return f"int4 layer with {w.n} output channels (the CPU pack needs a multiple of 64)"
        return None
    return f"weight kind {w.kind}"


# Steps of up to this many rows (decode rows + prefill-chunk rows) run natively, larger ones through torch's
# GEMMs (oneDNN, bf16 dot products), per build ISA (slotune_isa()) and weight kind; None: every step up to the
# decoder's capacity. The limits are measured crossovers (docs/design/kernels-cpu-decode.md); on AVX2 native
# won at every row count measured, so there is none.
MAX_NATIVE_ROWS = {
    ISA_AVX512: {W_BF16: 16, W_INT8: 32, W_INT4: None, W_F32: None, W_INT8_VNNI: None, W_INT4_VNNI: None},
    ISA_AVX2: {W_BF16: None, W_INT8: None, W_INT4: None, W_F32: None, W_INT8_AVX2: None, W_INT4_AVX2: None},
}
# Rows of capacity beyond max_num_seqs: a short prompt's prefill chunk runs in the same native call as the
# running decodes, which about halves a short prompt's TTFT (docs/design/kernels-cpu-decode.md).
PREFILL_ROWS = 64


class CpuDecoder:
    """Runs decode steps (one new token per row) of `model` over a paged KV cache in native code.

    Holds ctypes views of the model's weights and the cache (read in place; k_cache, v_cache:
    [L, NB, BS, Hkv, Dh] in the model dtype) and fp32 scratch for `max_rows`.
    """

    def __init__(
        self,
        model: NativeModel,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        max_rows: int,
        max_ctx: int,
        int8_activations: bool = False,
        act_group: int = 32,
    ) -> None:
        reason = self.unsupported(model, k_cache)
        assert reason is None, reason
        if int8_activations and not has_int8_activations():
            log.warning("kernels.int8_activations ignored: this build has no int8 kernels (AVX-512 without VNNI/VBMI)")
        self.lib = load_library()
        self.max_rows, self.max_ctx = max_rows, max_ctx
        self._keep: list[torch.Tensor] = []  # float32 biases (and repacked int8/int4 weights) the kernel reads
        lin = lambda w: _lin(w, self._keep, int8_activations)  # noqa: E731
        num_layers = len(model.layers)
        self._layers = (_Layer * num_layers)()
        for i, ly in enumerate(model.layers):
            self._layers[i] = _Layer(
                ly.input_norm.data_ptr(),
                ly.post_norm.data_ptr(),
                lin(ly.qkv),
                lin(ly.o),
                lin(ly.gate_up),
                lin(ly.down),
                *[None if n is None else n.data_ptr() for n in (ly.q_norm, ly.k_norm, ly.attn_out_norm)],
                *[None if n is None else n.data_ptr() for n in (ly.mlp_out_norm, ly.cos_sin)],
                ly.window or 0,
            )
        inter = model.intermediate_size
        d, h, hkv, hd = model.hidden_size, model.num_heads, model.num_kv_heads, model.head_dim
        f32 = dict(dtype=torch.float32)
        self._scratch = {
            "x": torch.zeros(max_rows, d, **f32),
            "res": torch.zeros(max_rows, d, **f32),
            "h": torch.zeros(max_rows, d, **f32),
            "qkv": torch.zeros(max_rows, (h + 2 * hkv) * hd, **f32),
            "att": torch.zeros(max_rows, h * hd, **f32),
            "gu": torch.zeros(max_rows, 2 * inter, **f32),
            "act": torch.zeros(max_rows, inter, **f32),
            "probs": torch.zeros(max_rows * h * max_ctx, **f32),
        }
        max_k = -(-max(d, inter, h * hd) // 32) * 32
        self._scratch["xq"] = torch.zeros(max_rows, max_k, dtype=torch.int8)
        self._scratch["xscale"] = torch.zeros(max_rows, max_k // 32, **f32)
        self._scratch["xsum"] = torch.zeros(max_rows, max_k // 32, **f32)
        self._scratch["ctx_slots"] = torch.zeros(max_rows, max_ctx, dtype=torch.int32)
        self._scratch["split_part"] = torch.zeros(SPLIT_THREADS, SPLIT_THREADS, SPLIT_ROWS, 64, **f32)
        self._scratch["split_count"] = torch.zeros(SPLIT_THREADS, dtype=torch.int32)
        self._scratch["split_att"] = torch.zeros(SPLIT_THREADS, SPLIT_THREADS, h // hkv, hd + 2, **f32)
        self.logits = torch.empty(max_rows, model.lm_head.n, **f32)
        limit = MAX_NATIVE_ROWS[isa() & (ISA_AVX512 | ISA_AVX2)][self._layers[0].gate_up.kind]
        # Rows per step worth running natively: None = any number (beyond max_rows, in several
        # calls), where no measured crossover hands many rows to torch's GEMM.
        self.max_native_rows = None if limit is None else min(limit, max_rows)
        self._model = model  # keeps every viewed tensor alive
        self._cache = (k_cache, v_cache)
        self._m = _Model(
            num_layers,
            d,
            h,
            hkv,
            hd,
            inter,
            self.logits.shape[1],
            _dtype_code(model.embed),
            k_cache.shape[2],
            model.rms_norm_eps,
            model.attn_scale,
            k_cache.shape[1],
            model.embed.data_ptr(),
            model.norm.data_ptr(),
            self._layers,
            lin(model.lm_head),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            *[self._scratch[n].data_ptr() for n in ("x", "res", "h", "qkv", "att", "gu", "act", "probs")],
            max_ctx,
            *[self._scratch[n].data_ptr() for n in ("xq", "xscale", "xsum")],
            max_k,
            int(int8_activations),
            self._scratch["ctx_slots"].data_ptr(),
            model.embed_scale or 0.0,
            model.rotary_dim,
            int(model.gelu),
            act_group,
            self._scratch["split_part"].data_ptr(),
            self._scratch["split_count"].data_ptr(),
            self._scratch["split_att"].data_ptr(),
        )

    @staticmethod
    def unsupported(model: NativeModel, k_cache: torch.Tensor) -> str | None:
        """None when `model` over a cache like `k_cache` can run here; otherwise the reason it cannot."""
        lib = load_library()
        if isinstance(lib, str):
            return lib
        if k_cache.device.type != "cpu":
            return "the model is not on the CPU"
        if _dtype_code(model.embed) is None:
            return f"model dtype {model.embed.dtype} (the kernel reads float32 and bfloat16)"
        if k_cache.dtype != model.embed.dtype:
            return f"a KV cache of dtype {k_cache.dtype} (the kernel reads a cache in the model dtype)"
        if model.head_dim > MAX_HEAD_DIM or model.head_dim % 16 or model.num_heads % model.num_kv_heads:
            return f"head_dim {model.head_dim} / heads {model.num_heads}:{model.num_kv_heads}"
        for ly in model.layers:
            for w in (ly.qkv, ly.o, ly.gate_up, ly.down):
                r = _unreadable(w)
                if r is not None:
                    return r
        return _unreadable(model.lm_head)

    def step(
        self,
        ids: list[int],
        positions: list[int],
        slots: list[int],
        block_tables: list[list[int]],
        logit_rows: list[int] | None = None,
    ) -> torch.Tensor:
        """One token per row (decode rows, or the rows of prefill chunks) -> logits [len(logit_rows), V]
        float32 for the rows listed (default: every row); a view of a buffer the next step overwrites."""
        b = len(ids)
        rows = list(range(b)) if logit_rows is None else logit_rows
        assert 0 < b <= self.max_rows and max(positions) < self.max_ctx
        width = max(len(t) for t in block_tables)
        bt = (ctypes.c_int32 * (b * width))()
        for i, t in enumerate(block_tables):
            bt[i * width : i * width + len(t)] = t
        self.lib.slotune_decode_step(
            ctypes.byref(self._m),
            b,
            (ctypes.c_int64 * b)(*ids),
            (ctypes.c_int64 * b)(*positions),
            (ctypes.c_int64 * b)(*slots),
            bt,
            width,
            (ctypes.c_int32 * len(rows))(*rows),
            len(rows),
            self.logits.data_ptr(),
            torch.get_num_threads(),
        )
        return self.logits[: len(rows)]
