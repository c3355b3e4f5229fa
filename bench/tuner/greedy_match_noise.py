"""What the greedy_match gate sees of llama-server launches that change numerics, not the model.

    PATH=<llama-server folder>:$PATH python bench/tuner/greedy_match_noise.py [--model smollm2-135m]

Launches llama-server with each of a few knob sets (the default launch twice, flash attention on and
off, more slots, q8_0 and q4_0 KV caches), asks each for the gate's greedy answers (the 16 agreement
prompts, 32 tokens), once one prompt at a time and once four at a time, and prints each launch's
match against the default launch's answers asked the same way (slotune/evals/greedy_match.py). The default
launch against itself is the noise floor; the weights requantized to Q2_K by llama-quantize (when it is
on PATH) are the negative control, a launch known to damage output. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import platform
import shutil
import subprocess
import tempfile
from datetime import date
from pathlib import Path

from slotune.engine.paths import resolve_model_path
from slotune.evals.gate_spec import GateSpec
from slotune.evals.greedy_match import gate_prompts, greedy_answers, match_score
from slotune.tuner.measure import external_trial
from slotune.tuner.spec.server import ServerConfig

LAUNCHES = {
    "default launch": {},
    "default launch again": {},
    "4 slots, flash attention on": {"parallel": 4, "flash_attn": "on"},
    "8 slots, flash attention on": {"parallel": 8, "flash_attn": "on"},
    "4 slots, flash attention off": {"parallel": 4, "flash_attn": "off"},
    "4 slots, q8_0 K and V": {"parallel": 4, "flash_attn": "on", "cache_type_k": "q8_0", "cache_type_v": "q8_0"},
    "4 slots, q4_0 K and V": {"parallel": 4, "flash_attn": "on", "cache_type_k": "q4_0", "cache_type_v": "q4_0"},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()
    gate = GateSpec(name="noise", kind="greedy_match", min_match=0.9)
    base = ServerConfig(engine="llama-server", model=args.model, knobs={"threads": 2, "ctx_per_slot": 1024})
    answers, tokenizer, launches = {}, None, dict(LAUNCHES)
    workdir = Path(tempfile.mkdtemp(prefix="greedy-match-noise-"))
    if shutil.which("llama-quantize"):
        q2 = workdir / "q2_k.gguf"
        src = str(resolve_model_path(args.model))
        subprocess.run(["llama-quantize", "--allow-requantize", src, str(q2), "Q2_K"], check=True, capture_output=True)
        launches["weights requantized to Q2_K"] = {"model": str(q2)}
    for concurrency in (1, 4):
        for name, knobs in launches.items():
            with (
                tempfile.TemporaryDirectory() as d,
                external_trial.external_server(base.with_updates(knobs), Path(d) / "server.log") as server,
            ):
                tokenizer = server.tokenizer
                prompts = gate_prompts(tokenizer, gate)
                answers[concurrency, name] = greedy_answers(
                    server.url, prompts, args.max_tokens, concurrency, server.model_id
                )
    print(
        f"{args.model}, llama-server, {len(prompts)} prompts x {args.max_tokens} tokens; {platform.node()}, {date.today()}"
    )
    print()
    print("| launch | match, one prompt at a time | identical | match, four at a time | identical |")
    print("|---|---|---|---|---|")
    for name in launches:
        cells = []
        for concurrency in (1, 4):
            ref, got = answers[concurrency, "default launch"], answers[concurrency, name]
            scores = [match_score(tokenizer.encode(r), tokenizer.encode(c)) for r, c in zip(ref, got)]
            cells += [f"{sum(scores) / len(scores):.3f}", f"{sum(s == 1 for s in scores)} of {len(scores)}"]
        print(f"| {name} | " + " | ".join(cells) + " |")
    shutil.rmtree(workdir)


if __name__ == "__main__":
    main()
