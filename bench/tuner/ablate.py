"""What each mechanism of the winner's confirmation changes, judged offline on a stored goals run.

    python bench/tuner/goals.py examples/01-chat-latency/spec.yaml --remeasure-candidates --runs R ...
    python bench/tuner/ablate.py bench/tuner/goals-chat-latency-DATE.json

Each study's stored round (user attribute `confirm`) and declaration (`declare`) are judged again as
if a mechanism were off: its later passes dropped, its near misses left out, no round at all (the
best trial by its own measurement wins), the declaration cut to its first `declare_repeats` seeds
(no adaptive stopping), a mean declared instead of the median, the round's value declared (no
declaration). The winner each variant picks is scored on goals.py's independent re-measure (every
round candidate is re-measured with --remeasure-candidates): its re-measured median against the
best re-measured config's (tuned / best, goal >= 0.9), and its declared value against its own
re-measured median (goal: within 10%). Measurements: what the variant would have spent after the
search. Measures nothing; prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Variant:
    name: str
    winner: int
    declared: float | None
    measurements: int


def variants(spec, study) -> list[Variant]:
    """The stored decision of one study, and the same data judged with each mechanism off."""
    from slotune.tuner.decide.confirm import confirm_round
    from slotune.tuner.decide.declare import objective_values
    from slotune.tuner.search.records import TrialRecord, stored_declaration, stored_round

    key, record, declaration = spec.objective.metric_key(), stored_round(study), stored_declaration(study)
    numbers = [n for n in record["order"] if n is not None]
    trials = [TrialRecord.of(study.trials[n]) for n in numbers]
    first = [m for m in record["measurements"] if "pass" not in m]
    passes = len(record["measurements"]) - len(first)
    full = confirm_round(spec, record, trials)
    one_pass = confirm_round(spec, {**record, "measurements": first}, trials)
    feasible = [t for t in trials if t.feasible]
    kept = {None, *(t.number for t in feasible)}
    no_near = confirm_round(
        spec, {**record, "measurements": [m for m in first if m.get("trial") in kept]}, feasible or trials
    )
    winner_values = objective_values(declaration.get("measurements", []), full.winner, key)
    seeds = declaration.get("seeds", [])
    n_declare = 2 * len(seeds)
    k = spec.budget.declare_repeats
    first_k = objective_values(
        [m for m in declaration.get("measurements", []) if m.get("seed") in seeds[:k]], full.winner, key
    )

    def median(values):
        return statistics.median(values) if values else None

    def round_value(c):
        m = c.standing(c.winner).metrics
        return None if m is None else m.get(key)

    own = full.best_by_trial
    return [
        Variant("as run", full.winner, median(winner_values), len(first) + passes + n_declare),
        Variant("no later passes", one_pass.winner, round_value(one_pass), len(first)),
        Variant(
            "no later passes, declared on fresh seeds",
            one_pass.winner,
            median(winner_values) if one_pass.winner == full.winner else None,
            len(first) + n_declare,
        ),
        Variant("no near misses (one pass)", no_near.winner, round_value(no_near), len(no_near.measured)),
        Variant("no declaration: the round's value", full.winner, round_value(full), len(first) + passes),
        Variant(f"declaration: first {k} seeds only", full.winner, median(first_k), len(first) + passes + 2 * k),
        Variant(
            "declaration: the mean",
            full.winner,
            statistics.fmean(winner_values) if winner_values else None,
            len(first) + passes + n_declare,
        ),
        Variant("no round: the best trial by its own", own, TrialRecord.of(study.trials[own]).values[0], 0),
    ]


def simulated(result: dict, seed: int, numbers: list[int], n: int) -> dict | None:
    """The simpler mechanism, simulated on goals.py's re-measure (every round candidate and the default,
    interleaved on fresh seeds): the candidates chosen between and declared on the first `n` repeats
    (the best median that held the SLO in each); its declared value judged on the other repeats (its
    median there), its choice as goals.py judges every winner (tuned / best over all repeats). None
    when fewer than n + 1 repeats were measured."""
    from slotune.tuner.spec.slo import SLO_KEYS

    direction, key = result["objective"].split()
    runs, sign = result["runs"], 1 if direction == "minimize" else -1

    def held(x: dict) -> bool:
        v = x.get("violations")
        return v is not None and x.get(key) is not None and all(v.get(k, 0.0) <= 0 for k in SLO_KEYS)

    def standing(name: str, part: slice) -> float | None:
        xs = runs[name][part]
        return statistics.median(x[key] for x in xs) if xs and all(held(x) for x in xs) else None

    if result["repeats"] <= n:
        return None
    names = {num: result["candidates"][f"{seed}:{num}"] for num in numbers}
    chosen = {num: v for num, name in names.items() if (v := standing(name, slice(0, n))) is not None}
    if not chosen:
        return None
    winner = min(chosen, key=lambda num: sign * chosen[num])
    row = result["rows"][names[winner]]
    best = result["rows"][result["best_config"]]["median"] if result.get("best_config") else None
    whole = row["median"] if row["slo_held"] == row["measured"] else None  # as goals.py judges every winner
    return {
        "winner": winner,
        "declared": chosen[winner],
        "remeasured": standing(names[winner], slice(n, None)),  # the winner's curse: on repeats it was not chosen on
        "tuned_over_best": None if not (whole and best) else (best / whole if sign > 0 else whole / best),
        "measurements": (len(numbers) + 1) * n,
    }


def repairs_words(study, winner: int) -> str:
    """How the study's start repairs (tuner/search/starts.py) figure: how many ran, and whether the winner is one."""
    from slotune.tuner.search.records import TrialRecord

    records = [TrialRecord.of(t) for t in study.trials]
    repaired = [r for r in records if r.start and r.rung]
    w = TrialRecord.of(study.trials[winner])
    whose = (
        f"the winner is start {w.start!r} repaired {w.rung} time(s)" if w.start and w.rung else "the winner is not one"
    )
    return f"{len(repaired)} repaired start trial(s) of {len(records)}; {whose}"


def rows(result: dict) -> list[dict]:
    import optuna
    import yaml
    from slotune.tuner.search.records import stored_round
    from slotune.tuner.spec.tuning_spec import TuningSpec

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    direction = result["objective"].split()[0]
    best = result["rows"][result["best_config"]]["median"] if result.get("best_config") else None
    out = []
    for w in result["winners"]:
        folder = Path(w["output_dir"])
        copy = folder.with_suffix(".yaml")  # goals.py's copy of the spec for this study
        seed = yaml.safe_load(copy.read_text())["seed"]
        spec = TuningSpec.from_yaml(copy)
        study = optuna.load_study(study_name=spec.name, storage=f"sqlite:///{folder / 'study.db'}")
        found = variants(spec, study)
        out.append({"study": f"seed {seed}", "repairs": repairs_words(study, found[0].winner)})
        for v in found:
            name = result.get("candidates", {}).get(f"{seed}:{v.winner}")
            remeasured = result["rows"][name]["median"] if name in result["rows"] else None
            held = name in result["rows"] and result["rows"][name]["slo_held"] == result["rows"][name]["measured"]
            ratio = None
            if remeasured and best and held:
                ratio = best / remeasured if direction == "minimize" else remeasured / best
            out.append(
                {
                    "study": f"seed {seed}",
                    "variant": v.name,
                    "winner": v.winner,
                    "remeasured": remeasured,
                    "slo_held": held,
                    "tuned_over_best": ratio,
                    "declared": v.declared,
                    "declared_over_remeasured": v.declared / remeasured if v.declared and remeasured else None,
                    "measurements": v.measurements,
                }
            )
        numbers = [n for n in stored_round(study)["order"] if n is not None]
        for n in (1, 2, 3):
            sim = simulated(result, seed, numbers, n)
            if sim is not None:
                out.append(
                    {
                        "study": f"seed {seed}",
                        "variant": f"simulated: top {len(numbers)} and the default on {n} fresh seed(s), "
                        f"judged on the other {result['repeats'] - n}",
                        "slo_held": True,
                        **sim,
                        "declared_over_remeasured": sim["declared"] / sim["remeasured"] if sim["remeasured"] else None,
                    }
                )
    return out


def markdown(result: dict, table: list[dict]) -> str:
    from slotune.tuner.measure.units import format_value

    key = result["objective"].split()[1]
    fmt = lambda v: format_value(key, v) if v is not None else "-"  # noqa: E731
    lines = [
        f"Ablation of {result['spec']} ({result['date']}, {result['machine']}): best re-measured config "
        f"{result.get('best_config')}.",
        "",
        "| study | variant | winner | re-measured | tuned / best | declared | declared / re-measured | "
        "measurements after the search |",
        "|---|---|---|---|---|---|---|---|",
    ]
    notes = [f"- {r['study']}: start repairs: {r['repairs']}." for r in table if "repairs" in r]
    for r in (r for r in table if "variant" in r):
        tb = (
            f"{r['tuned_over_best']:.3f}"
            if r["tuned_over_best"] is not None
            else ("SLO missed" if r["remeasured"] else "-")
        )
        dr = r["declared_over_remeasured"]
        lines.append(
            f"| {r['study']} | {r['variant']} | trial {r['winner']} | {fmt(r['remeasured'])} | {tb} | "
            f"{fmt(r['declared'])} | {f'{dr:.3f}' + ('' if abs(dr - 1) <= 0.1 else ' (off by >10%)') if dr else '-'} | "
            f"{r['measurements']} |"
        )
    return "\n".join([*lines, "", *notes]) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("result", type=Path, help="a goals.py result (.json) run with --remeasure-candidates")
    args = ap.parse_args()
    result = json.loads(args.result.read_text())
    print(markdown(result, rows(result)))


if __name__ == "__main__":
    main()
