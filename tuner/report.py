"""The study report (markdown + HTML): trials, winner vs default and baseline, SLO attainment,
Pareto front for multi-objective runs."""

from __future__ import annotations

import base64
import html
from pathlib import Path
from typing import Any


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "-" if v is None else str(v)


def _tagged(study, tag: str):
    for t in study.trials:
        if t.user_attrs.get("tag") == tag and t.state.name == "COMPLETE":
            return t
    return None


def _metrics_of(trial) -> dict | None:
    return trial.user_attrs.get("metrics") if trial is not None else None


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
    fig.savefig(path)
    plt.close(fig)
    return True


def write_report(spec, study, best, remeasure, out: Path) -> dict[str, Path]:
    obj = spec.objective
    key = obj.metric_key()
    lines = [f"# slotune study `{spec.name}`", "",
             f"Objective: **{obj.direction()} {key}**"
             + (f" with Pareto over {', '.join(obj.metric_key(m) for m in obj.pareto_with)}" if obj.pareto_with else ""),
             f"SLO: ttft p{obj.percentile} <= {_fmt(obj.ttft_limit_s)} s, tpot p{obj.percentile} <= {_fmt(obj.tpot_limit_s)} s, "
             f"min output tokens/s {_fmt(obj.min_output_tokens_per_s)}; sampler {spec.sampler}; {len(study.trials)} trials.", ""]
    ref = {"default": _metrics_of(_tagged(study, "default")), "baseline": _metrics_of(_tagged(study, "baseline"))}
    if ref["baseline"] is None:
        ref["baseline"] = study.user_attrs.get("baseline", {}).get("metrics")
    if best is not None:
        bm = best.user_attrs["metrics"]
        lines += ["## Winner", "", f"Trial {best.number}: `{key}` = {_fmt(best.values[0])}", "",
                  "| metric | winner | re-measured (fresh seed) | default | baseline |", "|---|---|---|---|---|"]
        rm = (remeasure or {}).get("metrics", {})
        for k in (key, "ttft_p50", f"ttft_p{obj.percentile}", "tpot_p50", f"tpot_p{obj.percentile}",
                  "output_tokens_per_s", "goodput_rps", "slo_attainment", "weight_bytes", "peak_kv_blocks"):
            row = [_fmt(bm.get(k)), _fmt(rm.get(k))]
            for rm_ in ref.values():
                row.append(_fmt(rm_.get(k)) if rm_ else "-")
            lines.append(f"| {k} | " + " | ".join(row) + " |")
        lines.append("")
        for name, rm_ in ref.items():
            if rm_ and rm_.get(key) and best.values[0]:
                a, b = best.values[0], rm_[key]
                ratio = (b / a) if obj.direction() == "minimize" else (a / b if b else float("inf"))
                lines.append(f"- improvement over {name}: **{ratio:.2f}x** on {key}")
        if remeasure and "error" in remeasure:
            lines.append(f"- re-measurement failed: {remeasure['error']}")
        lines += ["", "Parameters:", "", *[f"- `{k}`: {v}" for k, v in best.params.items()], ""]
    else:
        lines += ["## No feasible trial", "", "No trial met the SLO and the quality gates.", ""]
    lines += ["## Trials", "", f"| # | tag | state | {key} | feasible | params | note |", "|---|---|---|---|---|---|---|"]
    for t in study.trials:
        ua = t.user_attrs
        note = ua.get("fail_reason") or (", ".join(f"{k}={v:.3g}" for k, v in (ua.get("violations") or {}).items() if v > 0))
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
    md.write_text("\n".join(lines) + "\n")
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
    page_html.write_text(f"<!doctype html><html><head><meta charset='utf-8'><title>slotune {html.escape(spec.name)}</title>"
                         f"</head><body style='font-family:sans-serif'>{''.join(page)}</body></html>")
    paths = {"md": md, "html": page_html}
    if has_plot:
        paths["pareto"] = pareto
    return paths
