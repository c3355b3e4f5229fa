"""GPU check of the evals scorer on the Triton backend (random SmolLM2-shaped weights: the GGUF
exceeds the device tool's transfer limit, so only numerics parity and speed are checked here,
not task scores). lm-eval is not installed on the device, so the adapter is not run.

    python bench/gpu/run_all.py prepare .gpu/smollm2    # on a CPU machine
    python bench/evals/gpu_check.py .gpu/smollm2 OUT    # on the GPU machine

Checks: PagedScorer (paged KV path, batched) vs LLM.prompt_logprobs (contiguous, one sequence)
for kv_dtype auto / int8 / fp8 and int8 weights; the agreement gate vs the baseline; tokens/s.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpu"))
from run_all import make_checkpoint  # noqa: E402


def main(tok_dir: Path, out: Path) -> None:
    from slotune.engine import LLM, EngineConfig
    from slotune.evals.gate_spec import GateSpec
    from slotune.evals.gates import evaluate_gates
    from slotune.evals.scoring import PagedScorer

    model = Path("/tmp/evals-smollm2")
    model.mkdir(exist_ok=True)
    for f in tok_dir.iterdir():
        shutil.copy(f, model / f.name)
    make_checkpoint(model)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 49152, (n,), generator=g).tolist() for n in (17, 64, 200, 333, 512, 9, 128, 1000)]
    reqs = [(s, len(s) - 1) for s in seqs]
    res = {"device": torch.cuda.get_device_name(0)}
    base_cfg = EngineConfig(model=str(model), num_kv_blocks=512, max_model_len=2048)
    base = None
    for name, over in [
        ("bf16", {}),
        ("kv-int8", {"kv_dtype": "int8"}),
        ("kv-fp8", {"kv_dtype": "fp8"}),
        ("int8", {"quantization": "int8"}),
    ]:
        cfg = base_cfg.with_updates(over)
        llm = LLM(cfg)
        sc = PagedScorer(llm)
        paged = sc.score(reqs)
        ref = llm.prompt_logprobs(seqs)
        err = max(max(abs(a - b) for a, b in zip(p.logprobs, r.token_logprobs)) for p, r in zip(paged, ref))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(3):
            sc.score(reqs)
        torch.cuda.synchronize()
        tps = 3 * sum(len(s) for s in seqs) / (time.perf_counter() - t0)
        row = {
            "backend": llm.engine.runner.backend,
            "max_abs_logprob_diff_vs_contiguous": err,
            "score_tokens_per_s": tps,
        }
        if base is None:
            base = llm
        else:
            gate = GateSpec(name="agreement", kind="agreement", min_top1=0.5, limit=8)
            r = evaluate_gates(cfg, [gate], llm=llm, cache_dir=out / "cache", baseline_llm=base).gates[0]
            row["agreement_top1"], row["agreement_kl"], row["gate"] = r.candidate, r.details.get("mean_kl"), r.reason
        res[name] = row
        print(name, row, flush=True)
        if llm is not base:
            del llm, sc
            torch.cuda.empty_cache()
    (out / "gpu_check.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
