"""Which OpenMP wait policy serves fastest: `tune serve` under each, the same client and workload.

    python bench/serve_vs_trial/omp_policy.py CONFIG.yaml --spec examples/02-batch-throughput/spec.yaml \
        --policies default,active,passive,spin10000000 --rounds 3

A trial that measures the served path (`budget.measure: served`) runs its server under the policy
of `budget.trial_omp_wait_policy` (slotune/tuner/measure/trial_process.py trial_env); `tune serve` runs under whatever
its environment says. This serves CONFIG with `tune serve` once per policy ("default": variable
unset, libgomp's spin-then-sleep; "spinN": variable unset, GOMP_SPINCOUNT=N, so an idle worker
spins N iterations before it sleeps), one server at a time (an idle server spinning under `active`
would slow the others), in rounds so that slow drifts of the machine hit every policy alike; each
server gets one replay to warm up and one measured replay of the spec's workload from a client in
its own process. Also measured: the CPU the idle server burns (cores busy over 3 s after the
replays), which a policy that spins forever makes a whole core. Prints the medians and each
policy's ratio to the first.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run import _replay, _serve, _stop  # noqa: E402
from slotune.tuner.measure import machine  # noqa: E402

KEYS = ("output_tokens_per_s", "goodput_rps", "tpot_p50", "tpot_p95", "ttft_p50", "ttft_p95", "idle_cores")


def policy_env(policy: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    if policy.startswith("spin"):
        env["GOMP_SPINCOUNT"] = policy[4:]
    elif policy != "default":
        env["OMP_WAIT_POLICY"] = policy.upper()
    return env


def idle_cores(pid: int, seconds: float = 3.0) -> float:
    """Cores the process (threads included) keeps busy while it serves nothing."""
    import psutil

    proc = psutil.Process(pid)
    t0, c0 = time.perf_counter(), sum(proc.cpu_times()[:2])
    time.sleep(seconds)
    return (sum(proc.cpu_times()[:2]) - c0) / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config", type=Path, help="EngineConfig YAML or a best.yaml")
    ap.add_argument("--spec", type=Path, required=True, help="tuning spec whose workload and limits to replay")
    ap.add_argument("--policies", default="default,active,passive")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=None, help="workload seed (default: the spec's)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    from slotune.tuner.spec.tuning_spec import TuningSpec

    spec = TuningSpec.from_yaml(args.spec)
    seed = spec.workload.seed if args.seed is None else args.seed
    policies = args.policies.split(",")
    runs: dict[str, list[dict]] = {p: [] for p in policies}
    tmp = Path(tempfile.mkdtemp(prefix="omp-policy-"))
    for r in range(args.rounds):
        for p in policies:
            proc, url = _serve(args.config, tmp / f"serve-{p}-{r}.log", env=policy_env(p))
            try:
                _replay(url, {"path": args.spec}, tmp / "warm.json", seed)
                m = _replay(url, {"path": args.spec}, tmp / f"{p}-{r}.json", seed)
                m["idle_cores"] = idle_cores(proc.pid)
            finally:
                _stop(proc)
            runs[p].append({k: m.get(k) for k in KEYS})
            print(
                f"round {r} {p:>8}: " + ", ".join(f"{k} {m.get(k):.4g}" for k in KEYS if m.get(k) is not None),
                flush=True,
            )
    med = {
        p: {
            k: statistics.median(x[k] for x in runs[p] if x[k] is not None)
            for k in KEYS
            if any(x[k] is not None for x in runs[p])
        }
        for p in policies
    }
    base = policies[0]
    print(
        f"\n{machine.words()}; config {args.config}; workload of {args.spec} (seed {seed}); medians of {args.rounds} rounds"
    )
    print("| policy | " + " | ".join(KEYS) + " | tok/s ratio to " + base + " |")
    print("|---" * (len(KEYS) + 2) + "|")
    for p in policies:
        ratio = med[p]["output_tokens_per_s"] / med[base]["output_tokens_per_s"]
        print(f"| {p} | " + " | ".join(f"{med[p].get(k, float('nan')):.4g}" for k in KEYS) + f" | {ratio:.3f} |")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "machine": machine.words(),
                    "config": str(args.config),
                    "spec": str(args.spec),
                    "seed": seed,
                    "runs": runs,
                    "medians": med,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
