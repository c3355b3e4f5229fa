"""GPU benchmark in one run (< 10 min): kernel correctness and speed vs torch, tile search,
CUDA-graph decode vs the HBM floor, and end-to-end engine vs transformers.

Weights: SmolLM2-135M's architecture with random bf16 weights (speed does not depend on the
values; the 98 MB GGUF does not fit the device tool's transfer limit). The tokenizer is the
bundled model's, exported beside it by `prepare` on a CPU machine:

    python bench/gpu/run_all.py prepare .gpu/smollm2     # here (CPU): tokenizer files
    TRITON_INTERPRET=1 python bench/gpu/run_all.py smoke /tmp/smoke  # here (CPU): check the kernel part
    python bench/gpu/run_all.py run .gpu/smollm2 OUT_DIR  # on the GPU machine
"""

from __future__ import annotations

import json
import statistics
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


SMOKE = False  # `smoke`: CPU + Triton interpreter, tiny shapes, one timed call: checks this script, not speed
SEARCH_DEADLINE = float("inf")  # tile searches stop here (time.time()) so the engine section still runs


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


def _paged(B, ctx_len, Hkv, D, BS, dev, dtype=torch.bfloat16):
    nb_seq = -(-ctx_len // BS)
    NB = B * nb_seq + 8
    kc = torch.randn(NB, BS, Hkv, D, device=dev, dtype=dtype)
    vc = torch.randn_like(kc)
    bt = torch.randperm(NB, device=dev)[: B * nb_seq].view(B, nb_seq).to(torch.int32)
    return kc, vc, bt


def decode_attention_section(out: dict, dev: str) -> None:
    import torch.nn.functional as F
    from slotune.engine.config import EngineConfig
    from slotune.kernels import reference as ref
    from slotune.kernels.decode_attention import configs, paged_decode_attention
    from slotune.kernels.kv_store import store_kv

    t = EngineConfig().kernels.decode_attention
    default = t  # the engine's default
    shapes = [(1, 9, 3, 64, 1024), (64, 9, 3, 64, 1024), (64, 32, 8, 128, 2048), (8, 32, 8, 128, 8192)]
    if SMOKE:
        shapes = [(2, 4, 2, 32, 40)]
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

        t_ref = bench_ms(torch_path)
        cands = [c for c in configs(ctx_len, B) if c.num_stages == 2]
        best, t_best, t_default = search(
            lambda c: paged_decode_attention(q, kc, vc, bt, ctx, scale, config=c), default, cands, 4 if SMOKE else 32
        )
        row = {
            "rel_err": err,
            "torch_ms": t_ref,
            "triton_default_ms": t_default,
            "triton_best_ms": t_best,
            "best_config": str(best),
            "speedup_vs_torch": t_ref / t_best,
            "tile_search_gain": t_default / t_best,
            "kv_gbs": 2 * B * ctx_len * Hkv * D * 2 / t_best / 1e6,
        }
        if (B, H, D) == (64, 32, 128) or SMOKE:  # quantized caches at one shape: bytes halve, math adds a scale
            for kind, dt in (("int8", torch.int8), ("fp8", torch.float8_e4m3fn)):
                kq, vq = torch.empty_like(kc, dtype=dt), torch.empty_like(vc, dtype=dt)
                ks, vs = torch.empty(kc.shape[:3], device=dev), torch.empty(kc.shape[:3], device=dev)
                slots = torch.arange(kc.shape[0] * kc.shape[1], device=dev)
                store_kv(kc.view(-1, Hkv, D), vc.view(-1, Hkv, D), kq, vq, slots, ks, vs)
                e = rel_err(
                    paged_decode_attention(q, kq, vq, bt, ctx, scale, ks, vs, config=best),
                    ref.paged_decode_attention(q, kq, vq, bt, ctx, scale, ks, vs),
                )
                row[f"{kind}_kv_rel_err"] = e
                row[f"{kind}_kv_ms"] = bench_ms(
                    lambda: paged_decode_attention(q, kq, vq, bt, ctx, scale, ks, vs, config=best)
                )
        key = f"decode_attention B{B} H{H}/{Hkv} D{D} ctx{ctx_len}"
        out[key] = row
        print(key, row, flush=True)


def prefill_attention_section(out: dict, dev: str) -> None:
    import torch.nn.functional as F
    from slotune.engine.config import EngineConfig
    from slotune.kernels import reference as ref
    from slotune.kernels.prefill_attention import configs, paged_prefill_attention

    t = EngineConfig().kernels.prefill_attention
    default = t
    # (seqs, new tokens each, cached tokens each, H, Hkv, D): batched fresh prompts; chunked prefill over a long context
    shapes = [(4, 512, 0, 9, 3, 64), (8, 256, 1024, 32, 8, 128)]
    if SMOKE:
        shapes = [(2, 20, 7, 4, 2, 32)]
    for B, nq, nc, H, Hkv, D in shapes:
        BS, L = 16, nq + nc
        kc, vc, bt = _paged(B, L, Hkv, D, BS, dev)
        q = torch.randn(B * nq, H, D, device=dev, dtype=torch.bfloat16)
        i32 = lambda xs: torch.tensor(xs, dtype=torch.int32, device=dev)  # noqa: E731
        starts, qlens, ctxs = i32([i * nq for i in range(B)]), i32([nq] * B), i32([L] * B)
        scale = D**-0.5

        def kernel(c):
            return paged_prefill_attention(q, kc, vc, bt, starts, qlens, ctxs, nq, scale, config=c)

        err = rel_err(kernel(default), ref.paged_prefill_attention(q, kc, vc, bt, [nq] * B, [L] * B, scale))
        # the engine's torch path: gather the context, SDPA with a [B, 1, Q, L] causal mask
        Lp = bt.shape[1] * BS
        j = torch.arange(Lp, device=dev)[None, None, :]
        i = torch.arange(nq, device=dev)[None, :, None]
        mask = (j <= nc + i)[:, None].expand(B, 1, nq, Lp)

        def torch_path():
            k = kc.index_select(0, bt.flatten().long()).view(B, -1, Hkv, D).transpose(1, 2)
            v = vc.index_select(0, bt.flatten().long()).view(B, -1, Hkv, D).transpose(1, 2)
            return F.scaled_dot_product_attention(
                q.view(B, nq, H, D).transpose(1, 2), k, v, attn_mask=mask, scale=scale, enable_gqa=True
            )

        # lower bound: FlashAttention on contiguous K/V (what a single fresh prompt uses)
        kf = torch.randn(B, Hkv, L, D, device=dev, dtype=torch.bfloat16)
        qf = q.view(B, nq, H, D).transpose(1, 2)
        t_flash = bench_ms(
            lambda: F.scaled_dot_product_attention(qf, kf, kf, is_causal=nc == 0, scale=scale, enable_gqa=True)
        )
        t_ref = bench_ms(torch_path)
        best, t_best, t_default = search(kernel, default, configs(nq, D), 4 if SMOKE else 24)
        key = f"prefill_attention B{B} new{nq} cached{nc} H{H}/{Hkv} D{D}"
        out[key] = {
            "rel_err": err,
            "torch_path_ms": t_ref,
            "sdpa_contiguous_ms": t_flash,
            "triton_default_ms": t_default,
            "triton_best_ms": t_best,
            "best_config": str(best),
            "speedup_vs_torch_path": t_ref / t_best,
            "tile_search_gain": t_default / t_best,
        }
        print(key, out[key], flush=True)


def quant_matmul_section(out: dict, dev: str) -> None:
    import torch.nn.functional as F
    from slotune.engine.config import EngineConfig
    from slotune.kernels import quant_matmul as qm
    from slotune.kernels import reference as ref

    t = EngineConfig().kernels.matmul
    default = t
    shapes = [(1, 4096, 4096), (16, 4096, 4096), (1, 1536, 576), (1, 49152, 576), (64, 1536, 576)]
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
        n = 4 if SMOKE else 16
        for name, fn in (
            ("int8", lambda c: qm.int8_matmul(xm, q8, s8, c)),
            ("int4", lambda c: qm.int4_matmul(xm, packed, s4, z4, G, c)),
            ("fp8", lambda c: qm.fp8_matmul(xm, qf, sf, c)),
        ):
            best, t_best, t_default = search(fn, default, cands, n)
            row |= {f"{name}_default_ms": t_default, f"{name}_best_ms": t_best, f"{name}_best": str(best)}
        if has_scaled_mm:  # the engine's W8A8 path for larger batches: quantize activations, then _scaled_mm
            from slotune.engine.quantize import FP8Linear

            lin = FP8Linear(wd)
            row["fp8_scaled_mm_ms"] = bench_ms(lambda: lin(xm))
        key = f"quant_matmul M{M} N{N} K{K}"
        out[key] = row
        print(key, row, flush=True)


def kernels_section(res: dict, dev: str = "cuda") -> None:
    import torch.nn.functional as F
    from slotune.kernels import reference as ref
    from slotune.kernels.activation import silu_and_mul
    from slotune.kernels.kv_store import store_kv
    from slotune.kernels.rms_norm import rms_norm
    from slotune.kernels.rotary import rotary

    out = res.setdefault("kernels", {})
    for name, fn in (
        ("decode", decode_attention_section),
        ("prefill", prefill_attention_section),
        ("matmul", quant_matmul_section),
    ):
        t0 = time.time()
        try:
            fn(out, dev)
        except Exception as exc:  # keep the other kernels' numbers
            import traceback

            traceback.print_exc()
            out[f"{name}_error"] = repr(exc)
        out[f"{name}_s"] = time.time() - t0

    # --- quantized KV store: the fp8 conversion checked on real hardware ---
    k = torch.randn(64, 3, 64, device=dev)
    caches = [torch.zeros(8, 16, 3, 64, device=dev, dtype=torch.float8_e4m3fn) for _ in range(4)]
    scales = [torch.zeros(8, 16, 3, device=dev) for _ in range(4)]
    slots = torch.arange(64, device=dev)
    store_kv(k, k, caches[0], caches[1], slots, scales[0], scales[1])
    ref.store_kv(k, k, caches[2], caches[3], slots, scales[2], scales[3])
    out["kv_store_fp8_rel_err"] = rel_err(
        caches[0].float() * scales[0][..., None], caches[2].float() * scales[2][..., None]
    )

    # --- pointwise (decode batch 64 and a 2048-token prefill) ---
    from slotune.engine.layers.ops import apply_rotary, rope_cos_sin

    table = rope_cos_sin(64, 4096, 100000.0, torch.device(dev))
    for T in (8,) if SMOKE else (64, 2048):
        x = torch.randn(T, 576, device=dev, dtype=torch.bfloat16)
        r = torch.randn_like(x)
        w = torch.randn(576, device=dev, dtype=torch.bfloat16)
        out[f"rms_norm T{T}"] = {
            "rel_err": rel_err(rms_norm(x, w, 1e-5, r)[0], ref.rms_norm(x, w, 1e-5, r)[0]),
            "triton_ms": bench_ms(lambda: rms_norm(x, w, 1e-5, r)),
            "torch_ms": bench_ms(lambda: F.rms_norm(x + r, (576,), w, 1e-5)),
        }
        g = torch.randn(T, 3072, device=dev, dtype=torch.bfloat16)
        out[f"silu_and_mul T{T}"] = {
            "rel_err": rel_err(silu_and_mul(g), ref.silu_and_mul(g)),
            "triton_ms": bench_ms(lambda: silu_and_mul(g)),
            "torch_ms": bench_ms(lambda: F.silu(g[:, :1536]) * g[:, 1536:]),
        }
        qk = torch.randn(T, 12, 64, device=dev, dtype=torch.bfloat16)
        pos = torch.randint(0, 4096, (T,), device=dev)
        out[f"rotary T{T}"] = {
            "rel_err": rel_err(rotary(qk, table, pos), ref.rotary(qk, table[pos])),
            "triton_ms": bench_ms(lambda: rotary(qk, table, pos)),
            "torch_ms": bench_ms(lambda: apply_rotary(qk, table[pos])),
        }
    print({k: v for k, v in out.items() if k.split()[0] in ("rms_norm", "silu_and_mul", "rotary")}, flush=True)


def engine_section(res: dict, d: Path) -> None:
    import transformers
    from slotune.engine import LLM, EngineConfig, SamplingParams
    from slotune.tuner.measure.in_process_replay import run_in_process_replay
    from slotune.tuner.spec.workload_spec import WorkloadSpec

    out = res.setdefault("engine", {})
    base = dict(model=str(d), num_kv_blocks=8192, max_model_len=2048)
    try:
        llm = LLM(EngineConfig(**base, max_num_seqs=64))
    except Exception as exc:  # record, then measure without graphs
        import traceback

        traceback.print_exc()
        out["cuda_graph_error"] = repr(exc)
        llm = LLM(EngineConfig(**base, max_num_seqs=64, use_cuda_graph=False))
    nog = LLM(EngineConfig(**base, max_num_seqs=64, use_cuda_graph=False))
    pr = [[(j * 13) % 40000 + 100 for j in range(64)]]
    for e in (nog, llm):
        e.generate(pr, SamplingParams(max_tokens=8, ignore_eos=True))
    t = time.perf_counter()
    nog.generate(pr, SamplingParams(max_tokens=128, ignore_eos=True))
    t_nog = time.perf_counter() - t
    t = time.perf_counter()
    llm.generate(pr, SamplingParams(max_tokens=128, ignore_eos=True))
    out["cuda_graph_batch1_speedup"] = t_nog / (time.perf_counter() - t)
    out["eager_batch1_tps"] = 128 / t_nog
    del nog
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.bfloat16).cuda().eval()
    prompts = [[(i * 7 + j * 13) % 40000 + 100 for j in range(64)] for i in range(64)]
    # parity on random weights: greedy tokens equal to transformers for a few prompts
    p = SamplingParams(max_tokens=16, ignore_eos=True)
    ours = [o.output_token_ids for o in llm.generate(prompts[:4], p)]
    with torch.no_grad():
        theirs = [
            hf.generate(torch.tensor([pr], device="cuda"), max_new_tokens=16, min_new_tokens=16, do_sample=False)[
                0, 64:
            ].tolist()
            for pr in prompts[:4]
        ]
    out["greedy_match_transformers"] = sum(a == b for a, b in zip(ours, theirs)) / 4

    def ours_tps(batch, n):
        t = time.perf_counter()
        outs = llm.generate(prompts[:batch], SamplingParams(max_tokens=n, ignore_eos=True))
        torch.cuda.synchronize()
        return sum(len(o.output_token_ids) for o in outs) / (time.perf_counter() - t)

    def hf_tps(batch, n):
        ids = torch.tensor(prompts[:batch], device="cuda")
        t = time.perf_counter()
        with torch.no_grad():
            hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=2)
        torch.cuda.synchronize()
        return batch * n / (time.perf_counter() - t)

    for b in (1, 64):
        ours_tps(b, 8), hf_tps(b, 8)
        o = statistics.median([ours_tps(b, 128) for _ in range(3)])
        h = statistics.median([hf_tps(b, 128) for _ in range(3)])
        out[f"decode_batch{b}"] = {"ours_tps": o, "hf_tps": h, "ratio": o / h}
        print(f"batch {b}", out[f"decode_batch{b}"], flush=True)
    # batch-1 step time vs the HBM floor
    x = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    bw = 2 * x.numel() / bench_ms(lambda: y.copy_(x)) / 1e6  # GB/s, read + write
    wb = llm.engine.weight_bytes
    step_ms = 1e3 / out["decode_batch1"]["ours_tps"]
    out["hbm"] = {
        "copy_gbs": bw,
        "weight_bytes": wb,
        "floor_ms": wb / bw / 1e6,
        "batch1_step_ms": step_ms,
        "fraction_of_floor": (wb / bw / 1e6) / step_ms,
    }
    print("hbm", out["hbm"], flush=True)
    # mixed workload at 64 concurrent: continuous batching + graphs vs HF static batches
    wl = WorkloadSpec(
        arrivals="closed_loop",
        concurrency=64,
        num_requests=192,
        warmup_requests=2,
        prompt_len={"kind": "lognormal", "mean": 128, "sigma": 0.6, "min": 16, "max": 1024},
        output_len={"kind": "lognormal", "mean": 128, "sigma": 0.7, "min": 8, "max": 512},
    )
    r = run_in_process_replay(llm.config, wl, llm=llm)
    from slotune.tuner.workload.requests import generate_requests

    reqs = [q for q in generate_requests(wl, llm.tokenizer) if not q.request_id.startswith("warmup")]
    t = time.perf_counter()
    total = 0
    with torch.no_grad():
        for i in range(0, len(reqs), 64):  # HF: padded static batches, each runs to its longest output
            chunk = reqs[i : i + 64]
            width = max(len(q.prompt_token_ids) for q in chunk)
            ids = torch.tensor(
                [[2] * (width - len(q.prompt_token_ids)) + q.prompt_token_ids for q in chunk], device="cuda"
            )
            mask = (
                torch.arange(width, device="cuda")[None, :]
                >= torch.tensor([width - len(q.prompt_token_ids) for q in chunk], device="cuda")[:, None]
            ).long()
            n = max(q.output_len for q in chunk)
            hf.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=2)
            total += sum(q.output_len for q in chunk)  # useful tokens only
    hf_mixed = total / (time.perf_counter() - t)
    out["mixed_64"] = {
        "ours_tps": r.metrics["output_tokens_per_s"],
        "hf_tps": hf_mixed,
        "ratio": r.metrics["output_tokens_per_s"] / hf_mixed,
        "ours_tpot_p50_ms": r.metrics["tpot_p50"] * 1e3,
        "ours_ttft_p50_ms": r.metrics["ttft_p50"] * 1e3,
    }
    print("mixed_64", out["mixed_64"], flush=True)


def run(d: Path, out_dir: Path) -> None:
    import triton

    res = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
    }
    global SEARCH_DEADLINE
    make_checkpoint(d)
    t0 = time.time()
    SEARCH_DEADLINE = t0 + 300  # kernels ~5 min, engine ~2.5 min (2026-11-22 H100 run)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, fn in (("kernels", lambda: kernels_section(res)), ("engine", lambda: engine_section(res, d))):
        try:
            fn()
        except Exception as exc:  # keep what was measured
            import traceback

            traceback.print_exc()
            res[f"{name}_error"] = repr(exc)
        res[f"{name}_s"] = time.time() - t0
        (out_dir / "results.json").write_text(json.dumps(res, indent=1, default=str))  # partial results survive a kill
    (out_dir / "results.json").write_text(json.dumps(res, indent=1, default=str))
    print(json.dumps(res, indent=1, default=str))


def smoke(out_dir: Path) -> None:
    """CPU check of the kernel section (interpreter, tiny shapes): catches script errors before GPU time is spent."""
    global SMOKE
    SMOKE = True
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: the patch is a test helper
    from tests.kernels_tests.interpreter_bf16 import patch_interpreter_bf16

    patch_interpreter_bf16()
    res = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d"), "device": "cpu (TRITON_INTERPRET=1, smoke)"}
    kernels_section(res, "cpu")
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


if __name__ == "__main__":
    if sys.argv[1] == "prepare":
        prepare(Path(sys.argv[2]))
    elif sys.argv[1] == "smoke":
        import os

        if os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemExit(
                "smoke runs the kernels under the interpreter: TRITON_INTERPRET=1 python bench/gpu/run_all.py smoke OUT"
            )
        smoke(Path(sys.argv[2]))
    else:
        run(Path(sys.argv[2]), Path(sys.argv[3]))
