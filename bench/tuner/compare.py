"""Tuned vs default: re-measure an example's best.yaml against the default EngineConfig.

Both configs run on the example's own workload (same arrivals, same concurrency: the same
load), interleaved `--repeats` times on fresh workload seeds, each run an isolated trial
process exactly as in `tune run`; the table reports medians.

    tune run examples/02-batch-throughput/spec.yaml -o runs/02
    python bench/tuner/compare.py examples/02-batch-throughput/spec.yaml runs/02 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from datetime import date
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> None:
    from slotune.engine.config import EngineConfig
    from slotune.tuner.measure.trial_process import TrialFailure, measure
    from slotune.tuner.spec.slo import metric_key
    from slotune.tuner.spec.tuning_spec import TuningSpec

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("spec", type=Path)
    ap.add_argument("run_dir", type=Path, help="output dir of `tune run` (holds best.yaml)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--machine", default="2-core Intel Xeon (KVM), no GPU")
    args = ap.parse_args()
    spec = TuningSpec.from_yaml(args.spec)
    spec.output_dir = str(args.run_dir)
    configs = {"default": spec.base_config(), "tuned": EngineConfig.from_yaml(args.run_dir / "best.yaml")}
    obj = spec.objective
    p = obj.percentile
    keys = list(
        dict.fromkeys(
            [
                obj.metric_key(),
                metric_key("ttft", p),
                metric_key("tpot", p),
                "output_tokens_per_s",
                "goodput_rps",
                "slo_attainment",
            ]
        )
    )
    runs: dict[str, list[dict]] = {k: [] for k in configs}
    for i in range(args.repeats):
        for name, cfg in configs.items():  # interleaved: slow drifts of the machine hit both alike
            t = time.perf_counter()
            try:
                r = measure(spec, cfg, seed=100 + i, early_stop=False)
                runs[name].append({k: r.metrics.get(k) for k in keys})
            except TrialFailure as exc:
                runs[name].append({"error": exc.reason})
            print(f"repeat {i} {name}: {runs[name][-1]} ({time.perf_counter() - t:.0f} s)", flush=True)
    med = {
        name: {
            k: statistics.median([r[k] for r in rs if r.get(k) is not None])
            for k in keys
            if any(r.get(k) is not None for r in rs)
        }
        for name, rs in runs.items()
    }
    key = obj.metric_key()
    d, t = med["default"].get(key), med["tuned"].get(key)
    ratio = (d / t if obj.direction() == "minimize" else t / d) if d and t else None
    result = {
        "spec": str(args.spec),
        "date": date.today().isoformat(),
        "machine": args.machine,
        "python": platform.python_version(),
        "objective": f"{obj.direction()} {key}",
        "repeats": args.repeats,
        "tuned_config": configs["tuned"].model_dump(mode="json", exclude_defaults=True),
        "median": med,
        "improvement": ratio,
        "runs": runs,
    }
    out = HERE / f"compare-{spec.name}.json"
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps({"median": med, "improvement": ratio}, indent=1))


if __name__ == "__main__":
    main()
