"""How much a workload's totals change from seed to seed, stratified against independent draws.

    python bench/workload/seed_spread.py examples/02-batch-throughput/spec.yaml --seeds 300
    python bench/workload/seed_spread.py examples/06-rag-answers/spec.yaml --seeds 300

For each of `--seeds` workload seeds, the measured requests' prompt and output lengths and (open
loop, poisson or gamma) their arrival gaps are drawn as `iter_requests` draws them
(slotune/tuner/spec/workload_spec.py `length_streams`, `arrival_gaps`), and the coefficient of variation of the
totals across seeds is printed for both `length_sampling` and both `arrival_sampling` modes. A
throughput measured on one seed moves with its total output tokens, and a queueing-bound latency
with the span its arrivals take (the replay's realised rate), so these spreads are a floor under two
measurements on different seeds agreeing. No model or tokenizer is loaded: lengths and arrivals do
not depend on the prompts' text.
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path

import numpy as np


def totals(wl, seeds: int, mode: str) -> tuple[np.ndarray, np.ndarray]:
    """Total prompt and output tokens of the measured requests, one per seed."""
    from slotune.tuner.workload.requests import length_streams

    n, wl = wl.num_requests, wl.model_copy(update={"length_sampling": mode})
    prompt, output = [], []
    for seed in range(seeds):
        p, o = length_streams(wl, seed)
        prompt.append(sum(itertools.islice(p, n)))
        output.append(sum(itertools.islice(o, n)))
    return np.array(prompt, float), np.array(output, float)


def spans(wl, seeds: int, mode: str) -> tuple[np.ndarray, np.ndarray]:
    """Seconds from the first measured arrival to the last, one per seed, and every gap drawn."""
    from slotune.tuner.workload.requests import arrival_gaps

    n, wl = wl.num_requests, wl.model_copy(update={"arrival_sampling": mode})
    gaps = np.array([list(itertools.islice(arrival_gaps(wl, seed), n - 1)) for seed in range(seeds)])
    return gaps.sum(axis=1), gaps.ravel()


def main() -> None:
    from slotune.tuner.spec.tuning_spec import TuningSpec
    from slotune.tuner.spec.workload_spec import WorkloadSpec

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
    print(
        f"{args.spec}: {wl.num_requests} requests, prompt {wl.prompt_len}, output {wl.output_len}, arrivals "
        f"{wl.arrivals}{f' at {wl.rate:g}/s' if wl.rate else ''}; {args.seeds} seeds"
    )
    print()
    print("| length_sampling | prompt tokens CV | output tokens CV | mean output tokens/request |")
    print("|---|---|---|---|")
    for mode in ("independent", "stratified"):
        p, o = totals(wl, args.seeds, mode)
        print(f"| {mode} | {p.std() / p.mean():.1%} | {o.std() / o.mean():.1%} | {o.mean() / wl.num_requests:.1f} |")
    if wl.arrivals in ("poisson", "gamma") and wl.num_requests > 1:
        print()
        print("| arrival_sampling | span of the arrivals, mean | span CV | min - max | gaps' mean | gaps' CV |")
        print("|---|---|---|---|---|---|")
        for mode in ("independent", "stratified"):
            s, g = spans(wl, args.seeds, mode)
            print(
                f"| {mode} | {s.mean():.2f} s | {s.std() / s.mean():.1%} | {s.min():.2f} - {s.max():.2f} s | "
                f"{g.mean():.3f} s | {g.std() / g.mean():.2f} |"
            )


if __name__ == "__main__":
    main()
