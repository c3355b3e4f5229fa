"""Run the real `tune validate` over a corpus of hostile tuning specs and count the outcomes.

Each case is written into a fresh temp dir (with the helper files it references) and checked
with `python -m slotune.tuner.cli_main validate SPEC` in a subprocess, from a working
directory that is NOT the spec's folder (relative paths must resolve against the spec file).
An outcome is one of:

- clear error: exit 2, no traceback, and a stderr line `LOCATION: message` where LOCATION is
  a file path (optionally `:line:col`) or a dotted field path;
- traceback: "Traceback (most recent call last)" anywhere in the output;
- hang: still running after --timeout seconds (default 20);
- silent accept: exit 0 (listed one by one, to be judged by a human);
- unclear: anything else (another exit code, or exit 2 with no `LOCATION: message` line).

Controls are specs that must be accepted (relative paths from another working directory);
they are counted apart.

Usage: python bench/hardening/hostile_specs.py [--timeout 20] [--only SUBSTRING] [--markdown OUT.md]
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import date
from pathlib import Path
from typing import Callable

BASE = "name: hostile\nobjective: {kind: latency, metric: ttft}\n"
SPACE_HEAD = BASE + "search_space:\n  knobs:\n"
# one problem line: `path/to/file.yaml:3:5: msg`, `/abs/file: msg` or `objective.metric: msg`
LOCATED = re.compile(
    r"^\s*(?:error:\s+)?(?!error:)(?P<loc>(?:[\w.~+\-]*/[\w./~+\-]*|[a-z_][\w.\[\]]*)"
    r"(?::\d+(?::\d+)?)?): \S"
)


@dataclass
class Case:
    name: str
    category: str
    write: Callable[[Path], Path]  # writes the files into a folder, returns the spec path
    control: bool = False  # must be accepted


def text(body: str | bytes, extra: dict[str, str | bytes] | None = None, spec_name: str = "spec.yaml"):
    def write(d: Path) -> Path:
        for rel, content in (extra or {}).items():
            p = d / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(content if isinstance(content, bytes) else content.encode())
        p = d / spec_name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(body if isinstance(body, bytes) else body.encode())
        return p

    return write


def knobs(*lines: str, forbidden: str = "") -> str:
    return SPACE_HEAD + "".join(f"    - {ln}\n" for ln in lines) + (f"  forbidden: {forbidden}\n" if forbidden else "")


def billion_laughs(levels: int = 9, width: int = 9) -> str:
    out = ['a0: &a0 ["lol"]']
    for i in range(1, levels):
        out.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * width) + "]")
    return BASE + "\n".join(out) + "\n"


def cases() -> list[Case]:
    c: list[Case] = []
    add = lambda name, cat, body, **kw: c.append(Case(name, cat, text(body, **kw)))  # noqa: E731

    # --- YAML syntax and file-level hostility -------------------------------------------------
    add("syntax-unclosed-flow", "yaml", BASE + "budget: {n_trials: 3\n")
    add("syntax-bad-indent", "yaml", "name: x\n  objective: 1\n bad: [\n")
    add("tab-indent", "yaml", "name: x\nobjective:\n\tkind: latency\n\tmetric: ttft\n")
    add("python-object-apply", "yaml", BASE + "sampler: !!python/object/apply:os.system ['echo pwned']\n")
    add("python-name", "yaml", BASE + "seed: !!python/name:os.system\n")
    add("unknown-tag", "yaml", BASE + "seed: !include other.yaml\n")
    add("nul-byte", "yaml", BASE.encode() + b"seed: 1\x00\n")
    add("invalid-utf8", "yaml", BASE.encode() + b"description: \xff\xfe\xfa\n")
    add("deep-nesting-flow", "yaml", BASE + "engine: " + "[" * 20000 + "]" * 20000 + "\n")
    add("deep-nesting-block", "yaml", BASE + "".join("  " * i + f"k{i}:\n" for i in range(400)) + "  " * 400 + "v: 1\n")
    add("billion-laughs", "yaml", billion_laughs())
    add("recursive-alias", "yaml", BASE + "engine: &e {kernels: *e}\n")
    add("duplicate-key-top", "yaml", BASE + "sampler: tpe\nsampler: random\n")
    add("duplicate-key-nested", "yaml", "name: x\nobjective: {kind: latency, metric: ttft, metric: tpot}\n")
    add("multi-document", "yaml", BASE + "---\nname: y\n")
    add("empty-file", "yaml", "")
    add("top-level-list", "yaml", "- name: x\n")
    add("top-level-scalar", "yaml", "just a string\n")
    add("unhashable-key", "yaml", BASE + "? [a, b]\n: 1\n")
    add("huge-file", "yaml", BASE + "description: |\n" + ("  " + "x" * 1000 + "\n") * 20000)
    add("yaml-set-tag", "yaml", BASE + "engine: !!set {a, b}\n")
    add("timestamp-name", "yaml", "name: 2024-01-01\nobjective: {kind: latency, metric: ttft}\n")
    c.append(Case("directory-as-file", "file", lambda d: (d / "adir").mkdir() or d / "adir"))
    c.append(Case("nonexistent-file", "file", lambda d: d / "nope.yaml"))
    c.append(Case("endless-file-dev-zero", "file", lambda d: Path("/dev/zero")))
    add(
        "workload-file-alias-bomb",
        "yaml",
        BASE + "workload: wl.yaml\n",
        extra={"wl.yaml": billion_laughs().replace(BASE, "name: w\n")},
    )
    add(
        "space-file-duplicate-key",
        "yaml",
        BASE + "search_space: sp.yaml\n",
        extra={"sp.yaml": "knobs:\n  - {name: max_num_seqs, type: int, low: 1, high: 4}\nknobs: []\n"},
    )
    add("workload-file-tabs", "yaml", BASE + "workload: wl.yaml\n", extra={"wl.yaml": "name: w\n\tarrivals: x\n"})

    # --- storage and output locations ---------------------------------------------------------
    for name, line in (
        ("storage-not-a-url", "storage: not a url"),
        ("storage-unknown-dialect", "storage: 'nosuchdb://u@h/db'"),
        ("storage-sqlite-readonly", "storage: 'sqlite:////sys/slotune-ro/study.db'"),
        ("output-dir-readonly", "output_dir: /sys/slotune-ro/out"),
    ):
        add(name, "storage", BASE + line + "\n")
    add("output-dir-under-a-file", "storage", BASE + "output_dir: afile/out\n", extra={"afile": "x"})

    # --- relative paths ---------------------------------------------------------------------------
    for name, line in (
        ("relative-workload-missing", "workload: workloads/none.yaml"),
        ("relative-space-missing", "search_space: spaces/none.yaml"),
        ("missing-trace", "workload: {trace: nope.jsonl}"),
        ("missing-model", "model: ./no-such-model"),
        ("missing-model-gguf", "model: models/x.gguf"),
        ("engine-draft-model-missing", "engine: {speculative: {method: model, draft_model: ./draft}}"),
    ):
        add(name, "paths", BASE + line + "\n")
    add(
        "missing-trace-in-workload-file",
        "paths",
        BASE + "workload: wl/w.yaml\n",
        extra={"wl/w.yaml": "name: w\ntrace: missing.jsonl\n"},
    )
    add(
        "trace-bad-row",
        "paths",
        BASE + "workload: {trace: t.jsonl}\n",
        extra={"t.jsonl": '{"prompt_len": 8, "output_len": 4}\n{"prompt_len": -3, "output_len": "x"}\n'},
    )
    add("trace-not-json", "paths", BASE + "workload: {trace: t.jsonl}\n", extra={"t.jsonl": "prompt,output\n8,4\n"})
    add("engine-model-override", "engine", BASE + "engine: {model: ./elsewhere.gguf}\n")

    # --- search space values vs EngineConfig ------------------------------------------------------
    add("space-bad-later-choice", "space", knobs("{name: block_size, type: categorical, choices: [16, 17]}"))
    add("space-int-high-out-of-range", "space", knobs("{name: max_num_seqs, type: int, low: 1, high: 5000}"))
    add("space-log-with-step", "space", knobs("{name: max_num_seqs, type: int, low: 1, high: 15, log: true, step: 2}"))
    add("space-float-on-int-field", "space", knobs("{name: max_num_seqs, type: float, low: 1.5, high: 8.5}"))
    add("space-literal-out-of-set", "space", knobs("{name: quantization, type: categorical, choices: [none, int3]}"))
    add("space-int-knob-on-literal", "space", knobs("{name: block_size, type: int, low: 8, high: 64}"))
    add(
        "space-when-later-knob",
        "space",
        knobs(
            "{name: speculative.num_speculative_tokens, type: int, low: 2, high: 4, when: {speculative.method: [ngram]}}",
            "{name: speculative.method, type: categorical, choices: [none, ngram]}",
        ),
    )
    add(
        "space-when-unknown-value",
        "space",
        knobs(
            "{name: speculative.method, type: categorical, choices: [none, ngram]}",
            "{name: speculative.num_speculative_tokens, type: int, low: 2, high: 4, when: {speculative.method: [ngrm]}}",
        ),
    )
    add(
        "space-forbidden-unknown-knob",
        "space",
        knobs("{name: max_num_seqs, type: int, low: 1, high: 4}", forbidden="[{max_num_sqs: [1]}]"),
    )
    add(
        "space-forbidden-unknown-value",
        "space",
        knobs("{name: dtype, type: categorical, choices: [auto, float32]}", forbidden="[{dtype: [float64]}]"),
    )
    add("space-nan-bounds", "space", knobs("{name: kv_cache_memory_gb, type: float, low: .nan, high: 1.0}"))
    add("space-inf-high", "space", knobs("{name: kv_cache_memory_gb, type: float, low: 0.1, high: .inf}"))
    add("space-huge-int", "space", knobs("{name: max_num_batched_tokens, type: int, low: 16, high: 1e400}"))
    add(
        "space-grid-huge-range",
        "space",
        knobs("{name: max_num_batched_tokens, type: int, low: 16, high: 1000000000000}") + "sampler: grid\n",
    )
    add(
        "space-step-not-dividing",
        "space",
        knobs("{name: kv_cache_memory_gb, type: float, low: 0.1, high: 0.5, step: 0.3}"),
    )
    add(
        "space-categorical-dict-choice",
        "space",
        knobs("{name: kernels, type: categorical, choices: [{backend: torch}]}"),
    )
    add(
        "space-grid-float-no-step",
        "space",
        knobs("{name: kv_cache_memory_gb, type: float, low: 0.1, high: 1.0}") + "sampler: grid\n",
    )

    # --- numbers --------------------------------------------------------------------------------
    add("nan-ttft-limit", "numbers", "name: x\nobjective: {kind: latency, metric: tpot, ttft_limit_s: .nan}\n")
    add(
        "inf-tpot-limit", "numbers", "name: x\nobjective: {kind: throughput, metric: goodput_rps, tpot_limit_s: .inf}\n"
    )
    add("inf-trial-timeout", "numbers", BASE + "budget: {trial_timeout_s: .inf}\n")
    add("nan-study-timeout", "numbers", BASE + "budget: {timeout_s: .nan}\n")
    add("inf-trial-memory", "numbers", BASE + "budget: {trial_memory_gb: .inf}\n")
    add("huge-trial-memory", "numbers", BASE + "budget: {trial_memory_gb: 1.0e+300}\n")
    add("inf-rate", "numbers", BASE + "workload: {arrivals: poisson, rate: .inf}\n")
    add("nan-kv-memory", "numbers", BASE + "engine: {kv_cache_memory_gb: .nan}\n")
    add("inf-kv-memory", "numbers", BASE + "engine: {kv_cache_memory_gb: .inf}\n")
    add("negative-seed", "numbers", BASE + "seed: -1\n")
    add("huge-seed", "numbers", BASE + "seed: 123456789012345678901234567890\n")
    add("huge-robustness-seed", "numbers", BASE + "robustness_seed: 99999999999999999999\n")
    add("negative-workload-seed", "numbers", BASE + "workload: {seed: -5}\n")
    add("huge-n-trials", "numbers", BASE + "budget: {n_trials: 100000000000000000000000}\n")
    add("huge-prompt-len", "numbers", BASE + "workload: {prompt_len: {kind: fixed, value: 100000000000000000000}}\n")
    add(
        "max-model-len-beyond-context",
        "numbers",
        BASE + "engine: {max_model_len: 1000000, max_num_batched_tokens: 1000000}\n",
    )
    add(
        "space-max-model-len-beyond-context",
        "numbers",
        knobs("{name: max_model_len, type: categorical, choices: [2048, 65536]}"),
    )

    # --- gates and objective --------------------------------------------------------------------
    add(
        "gate-unknown-metric",
        "gates",
        BASE + "quality_gates:\n  - {name: g, kind: lm_eval, task: slotune_arithmetic_1digit, "
        "metric: accuracy, max_abs_drop: 0.1}\n",
    )
    add(
        "gate-perplexity-wrong-metric",
        "gates",
        BASE + "quality_gates:\n  - {name: g, kind: perplexity, metric: acc, max_rel_drop: 0.1}\n",
    )
    add(
        "duplicate-gate-names",
        "gates",
        BASE + "quality_gates:\n  - {name: g, kind: agreement, min_top1: 0.9}\n"
        "  - {name: g, kind: agreement, max_mean_kl: 0.1}\n",
    )
    add(
        "duplicate-pareto-with",
        "gates",
        "name: x\nobjective: {kind: latency, metric: ttft, "
        "pareto_with: [output_tokens_per_s, output_tokens_per_s]}\nsampler: nsga2\n",
    )
    add("pareto-with-own-metric", "gates", "name: x\nobjective: {kind: latency, metric: ttft, pareto_with: [ttft]}\n")

    # --- types and garbage ----------------------------------------------------------------------
    add("wrong-type-budget", "types", BASE + "budget: [1, 2, 3]\n")
    add("name-is-a-date", "types", "name: 2024-01-01\nobjective: {kind: latency, metric: ttft}\n")
    add("nested-garbage", "types", BASE + "workload: {prompt_len: {kind: {a: [1, {b: null}]}}}\n")
    add("engine-unknown-key", "types", BASE + "engine: {max_num_seq: 4}\n")

    # --- controls: must be accepted -------------------------------------------------------------
    c.append(
        Case(
            "control-relative-grid-space",
            "control",
            text(
                "name: ctl\nobjective: {kind: latency, metric: ttft}\nsampler: grid\nsearch_space: spaces/s.yaml\n"
                "workload: wl/w.yaml\noutput_dir: out\nstorage: sqlite:///out/study.db\n",
                extra={
                    "spaces/s.yaml": "knobs:\n  - {name: max_num_seqs, type: int, low: 1, high: 2}\n",
                    "wl/w.yaml": "name: w\ntrace: t.jsonl\nnum_requests: 2\n",
                    "wl/t.jsonl": '{"prompt_len": 8, "output_len": 4}\n',
                },
                spec_name="sub/../spec.yaml",
            ),
            control=True,
        )
    )
    c.append(
        Case(
            "control-inline-trace",
            "control",
            text(
                BASE + "workload: {trace: data/t.jsonl, num_requests: 2}\n",
                extra={"data/t.jsonl": '{"prompt_len": 8, "output_len": 4}\n'},
            ),
            control=True,
        )
    )
    return c


def run_case(case: Case, root: Path, timeout: float) -> tuple[str, str, float]:
    d = root / case.name
    d.mkdir()
    spec = case.write(d)
    cwd = root / "elsewhere"  # never the spec's folder
    cwd.mkdir(exist_ok=True)
    env = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1"}
    t0 = time.perf_counter()
    try:
        p = subprocess.run(
            [sys.executable, "-m", "slotune.tuner.cli_main", "validate", str(spec)],
            cwd=cwd,
            capture_output=True,
            timeout=timeout,
            env=env,
        )
    except subprocess.TimeoutExpired:
        return "hang", "", time.perf_counter() - t0
    dt = time.perf_counter() - t0
    out, err = p.stdout.decode(errors="replace"), p.stderr.decode(errors="replace")
    if "Traceback (most recent call last)" in out + err:
        return "traceback", err.strip().splitlines()[-1] if err.strip() else "", dt
    if p.returncode == 0:
        return "silent accept", "", dt
    located = [ln.strip() for ln in err.splitlines() if LOCATED.match(ln)]
    if p.returncode == 2 and located:
        return "clear error", located[0], dt
    return "unclear", f"exit {p.returncode}: " + " | ".join(err.strip().splitlines()[:3]), dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--timeout", type=float, default=20.0)
    ap.add_argument("--only", default="", help="run only the cases whose name contains this")
    ap.add_argument("--markdown", type=Path, help="also write the results as markdown here")
    args = ap.parse_args()
    corpus = [c for c in cases() if args.only in c.name]
    results = []
    with tempfile.TemporaryDirectory(prefix="hostile-specs-") as tmp:
        for case in corpus:
            outcome, detail, dt = run_case(case, Path(tmp), args.timeout)
            results.append((case, outcome, detail, dt))
            print(f"{outcome:14s} {dt:5.1f}s {case.category:8s} {case.name}: {detail[:160]}", flush=True)
    hostile = [r for r in results if not r[0].control]
    controls = [r for r in results if r[0].control]
    kinds = ("clear error", "traceback", "hang", "silent accept", "unclear")
    counts = {k: sum(1 for r in hostile if r[1] == k) for k in kinds}
    lines = [f"tried: {len(hostile)} hostile specs (+ {len(controls)} controls)"]
    lines += [f"{k}: {counts[k]}" for k in kinds]
    lines.append(f"controls accepted: {sum(1 for r in controls if r[1] == 'silent accept')}/{len(controls)}")
    accepted = [r for r in hostile if r[1] == "silent accept"]
    if accepted:
        lines.append("silent accepts (judge each):")
        lines += [f"  - {r[0].name} ({r[0].category})" for r in accepted]
    bad = [r for r in hostile if r[1] in ("traceback", "hang", "unclear")]
    if bad:
        lines.append("tracebacks / hangs / unclear:")
        lines += [f"  - {r[0].name}: {r[1]}: {r[2][:200]}" for r in bad]
    bad_controls = [r for r in controls if r[1] != "silent accept"]
    if bad_controls:
        lines.append("controls NOT accepted:")
        lines += [f"  - {r[0].name}: {r[1]}: {r[2][:200]}" for r in bad_controls]
    print("\n" + "\n".join(lines))
    if args.markdown:
        machine = (
            f"{platform.node() or 'host'}: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
            f"Python {platform.python_version()}"
        )
        md = [
            f"# Hostile tuning specs through `tune validate` ({date.today().isoformat()})",
            "",
            f"Machine: {machine}. Command: `python bench/hardening/hostile_specs.py --markdown ...` "
            f"(timeout {args.timeout:g} s per spec).",
            "",
            "```",
            *lines,
            "```",
            "",
            "| case | category | outcome | s | first line |",
            "|---|---|---|---|---|",
        ]
        md += [
            f"| {c.name} | {c.category} | {o} | {dt:.1f} | `{d[:140].replace('|', '/')}` |" for c, o, d, dt in results
        ]
        args.markdown.write_text("\n".join(md) + "\n")


if __name__ == "__main__":
    main()
