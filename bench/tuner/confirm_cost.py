"""What the confirmation's measurements cost: one trial process per seed against one process that
starts the config once and replays several seeds (`trial_process.measure_seeds`), side by side,
interleaved, on one spec. Prints seconds per seed and the ratio, and each way's values.

    python bench/tuner/confirm_cost.py examples/01-chat-latency/spec.yaml --seeds 4 --repeats 2 \
        --config 'int4-g32-1seq={"quantization":"int4","quant_group_size":32,"kernels.int8_activations":true,"max_num_seqs":1}'
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from slotune.tuner.measure.trial_process import measure, measure_seeds
from slotune.tuner.spec.tuning_spec import TuningSpec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("spec")
    ap.add_argument("--seeds", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--config", action="append", default=[], help="NAME=JSON updates of the default config")
    args = ap.parse_args()
    spec = TuningSpec.from_yaml(args.spec)
    configs = {"default": spec.base_config()}
    for item in args.config:
        name, _, updates = item.partition("=")
        configs[name] = spec.base_config().with_updates(json.loads(updates))
    key = spec.objective.metric_key()
    seeds = [spec.robustness_seed + i for i in range(args.seeds)]
    rows: dict[tuple[str, str], list[float]] = {}
    for rep in range(args.repeats):
        for name, cfg in configs.items():
            for way in (
                ("one process per seed", "one process, all seeds")
                if rep % 2 == 0
                else ("one process, all seeds", "one process per seed")
            ):
                t = time.perf_counter()
                if way == "one process per seed":
                    values = [measure(spec, cfg, seed=s, early_stop=False, gates=False).metrics[key] for s in seeds]
                else:
                    values = [r.metrics[key] for r in measure_seeds(spec, cfg, seeds)]
                s_per_seed = (time.perf_counter() - t) / len(seeds)
                rows.setdefault((name, way), []).append(s_per_seed)
                print(
                    f"repeat {rep} {name} {way}: {s_per_seed:.1f} s per seed; {key} {[round(v, 5) for v in values]}",
                    flush=True,
                )
    print(f"\n{spec.name}, {args.seeds} seeds, {args.repeats} repeats (median seconds per seed)")
    for name in configs:
        apart = statistics.median(rows[(name, "one process per seed")])
        together = statistics.median(rows[(name, "one process, all seeds")])
        print(f"  {name}: {apart:.1f} s apart, {together:.1f} s together: x{together / apart:.2f}")


if __name__ == "__main__":
    main()
