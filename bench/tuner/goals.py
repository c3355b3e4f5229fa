"""The tuner's goals on one example, measured: two studies with different seeds, each winner's
declared value against an independent re-measure, whether the two agree on the major levers,
and the tuned result against hand-picked configs of the same space.

    python bench/tuner/goals.py examples/01-chat-latency/spec.yaml --seeds 1 2 --repeats 3 \
        --hand int8-native-2='{"quantization": "int8", "kernels.int8_activations": true, "max_num_seqs": 2}'

1. `tune run` on a copy of the spec per seed (`seed: S`, its own output dir under --runs; the load
   sweep off: it comes after the winner is declared and is not part of these goals).
2. Independent re-measure: the default config, every study's winner and every --hand config,
   interleaved `--repeats` times on workload seeds no study saw (robustness_seed + 1000 + i; the
   confirmation uses robustness_seed and the few after it), each run an isolated trial process as in
   `tune run` (served, as the spec measures).
3. Goals (issue 18): each winner's declared value (its median over the confirmation's seeds: the
   value best.yaml and the report's winner card show) within
   10% of the median re-measure (beside it, the same comparison relative to the default config
   measured beside the winner in both: when the host's speed moved between the declaration and the
   re-measure, the default moved with it, and the relative figure shows what is left); the two
   winners agree on weight precision, KV precision and batching mode, or their re-measured values are within noise (the re-measures' bootstrap
   intervals overlap); the better winner within 10% of the best
   re-measured config of all (hand-picked ones included) that held the SLO in every repeat.

`--render JSON` judges a stored result again (after a change to `judged`) without measuring.

Writes goals-<spec name>-<date>.json and .md beside this file. Takes minutes per study.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

import yaml
from slotune.tuner.measure import machine

HERE = Path(__file__).resolve().parent
MAJOR_LEVERS = ("quantization", "kv_dtype", "scheduling")
SERVER_LEVERS = ("model", "parallel", "flash_attn", "cache_type_k")  # a llama-server spec's


def run_study(spec_path: Path, seed: int, runs: Path, confirm: dict | None = None) -> dict:
    """`tune run` on a copy of the spec with this seed (and `confirm:` updated); returns its
    best_metrics.json and wall time."""
    raw = yaml.safe_load(spec_path.read_text())
    out = runs / f"{raw['name']}-seed{seed}"
    raw.update(seed=seed, output_dir=str(out.resolve()), sweep={"enabled": False})
    if confirm:
        raw["confirm"] = {**(raw.get("confirm") or {}), **confirm}
    for part in ("workload", "search_space"):  # a relative file reference is relative to the original spec
        if isinstance(raw.get(part), str) and (spec_path.parent / raw[part]).exists():
            raw[part] = str((spec_path.parent / raw[part]).resolve())
    if isinstance(raw.get("model"), str) and (spec_path.parent / raw["model"]).exists():
        raw["model"] = str((spec_path.parent / raw["model"]).resolve())
    runs.mkdir(parents=True, exist_ok=True)
    copy = runs / f"{raw['name']}-seed{seed}.yaml"
    copy.write_text(yaml.safe_dump(raw, sort_keys=False))
    t, start = time.perf_counter(), time.time()
    subprocess.run(
        [sys.executable, "-m", "slotune.tuner.cli_main", "run", str(copy), "--no-progress", "--force-new"],
        check=True,
        env={**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{(out / 'mlflow.db').resolve()}"},
    )
    wall = time.perf_counter() - t
    summary = json.loads((out / "best_metrics.json").read_text())
    search_s = last_trial_end(out, raw["name"]) - start
    return {
        "seed": seed,
        "output_dir": str(out),
        "wall_s": wall,
        "search_s": search_s,
        "decide_s": wall - search_s,
        "summary": summary,
        "best_yaml": str(out / "best.yaml"),
    }


def last_trial_end(out: Path, name: str) -> float:
    """When the study's last trial ended (unix seconds): what `tune run` does after it (confirmation,
    declaration, best.yaml, the report) is its decision."""
    import optuna

    study = optuna.load_study(study_name=name, storage=f"sqlite:///{out / 'study.db'}")
    return max(t.datetime_complete.timestamp() for t in study.trials if t.datetime_complete is not None)


def confirm_candidates(st: dict, spec_name: str) -> dict[int, dict]:
    """Trial number -> EngineConfig dump of every candidate of a study's confirmation."""
    import optuna
    from slotune.tuner.search.records import TrialRecord

    numbers = {m["trial"] for m in st["summary"].get("confirm") or [] if m.get("trial") is not None}
    study = optuna.load_study(study_name=spec_name, storage=f"sqlite:///{Path(st['output_dir']) / 'study.db'}")
    return {n: TrialRecord.of(study.trials[n]).config for n in sorted(numbers)}


def declared(summary: dict) -> float:
    """The winner's declared value: best_metrics.json `remeasured` (its median over the confirmation's
    seeds), or its trial's value."""
    key = summary["objective"]
    re = (summary.get("remeasured") or {}).get("metrics") or {}
    return float(re.get(key, summary["value"]))


def declared_half_width(summary: dict) -> float | None:
    """Half the declared value's interval as a fraction of it (best_metrics.json `remeasured`), or None."""
    m, key = (summary.get("remeasured") or {}).get("metrics") or {}, summary["objective"]
    lo, hi, v = m.get(f"{key}_ci_low"), m.get(f"{key}_ci_high"), m.get(key)
    return (hi - lo) / 2 / v if lo is not None and hi is not None and v else None


def declared_default(summary: dict) -> float | None:
    """The default config's value measured beside the winner's declaration (best_metrics.json
    `remeasured.default`), or None."""
    value = ((summary.get("remeasured") or {}).get("default") or {}).get(summary["objective"])
    return float(value) if isinstance(value, (int, float)) else None


def relative_to_default(
    declared: float, beside: float | None, winner_runs: list[dict], default_runs: list[dict], key: str
) -> float | None:
    """The declaration relative to the default measured beside it (declared / beside), against the
    re-measure's median per-repeat winner / default (same seed, interleaved): a change of the host's
    speed between the two moves both and cancels. None without a default beside it or a pair."""
    pairs = [x[key] / y[key] for x, y in zip(winner_runs, default_runs) if x.get(key) and y.get(key)]
    return declared / beside / statistics.median(pairs) if beside and pairs else None


def main() -> None:
    from slotune.engine.config import EngineConfig
    from slotune.tuner.measure.metrics import ci_keys
    from slotune.tuner.spec.server import parse_config
    from slotune.tuner.measure.trial_process import TrialFailure, measure, omp_wait_policy
    from slotune.tuner.spec.tuning_spec import TuningSpec

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("spec", type=Path)
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--runs", type=Path, default=Path("runs/goals"))
    ap.add_argument(
        "--hand",
        action="append",
        default=[],
        metavar="NAME=JSON",
        help="a hand-picked config: EngineConfig updates (dotted keys) over the spec's fixed engine",
    )
    ap.add_argument("--confirm-seeds", type=int, help="the studies' `confirm.seeds` (default: the spec's)")
    ap.add_argument("--reuse", action="store_true", help="reuse finished studies in --runs (re-measure only)")
    ap.add_argument(
        "--remeasure-candidates",
        action="store_true",
        help="re-measure every confirmation candidate too (is the winner the best of them?)",
    )
    ap.add_argument(
        "--machine",
        default="",
        help="machine description for the results (default: lscpu's model name, core count and AMX/AVX-512 flags)",
    )
    ap.add_argument("--tag", default="", help="suffix of the results' file names (e.g. the machine: xeon-2c)")
    ap.add_argument(
        "--render",
        type=Path,
        metavar="JSON",
        help="judge a stored result again (`judged`) and rewrite its .json and .md; measures nothing",
    )
    args = ap.parse_args()
    if args.render:
        result = judged(json.loads(args.render.read_text()))
        args.render.write_text(json.dumps(result, indent=1))
        args.render.with_suffix(".md").write_text(markdown(result))
        print(markdown(result))
        return

    spec = TuningSpec.from_yaml(args.spec)
    # One OpenMP wait policy for the studies and the re-measures, decided once here (as `tune run` decides
    # it once per run): "auto" decided again before the re-measures could differ, and passive waiting
    # costs tens of percent on this machine (slotune/tuner/measure/trial_process.py trial_env).
    # An external server runs in the user's environment, as `tune run` launches it.
    policy = (
        os.environ.get("OMP_WAIT_POLICY", "unset")
        if spec.server
        else omp_wait_policy(spec.budget.trial_omp_wait_policy)
    )
    if not spec.server:
        os.environ["OMP_WAIT_POLICY"] = policy.upper()
    print(f"OMP_WAIT_POLICY={policy}", flush=True)
    studies = []
    for s in args.seeds:
        out = args.runs / f"{spec.name}-seed{s}"
        if args.reuse and (out / "best_metrics.json").exists():
            studies.append(
                {
                    "seed": s,
                    "output_dir": str(out),
                    "wall_s": None,
                    "best_yaml": str(out / "best.yaml"),
                    "summary": json.loads((out / "best_metrics.json").read_text()),
                }
            )
        else:
            confirm = {"seeds": args.confirm_seeds} if args.confirm_seeds else None
            studies.append(run_study(args.spec, s, args.runs, confirm))
        print(
            f"study seed {s}: winner {studies[-1]['summary']['params']} declared {declared(studies[-1]['summary']):.4g}",
            flush=True,
        )

    base = spec.base_config()
    configs = {"default": base}
    for st in studies:
        best = Path(st["best_yaml"])
        configs[f"winner-seed{st['seed']}"] = (
            parse_config(yaml.safe_load(best.read_text())) if spec.server else EngineConfig.from_yaml(best)
        )
    for item in args.hand:
        name, _, updates = item.partition("=")
        configs[f"hand:{name}"] = base.with_updates(json.loads(updates))
    candidates: dict[str, str] = {}  # "seed:trial" -> the name of the config re-measured for it
    if args.remeasure_candidates:
        for st in studies:
            for n, dump in confirm_candidates(st, spec.name).items():
                cfg = parse_config(dump)
                same = next((name for name, c in configs.items() if c == cfg), None)
                candidates[f"{st['seed']}:{n}"] = same or f"seed{st['seed']}-trial{n}"
                configs.setdefault(candidates[f"{st['seed']}:{n}"], cfg)
    obj = spec.objective
    key = obj.metric_key()
    keys = [key, *ci_keys(key)]
    runs: dict[str, list[dict]] = {k: [] for k in configs}
    for i in range(args.repeats):
        for name, cfg in configs.items():  # interleaved: slow drifts of the machine hit every config alike
            t = time.perf_counter()
            try:
                r = measure(spec, cfg, seed=spec.robustness_seed + 1000 + i, early_stop=False, gates=False)
                ci = r.metrics.interval(key) or (None, None)
                runs[name].append(dict(zip(keys, (r.metrics.get(key), *ci))) | {"violations": r.violations})
            except TrialFailure as exc:
                runs[name].append({"error": exc.reason})
            print(f"repeat {i} {name}: {runs[name][-1]} ({time.perf_counter() - t:.0f} s)", flush=True)

    result = {
        "spec": str(args.spec),
        "date": date.today().isoformat(),
        "machine": args.machine or machine.words(),
        "python": platform.python_version(),
        "omp_wait_policy": policy,
        "objective": f"{obj.direction()} {key}",
        "repeats": args.repeats,
        "configs": {n: c.model_dump(mode="json", exclude_defaults=True) for n, c in configs.items()},
        "winners": [
            {
                "name": f"winner-seed{st['seed']}",
                "declared": declared(st["summary"]),
                "declared_default": declared_default(st["summary"]),
                "declaration_seeds": len((st["summary"].get("remeasured") or {}).get("seeds") or []),
                "declared_half_width": declared_half_width(st["summary"]),
                "major_levers": {
                    k: configs[f"winner-seed{st['seed']}"].value_at(k)
                    for k in (SERVER_LEVERS if spec.server else MAJOR_LEVERS)
                },
                "params": st["summary"]["params"],
                "trial": st["summary"]["trial"],
                "wall_s": st["wall_s"],
                "search_s": st.get("search_s"),
                "decide_s": st.get("decide_s"),
                "confirm_s": st["summary"].get("confirm_s"),  # tune run's own clock of the confirmation
                "output_dir": st["output_dir"],
            }
            for st in studies
        ],
        "candidates": candidates,
        "runs": runs,
    }
    result = judged(result)
    stem = HERE / f"goals-{spec.name}-{result['date']}{'-' + args.tag if args.tag else ''}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1))
    stem.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))


def judged(r: dict) -> dict:
    """The goals computed from a result's re-measures (`runs`): per config the median of its values
    and of its intervals, and in how many repeats the SLO held; each winner's declared / re-measured;
    whether the winners agree; the best config among those that held the SLO in every repeat (the
    standard the confirmation holds a winner to: a config that misses it in one of five is
    no answer, however fast), and tuned / best.
    A pure function of `r`, so `--render` can judge a stored result again."""
    from slotune.tuner.spec.slo import SLO_KEYS

    direction, key = r["objective"].split()
    lo_key, hi_key = f"{key}_ci_low", f"{key}_ci_high"
    runs = r["runs"]

    def med(name: str, k: str) -> float | None:
        vals = [x[k] for x in runs[name] if x.get(k) is not None]
        return statistics.median(vals) if vals else None

    def held(x: dict) -> bool:  # the SLO's limits (not the gates, not run here) held in this repeat
        v = x.get("violations")
        return v is not None and all(v.get(k, 0.0) <= 0 for k in SLO_KEYS)

    rows = {
        n: {
            "median": med(n, key),
            "ci_low": med(n, lo_key),
            "ci_high": med(n, hi_key),
            "values": [x.get(key) for x in runs[n]],
            "slo_held": sum(held(x) for x in runs[n]),
            "measured": len(runs[n]),
        }
        for n in runs
    }
    # A config measured under two names (a winner and a hand-picked config) is one config: judged on all
    # its re-measures, so tuned / best never compares a config with its own replicate.
    same = _same_config(r)
    pooled = {n: [x for m in same[n] for x in runs[m]] for n in runs}
    sign = 1 if direction == "minimize" else -1
    for w in r["winners"]:
        m = rows[w["name"]]["median"]
        w.update(
            remeasured_median=m,
            declared_over_remeasured=w["declared"] / m if m else None,
            within_10pct=bool(m) and abs(w["declared"] / m - 1) <= 0.10,
        )
        hw = w.get("declared_half_width")
        if hw is not None and m:  # the declared interval (median +- half width) holds the re-measure
            w["inside_declared_interval"] = w["declared"] * (1 - hw) <= m <= w["declared"] * (1 + hw)
        vals = [x[key] for x in pooled[w["name"]] if x.get(key) is not None]
        if len(same[w["name"]]) > 1 and vals:  # also re-measured under another name: all its re-measures
            pm = statistics.median(vals)
            w.update(pooled_names=same[w["name"]], pooled_median=pm, declared_over_pooled=w["declared"] / pm)
        d0 = w.get("declared_default")
        rel = relative_to_default(w["declared"], d0, runs[w["name"]], runs.get("default", []), key)
        dm = rows.get("default", {}).get("median")
        w.update(
            relative_over_remeasured=rel,
            relative_within_10pct=rel is not None and abs(rel - 1) <= 0.10,
            default_drift=dm / d0 if d0 and dm else None,
        )
    lo_hi = [(rows[w["name"]]["ci_low"], rows[w["name"]]["ci_high"]) for w in r["winners"]]
    measured = all(v is not None for iv in lo_hi for v in iv)
    overlap = max(lo for lo, _ in lo_hi) <= min(hi for _, hi in lo_hi) if measured else None
    eligible = {
        n: statistics.median(vals)
        for n, xs in pooled.items()
        if (vals := [x[key] for x in xs if x.get(key) is not None]) and len(vals) == len(xs) and all(map(held, xs))
    }
    best_name = min(eligible, key=lambda n: sign * eligible[n]) if eligible else None
    tuned = [w["name"] for w in r["winners"] if w["name"] in eligible]
    tuned_name = min(tuned, key=lambda n: sign * eligible[n]) if tuned else None
    t = eligible.get(tuned_name)
    b = eligible.get(best_name)
    tuned_vs_best = None if t is None or b is None else (b / t if direction == "minimize" else t / b)
    d = rows.get("default", {}).get("median")
    return {
        **r,
        "rows": rows,
        "winners_agree_on_major_levers": len({json.dumps(w["major_levers"], sort_keys=True) for w in r["winners"]})
        == 1,
        "winners_within_noise": overlap,
        "best_config": best_name,
        "tuned": tuned_name,
        "tuned_vs_best": tuned_vs_best,
        "tuned_within_10pct_of_best": tuned_vs_best is not None and tuned_vs_best >= 0.9,
        "default_vs_tuned": (d / t if direction == "minimize" else t / d) if d and t else None,
        "better": {n: sign * eligible[n] < sign * d for n in eligible if n != "default"} if d else {},
    }


def markdown(r: dict) -> str:
    from slotune.tuner.measure.units import format_value

    key = r["objective"].split()[1]
    lines = [
        f"# Tuner goals: {r['spec']}",
        "",
        f"Date {r['date']}; machine {r['machine']}; OMP_WAIT_POLICY {r.get('omp_wait_policy', '?')}; objective {r['objective']}; "
        f"{r['repeats']} interleaved re-measures per config on unseen workload seeds (medians; interval = the "
        "median of the re-measures' bootstrap intervals).",
        "",
        "| config | re-measured median | interval | values | SLO held |",
        "|---|---|---|---|---|",
    ]
    for n, row in r["rows"].items():
        fmt = lambda v: format_value(key, v) if v is not None else "-"
        lines.append(
            f"| {n} | {fmt(row['median'])} | {fmt(row['ci_low'])} - {fmt(row['ci_high'])} | "
            f"{', '.join(fmt(v) for v in row['values'])} | {row['slo_held']} of {row['measured']} |"
        )
    lines += [
        "",
        "| winner | study wall (decision: after the last trial) | trial | params | declared | declared on (interval, +-) | re-measured | "
        "declared / re-measured | within 10% | default re-measured / beside the declaration | "
        "relative to the default: declared / re-measured |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for w in r["winners"]:
        wall = f"{w['wall_s'] / 60:.1f} min" if w["wall_s"] else "-"
        if w.get("decide_s") and w["wall_s"]:  # after the last trial: confirmation, declaration, outputs
            wall += f" (decision {w['decide_s'] / w['wall_s']:.0%}"
            wall += f", confirmation {w['confirm_s'] / w['wall_s']:.0%})" if w.get("confirm_s") else ")"
        ratio = f"{w['declared_over_remeasured']:.3f}" if w["declared_over_remeasured"] else "-"
        hw = w.get("declared_half_width")
        on = f"{w.get('declaration_seeds', '?')} seeds" + (f" (+-{hw:.1%})" if hw is not None else "")
        lines.append(
            f"| {w['name']} | {wall} | {w['trial']} | `{json.dumps(w['params'])}` | {format_value(key, w['declared'])} | "
            f"{on} | {format_value(key, w['remeasured_median']) if w['remeasured_median'] else '-'} | {ratio} | "
            f"{'yes' if w['within_10pct'] else 'no'} | "
            + (f"{w['default_drift']:.3f}" if w.get("default_drift") else "-")
            + " | "
            + (f"{w['relative_over_remeasured']:.3f}" if w.get("relative_over_remeasured") else "-")
            + " |"
        )
    lines += [
        "",
        f"- Winners agree on the major levers ({', '.join(r['winners'][0]['major_levers'])}): "
        f"**{'yes' if r['winners_agree_on_major_levers'] else 'no'}** "
        f"({'; '.join(w['name'] + ': ' + json.dumps(w['major_levers']) for w in r['winners'])}).",
        "- Winners' re-measured intervals overlap (within noise): "
        + {True: "**yes**.", False: "**no**.", None: "not known (no intervals stored)."}[r["winners_within_noise"]],
        *_same_config_lines(r, key),
        *[
            f"- {w['name']}'s re-measure is {'inside' if w['inside_declared_interval'] else 'outside'} its declared "
            f"value +- half its interval's width ({format_value(key, w['declared'] * (1 - w['declared_half_width']))} - "
            f"{format_value(key, w['declared'] * (1 + w['declared_half_width']))})."
            for w in r["winners"]
            if w.get("inside_declared_interval") is not None
        ],
        *[
            f"- {w['name']} over all its re-measures ({', '.join(w['pooled_names'])}): median "
            f"{format_value(key, w['pooled_median'])}; declared / that = **{w['declared_over_pooled']:.3f}**."
            for w in r["winners"]
            if w.get("pooled_median")
        ],
        f"- Best re-measured config of those that held the SLO in every repeat: {r['best_config']}; "
        + (
            f"tuned ({r['tuned']}) / best = **{r['tuned_vs_best']:.3f}** (goal >= 0.9)."
            if r["tuned_vs_best"] is not None
            else "no winner held it in every repeat."
        ),
        f"- Tuned vs default (better direction): {r['default_vs_tuned']:.2f}x." if r["default_vs_tuned"] else "",
    ]
    return "\n".join(lines) + "\n"


def _same_config(r: dict) -> dict[str, list[str]]:
    """Each re-measured name: the names re-measured with the same config (itself included), in order."""
    return {n: [m for m in r["runs"] if r["configs"].get(m, m) == r["configs"].get(n, n)] for n in r["runs"]}


def _same_config_lines(r: dict, key: str) -> list[str]:
    """A line for configs measured under two names (two winners, a winner and a hand-picked config): their
    re-measures (same seeds, interleaved) are then replicates of one config, and how far apart they
    land is the re-measure's own spread."""
    from slotune.tuner.measure.units import format_value

    lines = []
    for names in dict.fromkeys(tuple(g) for g in _same_config(r).values() if len(g) > 1):
        meds = [r["rows"][n]["median"] for n in names]
        if all(m is not None for m in meds):
            spread = f" ({max(meds) / min(meds):.2f}x apart)" if min(meds) > 0 else ""
            lines.append(
                f"- {' and '.join(names)} are the same config: their re-measures, on the same seeds and "
                f"interleaved, are replicates of one config; medians {', '.join(format_value(key, m) for m in meds)}"
                f"{spread}, the re-measure's own spread."
            )
    return lines


if __name__ == "__main__":
    main()
