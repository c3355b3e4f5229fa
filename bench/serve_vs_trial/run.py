"""Does a study's winner keep, under `tune serve`, the numbers its trial measured?

For each tuning spec: run the study if its output is missing (`tune run SPEC -o DIR`), then
serve `DIR/best.yaml` with `tune serve` (a separate process, as a user runs it) and replay the
spec's workload with the HTTP client (`tune bench --url`'s `run_http_replay`, a separate
process too), `--repeats` times, on the workload seed the trials used. Reports, for the
objective metric and output tokens/s, served / trial ratios (median over repeats) against the
winning trial's own measurement (`best_metrics.json` `metrics`). Goal: within 10% either way
(served better than its trial by more is a miss too: the trial misjudged the config).

The trial was measured minutes to hours earlier, and it is the best of many, so that ratio carries
the machine's drift and the selection's bias as well as any difference between the two paths. The
paths themselves are compared side by side: each repeat is a pair, one replay against `tune serve`
and one measurement of the same config on the same seed by the trial harness (`trial_process.measure`,
an isolated trial process serving it as `tune run` does), in alternating order (S T, T S, ...);
served / harness is the median of the per-pair ratios.

    python bench/serve_vs_trial/run.py                      # examples 01 and 02
    python bench/serve_vs_trial/run.py --specs examples/01-chat-latency/spec.yaml --repeats 5

Writes bench/serve_vs_trial/results-DATE[-TAG].{json,md}. Not part of CI (minutes per spec).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

from slotune.tuner.measure import machine
from slotune.tuner.measure.http_replay import wait_ready
from slotune.tuner.measure.intervals import ratio_interval

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
DEFAULT_SPECS = ["examples/01-chat-latency/spec.yaml", "examples/02-batch-throughput/spec.yaml"]
TUNE = [sys.executable, "-m", "slotune.tuner.cli_main"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(best: Path, log: Path, env: dict[str, str] | None = None):
    """`tune serve best` in its own process (environment `env`, default this one's); returns it and its URL."""
    port = _free_port()
    proc = subprocess.Popen(
        [*TUNE, "serve", str(best), "--port", str(port)],
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env=env,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, timeout_s=600, proc=proc)
    except RuntimeError as exc:
        proc.terminate()
        raise RuntimeError(f"tune serve: {exc}; see {log}") from None
    return proc, url


def _stop(proc) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def _replay(url: str, spec, out: Path, seed: int) -> dict:
    """One replay in a client process of its own (as a user's client is)."""
    code = (
        "import json, sys\n"
        "from slotune.tuner.spec.tuning_spec import TuningSpec\n"
        "from slotune.tuner.measure.in_process_replay import load_tokenizer\n"
        "from slotune.tuner.measure.http_replay import run_http_replay\n"
        "spec = TuningSpec.from_yaml(sys.argv[1]); o = spec.objective\n"
        "res = run_http_replay(sys.argv[2], spec.workload, tokenizer=load_tokenizer(spec.model),\n"
        "    ttft_limit_s=o.ttft_limit_s, tpot_limit_s=o.tpot_limit_s, seed=int(sys.argv[4]), percentiles=(o.percentile,))\n"
        "open(sys.argv[3], 'w').write(json.dumps(res.metrics))\n"
    )
    subprocess.run([sys.executable, "-c", code, str(spec["path"]), url, str(out), str(seed)], check=True)
    return json.loads(out.read_text())


def _interval_words(iv: tuple[float, float] | None) -> str:
    return "-" if iv is None else f"{iv[0]:.3f} - {iv[1]:.3f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--specs", default=",".join(DEFAULT_SPECS))
    ap.add_argument("--runs-dir", default="runs/serve_vs_trial", help="study outputs, one folder per spec")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--n-trials", type=int, default=None, help="override the specs' budget.n_trials (a quicker study)")
    ap.add_argument("--tag", default="", help="suffix of the results' file names (another run on the same day)")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from slotune.engine.config import EngineConfig
    from slotune.tuner.measure.trial_process import TrialFailure, measure
    from slotune.tuner.spec.tuning_spec import TuningSpec

    rows, raw = [], []
    for spec_path in args.specs.split(","):
        spec_path = Path(spec_path)
        spec = TuningSpec.from_yaml(spec_path)
        out_dir = Path(args.runs_dir) / spec.name
        if not (out_dir / "best_metrics.json").exists():
            print(f"[{spec.name}] tune run -> {out_dir}", flush=True)
            t0 = time.perf_counter()
            extra = ["--n-trials", str(args.n_trials)] if args.n_trials else []
            subprocess.run([*TUNE, "run", str(spec_path), "-o", str(out_dir), "--no-progress", *extra], check=True)
            print(f"[{spec.name}] study took {time.perf_counter() - t0:.0f} s", flush=True)
        best = json.loads((out_dir / "best_metrics.json").read_text())
        key, trial_m = best["objective"], best["metrics"]
        seed = spec.workload.seed
        config = EngineConfig.from_yaml(out_dir / "best.yaml")
        spec.output_dir = str(out_dir)  # as `tune run -o` ran the study: the harness uses its cache
        proc, url = _serve(out_dir / "best.yaml", out_dir / "serve.log")
        served, harness = [], []
        try:
            for r in range(args.repeats):
                for side in ("served", "harness") if r % 2 == 0 else ("harness", "served"):
                    if side == "served":
                        m = _replay(url, {"path": spec_path}, out_dir / f"served-{r}.json", seed)
                        served.append(m)
                    else:  # the trial harness, as `tune run` measured the winner (no gates: they do not time)
                        try:
                            m = measure(spec, config, seed=seed, early_stop=False, gates=False).metrics.to_dict()
                        except TrialFailure as exc:
                            m = {"error": exc.reason}
                        harness.append(m)
                    print(
                        f"[{spec.name}] {side} #{r}: {key} {m.get(key)}, tok/s {m.get('output_tokens_per_s')} "
                        f"(trial: {trial_m.get(key)}, {trial_m['output_tokens_per_s']:.1f})",
                        flush=True,
                    )
        finally:
            _stop(proc)
        med = {k: statistics.median(m[k] for m in served if m.get(k) is not None) for k in (key, "output_tokens_per_s")}
        ratio = med[key] / trial_m[key]
        pairs = {
            k: [s[k] / h[k] for s, h in zip(served, harness) if s.get(k) and h.get(k)]
            for k in (key, "output_tokens_per_s")
        }
        paired = {k: statistics.median(v) if v else None for k, v in pairs.items()}
        paired_interval = ratio_interval(pairs[key])
        harness_values = [h[key] for h in harness if h.get(key) is not None]
        declaration = best.get("remeasured") or {}
        remeasured = declaration.get("metrics") or {}
        rows.append(
            {
                "spec": spec.name,
                "objective": key,
                "direction": best["direction"],
                "trial": trial_m[key],
                "served": med[key],
                "ratio": ratio,
                "remeasured": remeasured.get(key),
                "ratio_to_remeasured": med[key] / remeasured[key] if remeasured.get(key) else None,
                "declared_seeds": len(declaration.get("seeds") or []),
                "declared_half_width": declaration.get("half_width"),
                "is_within_10pct": 0.90 <= ratio <= 1.10,  # either way: better than the trial is a miss too
                "trial_tok_s": trial_m["output_tokens_per_s"],
                "served_tok_s": med["output_tokens_per_s"],
                "tok_s_ratio": med["output_tokens_per_s"] / trial_m["output_tokens_per_s"],
                "trial_measure": trial_m.get("measure", "served" if "client_cpu_s" in trial_m else "in_process"),
                "harness": statistics.median(harness_values) if harness_values else None,
                "served_over_harness_pairs": pairs[key],
                "served_over_harness": paired[key],
                "served_over_harness_interval": paired_interval,
                "tok_s_served_over_harness_pairs": pairs["output_tokens_per_s"],
                "tok_s_served_over_harness": paired["output_tokens_per_s"],
                "paths_within_10pct": paired[key] is not None and 0.90 <= paired[key] <= 1.10,
            }
        )
        raw.append({"spec": spec.name, "best": best, "served": served, "harness": harness})

    stamp = date.today().isoformat()
    meta = {
        "date": stamp,
        "machine": machine.words(),
        "python": platform.python_version(),
        "repeats": args.repeats,
        "command": "python bench/serve_vs_trial/run.py " + " ".join(sys.argv[1:]),
    }
    stem = HERE / f"results-{stamp}{'-' + args.tag if args.tag else ''}"
    stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows, "raw": raw}, indent=1))
    md = [
        f"# Served winner vs its trial ({stamp}, {meta['machine']})",
        "",
        f"`{meta['command']}`; served = median of {args.repeats} replays of the spec's workload (trial seed) "
        "against `tune serve best.yaml`, client in its own process. Ratio = served / trial. Declared = the value "
        "best.yaml states: `tune run`'s mean over the winner's declaration measurements (served, on fresh workload "
        "seeds, as many as its 95% interval asked), with that interval.",
        "",
        "| spec | objective | trial | declared | served | served / trial | within 10% | served / declared "
        "| trial tok/s | served tok/s | tok/s ratio |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        rem = "-" if r["remeasured"] is None else f"{r['remeasured']:.4g}"
        if r.get("declared_seeds"):
            hw = r.get("declared_half_width")
            rem += f" ({r['declared_seeds']} seeds" + (f", ±{hw:.1%})" if hw is not None else ")")
        rem_ratio = "-" if r["ratio_to_remeasured"] is None else f"{r['ratio_to_remeasured']:.2f}"
        md.append(
            f"| {r['spec']} | {r['objective']} ({r['direction']}) | {r['trial']:.4g} | {rem} | {r['served']:.4g} | "
            f"{r['ratio']:.2f} | {'yes' if r['is_within_10pct'] else 'no'} | {rem_ratio} | {r['trial_tok_s']:.1f} | "
            f"{r['served_tok_s']:.1f} | {r['tok_s_ratio']:.2f} |"
        )
    md += [
        "",
        "The two paths side by side: per pair, one replay against `tune serve` and one measurement of the same "
        "config on the same seed by the trial harness (as `tune run` measured the winner), alternating which goes first. "
        "Ratio = served / harness (median of the per-pair ratios); interval = 95% interval of their geometric mean "
        "(Student's t on the logarithms).",
        "",
        "| spec | objective | harness (median) | served (median) | served / harness, per pair | median | interval "
        "| within 10% | tok/s served / harness, per pair | median |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]

    def fmt(v):
        return "-" if v is None else f"{v:.3f}"

    for r in rows:
        md.append(
            f"| {r['spec']} | {r['objective']} | {'-' if r['harness'] is None else format(r['harness'], '.4g')} | "
            f"{r['served']:.4g} | {', '.join(map(fmt, r['served_over_harness_pairs']))} | "
            f"**{fmt(r['served_over_harness'])}** | {_interval_words(r['served_over_harness_interval'])} | "
            f"{'yes' if r['paths_within_10pct'] else 'no'} | "
            f"{', '.join(map(fmt, r['tok_s_served_over_harness_pairs']))} | {fmt(r['tok_s_served_over_harness'])} |"
        )
    stem.with_suffix(".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
