"""TPE vs random search: trials needed to come within 5% of the exhaustive-grid best.

Measuring every config for every sampler and seed would take hours on a 2-core CPU, so this
replays the samplers against a cached table: the grid study of `grid-spec.yaml` is measured
once with the real engine (`tune run bench/tuner/grid-spec.yaml -o runs/sampler-grid`, every
config one isolated trial), then each sampler runs many seeded in-memory studies whose
objective looks its suggestion up in that table. The table is committed (grid-table.json), so
the comparison reruns in seconds: `python bench/tuner/sampler_compare.py`.

    python bench/tuner/sampler_compare.py --from-study runs/sampler-grid/study.db  # refresh table
    python bench/tuner/sampler_compare.py --seeds 200                             # compare
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import warnings
from pathlib import Path

from slotune.tuner.spec.tuning_spec import TuningSpec

HERE = Path(__file__).resolve().parent
KNOBS = ("max_num_seqs", "max_num_batched_tokens", "dtype")


def table_from_study(db: Path) -> dict:
    import optuna

    study = optuna.load_study(study_name="sampler-grid", storage=f"sqlite:///{db.resolve()}")
    from slotune.tuner.search.records import TrialRecord

    rows = []
    for t in map(TrialRecord.of, study.trials):
        if t.is_complete:
            rows.append(
                {
                    "params": t.params,
                    "value": t.values[0],
                    "tpot_p95": t.metrics.get("tpot_p95"),
                    "ttft_p95": t.metrics.get("ttft_p95"),
                }
            )
    return {
        "objective": "maximize output_tokens_per_s",
        "workload": "grid-chat (bench/tuner/grid-spec.yaml)",
        "rows": rows,
    }


def trials_to_target(
    sampler_name: str, seed: int, table: dict, space, target: float, budget: int, repeats: bool
) -> int | None:
    """Measured trials a seeded study needs to reach `target`, or None within `budget`.

    repeats=True replays the study as `tune run` runs it since 2026-11-25 (slotune/tuner/search/objective.py):
    a config the sampler proposes again takes the earlier measurement (no budget slot) and an
    unexplored config is enqueued. repeats=False: every proposal is measured (as before).
    """
    import optuna
    from slotune.tuner.search.records import UNMEASURED_REPEAT, set_unmeasured
    from slotune.tuner.search.trials import earlier_measurement, enqueue_unexplored

    lookup = {tuple(r["params"][k] for k in KNOBS): r["value"] for r in table["rows"]}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if sampler_name == "tpe":  # as `tune run` configures it (slotune/tuner/search/study.py make_sampler)
            sampler = optuna.samplers.TPESampler(seed=seed, multivariate=True, group=True, n_startup_trials=4)
        else:
            sampler = optuna.samplers.RandomSampler(seed=seed)
        study = optuna.create_study(direction="maximize", sampler=sampler)
    measured = 0
    for _ in range(10 * budget):  # a sampler stuck on repeats still ends (tune run: TrialBudget)
        t = study.ask()
        params = space.sample(t)
        earlier = earlier_measurement(study, params, before=t.number) if repeats else None
        if earlier is not None:
            set_unmeasured(t, UNMEASURED_REPEAT)
            study.tell(t, earlier.values[0])
            enqueue_unexplored(space, study, seed=seed + t.number)
            continue
        measured += 1
        value = lookup[tuple(params[k] for k in KNOBS)]
        study.tell(t, value)
        if value >= target:
            return measured
        if measured == budget:
            return None
    return None


def censored_quantile(hits: list[int | None], budget: int, q: float) -> int | str:
    """q-quantile of trials-to-target; None (not reached in `budget` trials) sorts last."""
    ranked = sorted(hits, key=lambda h: float("inf") if h is None else h)
    h = ranked[max(0, int(q * len(ranked)) - 1)]
    return f"> {budget}" if h is None else h


def censored_median(hits: list[int | None], budget: int) -> float | str:
    """Median trials-to-target where None (not reached in `budget` trials) sorts last."""
    ranked = sorted(hits, key=lambda h: float("inf") if h is None else h)
    mid = [ranked[(len(ranked) - 1) // 2], ranked[len(ranked) // 2]]
    if any(h is None for h in mid):
        return f"> {budget}"
    return statistics.median(mid)


def main() -> None:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--from-study", type=Path, help="refresh grid-table.json from a measured grid study")
    ap.add_argument("--seeds", type=int, default=200)
    ap.add_argument("--within", type=float, default=0.05)
    args = ap.parse_args()
    table_path = HERE / "grid-table.json"
    if args.from_study:
        table_path.write_text(json.dumps(table_from_study(args.from_study), indent=1))
    table = json.loads(table_path.read_text())
    space = TuningSpec.from_yaml(HERE / "grid-spec.yaml").search_space
    n = len(list(itertools.product(*space.grid().values())))
    assert len(table["rows"]) == n, f"table has {len(table['rows'])} rows, grid has {n} configs"
    best = max(r["value"] for r in table["rows"])
    target = (1 - args.within) * best
    num_good = sum(r["value"] >= target for r in table["rows"])
    result = {
        "grid_size": n,
        "grid_best": best,
        "target": target,
        "num_configs_within": num_good,
        "seeds": args.seeds,
        "samplers": {},
    }
    for name, repeats in (("tpe", True), ("random", True), ("tpe", False), ("random", False)):
        hits = [trials_to_target(name, s, table, space, target, budget=n, repeats=repeats) for s in range(args.seeds)]
        found = [h for h in hits if h is not None]
        result["samplers"][name if repeats else f"{name}, every proposal measured"] = {
            # Seeds that never reach the target within the grid's size count as > n (censored).
            "median_trials": censored_median(hits, n),
            "mean_trials_when_found": statistics.mean(found) if found else None,
            "p90_trials": censored_quantile(hits, n, 0.9),
            "found_within_10": sum(h is not None and h <= 10 for h in hits) / len(hits),
            "found_within_grid": len(found) / len(hits),
        }
    (HERE / "sampler-compare.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
