"""GPU check in one run (about 6 minutes): every kernel test on the GPU, the decode step against
the HBM floor, weight-only matmuls against bf16, and a served `tune run` whose winner is measured
with default and with searched tiles.

Weights: SmolLM2-135M's architecture with random bf16 weights, made on the device (speed does
not depend on the values). The tokenizer is the bundled model's, exported by `prepare`:

    python bench/gpu/run_all.py prepare .gpu/smollm2                  # here (CPU): tokenizer files
    TRITON_INTERPRET=1 python bench/gpu/run_all.py smoke /tmp/smoke   # here (CPU): the kernel timings' code
    python bench/gpu/run_all.py run .gpu/smollm2 OUT_DIR              # on the GPU machine
    python bench/gpu/run_all.py report OUT_DIR/results.json           # anywhere: the summary table

Each part writes OUT_DIR/results.json when it ends, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

SMOL = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
)
REPO = Path(__file__).resolve().parents[2]
SMOKE = False  # `smoke`: CPU + Triton interpreter, tiny shapes, one timed call: checks this script, not speed
SEARCH_S = 75.0  # all tile searches together (kernel timings)
SEARCH_DEADLINE = float("inf")


def prepare(d: Path) -> None:
    from slotune.engine.loader import resolve_model_path
    from slotune.engine.tokenizer import Tokenizer

    d.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer.from_gguf(resolve_model_path("smollm2-135m"))
    tok._tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|im_end|>", "bos_token": "<|im_start|>", "chat_template": tok.chat_template})
    )


def make_checkpoint(d: Path) -> None:
    import transformers
    from safetensors.torch import save_file

    cfg = transformers.LlamaConfig(**SMOL)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    sd = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(sd, str(d / "model.safetensors"))
    conf = cfg.to_dict()
    conf["architectures"] = ["LlamaForCausalLM"]
    conf["model_type"] = "llama"
    (d / "config.json").write_text(json.dumps(conf))


def bench_ms(fn, warmup=25, rep=100) -> float:
    if SMOKE:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    import triton.testing

    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def rel_err(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def spread(cands: list, n: int) -> list:
    """n candidates evenly spaced through the list (every tile size represented)."""
    if len(cands) <= n:
        return cands
    return [cands[i * len(cands) // n] for i in range(n)]


def search(fn, default, cands, n: int) -> tuple[object, float, float]:
    """Time `fn(config)` for the default and up to n candidates -> (best, best_ms, default_ms)."""
    t_default = bench_ms(lambda: fn(default))
    best, t_best = default, t_default
    for c in spread([c for c in cands if c != default], n):
        if time.time() > SEARCH_DEADLINE:
            print("tile search truncated: time budget", flush=True)
            break
        try:
            t = bench_ms(lambda: fn(c), warmup=5, rep=20)
        except Exception:  # a tile that does not fit (shared memory, registers) is skipped
            continue
        if t < t_best:
            best, t_best = c, t
    if best is not default:
        t_best = bench_ms(lambda: fn(best))
    return best, t_best, t_default


# --- 1. every kernel test, compiled ---------------------------------------------------------------
def kernel_tests(out: dict, env: dict[str, str]) -> None:
    """tests/kernels_tests under TRITON_INTERPRET=0 (tests/kernels_tests/conftest.py then puts
    tensors on CUDA); it stops after 8 failures and keeps the first one's assertion."""
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "tests/kernels_tests",
        "--maxfail=8",
        "-q",
        "-rfEs",
        "-p",
        "no:cacheprovider",
    ]
    cmd += ["-m", "not slow"]  # the gpu-marked tests too (pyproject's addopts leave them out)
    cmd += ["-n", "8"]  # Triton compiles on the CPU: 8 workers compile in parallel
    t0 = time.time()
    p = subprocess.run(cmd, cwd=REPO, env=env | {"TRITON_INTERPRET": "0"}, capture_output=True, text=True)
    tail = (p.stdout + p.stderr).strip().splitlines()
    print("\n".join(tail[-60:]), flush=True)
    summary = next((ln for ln in reversed(tail) if re.search(r"\d+ (passed|failed|error)", ln)), "")
    out["kernel_tests"] = {"returncode": p.returncode, "summary": summary.strip("= "), "s": time.time() - t0}
    if p.returncode:
        failed = [ln for ln in tail if ln.startswith(("FAILED", "ERROR"))]
        first = next((i for i, ln in enumerate(tail) if ln.startswith("E ")), None)
        out["kernel_tests"] |= {"failed": failed[:10], "first_error": tail[first : first + 12] if first else []}


# --- 2. the decode step ---------------------------------------------------------------------------
def _prompts(n: int, length: int) -> list[list[int]]:
    return [[(i * 7 + j * 13) % 40000 + 100 for j in range(length)] for i in range(n)]


def _decode_step_ms(llm, batch: int, new_tokens: int = 96) -> float:
    """Median wall time of `engine.step()` once every sequence of the batch decodes."""
    from slotune.engine import SamplingParams

    eng = llm.engine
    for i, p in enumerate(_prompts(batch, 64)):
        eng.add_request(f"step{batch}-{i}-{time.time()}", p, SamplingParams(max_tokens=new_tokens, ignore_eos=True))
    times = []
    while eng.has_unfinished_requests():
        t = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t)
    return statistics.median(times[4:]) * 1e3  # the prompts' steps first


def _replay_ms(graphs, batch: int) -> float:
    """GPU time of the captured decode graph alone (CUDA events), median of 50 replays."""
    g = graphs.graphs[next(b for b in graphs.buckets if b >= batch)]
    ts = []
    for _ in range(50):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def _kernels_per_step(llm, batch: int) -> dict:
    """Kernels a decode step launches and their summed GPU time (torch.profiler over eager steps)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from slotune.engine import SamplingParams

    eng = llm.engine
    for i, p in enumerate(_prompts(batch, 64)):
        eng.add_request(f"prof{batch}-{i}-{time.time()}", p, SamplingParams(max_tokens=12, ignore_eos=True))
    for _ in range(4):  # past the prompts
        eng.step()
    steps = 4
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            eng.step()
    while eng.has_unfinished_requests():
        eng.step()
    by_name: dict[str, float] = {}
    n = 0
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            n += 1
            by_name[e.name] = by_name.get(e.name, 0.0) + e.time_range.elapsed_us() / steps
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:8]
    return {
        "kernels": n / steps,
        "gpu_us": sum(by_name.values()),
        "top_us": {k[:80]: round(v, 1) for k, v in top},
    }


def _count_prefill_paths(llm, backend) -> dict:
    """Which attention ran each prompt step of a mixed workload: the paged prefill kernel, flash
    SDPA for a single fresh prompt, or torch after a kernel failure."""
    from slotune.engine.layers.attention import TorchAttentionBackend
    from slotune.kernels import prefill_attention as pa
    from slotune.engine import SamplingParams

    counts = {"paged_prefill_kernel": 0, "torch_extend": 0}
    real_kernel, real_extend = pa.paged_prefill_attention, TorchAttentionBackend._extend

    def kernel(*a, **k):
        counts["paged_prefill_kernel"] += 1
        return real_kernel(*a, **k)

    def extend(self, *a, **k):
        counts["torch_extend"] += 1
        return real_extend(self, *a, **k)

    pa.paged_prefill_attention, TorchAttentionBackend._extend = kernel, extend
    before = backend.num_prefill_fallbacks
    try:
        lens = [16, 300, 40, 1000, 90, 7, 500, 64] * 4  # batched prompts, chunks of the long ones
        prompts = [[(i * 7 + j * 13) % 40000 + 100 for j in range(n)] for i, n in enumerate(lens)]
        llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True))
        llm.generate(_prompts(1, 200), SamplingParams(max_tokens=4, ignore_eos=True))  # one fresh prompt alone
    finally:
        pa.paged_prefill_attention, TorchAttentionBackend._extend = real_kernel, real_extend
    layers = llm.engine.runner.model_cfg.num_layers
    fallbacks = backend.num_prefill_fallbacks - before
    return {
        "paged_prefill_kernel_steps": counts["paged_prefill_kernel"] / layers,
        "flash_sdpa_one_prompt_steps": (counts["torch_extend"] - fallbacks) / layers,
        "torch_after_kernel_failure_steps": fallbacks / layers,
    }


def engine_section(res: dict, d: Path) -> None:
    from slotune.engine import LLM, EngineConfig, SamplingParams

    out = res.setdefault("engine", {})
    base = dict(model=str(d), num_kv_blocks=8192, max_model_len=2048, max_num_seqs=64)
    llm = LLM(EngineConfig(**base))
    nog = LLM(EngineConfig(**base, use_cuda_graph=False))
    out["graphs_captured"] = llm.engine.runner.graphs is not None
    # the graph step against the eager one: the same greedy tokens (checks the graphs' input staging)
    p = SamplingParams(max_tokens=24, ignore_eos=True)
    for b in (1, 5, 64):
        a = [o.output_token_ids for o in llm.generate(_prompts(b, 48), p)]
        e = [o.output_token_ids for o in nog.generate(_prompts(b, 48), p)]
        out[f"graph_tokens_equal_eager_batch{b}"] = sum(x == y for x, y in zip(a, e)) / b
    x = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    bw = 2 * x.numel() / bench_ms(lambda: y.copy_(x)) / 1e6  # GB/s, read + write
    wb = llm.engine.weight_bytes
    for b in (1, 64):
        _decode_step_ms(llm, b, 16)  # warm
        step = statistics.median(_decode_step_ms(llm, b) for _ in range(3))
        replay = _replay_ms(llm.engine.runner.graphs, b)
        kv_bytes = b * 112 * llm.engine.runner.kv_bytes_per_token  # the mean context: 64 prompt + 48 new
        floor = (wb + kv_bytes) / bw / 1e6
        row = {
            "step_ms": step,
            "graph_replay_ms": replay,
            "host_ms": step - replay,
            "hbm_floor_ms": floor,
            "fraction_of_floor": floor / step,
            "tokens_per_s": b * 1e3 / step,
        }
        out[f"decode_batch{b}"] = row
        print(f"decode batch {b}", row, flush=True)
    out["hbm"] = {"copy_gbs": bw, "weight_bytes": wb}
    out["prefill_paths"] = _count_prefill_paths(llm, llm.engine.runner.model.backend.attn)
    print("prefill paths", out["prefill_paths"], flush=True)


def kernel_profile(res: dict, d: Path) -> None:
    """Kernels per eager decode step, last: once CUPTI is attached, later launches in this process
    cost more (the first run's kernel timings, taken after it, were up to 2.6x slower)."""
    from slotune.engine import LLM, EngineConfig

    nog = LLM(EngineConfig(model=str(d), num_kv_blocks=8192, max_model_len=2048, max_num_seqs=64, use_cuda_graph=False))
    for b in (1, 64):
        res.setdefault("engine", {}).setdefault(f"decode_batch{b}", {})["eager"] = _kernels_per_step(nog, b)


def engine_int4(res: dict, d: Path) -> None:
    """int4 weights through the engine (the gemv at decode): graph and eager tokens, step vs bf16."""
    from slotune.engine import LLM, EngineConfig, SamplingParams

    out = res.setdefault("engine_int4", {})
    base = dict(model=str(d), num_kv_blocks=8192, max_model_len=2048, max_num_seqs=64)
    llms = {q: LLM(EngineConfig(**base, quantization=q)) for q in ("none", "int4")}
    eager = LLM(EngineConfig(**base, quantization="int4", use_cuda_graph=False))
    p = SamplingParams(max_tokens=24, ignore_eos=True)
    a = [o.output_token_ids for o in llms["int4"].generate(_prompts(5, 48), p)]
    e = [o.output_token_ids for o in eager.generate(_prompts(5, 48), p)]
    out["graph_tokens_equal_eager"] = sum(x == y for x, y in zip(a, e)) / 5
    for b in (1, 4):
        for q, llm in llms.items():
            _decode_step_ms(llm, b, 16)
        steps = {q: [] for q in llms}
        for _ in range(3):  # interleaved
            for q, llm in llms.items():
                steps[q].append(_decode_step_ms(llm, b))
        out[f"batch{b}_step_ms"] = {q: statistics.median(v) for q, v in steps.items()}
        out[f"batch{b}_weight_mb"] = {q: llm.engine.weight_bytes / 1e6 for q, llm in llms.items()}
    print("engine int4", out, flush=True)


# --- 3. weight-only matmuls -----------------------------------------------------------------------
def quant_matmul_section(out: dict, dev: str) -> None:
    import torch.nn.functional as F

    from slotune.engine.config import EngineConfig
    from slotune.kernels import quant_matmul as qm
    from slotune.kernels import reference as ref

    default = EngineConfig().kernels.matmul
    shapes = [(1, 4096, 4096), (16, 4096, 4096), (1, 1536, 576), (1, 49152, 576)]
    if SMOKE:
        shapes = [(1, 48, 128), (5, 40, 192)]
    G = 64
    has_scaled_mm = dev == "cuda" and torch.cuda.get_device_capability() >= (8, 9)
    for M, N, K in shapes:
        wd = torch.randn(N, K, device=dev, dtype=torch.bfloat16) * K**-0.5
        xm = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
        s8 = wd.float().abs().amax(1) / 127
        q8 = torch.round(wd.float() / s8[:, None]).to(torch.int8)
        sf = wd.float().abs().amax(1) / 448
        qf = (wd.float() / sf[:, None]).to(torch.float8_e4m3fn)
        packed = torch.randint(0, 256, (N, K // 2), device=dev, dtype=torch.uint8)
        s4 = torch.rand(N, K // G, device=dev, dtype=torch.bfloat16) * 0.01
        z4 = torch.randn(N, K // G, device=dev, dtype=torch.bfloat16) * 0.01
        row = {
            "bf16_ms": bench_ms(lambda: F.linear(xm, wd)),
            "int8_rel_err": rel_err(qm.int8_matmul(xm, q8, s8, default), ref.int8_matmul(xm, q8, s8)),
            "int4_rel_err": rel_err(
                qm.int4_matmul(xm, packed, s4, z4, G, default), ref.int4_matmul(xm, packed, s4, z4, G)
            ),
            "fp8_rel_err": rel_err(qm.fp8_matmul(xm, qf, sf, default), ref.fp8_matmul(xm, qf, sf)),
        }
        row["bf16_weight_gbs"] = N * K * 2 / row["bf16_ms"] / 1e6
        cands = qm.configs(M, N, K, G)
        n = 4 if SMOKE else (8 if N == K == 4096 else 0)
        for name, fn, wbytes in (
            ("int8", lambda c: qm.int8_matmul(xm, q8, s8, c), N * K),
            ("int4", lambda c: qm.int4_matmul(xm, packed, s4, z4, G, c), N * K // 2),
            ("fp8", lambda c: qm.fp8_matmul(xm, qf, sf, c), N * K),
        ):
            best, t_best, t_default = search(fn, default, cands, n)
            row |= {f"{name}_default_ms": t_default, f"{name}_best_ms": t_best, f"{name}_best": str(best)}
            row[f"{name}_vs_bf16"] = row["bf16_ms"] / t_best
            row[f"{name}_weight_gbs"] = wbytes / t_best / 1e6
        if has_scaled_mm:  # the engine's W8A8 path for larger batches: quantize activations, then _scaled_mm
            from slotune.engine.quantize import FP8Linear

            lin = FP8Linear(wd)
            row["fp8_scaled_mm_ms"] = bench_ms(lambda: lin(xm))
        key = f"quant_matmul M{M} N{N} K{K}"
        out[key] = row
        print(key, row, flush=True)


def _paged(B, ctx_len, Hkv, D, BS, dev, dtype=torch.bfloat16):
    nb_seq = -(-ctx_len // BS)
    NB = B * nb_seq + 8
    kc = torch.randn(NB, BS, Hkv, D, device=dev, dtype=dtype)
    vc = torch.randn_like(kc)
    bt = torch.randperm(NB, device=dev)[: B * nb_seq].view(B, nb_seq).to(torch.int32)
    return kc, vc, bt


def decode_attention_section(out: dict, dev: str) -> None:
    """Paged decode attention at the bundled model's shapes: default tiles, searched, torch's path."""
    import torch.nn.functional as F

    from slotune.engine.config import EngineConfig
    from slotune.kernels import reference as ref
    from slotune.kernels.decode_attention import configs, paged_decode_attention

    default = EngineConfig().kernels.decode_attention
    shapes = [(1, 9, 3, 64, 1024), (64, 9, 3, 64, 1024)] if not SMOKE else [(2, 4, 2, 32, 40)]
    for B, H, Hkv, D, ctx_len in shapes:
        kc, vc, bt = _paged(B, ctx_len, Hkv, D, 16, dev)
        q = torch.randn(B, H, D, device=dev, dtype=torch.bfloat16)
        ctx = torch.full((B,), ctx_len, dtype=torch.int32, device=dev)
        scale = D**-0.5
        err = rel_err(
            paged_decode_attention(q, kc, vc, bt, ctx, scale, config=default),
            ref.paged_decode_attention(q, kc, vc, bt, ctx, scale),
        )

        def torch_path():  # the engine's torch backend: gather the blocks, then SDPA
            k = kc.index_select(0, bt.flatten().long()).view(B, -1, Hkv, D).transpose(1, 2)
            v = vc.index_select(0, bt.flatten().long()).view(B, -1, Hkv, D).transpose(1, 2)
            return F.scaled_dot_product_attention(q.unsqueeze(2), k, v, scale=scale, enable_gqa=True)

        best, t_best, t_default = search(
            lambda c: paged_decode_attention(q, kc, vc, bt, ctx, scale, config=c),
            default,
            [c for c in configs(ctx_len, B) if c.num_stages == 2],
            4 if SMOKE else 16,
        )
        key = f"decode_attention B{B} H{H}/{Hkv} D{D} ctx{ctx_len}"
        out[key] = {
            "rel_err": err,
            "torch_ms": bench_ms(torch_path),
            "triton_default_ms": t_default,
            "triton_best_ms": t_best,
            "best_config": str(best),
            "kv_gbs": 2 * B * ctx_len * Hkv * D * 2 / t_best / 1e6,
        }
        print(key, out[key], flush=True)


def kernel_timings(res: dict, dev: str = "cuda") -> None:
    global SEARCH_DEADLINE
    SEARCH_DEADLINE = time.time() + SEARCH_S
    out = res.setdefault("kernels", {})
    for name, fn in (("matmul", quant_matmul_section), ("decode", decode_attention_section)):
        t0 = time.time()
        try:
            fn(out, dev)
        except Exception as exc:  # keep the other kernels' numbers
            import traceback

            traceback.print_exc()
            out[f"{name}_error"] = repr(exc)
        out[f"{name}_s"] = time.time() - t0


def int4_tiles(res: dict, dev: str = "cuda") -> None:
    """int4 at M=1, 4096x4096 over its skinny-M tiles (split-K included): the kernel's best, not a sample."""
    from slotune.kernels import quant_matmul as qm

    M, N, K, G = 1, 4096, 4096, 64
    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    packed = torch.randint(0, 256, (N, K // 2), device=dev, dtype=torch.uint8)
    s4 = torch.rand(N, K // G, device=dev, dtype=torch.bfloat16) * 0.01
    z4 = torch.randn(N, K // G, device=dev, dtype=torch.bfloat16) * 0.01
    wd = torch.randn(N, K, device=dev, dtype=torch.bfloat16)
    cands = [c for c in qm.configs(M, N, K, G) if c.block_m == 16 and c.num_warps in (2, 4) and c.num_stages == 2]
    times = {}
    t0 = time.time()
    for c in cands:
        if time.time() - t0 > 60:
            break
        try:
            times[str(c)] = bench_ms(lambda: qm.int4_matmul(x, packed, s4, z4, G, c), warmup=5, rep=30)
        except Exception:  # a tile that does not fit
            continue
    best = sorted(times.items(), key=lambda kv: kv[1])[:5]
    bf16 = bench_ms(lambda: torch.nn.functional.linear(x, wd))
    res["int4_tiles"] = {"tried": len(times), "of": len(cands), "bf16_ms": bf16, "best": best}
    print("int4 tiles", res["int4_tiles"], flush=True)


def int4_gemv_tiles(res: dict, dev: str = "cuda") -> None:
    """The decode-batch int4 kernel (slotune/kernels/int4_gemv.py) against bf16 and the dot kernel's best tile."""
    from slotune.kernels import quant_matmul as qm
    from slotune.kernels import reference as ref
    from slotune.kernels.int4_gemv import int4_gemv

    out = res.setdefault("int4_gemv", {})
    G = 64
    t0 = time.time()
    for M, N, K in ((1, 4096, 4096), (4, 4096, 4096), (1, 1536, 576), (1, 576, 1536)):
        x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
        packed = torch.randint(0, 256, (N, K // 2), device=dev, dtype=torch.uint8)
        s4 = torch.rand(N, K // G, device=dev, dtype=torch.bfloat16) * 0.01
        z4 = torch.randn(N, K // G, device=dev, dtype=torch.bfloat16) * 0.01
        wd = torch.randn(N, K, device=dev, dtype=torch.bfloat16)
        dot_best = qm.MatmulConfig(block_m=16, block_n=128, block_k=64, num_warps=4, num_stages=2, split_k=8)
        row = {
            "bf16_ms": bench_ms(lambda: torch.nn.functional.linear(x, wd)),
            "dot_kernel_ms": bench_ms(lambda: qm.int4_matmul(x, packed, s4, z4, G, dot_best)),
            "rel_err": rel_err(int4_gemv(x, packed, s4, z4, G), ref.int4_matmul(x, packed, s4, z4, G)),
        }
        times = {}
        for bn in (8, 16, 32):
            for bk in (256, 512, 1024):
                for sk in (1, 4):
                    for w in (2, 4):
                        if time.time() - t0 > 90 or bk > max(256, K):
                            continue
                        try:
                            times[(bn, bk, sk, w)] = bench_ms(
                                lambda: int4_gemv(x, packed, s4, z4, G, bn, bk, sk, w), warmup=5, rep=30
                            )
                        except Exception:  # a tile that does not fit
                            continue
        if times:
            (bn, bk, sk, w), best = min(times.items(), key=lambda kv: kv[1])
            row |= {"gemv_best_ms": best, "gemv_best": f"block_n={bn} block_k={bk} split_k={sk} num_warps={w}"}
            row |= {
                "tried": len(times),
                "gemv_vs_bf16": row["bf16_ms"] / best,
                "gemv_weight_gbs": N * K / 2 / best / 1e6,
            }
        out[f"M{M} N{N} K{K}"] = row
        print("int4 gemv", M, N, K, row, flush=True)


# --- 4. a served tune run, and its winner's tiles -------------------------------------------------
GPU_WORKLOAD = {
    "name": "gpu-mixed",
    "arrivals": "closed_loop",
    "concurrency": 32,
    "num_requests": 96,
    "warmup_requests": 2,
    "prompt_len": {"kind": "lognormal", "mean": 128, "sigma": 0.6, "min": 16, "max": 512},
    "output_len": {"kind": "lognormal", "mean": 48, "sigma": 0.6, "min": 8, "max": 192},
    "seed": 0,
}


def tune_section(res: dict, d: Path, out_dir: Path, env: dict[str, str], device: str = "cuda") -> None:
    """`tune run` with the `gpu` space, 4 served trials, tracking and gates off, then the winner
    measured in process with the default tiles and with its own, interleaved."""
    import yaml

    out = res.setdefault("tune", {})
    spec = {
        "name": "gpu-check",
        "model": str(d.resolve()),
        "engine": {"device": device, "kv_cache_memory_gb": 2, "max_model_len": 2048},
        "workload": GPU_WORKLOAD,
        "objective": {"kind": "throughput", "metric": "output_tokens_per_s", "ttft_limit_s": 2, "tpot_limit_s": 0.1},
        "search_space": "gpu",
        "sampler": "tpe",
        "budget": {
            "n_trials": 4,
            "trial_timeout_s": 150,
            "trial_memory_gb": 48,
        },
        "confirm": {"candidates": 0},
        "output_dir": str((out_dir / "tune").resolve()),
    }
    path = out_dir / "tune-spec.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    t0 = time.time()
    cmd = [sys.executable, "-m", "slotune.tuner.cli_main", "run", str(path), "--no-progress", "--no-tracking"]
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    log = (p.stdout + p.stderr).strip().splitlines()
    (out_dir / "tune-log.txt").write_text("\n".join(log))
    print("\n".join(log[-40:]), flush=True)
    out |= {"returncode": p.returncode, "s": time.time() - t0}
    best = out_dir / "tune" / "best.yaml"
    if not best.exists():
        return
    from slotune.engine import LLM, EngineConfig
    from slotune.tuner.measure.in_process_replay import run_in_process_replay
    from slotune.tuner.spec.workload_spec import WorkloadSpec

    out["best_metrics"] = json.loads((out_dir / "tune" / "best_metrics.json").read_text())
    tuned = EngineConfig.from_yaml(best)
    default_tiles = tuned.model_copy(update={"kernels": EngineConfig().kernels})
    out["best"] = tuned.model_dump(mode="json", exclude_defaults=True)
    wl = WorkloadSpec.model_validate(GPU_WORKLOAD)
    llms = {"searched_tiles": LLM(tuned), "default_tiles": LLM(default_tiles)}
    runs: dict[str, list[float]] = {k: [] for k in llms}
    for seed in (11, 12, 13):  # interleaved, fresh seeds
        for k, llm in llms.items():
            r = run_in_process_replay(llm.config, wl, llm=llm, seed=seed)
            runs[k].append(r.metrics["output_tokens_per_s"])
    out["tiles"] = {k: {"tokens_per_s": v, "median": statistics.median(v)} for k, v in runs.items()}
    out["tiles"]["searched_over_default"] = (
        out["tiles"]["searched_tiles"]["median"] / out["tiles"]["default_tiles"]["median"]
    )
    print("tiles", out["tiles"], flush=True)


def run(d: Path, out_dir: Path, only: set[str] | None = None) -> None:
    import triton

    t_start = time.time()
    res = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name(),
        "driver": subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True
        ).stdout.strip(),
        "torch": torch.__version__,
        "triton": triton.__version__,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    make_checkpoint(d)
    parts = (
        ("kernel_tests", lambda: kernel_tests(res, env)),
        ("engine", lambda: engine_section(res, d)),
        ("engine_int4", lambda: engine_int4(res, d)),
        ("kernel_timings", lambda: kernel_timings(res)),
        ("int4_tiles", lambda: int4_tiles(res)),
        ("int4_gemv", lambda: int4_gemv_tiles(res)),
        ("tune", lambda: tune_section(res, d, out_dir, env)),
        ("kernel_profile", lambda: kernel_profile(res, d)),
    )
    for name, fn in parts:
        if only and name not in only:
            continue
        t0 = time.time()
        try:
            fn()
        except Exception as exc:  # keep what was measured
            import traceback

            traceback.print_exc()
            res[f"{name}_error"] = repr(exc)
        res[f"{name}_s"] = time.time() - t0
        (out_dir / "results.json").write_text(json.dumps(res, indent=1, default=str))  # survives a kill
        print(f"== {name} done in {time.time() - t0:.0f} s (total {time.time() - t_start:.0f} s)", flush=True)


def smoke(out_dir: Path) -> None:
    """CPU check of the kernel timings (interpreter, tiny shapes): catches script errors before GPU time is spent."""
    global SMOKE
    SMOKE = True
    sys.path.insert(0, str(REPO))  # the repo root: the patch is a test helper
    from tests.kernels_tests.interpreter_bf16 import patch_interpreter_bf16

    patch_interpreter_bf16()
    res = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d"), "device": "cpu (TRITON_INTERPRET=1, smoke)"}
    kernel_timings(res, "cpu")
    errors = {k: v for k, v in res["kernels"].items() if k.endswith("_error")}
    errors |= {
        f"{k}.{f}": e
        for k, row in res["kernels"].items()
        if isinstance(row, dict)
        for f, e in row.items()
        if f.endswith("rel_err") and not e < 2e-2
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "smoke.json").write_text(json.dumps(res, indent=1, default=str))
    if errors:
        raise SystemExit(f"smoke failed: {errors}")
    print("smoke ok", flush=True)


def report(path: Path) -> str:
    """results.json -> the markdown summary committed beside it; each goal with its measured value."""
    r = json.loads(path.read_text())
    lines = [
        f"# GPU check ({r['date']}, {r['device']}, driver {r.get('driver', '?')}, torch {r['torch']}, "
        f"triton {r['triton']})",
        "",
        "Command: `python bench/gpu/run_all.py run .gpu/smollm2 OUT` (README.md). SmolLM2-135M's shape, random bf16 "
        "weights.",
        "",
        "| goal | measured | met |",
        "|---|---|---|",
    ]
    kt = r.get("kernel_tests", {})
    lines.append(
        f"| every kernel test passes on the GPU | {kt.get('summary', 'not run')} | {kt.get('returncode') == 0} |"
    )
    b1 = r.get("engine", {}).get("decode_batch1", {})
    if b1:
        lines.append(f"| batch-1 decode step <= 0.5 ms | {b1['step_ms']:.3f} ms | {b1['step_ms'] <= 0.5} |")
    mm = r.get("kernels", {}).get("quant_matmul M1 N4096 K4096", {})
    gemv = r.get("int4_gemv", {}).get("M1 N4096 K4096")
    if gemv:
        lines.append(
            f"| int4 >= bf16 at M=1 (4096x4096) | int4 (gemv) {gemv['gemv_best_ms'] * 1e3:.1f} us vs bf16 "
            f"{gemv['bf16_ms'] * 1e3:.1f} us ({gemv['gemv_vs_bf16']:.2f}x) | {gemv['gemv_vs_bf16'] >= 1} |"
        )
    elif mm:
        lines.append(
            f"| int4 >= bf16 at M=1 (4096x4096) | int4 {mm['int4_best_ms'] * 1e3:.1f} us vs bf16 "
            f"{mm['bf16_ms'] * 1e3:.1f} us ({mm['int4_vs_bf16']:.2f}x) | {mm['int4_vs_bf16'] >= 1} |"
        )
    if kt.get("failed"):
        lines += ["", "First kernel-test failures:", "", "```", *kt["failed"], *kt.get("first_error", []), "```"]
    eng = r.get("engine", {})
    if eng:
        lines += ["", "## Decode step (CUDA graphs)", ""]
        lines += [
            "| batch | step ms | graph replay ms (GPU) | host ms | HBM floor ms | kernels/step | top kernels (us/step) |"
        ]
        lines += ["|---|---|---|---|---|---|---|"]
        for b in (1, 64):
            row = eng.get(f"decode_batch{b}")
            if row and "step_ms" in row:
                eager = row.get("eager", {"kernels": float("nan"), "top_us": {}})
                top = "; ".join(f"{k[:40]} {v}" for k, v in list(eager["top_us"].items())[:4])
                lines.append(
                    f"| {b} | {row['step_ms']:.3f} | {row['graph_replay_ms']:.3f} | {row['host_ms']:.3f} | "
                    f"{row['hbm_floor_ms']:.3f} | {eager['kernels']:.0f} | {top} |"
                )
        lines += [
            "",
            f"- copy bandwidth {eng['hbm']['copy_gbs']:.0f} GB/s; weights {eng['hbm']['weight_bytes'] / 1e6:.0f} MB.",
        ]
        eq = {k: v for k, v in eng.items() if k.startswith("graph_tokens_equal")}
        lines.append(f"- graph steps emit the eager steps' greedy tokens: {eq}")
        lines.append(f"- prompt steps by attention path: {eng.get('prefill_paths')}")
    e4 = r.get("engine_int4")
    if e4:
        lines.append(
            f"- int4 weights in the engine: graph tokens equal eager {e4['graph_tokens_equal_eager']:.0%}; decode step "
            f"(ms, bf16 / int4) batch 1 {e4['batch1_step_ms']['none']:.3f} / {e4['batch1_step_ms']['int4']:.3f}, "
            f"batch 4 {e4['batch4_step_ms']['none']:.3f} / {e4['batch4_step_ms']['int4']:.3f}; weights "
            f"{e4['batch1_weight_mb']['none']:.0f} / {e4['batch1_weight_mb']['int4']:.0f} MB"
        )
    ker = r.get("kernels", {})
    rows = [(k, v) for k, v in ker.items() if k.startswith("quant_matmul")]
    if rows:
        lines += ["", "## Weight-only matmul (best tile; us)", ""]
        lines += [
            "| shape | bf16 | int8 | int4 | fp8 | fp8 W8A8 (_scaled_mm) | max rel err |",
            "|---|---|---|---|---|---|---|",
        ]
        for k, v in rows:
            err = max(v["int8_rel_err"], v["int4_rel_err"], v["fp8_rel_err"])
            sm = f"{v['fp8_scaled_mm_ms'] * 1e3:.1f}" if "fp8_scaled_mm_ms" in v else "-"
            lines.append(
                f"| {k.removeprefix('quant_matmul ')} | {v['bf16_ms'] * 1e3:.1f} | {v['int8_best_ms'] * 1e3:.1f} | "
                f"{v['int4_best_ms'] * 1e3:.1f} | {v['fp8_best_ms'] * 1e3:.1f} | {sm} | {err:.1e} |"
            )
    rows = [(k, v) for k, v in ker.items() if k.startswith("decode_attention")]
    if rows:
        lines += [
            "",
            "| decode attention | torch ms | default tile ms | searched ms | searched tile |",
            "|---|---|---|---|---|",
        ]
        lines += [
            f"| {k.removeprefix('decode_attention ')} | {v['torch_ms']:.4f} | {v['triton_default_ms']:.4f} | "
            f"{v['triton_best_ms']:.4f} | {v['best_config']} |"
            for k, v in rows
        ]
    g = r.get("int4_gemv", {})
    if g:
        lines += ["", "## int4 at decode batches: the gemv kernel (slotune/kernels/int4_gemv.py), us", ""]
        lines += [
            "| shape | bf16 | int4 dot kernel | int4 gemv (best tile) | gemv vs bf16 | gemv tile |",
            "|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {k} | {v['bf16_ms'] * 1e3:.1f} | {v['dot_kernel_ms'] * 1e3:.1f} | {v['gemv_best_ms'] * 1e3:.1f} | "
            f"{v['gemv_vs_bf16']:.2f}x | {v['gemv_best']} |"
            for k, v in g.items()
            if "gemv_best_ms" in v
        ]
    t4 = r.get("int4_tiles")
    if t4:
        best, ms = t4["best"][0]
        lines.append(
            f"- the dot kernel's best of {t4['tried']} skinny-M tiles at M=1: {ms * 1e3:.1f} us ({best}); "
            f"bf16 {t4['bf16_ms'] * 1e3:.1f} us"
        )
    tune = r.get("tune", {})
    if tune:
        lines += ["", "## Served `tune run` (gpu space, 4 trials, tracking and gates off)", ""]
        lines.append(f"- exit code {tune.get('returncode')}, {tune.get('s', 0):.0f} s; winner: `{tune.get('best')}`")
        t = tune.get("tiles")
        if t:
            lines.append(
                f"- the winner with its searched tiles vs the default tiles, in process, 3 fresh seeds interleaved: "
                f"{t['searched_tiles']['median']:.0f} vs {t['default_tiles']['median']:.0f} output tok/s "
                f"({t['searched_over_default']:.2f}x)"
            )
    errors = {k: v for k, v in r.items() if k.endswith("_error")}
    if errors:
        lines += ["", f"Errors: {errors}"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    if sys.argv[1] == "prepare":
        prepare(Path(sys.argv[2]))
    elif sys.argv[1] == "smoke":
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemExit(
                "smoke runs the kernels under the interpreter: TRITON_INTERPRET=1 python bench/gpu/run_all.py smoke OUT"
            )
        smoke(Path(sys.argv[2]))
    elif sys.argv[1] == "report":
        print(report(Path(sys.argv[2])), end="")
    else:  # run D OUT [part,part,...]
        run(Path(sys.argv[2]), Path(sys.argv[3]), set(sys.argv[4].split(",")) if len(sys.argv) > 4 else None)
