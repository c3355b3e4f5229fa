"""The load sweep in words, tables and figures (slotune/tuner/sweep.py measures it): the report's sections
"Latency against load" (capacity table, the latency-throughput curves) and "Load sweep points", and
the small page `tune sweep --html` writes with them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from slotune.tuner.measure.load_sweep import Load, LoadCurve, LoadPoint, SweepResult
from slotune.tuner.measure.units import axis_unit, format_value, metric_label, number
from slotune.tuner.report.facts import ReportSection
from slotune.tuner.spec.slo import SLOLimits, metric_key

COLORS = ("#1f77b4", "#7f7f7f", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b")  # winner, default, naive, ...


def offered_words(load: Load, offered: float) -> str:
    if math.isinf(offered):
        return "saturation probe"
    return f"{offered:g} concurrent" if load == "concurrency" else f"{number(offered)} req/s offered"


def point_line(name: str, load: Load, p: LoadPoint, limits: SLOLimits) -> str:
    """One line: 'sweep winner: 4 concurrent -> 3.2 req/s, 103 tok/s, p95 TTFT 987 ms, p95 TPOT 38 ms: meets the SLO'."""
    head = f"sweep {name}: {offered_words(load, p.offered)}"
    if p.error:
        return f"{head}: failed ({p.error})"
    lat = ", ".join(
        f"{metric_label(k)} {format_value(k, p.metrics.get(k))}"
        for k in (metric_key("ttft", limits.percentile), metric_key("tpot", limits.percentile))
    )
    verdict_words = "meets the SLO" if p.passed else "misses the SLO: " + "; ".join(p.reasons)
    return (
        f"{head} -> {format_value('requests_per_s', p.achieved_rps)}, "
        f"{format_value('output_tokens_per_s', p.tokens_per_s)}, {lat}: {verdict_words}"
    )


def capacity_table(result: SweepResult) -> list[list[str]]:
    """config | capacity | requests/s there | output tokens/s there | [replicas for the peak] | points within the SLO | sweep ended."""
    peak = result.peak_rps
    rows = [
        [
            "config",
            "capacity (offered load)",
            "requests/s at capacity",
            "output tokens/s at capacity",
            *([f"replicas for {number(peak)} req/s peak"] if peak else []),
            "points within the SLO",
            "sweep ended",
        ]
    ]
    for c in result.curves:
        cap = c.capacity
        replicas = c.replicas(peak)
        rows.append(
            [
                c.name,
                offered_words(c.load, cap.offered) if cap else "none: no load met the SLO",
                format_value("requests_per_s", cap.achieved_rps if cap else None),
                format_value("output_tokens_per_s", cap.tokens_per_s if cap else None),
                *([str(replicas) if replicas is not None else "–"] if peak else []),
                f"{sum(p.passed for p in c.points)} of {len(c.points)}",
                c.stopped,
            ]
        )
    return rows


def capacity_line(result: SweepResult, curve: LoadCurve) -> str:
    """The capacity of one curve in a sentence, with the replicas for the peak and why the sweep ended."""
    cap = curve.capacity
    slo = result.limits.latency_only.describe()
    if cap is None:
        text = f"capacity of {curve.name}: none, no load met the SLO ({slo})"
    else:
        text = (
            f"capacity of {curve.name}: {offered_words(curve.load, cap.offered)}, "
            f"{format_value('requests_per_s', cap.achieved_rps)} and "
            f"{format_value('output_tokens_per_s', cap.tokens_per_s)} within the SLO ({slo})"
        )
        if slo == "none":
            text += ": no latency limit given, so every completed point meets it"
    replicas = curve.replicas(result.peak_rps)
    if result.peak_rps:
        text += (
            f"; a peak of {number(result.peak_rps)} req/s takes {replicas} replica{'s' if replicas != 1 else ''}"
            if replicas is not None
            else f"; no replica count for the {number(result.peak_rps)} req/s peak"
        )
    return f"{text}. The sweep ended: {curve.stopped}."


def points_table(result: SweepResult) -> list[list[str]]:
    """One row per point: config | offered | requests/s | output tokens/s | TTFT p50, pXX | TPOT p50, pXX | SLO."""
    pct = result.limits.percentile
    keys = [metric_key(n, p) for n in ("ttft", "tpot") for p in dict.fromkeys((50, pct))]
    rows = [
        ["config", "offered load", "requests/s", "output tokens/s", *(metric_label(k) for k in keys), "meets the SLO"]
    ]
    for c in result.curves:
        for p in c.points:
            rows.append(
                [
                    c.name,
                    offered_words(c.load, p.offered),
                    format_value("requests_per_s", p.achieved_rps),
                    format_value("output_tokens_per_s", p.tokens_per_s),
                    *(format_value(k, p.metrics.get(k)) for k in keys),
                    "yes" if p.passed else "no: " + "; ".join(p.reasons),
                ]
            )
    return rows


def curve_figure(result: SweepResult):
    """p95 TTFT (top) and p95 TPOT (bottom) against output tokens/s (left) and requests/s (right), a
    line per config, failing points as crosses, the SLO limits as dashed lines."""
    import plotly.graph_objects as go  # heavy: the tuner's plotting dependency, only for the report
    from plotly.subplots import make_subplots

    pct, limits = result.limits.percentile, result.limits
    rows = [(metric_key("ttft", pct), limits.ttft_s), (metric_key("tpot", pct), limits.tpot_s)]
    xs = [("output_tokens_per_s", "output tokens/s"), ("requests_per_s", "requests/s")]
    fig = make_subplots(rows=2, cols=2, shared_yaxes=True, horizontal_spacing=0.06, vertical_spacing=0.12)
    for r, (key, limit) in enumerate(rows, start=1):
        factor, unit = axis_unit(key, [p.metrics.get(key) for c in result.curves for p in c.points] + [limit])
        for col, (xkey, xtitle) in enumerate(xs, start=1):
            for i, c in enumerate(result.curves):
                pts = [p for p in c.points if p.metrics.get(key) is not None and p.metrics.get(xkey) is not None]
                fig.add_trace(
                    go.Scatter(
                        x=[p.metrics[xkey] for p in pts],
                        y=[p.metrics[key] * factor for p in pts],
                        name=c.name,
                        mode="lines+markers",
                        legendgroup=c.name,
                        showlegend=r == 1 and col == 1,
                        line={"color": COLORS[i % len(COLORS)]},
                        marker={"size": 9, "symbol": ["circle" if p.passed else "x" for p in pts]},
                        text=[point_line(c.name, c.load, p, limits) for p in pts],
                        hovertemplate="%{text}<extra></extra>",
                    ),
                    row=r,
                    col=col,
                )
            if limit:
                label = {"annotation_text": f"limit {format_value(key, limit)}"} if col == 2 else {}
                fig.add_hline(y=limit * factor, line_dash="dash", line_color="#d62728", row=r, col=col, **label)
            fig.update_xaxes(title_text=xtitle if r == 2 else None, rangemode="tozero", row=r, col=col)
        fig.update_yaxes(
            title_text=f"{metric_label(key)} ({unit})" if unit else metric_label(key), rangemode="tozero", row=r, col=1
        )
    fig.update_layout(
        height=640,
        margin={"l": 70, "r": 20, "t": 30, "b": 50},
        template="plotly_white",
        legend={"orientation": "h", "y": -0.12},
    )
    return fig


def report_sections(result: SweepResult) -> list[ReportSection]:
    """The report's sections: the curves with the capacity table, then every point."""
    load = result.curves[0].load if result.curves else "concurrency"
    what = "concurrency (requests kept in flight)" if load == "concurrency" else "arrival rate"
    text = [
        f"Each config measured at rising {what} on the workload '{result.workload}' (its prompt and output "
        "lengths, prefixes and seed), each point as a trial is measured: the numbers `tune serve` delivers. "
        "Throughput rises to a plateau while latency climbs past the knee; dashed lines are the SLO limits "
        f"({result.limits.latency_only.describe()}), crosses the points that miss them.",
        "Capacity: the highest offered load whose point meets the latency limits with every request completed "
        "(the throughput floor is not judged here: the offered load sets the throughput).",
    ]
    if result.peak_rps:
        text.append(
            f"Replicas for a peak of {number(result.peak_rps)} requests/s: the peak divided by the "
            "requests/s at capacity, rounded up."
        )
    return [
        ReportSection(
            "Latency against load",
            "\n".join(text),
            capacity_table(result),
            [curve_figure(result)] if result.curves else [],
            anchor="sweep",
        ),
        ReportSection(
            "Load sweep points",
            "Every point measured, in rising offered load.",
            points_table(result),
            anchor="sweep-points",
        ),
    ]


def render_page(title: str, sections: Sequence[ReportSection]) -> str:
    """A small self-contained page of `sections` (`tune sweep --html`): headings, text, tables and
    figures as report.html lays them out (figure divs `fig-<section>-<i>`, plotly inlined once)."""
    from html import escape

    from plotly.offline import get_plotlyjs  # heavy: only for the page

    def table(rows: Sequence[Sequence[str]]) -> str:
        if not rows:
            return ""
        head = "".join(f"<th>{escape(c)}</th>" for c in rows[0])
        body = "".join("<tr>" + "".join(f"<td>{escape(c)}</td>" for c in r) + "</tr>" for r in rows[1:])
        return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"

    parts = []
    for s in sections:
        figs = "".join(
            f'<div class="figure">{f.to_html(full_html=False, include_plotlyjs=False, div_id=f"fig-{s.id}-{i}", config={"displaylogo": False, "responsive": True})}</div>'  # noqa: E501
            for i, f in enumerate(s.figures)
        )
        paras = "".join(f"<p>{escape(line)}</p>" for line in s.text.splitlines() if line)
        parts.append(f'<section id="{escape(s.id)}"><h2>{escape(s.title)}</h2>{paras}{table(s.table)}{figs}</section>')
    style = (
        "body{font-family:system-ui,sans-serif;margin:24px;color:#222}table{border-collapse:collapse;"
        "font-size:.9em;margin:8px 0}th,td{border:1px solid #dde1e6;padding:4px 8px;text-align:left}"
        "th{background:#f0f2f5}"
    )
    return (
        f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>{escape(title)}</title>'
        f'<style>{style}</style><script type="text/javascript">{get_plotlyjs()}</script></head>'
        f"<body><h1>{escape(title)}</h1>{''.join(parts)}</body></html>"
    )
