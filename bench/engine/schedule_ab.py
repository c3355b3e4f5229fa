"""The native step's loop schedule, served: each round starts one trial process per schedule (the
native library built with -DSLOTUNE_SCHEDULE=...; the order alternates by round) and replays the
spec's confirmation seeds in it, as `tune run` measures. The round trip between CPU 0 and CPU 1
(bench/tuner/host_drift.py's probe) is read before and after each process, so every value carries
where the host had placed the two vCPUs. Prints each round, then per schedule and placement the
median, and the rounds each schedule won.

    python bench/engine/schedule_ab.py examples/01-chat-latency/spec.yaml --rounds 12 \\
        --config '{"quantization":"int4","quant_group_size":32,"kernels.int8_activations":true,"max_num_seqs":1}'
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from slotune.tuner.measure.trial_process import TrialResult, measure_seeds  # noqa: E402
from slotune.tuner.spec.tuning_spec import TuningSpec  # noqa: E402

from bench.tuner.host_drift import placed, round_trip_probe, write  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("spec", nargs="?")
    ap.add_argument("--config", default="{}", help="JSON updates of the default config")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--schedules", nargs=2, default=["static", "guided"])
    ap.add_argument("--out", type=Path, help="write the values as JSON here")
    ap.add_argument("--render", type=Path, help="summarize a record written by --out")
    args = ap.parse_args()
    if args.render:
        record = json.loads(args.render.read_text())
        direction = TuningSpec.from_yaml(record["spec"]).objective.direction()
        summarize(record["key"], direction, record["schedules"], record["rows"])
        return
    if not args.spec:
        ap.error("give a spec, or --render FILE")
    spec = TuningSpec.from_yaml(args.spec)
    cfg = spec.base_config().with_updates(json.loads(args.config))
    key = spec.objective.metric_key()
    seeds = [spec.robustness_seed, spec.robustness_seed + 1]
    flags = os.environ.get("SLOTUNE_NATIVE_CFLAGS", "")
    rows = []
    with round_trip_probe(0.3) as round_trip:
        for r in range(args.rounds):
            for schedule in args.schedules[:: 1 if r % 2 == 0 else -1]:
                os.environ["SLOTUNE_NATIVE_CFLAGS"] = f"{flags} -DSLOTUNE_SCHEDULE={schedule}".strip()
                before = round_trip()
                results = measure_seeds(spec, cfg, seeds)
                after = round_trip()
                for seed, res in zip(seeds, results):
                    if not isinstance(res, TrialResult):
                        raise SystemExit(f"round {r}, {schedule}, seed {seed}: {res}")
                    rows.append(
                        {
                            "round": r,
                            "schedule": schedule,
                            "seed": seed,
                            "value": res.metrics[key],
                            "handoff_ns": [before, after],
                        }
                    )
                values = " ".join(f"{x['value']:.4g}" for x in rows[-len(seeds) :])
                print(f"round {r} {schedule}: {values}; round trip {before:.0f} / {after:.0f} ns", flush=True)
    os.environ["SLOTUNE_NATIVE_CFLAGS"] = flags
    summarize(key, spec.objective.direction(), args.schedules, rows)
    record = {"spec": args.spec, "config": json.loads(args.config), "key": key, "schedules": args.schedules}
    write(args.out, {**record, "rows": rows})


def summarize(key: str, direction: str, schedules: list[str], rows: list[dict]) -> None:
    lower = direction == "minimize"
    for schedule in schedules:
        mine = [x for x in rows if x["schedule"] == schedule]
        parts = [f"all {len(mine)}: {statistics.median(x['value'] for x in mine):.4g}"]
        for where, rs in placed(mine).items():
            if rs:
                parts.append(f"{where} {len(rs)}: {statistics.median(x['value'] for x in rs):.4g}")
        print(f"{schedule} ({key} median): " + ", ".join(parts))
    a, b = schedules
    wins = 0
    rounds = sorted({x["round"] for x in rows})
    for r in rounds:
        ma, mb = (statistics.median(x["value"] for x in rows if x["round"] == r and x["schedule"] == s) for s in (a, b))
        wins += (ma < mb) if lower else (ma > mb)
    print(f"{a} better than {b} in {wins} of {len(rounds)} rounds")


if __name__ == "__main__":
    main()
