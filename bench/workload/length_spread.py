"""How much a workload's total tokens change from seed to seed, stratified against independent lengths.

    python bench/workload/length_spread.py examples/02-batch-throughput/spec.yaml --seeds 300

For each of `--seeds` workload seeds, the measured requests' prompt and output lengths are drawn as
`iter_requests` draws them (tuner/workload.py `length_streams`), and the totals' coefficient
of variation across seeds is printed for both `length_sampling` modes. A throughput measured on one
seed moves with its total output tokens, so this spread is a floor under any two measurements on
different seeds agreeing. No model or tokenizer is loaded: lengths do not depend on the prompts' text.
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path

import numpy as np


def totals(wl, seeds: int, mode: str) -> tuple[np.ndarray, np.ndarray]:
    from slotune.tuner.workload import length_streams

    n, wl = wl.num_requests, wl.model_copy(update={"length_sampling": mode})
    prompt, output = [], []
    for seed in range(seeds):
        p, o = length_streams(wl, seed)
        prompt.append(sum(itertools.islice(p, n)))
        output.append(sum(itertools.islice(o, n)))
    return np.array(prompt, float), np.array(output, float)


def main() -> None:
    from slotune.tuner.spec import TuningSpec
    from slotune.tuner.workload import WorkloadSpec

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("spec", type=Path, help="a tuning spec or a workload YAML")
    ap.add_argument("--seeds", type=int, default=300)
    args = ap.parse_args()
    try:
        wl = TuningSpec.from_yaml(args.spec).workload
    except Exception:  # noqa: BLE001 - not a tuning spec: a workload file
        wl = WorkloadSpec.load(args.spec)
    if wl.num_requests is None or wl.trace_source is not None:
        raise SystemExit("needs a workload with num_requests and length distributions")
    print(f"{args.spec}: {wl.num_requests} requests, prompt {wl.prompt_len}, output {wl.output_len}; {args.seeds} seeds")
    print("| length_sampling | prompt tokens CV | output tokens CV | mean output tokens/request |")
    print("|---|---|---|---|")
    for mode in ("independent", "stratified"):
        p, o = totals(wl, args.seeds, mode)
        print(f"| {mode} | {p.std() / p.mean():.1%} | {o.std() / o.mean():.1%} | {o.mean() / wl.num_requests:.1f} |")


if __name__ == "__main__":
    main()
