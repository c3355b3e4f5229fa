"""How much a config's measured value depends on the workload seed and how much on when it ran: each
config started once per round and replayed on the confirmation's seeds (robustness_seed, + 1, ...)
and the re-measure's (robustness_seed + 1000 + i, as bench/tuner/goals.py), the seed order rotated
each round and the configs' order reversed every other round; `--num-requests` measures each config
at several workload lengths, alternated the same way. Prints each value, the median per seed over
rounds and per round over seeds, and the confirmation seeds' median against the re-measure seeds'.
`--resample FILE` reads such values back and counts, for each number of declaring seeds, how often a
declaration (their median in one round) lands within 10% of a re-measure (the median of the other
seeds, at most 5, in another round).

    python bench/tuner/seed_spread.py examples/02-batch-throughput/spec.yaml --rounds 3 \
        --config 'int8-64-512={"quantization":"int8","kernels.int8_activations":true,"max_num_seqs":64,"max_num_batched_tokens":512}'
    python bench/tuner/seed_spread.py examples/02-batch-throughput/spec.yaml --rounds 3 --num-requests 24 96 \
        --config 'int8-64-512={"quantization":"int8","kernels.int8_activations":true,"max_num_seqs":64,"max_num_batched_tokens":512}'
    python bench/tuner/seed_spread.py --resample bench/tuner/seed-spread-batch-throughput-2026-12-03-zen3-2c.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
from pathlib import Path

from slotune.tuner.measure.trial_process import TrialResult, measure_seeds
from slotune.tuner.spec.tuning_spec import TuningSpec


def resample(path: Path) -> None:
    """Every split of the seeds into declaring and re-measuring ones, on every ordered pair of rounds."""
    for name, v in json.loads(path.read_text())["values"].items():
        seeds, rounds = sorted(v), len(next(iter(v.values())))
        logs = [[math.log(x) for x in v[s]] for s in seeds]
        run = statistics.mean(statistics.pvariance(x) for x in logs)  # one seed again, another round
        seed = max(statistics.pvariance([statistics.mean(x) for x in logs]) - run / rounds, 0.0)
        print(
            f"{name}: {len(seeds)} seeds, {rounds} rounds; log sd run to run {run**0.5:.3f}, seed to seed {seed**0.5:.3f}"
        )
        for n in range(1, len(seeds)):
            ratios = []
            for mine in itertools.combinations(seeds, n):
                others = [s for s in seeds if s not in mine][:5]
                for r1, r2 in itertools.permutations(range(rounds), 2):
                    ratios.append(
                        statistics.median(v[s][r1] for s in mine) / statistics.median(v[s][r2] for s in others)
                    )
            within = sum(abs(q - 1) <= 0.10 for q in ratios) / len(ratios)
            deciles = statistics.quantiles(ratios, n=10)
            print(
                f"  {n} declaring, {len(others)} re-measuring: within 10% in {within:.0%} of {len(ratios)}; ratio p10 {deciles[0]:.2f}, p90 {deciles[-1]:.2f}"
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("spec", nargs="?")
    ap.add_argument("--resample", type=Path, help="a values file written by --out")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--confirm-seeds", type=int, default=2)
    ap.add_argument("--remeasure-seeds", type=int, default=5)
    ap.add_argument("--config", action="append", default=[], help="NAME=JSON updates of the default config")
    ap.add_argument("--num-requests", type=int, nargs="+", help="workload lengths to measure each config at")
    ap.add_argument("--out", type=Path, help="write the values as JSON here")
    args = ap.parse_args()
    if args.resample:
        resample(args.resample)
        return
    if not args.spec:
        ap.error("give a spec, or --resample FILE")
    spec = TuningSpec.from_yaml(args.spec)
    lengths = args.num_requests or [None]
    specs = {n: spec if n is None else _with_length(spec, n) for n in lengths}
    configs = {
        name if n is None else f"{name} num_requests={n}": (specs[n], spec.base_config().with_updates(json.loads(u)))
        for name, _, u in (c.partition("=") for c in args.config)
        for n in lengths
    }
    key = spec.objective.metric_key()
    confirm = [spec.robustness_seed + i for i in range(args.confirm_seeds)]
    remeasure = [spec.robustness_seed + 1000 + i for i in range(args.remeasure_seeds)]
    seeds = confirm + remeasure
    values: dict[str, dict[int, list[float]]] = {n: {s: [] for s in seeds} for n in configs}
    for r in range(args.rounds):
        order = seeds[r % len(seeds) :] + seeds[: r % len(seeds)]
        for name, (arm, cfg) in list(configs.items())[:: 1 if r % 2 == 0 else -1]:
            for s, res in zip(order, measure_seeds(arm, cfg, order)):
                if not isinstance(res, TrialResult):
                    raise SystemExit(f"{name} on seed {s}: {res}")
                values[name][s].append(res.metrics[key])
            print(f"round {r} {name}: " + ", ".join(f"{s}={values[name][s][-1]:.4g}" for s in order), flush=True)
    for name in configs:
        v = values[name]
        per_seed = {s: statistics.median(v[s]) for s in seeds}
        per_round = [statistics.median(v[s][r] for s in seeds) for r in range(args.rounds)]
        print(f"\n{name} ({key})")
        print("  per seed (median of rounds): " + ", ".join(f"{s}={x:.4g}" for s, x in per_seed.items()))
        print(f"  per seed max/min: {max(per_seed.values()) / min(per_seed.values()):.3f}")
        print("  per round (median of seeds): " + ", ".join(f"{x:.4g}" for x in per_round))
        print(f"  per round max/min: {max(per_round) / min(per_round):.3f}")
        if remeasure:
            c, m = statistics.median(per_seed[s] for s in confirm), statistics.median(per_seed[s] for s in remeasure)
            print(f"  confirmation seeds {confirm}: {c:.4g}; re-measure seeds: {m:.4g}; ratio {c / m:.3f}")
    if args.out:
        args.out.write_text(json.dumps({"spec": args.spec, "key": key, "values": values}, indent=1))


def _with_length(spec: TuningSpec, num_requests: int) -> TuningSpec:
    """The spec with its workload cut or stretched to `num_requests` requests."""
    workload = spec.workload.model_copy(update={"num_requests": num_requests, "duration_s": None})
    return spec.model_copy(update={"workload": workload})


if __name__ == "__main__":
    main()
