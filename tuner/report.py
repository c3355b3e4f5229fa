"""The study report (markdown + HTML): trials, winner vs the default and naive configs, SLO attainment,
Pareto front for multi-objective runs."""

from __future__ import annotations

import base64
import html
import io
import os
import secrets
from pathlib import Path
from typing import Any

from slotune.tuner.slo import SLO_KEYS, SLOLimits, judge, metric_key
from slotune.tuner.workload import describe_replay


def write_atomic(path: Path, data: str | bytes) -> None:
    """Write `path` whole or not at all: a temp file in the same directory, then os.replace.

    A reader, a crash or a full disk never leaves a half-written file behind; the previous
    version stays until the new one is complete.

    Raises:
        OSError: naming `path` (say, "No space left on device: could not write .../best.yaml").
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    raw = data.encode() if isinstance(data, str) else data
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask applies, as for open()
        try:
            view = memoryview(raw)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise OSError(exc.errno, f"{exc.strerror or exc}: could not write {path}") from exc
        raise


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "-" if v is None else str(v)


def _pareto_plot(spec, study, path: Path) -> bool:
    if not spec.objective.pareto_with:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [t for t in study.trials if t.state.name == "COMPLETE"]
    front = {t.number for t in study.best_trials}
    keys = [spec.objective.metric_key(m) for m in spec.objective.metrics[:2]]
    fig, ax = plt.subplots(figsize=(5, 4))
    for t in done:
        ax.scatter(t.values[0], t.values[1], c="tab:red" if t.number in front else "tab:gray",
                   marker="o" if t.user_attrs.get("feasible") else "x")
    ax.set_xlabel(keys[0])
    ax.set_ylabel(keys[1])
    ax.set_title("Pareto front (red), infeasible (x)")
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png")
    plt.close(fig)
    write_atomic(path, png.getvalue())
    return True


def _slo_rows(limits: SLOLimits, metrics: dict) -> list[tuple[str, str, str, bool]]:
    """(check, limit, measured, passed) for each SLO limit, as the study judged it."""
    rows = []
    for c in judge(metrics, limits).checks:
        if c.name == "throughput":
            rows.append((c.label, f">= {c.limit:g}", _fmt(c.value), c.passed))
        else:
            rows.append((f"{c.label} (s)", f"<= {c.limit:g}", _fmt(c.value), c.passed))
    return rows


def _infeasible_note(limits: SLOLimits, ua: dict) -> str:
    """Why a trial is infeasible, in words: its missed limits, then the failed flags."""
    v = ua.get("violations") or {}
    words = []
    if any(v.get(k, 0) > 0 for k in SLO_KEYS):
        # Judged again from the stored metrics for the words; the stored numbers if those are gone.
        words = judge(ua.get("metrics") or {}, limits).reasons or [f"{k}={v[k]:.3g}" for k in SLO_KEYS if v.get(k, 0) > 0]
    if v.get("quality_gates", 0) > 0:
        words.append("quality gates failed")
    return "; ".join(words)


def write_report(spec, study, best, remeasure, out: Path) -> dict[str, Path]:
    """Write report.md and report.html (and pareto.png for multi-objective runs) into `out`.

    Args:
        spec: the TuningSpec.
        study: the finished Optuna study (trials with their user attributes).
        best: the winning FrozenTrial, or None when no trial was feasible.
        remeasure: the winner's re-measurement on a fresh workload seed (`metrics` or `error`).
        out: output directory.

    Returns:
        Paths written: {"md", "html"[, "pareto"]}.
    """
    from slotune.tuner.study import reference_metrics

    obj = spec.objective
    limits = SLOLimits.from_objective(obj)
    key = obj.metric_key()
    states = [t.state.name for t in study.trials]
    lines = [f"# slotune study `{spec.name}`", "",
             f"Objective: **{obj.direction()} {key}**"
             + (f" with Pareto over {', '.join(obj.metric_key(m) for m in obj.pareto_with)}" if obj.pareto_with else ""),
             f"SLO: {limits.describe()}; quality gates: "
             f"{', '.join(g.name for g in spec.quality_gates) or 'none'}; sampler {spec.sampler}; "
             f"{len(states)} trials ({states.count('COMPLETE')} complete, {states.count('FAIL')} failed, "
             f"{states.count('PRUNED')} pruned).", ""]
    replay = describe_replay(spec.workload)
    if replay is not None:  # a trace workload: which traffic window the numbers below are about
        lines += [f"Traffic: tuned on {replay}.", ""]
    ref = reference_metrics(study)
    if best is not None:
        bm = best.user_attrs["metrics"]
        rm = (remeasure or {}).get("metrics", {})
        seed = (remeasure or {}).get("seed", spec.robustness_seed)
        lines += ["## Winner", "", f"Trial {best.number}: `{key}` = {_fmt(best.values[0])}; "
                  f"re-measured on workload seed {seed}: {_fmt(rm.get(key))}", "",
                  f"| metric | winner | re-measured (seed {seed}) | default | naive |", "|---|---|---|---|---|"]
        for k in dict.fromkeys((key, metric_key("ttft", 50), metric_key("ttft", obj.percentile), metric_key("tpot", 50),
                                metric_key("tpot", obj.percentile),
                                "output_tokens_per_s", "goodput_rps", "slo_attainment", "weight_bytes", "peak_kv_blocks",
                                "peak_memory_mb")):
            row = [_fmt(bm.get(k)), _fmt(rm.get(k))] + [_fmt(m.get(k)) if m else "-" for m in ref.values()]
            lines.append(f"| {k} | " + " | ".join(row) + " |")
        lines.append("")
        for name, m in ref.items():
            if m and m.get(key) is not None and best.values[0]:
                a, b = best.values[0], m[key]
                ratio = (b / a) if obj.direction() == "minimize" else (a / b if b else float("inf"))
                lines.append(f"- improvement over {name}: **{ratio:.2f}x** on {key}")
        if remeasure and "error" in remeasure:
            lines.append(f"- re-measurement failed: {remeasure['error']}")
        lines += ["", "## SLO attainment of the winner", "",
                  f"Requests meeting the per-request limits: {_fmt(bm.get('slo_attainment'))} "
                  f"(re-measured: {_fmt(rm.get('slo_attainment'))}).", "",
                  "| check | limit | winner | pass | re-measured | pass |", "|---|---|---|---|---|---|"]
        rrows = {r[0]: r for r in _slo_rows(limits, rm)} if rm else {}
        for check, limit, v, ok in _slo_rows(limits, bm):
            r = rrows.get(check)
            lines.append(f"| {check} | {limit} | {v} | {'yes' if ok else 'no'} | {r[2] if r else '-'} | "
                         f"{('yes' if r[3] else 'no') if r else '-'} |")
        gates = best.user_attrs.get("gates")
        for g in (gates or {}).get("gates", []):
            lines.append(f"| gate {g['name']} ({g['kind']}) | {g.get('reason', '')[:60]} | {_fmt(g.get('candidate'))} | "
                         f"{'yes' if g['passed'] else 'no'} | - | - |")
        lines += ["", "Parameters:", "", *[f"- `{k}`: {v}" for k, v in best.params.items()], ""]
    else:
        lines += ["## No feasible trial", "", "No trial met the SLO and the quality gates; the trials table says why.", ""]
    lines += ["## Trials", "", f"| # | tag | state | {key} | feasible | params | note |", "|---|---|---|---|---|---|---|"]
    for t in study.trials:
        ua = t.user_attrs
        note = ua.get("fail_reason") or _infeasible_note(limits, ua)
        if ua.get("early_stopped"):
            note = "early-stopped; " + note
        params = ", ".join(f"{k}={v}" for k, v in t.params.items())
        lines.append(f"| {t.number} | {ua.get('tag', '')} | {t.state.name} | {_fmt(t.values[0] if t.values else None)} | "
                     f"{_fmt(ua.get('feasible'))} | {params} | {note[:160].replace('|', '/')} |")
    md = out / "report.md"
    pareto = out / "pareto.png"
    has_plot = _pareto_plot(spec, study, pareto)
    if has_plot:
        lines += ["", "![Pareto front](pareto.png)"]
    write_atomic(md, "\n".join(lines) + "\n")
    body = []
    for line in lines:  # a tiny markdown subset: headings, tables, bullets, paragraphs
        if line.startswith("# "):
            body.append(f"<h1>{html.escape(line[2:])}</h1>")
        elif line.startswith("## "):
            body.append(f"<h2>{html.escape(line[3:])}</h2>")
        elif line.startswith("|---"):
            continue
        elif line.startswith("|"):
            cells = [html.escape(c.strip()) for c in line.strip("|").split("|")]
            body.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
        elif line.startswith("- "):
            body.append(f"<li>{html.escape(line[2:])}</li>")
        elif line.startswith("!["):
            data = base64.b64encode(pareto.read_bytes()).decode()
            body.append(f'<img src="data:image/png;base64,{data}"/>')
        elif line:
            body.append(f"<p>{html.escape(line)}</p>")
    page, in_table = [], False
    for b in body:
        if b.startswith("<tr>") and not in_table:
            page.append("<table border=1 cellspacing=0 cellpadding=3>")
            in_table = True
        if not b.startswith("<tr>") and in_table:
            page.append("</table>")
            in_table = False
        page.append(b)
    if in_table:
        page.append("</table>")
    page_html = out / "report.html"
    write_atomic(page_html, f"<!doctype html><html><head><meta charset='utf-8'><title>slotune {html.escape(spec.name)}</title>"
                            f"</head><body style='font-family:sans-serif'>{''.join(page)}</body></html>")
    paths = {"md": md, "html": page_html}
    if has_plot:
        paths["pareto"] = pareto
    return paths
