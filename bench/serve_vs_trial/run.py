"""Does a study's winner keep, under `tune serve`, the numbers its trial measured?

For each tuning spec: run the study if its output is missing (`tune run SPEC -o DIR`), then
serve `DIR/best.yaml` with `tune serve` (a separate process, as a user runs it) and replay the
spec's workload with the HTTP client (`tune bench --url`'s `run_http_benchmark`, a separate
process too), `--repeats` times, on the workload seed the trials used. Reports, for the
objective metric and output tokens/s, served / trial ratios (median over repeats) against the
winning trial's own measurement (`best_metrics.json` `metrics`). Goal: within 10% either way
(served better than its trial by more is a miss too: the trial misjudged the config).

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


from slotune.tuner import machine
from slotune.tuner.http_bench import wait_ready

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
    proc = subprocess.Popen([*TUNE, "serve", str(best), "--port", str(port)], stdout=log.open("w"),
                            stderr=subprocess.STDOUT, start_new_session=True, env=env)
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
        "from slotune.tuner.spec import TuningSpec\n"
        "from slotune.tuner.bench import load_tokenizer\n"
        "from slotune.tuner.http_bench import run_http_benchmark\n"
        "spec = TuningSpec.from_yaml(sys.argv[1]); o = spec.objective\n"
        "res = run_http_benchmark(sys.argv[2], spec.workload, tokenizer=load_tokenizer(spec.model),\n"
        "    ttft_limit_s=o.ttft_limit_s, tpot_limit_s=o.tpot_limit_s, seed=int(sys.argv[4]), percentiles=(o.percentile,))\n"
        "open(sys.argv[3], 'w').write(json.dumps(res.metrics))\n")
    subprocess.run([sys.executable, "-c", code, str(spec["path"]), url, str(out), str(seed)], check=True)
    return json.loads(out.read_text())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--specs", default=",".join(DEFAULT_SPECS))
    ap.add_argument("--runs-dir", default="runs/serve_vs_trial", help="study outputs, one folder per spec")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--n-trials", type=int, default=None, help="override the specs' budget.n_trials (a quicker study)")
    ap.add_argument("--tag", default="", help="suffix of the results' file names (another run on the same day)")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from slotune.tuner.spec import TuningSpec

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
        proc, url = _serve(out_dir / "best.yaml", out_dir / "serve.log")
        served = []
        try:
            for r in range(args.repeats):
                m = _replay(url, {"path": spec_path}, out_dir / f"served-{r}.json", seed)
                served.append(m)
                print(f"[{spec.name}] served #{r}: {key} {m.get(key)}, tok/s {m['output_tokens_per_s']:.1f} "
                      f"(trial: {trial_m.get(key)}, {trial_m['output_tokens_per_s']:.1f})", flush=True)
        finally:
            _stop(proc)
        med = {k: statistics.median(m[k] for m in served if m.get(k) is not None) for k in (key, "output_tokens_per_s")}
        ratio = med[key] / trial_m[key]
        declaration = best.get("remeasured") or {}
        remeasured = declaration.get("metrics") or {}
        rows.append({"spec": spec.name, "objective": key, "direction": best["direction"], "trial": trial_m[key],
                     "served": med[key], "ratio": ratio, "remeasured": remeasured.get(key),
                     "ratio_to_remeasured": med[key] / remeasured[key] if remeasured.get(key) else None,
                     "declared_seeds": len(declaration.get("seeds") or []), "declared_half_width": declaration.get("half_width"),
                     "is_within_10pct": 0.90 <= ratio <= 1.10,  # either way: better than the trial is a miss too
                     "trial_tok_s": trial_m["output_tokens_per_s"], "served_tok_s": med["output_tokens_per_s"],
                     "tok_s_ratio": med["output_tokens_per_s"] / trial_m["output_tokens_per_s"],
                     "trial_measure": trial_m.get("measure", "served" if "client_cpu_s" in trial_m else "in_process")})
        raw.append({"spec": spec.name, "best": best, "served": served})

    stamp = date.today().isoformat()
    meta = {"date": stamp, "machine": machine.words(), "python": platform.python_version(), "repeats": args.repeats,
            "command": "python bench/serve_vs_trial/run.py " + " ".join(sys.argv[1:])}
    stem = HERE / f"results-{stamp}{'-' + args.tag if args.tag else ''}"
    stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows, "raw": raw}, indent=1))
    md = [f"# Served winner vs its trial ({stamp}, {meta['machine']})", "",
          f"`{meta['command']}`; served = median of {args.repeats} replays of the spec's workload (trial seed) "
          "against `tune serve best.yaml`, client in its own process. Ratio = served / trial. Declared = the value "
          "best.yaml states: `tune run`'s mean over the winner's declaration measurements (served, on fresh workload "
          "seeds, as many as its 95% interval asked), with that interval.", "",
          "| spec | objective | trial | declared | served | served / trial | within 10% | served / declared "
          "| trial tok/s | served tok/s | tok/s ratio |",
          "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        rem = "-" if r["remeasured"] is None else f"{r['remeasured']:.4g}"
        if r.get("declared_seeds"):
            hw = r.get("declared_half_width")
            rem += f" ({r['declared_seeds']} seeds" + (f", ±{hw:.1%})" if hw is not None else ")")
        rem_ratio = "-" if r["ratio_to_remeasured"] is None else f"{r['ratio_to_remeasured']:.2f}"
        md.append(f"| {r['spec']} | {r['objective']} ({r['direction']}) | {r['trial']:.4g} | {rem} | {r['served']:.4g} | "
                  f"{r['ratio']:.2f} | {'yes' if r['is_within_10pct'] else 'no'} | {rem_ratio} | {r['trial_tok_s']:.1f} | "
                  f"{r['served_tok_s']:.1f} | {r['tok_s_ratio']:.2f} |")
    stem.with_suffix(".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
