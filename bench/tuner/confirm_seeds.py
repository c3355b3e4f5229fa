"""How many confirmation seeds a winner needs, judged offline on a stored goals run.

    python bench/tuner/confirm_seeds.py bench/tuner/goals-chat-latency-<date>-<tag>.json

The goals run must come from studies with `confirm.seeds: n` (goals.py --confirm-seeds n); with
`--remeasure-candidates` every candidate has an independent re-measure, without it only the study's
own winner does (a row whose winner was not re-measured shows its declared value only). For each study and each
k = 1..n, the stored confirmation is judged as if it had measured only its first k seeds (the plan's
first k seeds are exactly what `confirm.seeds: k` measures, in the same order): which candidate wins,
its declared median, and that against the candidate's re-measure; and the same with only the best j
candidates (`confirm.candidates: j`; the order of the measurements then differs a little). Beside it, "held out": the choice
on the first k seeds and the declaration on the remaining ones only, so the numbers declared are not
the ones the winner was chosen on. Prints a markdown table; measures nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def main() -> None:
    import optuna

    from slotune.tuner.decide.confirm import candidates, judge_runs
    from slotune.tuner.measure.units import format_value
    from slotune.tuner.search.records import stored_confirmation
    from slotune.tuner.spec.tuning_spec import TuningSpec

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("goals", type=Path, help="a goals-*.json made with --remeasure-candidates")
    args = ap.parse_args()
    r = json.loads(args.goals.read_text())
    direction, key = r["objective"].split()
    rows = r["rows"]
    sign = 1 if direction == "minimize" else -1
    eligible = {n: x["median"] for n, x in rows.items() if x["median"] and x["slo_held"] == x["measured"]}
    best = min(eligible.values(), key=lambda v: sign * v) if eligible else None
    print(
        f"{args.goals.name}: objective {direction} {key}; best re-measured config that held the SLO: {format_value(key, best)}"
    )
    print()
    print(
        "| study | candidates | seeds | winner (trial) | declared | re-measured | declared / re-measured | SLO held in re-measures | tuned / best | held out: declared on the rest / re-measured |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for w in r["winners"]:
        out = Path(w["output_dir"])
        study_seed = int(w["name"].removeprefix("winner-seed"))
        spec = TuningSpec.from_yaml(out.parent / f"{out.name}.yaml")
        study = optuna.load_study(study_name=spec.name, storage=f"sqlite:///{out / 'study.db'}")
        trials = candidates(study, spec)
        record = stored_confirmation(study)
        seeds = record["seeds"]
        for j, k in [(j, k) for j in range(len(trials), 0, -1) for k in range(1, len(seeds) + 1)]:
            kept = {t.number for t in trials[:j]}
            runs = [m for m in record["runs"] if m["seed"] in seeds[:k] and m["trial"] in kept | {None}]
            c = judge_runs(spec, {"seeds": seeds[:k], "runs": runs}, trials[:j])
            name = r["candidates"].get(f"{study_seed}:{c.winner}") or (w["name"] if c.winner == w["trial"] else None)
            row = rows.get(name, {})
            declared = (c.median(c.winner) or {}).get(key)
            m, held = row.get("median"), f"{row.get('slo_held')} of {row.get('measured')}"
            rest = [
                x["metrics"][key]
                for x in record["runs"]
                if x["trial"] == c.winner and x["seed"] in seeds[k:] and x.get("metrics")
            ]
            held_out = f"{statistics.median(rest) / m:.3f}" if rest and m else "-"
            print(
                f"| {study_seed} | {j} | {k}{'' if c.confirmed else ' (unconfirmed)'} | {name} ({c.winner}) | {format_value(key, declared)} | "
                f"{format_value(key, m)} | **{declared / m:.3f}** | {held} | {best / m if sign > 0 else m / best:.3f} | {held_out} |"
                if declared and m and best
                else f"| {study_seed} | {j} | {k} | {name or 'not re-measured'} ({c.winner}) | {format_value(key, declared)} | - | - | - | - | - |"
            )


if __name__ == "__main__":
    main()
