"""Stored goals runs judged again with another declared value: each winner's declaration
measurements (kept in its study, user attribute `declare`) taken as their mean (before 95fcbda)
and as their median (since), against the median of the independent re-measure goals.py made;
and the median relative to the default measured beside it (its median on the same seeds), against
the re-measure's median per-repeat winner / default: this takes out a change of the host's speed
between the two (goals.py's last column).

    python bench/tuner/declared_again.py bench/tuner/goals-chat-latency-2026-11-27-xeon-2c-repairs-seeds34.json /tmp/goals01f

RUNS is the goals run's --runs folder (each study's output dir, `<study name>-seed<S>/study.db`).
Measures nothing; prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from goals import relative_to_default  # this folder is sys.path[0]


def values(study, key: str, trial: int | None) -> dict[int, float]:
    """Seed -> the objective `key` of `trial`'s (None: the default's) declaration measurements."""
    from slotune.tuner.search.records import stored_declaration

    record = stored_declaration(study)
    return {
        m["seed"]: m["metrics"][key]
        for m in record.get("measurements", [])
        if m.get("trial") == trial and isinstance((m.get("metrics") or {}).get(key), (int, float))
    }


def rows(result: dict, runs: Path) -> list[dict]:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    key = result["objective"].split()[1]
    out = []
    for w in result["winners"]:
        seed = w["name"].removeprefix("winner-seed")
        db = next(runs.glob(f"*-seed{seed}/study.db"))
        url = f"sqlite:///{db}"
        name = next(s.study_name for s in optuna.get_all_study_summaries(url) if ".replaced-" not in s.study_name)
        study = optuna.load_study(study_name=name, storage=url)
        from slotune.tuner.search.records import stored_declaration

        trial = stored_declaration(study).get("trial")
        mine, default = values(study, key, trial), values(study, key, None)
        again = [x[key] for x in result["runs"][w["name"]] if x.get(key)]
        if not mine or not again:
            continue
        remeasured = statistics.median(again)
        beside = [default[s] for s in mine if s in default]  # the default on the winner's seeds, as declared
        declared = statistics.median(mine.values())
        relative = relative_to_default(
            declared,
            statistics.median(beside) if beside else None,
            result["runs"][w["name"]],
            result["runs"]["default"],
            key,
        )
        out.append(
            {
                "winner": w["name"],
                "declared_on": list(mine.values()),
                "remeasured": remeasured,
                "mean": statistics.fmean(mine.values()) / remeasured,
                "median": declared / remeasured,
                "relative": relative,
            }
        )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("result", type=Path, help="a goals-*.json")
    ap.add_argument("runs", type=Path, help="its --runs folder")
    args = ap.parse_args(argv)
    result = json.loads(args.result.read_text())
    from slotune.tuner.measure.units import format_value

    key = result["objective"].split()[1]
    print(f"{args.result.name} ({key}); declared / re-measured (goal 0.9-1.1)\n")
    print(
        "| winner | declaration measurements | re-measured (median) | mean / re-measured | median / re-measured | "
        "relative to the default beside it |"
    )
    print("|---|---|---|---|---|---|")
    for r in rows(result, args.runs):
        rel = f"{r['relative']:.3f}" if r["relative"] is not None else "-"
        print(
            f"| {r['winner']} | {', '.join(format_value(key, v) for v in r['declared_on'])} | "
            f"{format_value(key, r['remeasured'])} | {r['mean']:.3f} | {r['median']:.3f} | {rel} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
