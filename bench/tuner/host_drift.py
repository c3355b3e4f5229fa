"""Does a config's replay move with the host? One config loaded in process replays the spec's workload
`--replays` times (its seeds alternated), each replay between two probes: the round trip of a cache
line between CPU 0 and CPU 1 (core_handoff.c) and two threads' read bandwidth. Prints the replays by
placement (`near`: round trip under NEAR_NS before and after; `far`: over it both times; `moved`) and
how often a two-replay declaration lands within 10% of 5 other replays.

    python bench/tuner/host_drift.py examples/02-batch-throughput/spec.yaml --replays 40 \\
        --config '{"quantization":"int8","kernels.int8_activations":true,"max_num_seqs":64}'
    python bench/tuner/host_drift.py --alone 150   # probes only, no engine: the placement's timeline
    python bench/tuner/host_drift.py --render bench/tuner/host-drift-alone-2026-12-07-zen4-2c.json

In process (`budget.measure: in_process`), with the OpenMP wait policy a trial process gets.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from datetime import date
from pathlib import Path

from slotune.tuner.measure import machine
from slotune.tuner.measure.trial_process import omp_wait_policy

PROBE_S = 0.5
NEAR_NS = 300.0  # both CPUs on one L3: 50-250 ns on the 2-vCPU EPYCs here; on two: 300-710 ns


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("spec", nargs="?")
    ap.add_argument("--config", default="{}", help="JSON updates of the default config")
    ap.add_argument("--replays", type=int, default=40)
    ap.add_argument("--seeds", type=int, default=2, help="workload seeds to alternate")
    ap.add_argument("--metric", help="the value to follow (default: the objective's)")
    ap.add_argument("--out", type=Path, help="write the rows as JSON here")
    ap.add_argument("--render", type=Path, help="summarize a record written by --out")
    ap.add_argument("--alone", type=int, metavar="N", help="probe N times with no engine loaded")
    args = ap.parse_args()
    if args.render:
        record = json.loads(args.render.read_text())
        summarize(record["key"], record["rows"]) if record.get("key") else timeline(record["rows"])
        return
    if bool(args.spec) == bool(args.alone):
        ap.error("give a spec, or --alone N (N > 0), or --render FILE")
    # Before torch loads. Alone, its threads sleep between reads rather than spin beside the round trip.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE" if args.alone else omp_wait_policy("auto").upper())

    import torch

    big = torch.ones(64 * 2**20)  # 256 MiB: far beyond any cache
    with round_trip_probe(PROBE_S) as round_trip:

        def probe() -> tuple[float, float]:
            ns = round_trip()
            t, n = time.perf_counter(), 0
            while time.perf_counter() - t < PROBE_S:
                big.sum()
                n += 1
            return ns, n * big.numel() * 4 / 1e9 / (time.perf_counter() - t)

        if args.alone:
            alone(probe, args.alone, args.out)
        else:
            replays(probe, args)


@contextlib.contextmanager
def round_trip_probe(seconds: float) -> Iterator[Callable[[], float]]:
    """core_handoff.c, built and started: each call probes for `seconds` and returns the round trip (ns)."""
    with tempfile.TemporaryDirectory(prefix="slotune-handoff-") as workdir:
        exe = Path(workdir) / "core_handoff"
        src = Path(__file__).with_name("core_handoff.c")
        subprocess.run(["gcc", "-O2", "-pthread", str(src), "-o", str(exe)], check=True)
        cmd = [str(exe), str(seconds * 1e3)]
        with subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as handoff:

            def probe() -> float:
                handoff.stdin.write("\n")
                handoff.stdin.flush()
                return float(handoff.stdout.readline())

            yield probe
            handoff.stdin.close()


def alone(probe, n: int, out: Path | None) -> None:
    before = _cpu_times()
    rows = [dict(zip(("handoff_ns", "gbps"), probe()), at=time.time()) for _ in range(n)]
    spent = [b - a for a, b in zip(before, _cpu_times())]
    steal = spent[7] / sum(spent)  # the hypervisor's time away from this guest
    timeline(rows)
    print(f"steal time: {steal:.1%} of the CPUs' time")
    write(out, {"omp_wait_policy": os.environ["OMP_WAIT_POLICY"], "steal_share": steal, "rows": rows})


def replays(probe, args) -> None:
    from slotune.engine import LLM
    from slotune.tuner.measure.in_process_replay import run_in_process_replay
    from slotune.tuner.spec.tuning_spec import TuningSpec

    spec = TuningSpec.from_yaml(args.spec)
    cfg = spec.base_config().with_updates(json.loads(args.config))
    key = args.metric or spec.objective.metric_key()
    llm = LLM(cfg)
    rows = []
    for i in range(args.replays):
        seed = spec.robustness_seed + i % args.seeds
        before = probe()
        res = run_in_process_replay(
            cfg,
            spec.workload,
            llm=llm,
            seed=seed,
            ttft_limit_s=spec.objective.ttft_limit_s,  # goodput counts as a trial counts it
            tpot_limit_s=spec.objective.tpot_limit_s,
            percentiles=(spec.objective.percentile,),
        )
        after = probe()
        row = {
            "seed": seed,
            "value": res.metrics[key],
            "handoff_ns": [before[0], after[0]],
            "gbps": [before[1], after[1]],
            "at": time.time(),
        }
        rows.append(row)
        print(
            f"{i}: seed {seed} {key} {row['value']:.4g}; round trip {before[0]:.0f} / {after[0]:.0f} ns, "
            f"bandwidth {before[1]:.1f} / {after[1]:.1f} GB/s",
            flush=True,
        )
    summarize(key, rows)
    record = {"spec": args.spec, "config": json.loads(args.config), "key": key, "rows": rows}
    write(args.out, {"omp_wait_policy": os.environ["OMP_WAIT_POLICY"], **record})


def _cpu_times() -> list[int]:
    """/proc/stat's first line: user, nice, system, idle, iowait, irq, softirq, steal, ... (ticks)."""
    return [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]


def write(out: Path | None, record: dict) -> None:
    """`record` as JSON at `out` (if given), with the machine, date and commit that measured it."""
    if out is None:
        return
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    where = {"machine": machine.words(), "date": date.today().isoformat(), "commit": commit}
    out.write_text(json.dumps({**where, **record}, indent=1))


def timeline(rows: list[dict]) -> None:
    """Probes alone (about a second each): each stretch of one placement, its length and ranges."""
    spans: list[list[dict]] = []
    for r in rows:
        if spans and (spans[-1][0]["handoff_ns"] < NEAR_NS) == (r["handoff_ns"] < NEAR_NS):
            spans[-1].append(r)
        else:
            spans.append([r])
    for span in spans:
        ns, gb = [r["handoff_ns"] for r in span], [r["gbps"] for r in span]
        where = "near" if ns[0] < NEAR_NS else "far"
        ranges = f"round trip {min(ns):.0f}-{max(ns):.0f} ns, read {min(gb):.1f}-{max(gb):.1f} GB/s"
        print(f"{where}: {len(span)} probes, {ranges}")


def summarize(key: str, rows: list[dict]) -> None:
    """Per seed, then as declarations. The first replay of each seed is left out: on 06 its documents
    were not yet in the prefix cache."""
    seeds = sorted({r["seed"] for r in rows})
    rows = rows[len(seeds) :]
    for seed in seeds:
        summary(seed, key, [r for r in rows if r["seed"] == seed])
    for matched in (False, True):
        within, n = declarations(rows, len(seeds), matched)
        how = "its own placement" if matched else "any placement"
        print(f"declared from {len(seeds)} replays in a row, within 10% of 5 others in {how}: {within:.0%} of {n}")


def declarations(rows: list[dict], k: int, matched: bool, draws: int = 200) -> tuple[float, int]:
    """Each run of k replays in a row (one per seed) declares their mean, against the median of 5 replays
    drawn from the other runs (`matched`: from its own placement only). The share within 10%, and
    how many runs declared (not one that moved, nor one with fewer than 5 to draw from)."""
    runs = [rows[i : i + k] for i in range(0, len(rows) - k + 1, k)]
    rng, hits, total, declared = random.Random(0), 0, 0, 0
    for j, run in enumerate(runs):
        where = {state for state, rs in placed(run).items() if rs}
        if matched and where not in ({"near"}, {"far"}):
            continue
        pool = [r for i, other in enumerate(runs) if i != j for r in other]
        if matched:
            pool = placed(pool)[where.pop()]
        if len(pool) < 5:
            continue
        declared += 1
        value = statistics.mean(r["value"] for r in run)
        for _ in range(draws):
            again = statistics.median(r["value"] for r in rng.sample(pool, 5))
            hits += abs(value / again - 1) <= 0.10
            total += 1
    return (hits / total if total else float("nan")), declared


def summary(seed: int, key: str, rows: list[dict]) -> None:
    y = [math.log(r["value"]) for r in rows]
    print(f"seed {seed}, {len(rows)} replays: {key} log sd {statistics.pstdev(y):.3f}")
    for probe in ("handoff_ns", "gbps"):
        x = [math.log(statistics.mean(r[probe])) for r in rows]
        fit = statistics.linear_regression(x, y)
        left = statistics.pstdev([v - fit.slope * u - fit.intercept for u, v in zip(x, y)])
        print(f"  {probe}: corr {statistics.correlation(x, y):.2f}, log sd left {left:.3f}")
    for state, rs in placed(rows).items():
        if rs:
            v = [r["value"] for r in rs]
            sd = f", log sd {statistics.pstdev([math.log(x) for x in v]):.3f}" if len(v) > 1 else ""
            print(f"  {state}: {len(rs)} replays, median {statistics.median(v):.4g}{sd}")


def placed(rows: list[dict]) -> dict[str, list[dict]]:
    """The replays by where the two CPUs were before and after: near, far or moved."""
    out: dict[str, list[dict]] = {"near": [], "far": [], "moved": []}
    for r in rows:
        lo, hi = min(r["handoff_ns"]), max(r["handoff_ns"])
        out["near" if hi < NEAR_NS else "far" if lo > NEAR_NS else "moved"].append(r)
    return out


if __name__ == "__main__":
    main()
