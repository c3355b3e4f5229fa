"""`kernels.int8_activation_group_size`: what coarser activation groups cost in logits and buy in steps.

Per config (SmolLM2-135M, int8 and int4-g32 weights, bf16, int8 activations) and group size:
- error: the native step's logits over the bundled corpus (`--tokens` positions, one sequence, token by
  token) against the same weights with float activations (`int8_activations: false`, also native), so
  only the activations' quantization differs: mean and max |logit difference| and top-1 agreement;
- speed: native engine steps at each row count, every group's engine stepped in turn (rotated each
  repeat), medians. Rows of 16 and more run 16-row tiles on AMX where the machine has it.

    .venv/bin/python bench/engine/act_groups.py --groups 32,64,128,256 --rows 1,16,64 [--out PREFIX]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from slotune.engine import EngineConfig  # noqa: E402
from slotune.engine.llm_engine import LLMEngine  # noqa: E402
from slotune.engine.loader import resolve_model_path  # noqa: E402
from slotune.engine.tokenizer import Tokenizer  # noqa: E402
from slotune.kernels import cpu_decode  # noqa: E402
from slotune.tuner.measure import machine  # noqa: E402
from slotune.tuner.workload.requests import corpus_token_ids  # noqa: E402

from bench.engine.native_avx2 import _engine, _timed_step  # noqa: E402

CONFIGS = {
    "int8": {"dtype": "bfloat16", "quantization": "int8"},
    "int4-g32": {"dtype": "bfloat16", "quantization": "int4", "quant_group_size": 32},
}


def _logits(overrides: dict, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), vocab] logits of one sequence decoded token by token by the native step."""
    bs = 16
    cfg = EngineConfig(model="smollm2-135m").with_updates(
        {
            **overrides,
            "kernels": {**overrides.get("kernels", {}), "backend": "native"},
            "max_num_seqs": 1,
            "max_model_len": len(tokens) + bs,
            "block_size": bs,
            "num_kv_blocks": -(-len(tokens) // bs) + 1,
        }
    )
    native = LLMEngine(cfg).runner.native
    table = list(range(-(-len(tokens) // bs)))
    rows = [
        native.step(ids=[t], positions=[p], slots=[p], block_tables=[table])[0].clone() for p, t in enumerate(tokens)
    ]
    return torch.stack(rows)


def error(name: str, groups: list[int], tokens: list[int]) -> list[dict]:
    base = CONFIGS[name]
    want = _logits({**base, "kernels": {"int8_activations": False}}, tokens)
    out = []
    for g in groups:
        got = _logits({**base, "kernels": {"int8_activations": True, "int8_activation_group_size": g}}, tokens)
        diff = (got - want).abs()
        out.append(
            {
                "config": name,
                "group": g,
                "mean_abs_err": float(diff.mean()),
                "max_abs_err": float(diff.max()),
                "top1_agreement": float((got.argmax(-1) == want.argmax(-1)).float().mean()),
            }
        )
        print(json.dumps(out[-1]), flush=True)
    return out


def speed(name: str, groups: list[int], rows: int, repeats: int) -> list[dict]:
    engines = {
        g: _engine(
            {**CONFIGS[name], "kernels": {"int8_activations": True, "int8_activation_group_size": g}},
            "native",
            rows,
            repeats + 4,
        )
        for g in groups
    }
    for e in engines.values():
        _timed_step(e), _timed_step(e)  # warm-up
    times: dict[int, list[float]] = {g: [] for g in groups}
    for r in range(repeats):
        order = groups[r % len(groups) :] + groups[: r % len(groups)]
        for g in order:
            times[g].append(_timed_step(engines[g]))
    out = [{"config": name, "group": g, "rows": rows, "step_ms": 1e3 * statistics.median(times[g])} for g in groups]
    for o in out:
        print(json.dumps(o), flush=True)
    return out


def to_markdown(rep: dict) -> str:
    lines = [
        f"# int8 activation groups: error and step time ({rep['date']}, {rep['machine']})",
        "",
        f"Command: `{rep['command']}`. AMX kernels: {'on' if rep['amx'] else 'none'}. Error: logits of "
        f"{rep['tokens']} corpus positions against the same weights with float activations.",
        "",
        "| config | group | mean abs err | max abs err | top-1 agreement |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {e['config']} | {e['group']} | {e['mean_abs_err']:.4f} | {e['max_abs_err']:.3f} | {e['top1_agreement']:.3f} |"
        for e in rep["error"]
    ]
    lines += ["", "| config | rows | " + " | ".join(f"group {g} ms" for g in rep["groups"]) + " | 32 / largest |"]
    lines += ["|---|---|" + "---|" * (len(rep["groups"]) + 1)]
    by = {(s["config"], s["rows"], s["group"]): s["step_ms"] for s in rep["speed"]}
    for name in rep["configs"]:
        for rows in rep["rows"]:
            ms = [by[name, rows, g] for g in rep["groups"]]
            lines.append(f"| {name} | {rows} | " + " | ".join(f"{m:.2f}" for m in ms) + f" | {ms[0] / ms[-1]:.2f}x |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default="int8,int4-g32")
    ap.add_argument("--groups", default="32,64,128,256")
    ap.add_argument("--rows", default="1,16,64")
    ap.add_argument("--repeats", type=int, default=24)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--out", type=Path, default=None, help="write <out>.json and <out>.md")
    args = ap.parse_args()
    configs, groups, rows = args.configs.split(","), [int(g) for g in args.groups.split(",")], args.rows.split(",")
    tokens = corpus_token_ids(Tokenizer.from_model_path(resolve_model_path("smollm2-135m")))[: args.tokens]
    rep = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        "machine": machine.words(),
        "command": "python bench/engine/act_groups.py " + " ".join(sys.argv[1:]),
        "amx": cpu_decode.set_amx(True),
        "configs": configs,
        "groups": groups,
        "rows": [int(r) for r in rows],
        "tokens": len(tokens),
        "error": [e for name in configs for e in error(name, groups, tokens)],
        "speed": [s for name in configs for r in rows for s in speed(name, groups, int(r), args.repeats)],
    }
    md = to_markdown(rep)
    print(md)
    if args.out:
        args.out.with_suffix(".json").write_text(json.dumps(rep, indent=1) + "\n")
        args.out.with_suffix(".md").write_text(md)


if __name__ == "__main__":
    main()
