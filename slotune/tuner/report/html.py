"""report.html: the report's facts (slotune/tuner/report/markdown.py: `ReportData`) as one self-contained page.

A jinja2 template (templates/report.html.j2) lays out the winner card, the sections and the
trials table; plotly draws the figures, its JavaScript inlined once, so the page works offline
and from an MLflow artifact view. Every figure lives in a `ReportSection`: the built-in ones
(optimization history, Pareto front, latency distributions, parameter importances) and any a
caller adds (`write_report(..., sections=[...])`) are laid out by the same template loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from importlib import resources

from slotune.tuner.measure.units import axis_title, format_params, format_value, metric_label
from slotune.tuner.report.facts import ReportData, ReportSection, TrialFacts
from slotune.tuner.spec.slo import metric_key, parse_metric_key

COLORS = {
    "feasible": "#1f77b4",
    "infeasible": "#d62728",
    "best": "#2ca02c",
    "winner": "#1f77b4",
    "default": "#7f7f7f",
    "front": "#d62728",
    "other": "#9e9e9e",
}


def _layout(fig, height: int = 380) -> None:
    fig.update_layout(
        height=height,
        margin={"l": 60, "r": 20, "t": 30, "b": 50},
        template="plotly_white",
        legend={"orientation": "h", "y": -0.2},
    )


def _is_better(a: float, b: float, direction: str) -> bool:
    return a < b if direction == "minimize" else a > b


def history_section(data: ReportData) -> ReportSection:
    """The first objective per trial, the best feasible value so far, infeasible trials marked."""
    import plotly.graph_objects as go  # heavy: the tuner's plotting dependency, only for report.html

    key, direction = data.objective_keys[0], data.directions[0]
    done = [t for t in data.trials if t.state == "COMPLETE" and t.values]
    factor, title = axis_title(key, [t.values[0] for t in done])
    fig = go.Figure()
    for is_ok, name, symbol in ((True, "feasible", "circle"), (False, "infeasible", "x")):
        pts = [t for t in done if bool(t.feasible) == is_ok]
        fig.add_trace(
            go.Scatter(
                x=[t.number for t in pts],
                y=[t.values[0] * factor for t in pts],
                mode="markers",
                name=name,
                marker={"symbol": symbol, "size": 10, "color": COLORS[name]},
                text=[_hover(t, key) for t in pts],
                hovertemplate="%{text}<extra></extra>",
            )
        )
    best_x, best_y, best = [], [], None
    for t in done:
        if t.feasible and (best is None or _is_better(t.values[0], best, direction)):
            best = t.values[0]
        if best is not None:
            best_x.append(t.number)
            best_y.append(best * factor)
    fig.add_trace(
        go.Scatter(
            x=best_x,
            y=best_y,
            mode="lines",
            name="best feasible so far",
            line_shape="hv",
            line={"color": COLORS["best"], "width": 2},
        )
    )
    if data.winner is not None:
        w = next(t for t in done if t.number == data.winner.number)
        fig.add_trace(
            go.Scatter(
                x=[w.number],
                y=[w.values[0] * factor],
                mode="markers",
                name="winner",
                marker={"symbol": "star", "size": 16, "color": COLORS["best"]},
                text=[_hover(w, key)],
                hovertemplate="%{text}<extra></extra>",
            )
        )
    for t in done:
        if t.tag:
            fig.add_annotation(x=t.number, y=t.values[0] * factor, text=t.tag, showarrow=True, arrowhead=0, ay=-25)
    _layout(fig)
    fig.update_xaxes(title_text="trial", dtick=1 if len(data.trials) <= 30 else None)
    fig.update_yaxes(title_text=title)
    unplotted = [t for t in data.trials if t not in done]
    text = f"{metric_label(key)} of each complete trial ({direction}); the line is the best feasible value so far."
    if unplotted:
        text += (
            "\nNot plotted (no value): " + ", ".join(f"trial {t.number} ({t.state.lower()})" for t in unplotted) + "."
        )
    return ReportSection("Optimization history", text, figures=[fig], anchor="history")


def _hover(t: TrialFacts, key: str) -> str:
    head = (
        f"trial {t.number}{' (' + t.tag + ')' if t.tag else ''}: {format_value(key, t.values[0] if t.values else None)}"
    )
    body = format_params(t.params)
    return "<br>".join(x for x in (head, body, t.note) if x)


def pareto_section(data: ReportData) -> ReportSection | None:
    """Multi-objective runs: the first two objectives of every complete trial, the front joined."""
    if not data.is_multi_objective:
        return None
    import plotly.graph_objects as go  # heavy: see history_section

    kx, ky = data.objective_keys[:2]
    done = [t for t in data.trials if t.state == "COMPLETE" and t.values and len(t.values) > 1]
    fx, tx = axis_title(kx, [t.values[0] for t in done])
    fy, ty = axis_title(ky, [t.values[1] for t in done])
    fig = go.Figure()
    groups = (
        ("Pareto front (feasible)", lambda t: t.number in data.pareto_front, "circle", COLORS["front"]),
        ("feasible", lambda t: t.feasible and t.number not in data.pareto_front, "circle", COLORS["other"]),
        ("infeasible", lambda t: not t.feasible, "x", COLORS["infeasible"]),
    )
    for name, member, symbol, color in groups:
        pts = sorted((t for t in done if member(t)), key=lambda t: t.values[0])
        fig.add_trace(
            go.Scatter(
                x=[t.values[0] * fx for t in pts],
                y=[t.values[1] * fy for t in pts],
                name=name,
                mode="lines+markers" if name.startswith("Pareto") else "markers",
                line={"dash": "dot", "color": color},
                marker={"symbol": symbol, "size": 10, "color": color},
                text=[_hover(t, kx) for t in pts],
                hovertemplate="%{text}<extra></extra>",
            )
        )
    _layout(fig)
    fig.update_xaxes(title_text=tx)
    fig.update_yaxes(title_text=ty)
    text = (
        f"{metric_label(kx)} ({data.directions[0]}) against {metric_label(ky)} ({data.directions[1]}); "
        f"{len(data.pareto_front)} feasible trial(s) on the front: no other feasible trial beats them on both."
    )
    return ReportSection("Pareto front", text, figures=[fig], anchor="pareto")


def distribution_section(data: ReportData) -> ReportSection | None:
    """TTFT and TPOT of the winner against the default: per-request distributions when both
    trials stored their requests' latencies, else the percentile ladder of each."""
    w = data.winner
    if w is None:
        return None
    import plotly.graph_objects as go  # heavy: see history_section
    from plotly.subplots import make_subplots

    winner = next(t for t in data.trials if t.number == w.number)
    default, default_lat = w.default, w.default_latencies
    series = (("ttft", "TTFT"), ("tpot", "TPOT"))
    fig = make_subplots(rows=1, cols=2, subplot_titles=[s for _, s in series])
    configs = [(f"winner (trial {w.number})", w.metrics, winner.latencies, COLORS["winner"])]
    if default:
        configs.append(("default", default, default_lat, COLORS["default"]))
    if all(lat and lat.get("ttft") for _, _, lat, _ in configs) and len(configs) > 1:
        for col, (name, _) in enumerate(series, start=1):
            factor, title = axis_title(f"{name}_max", [v for _, _, lat, _ in configs for v in lat.get(name, [])])
            for label, _, lat, color in configs:
                fig.add_trace(
                    go.Box(
                        y=[v * factor for v in lat.get(name, [])],
                        name=label,
                        marker_color=color,
                        boxpoints="all",
                        jitter=0.4,
                        pointpos=0,
                        showlegend=col == 1,
                    ),
                    row=1,
                    col=col,
                )
            fig.update_yaxes(title_text=title.replace("max ", ""), row=1, col=col)
        text = "Per-request latencies of the winner and the default config, every request a point."
    else:
        for col, (name, _) in enumerate(series, start=1):
            keys = _ladder_keys(name, [m for _, m, _, _ in configs])
            factor, title = axis_title(f"{name}_max", [m.get(k) for _, m, _, _ in configs for k in keys])
            for label, m, _, color in configs:
                fig.add_trace(
                    go.Bar(
                        x=[_ladder_label(k) for k in keys],
                        y=[(m.get(k) or 0) * factor for k in keys],
                        name=label,
                        marker_color=color,
                        showlegend=col == 1,
                        text=[format_value(k, m.get(k)) for k in keys],
                        textposition="outside",
                    ),
                    row=1,
                    col=col,
                )
            fig.update_yaxes(title_text=title.replace("max ", ""), row=1, col=col)
        fig.update_layout(barmode="group")
        text = (
            "Percentiles of TTFT and TPOT, winner against the default config"
            if default
            else "Percentiles of TTFT and TPOT of the winner (the default config was not measured)"
        )
        text += ": the trials stored no per-request latencies to draw whole distributions from."
    _layout(fig, height=400)
    return ReportSection("Latency distributions: winner vs default", text, figures=[fig], anchor="distributions")


def _ladder_keys(name: str, metrics: list[dict]) -> list[str]:
    """'ttft_p50', 'ttft_p90', ..., 'ttft_max': the percentiles any of `metrics` has, in order."""
    ps = sorted(
        {p for m in metrics for k in m if (parsed := parse_metric_key(k)) and parsed[0] == name for p in [parsed[1]]}
    )
    return [metric_key(name, p) for p in ps] + ([f"{name}_max"] if any(f"{name}_max" in m for m in metrics) else [])


def _ladder_label(key: str) -> str:
    return "max" if key.endswith("_max") else key.rsplit("_", 1)[1]


def importance_section(data: ReportData) -> ReportSection:
    """Optuna's parameter importances as bars, or the sentence saying why there are none."""
    if not data.importances:
        return ReportSection("Parameter importances", data.importance_note, anchor="importances")
    import plotly.graph_objects as go  # heavy: see history_section

    items = sorted(data.importances.items(), key=lambda kv: kv[1])
    fig = go.Figure(
        go.Bar(
            x=[v * 100 for _, v in items],
            y=[k for k, _ in items],
            orientation="h",
            text=[f"{v:.0%}" for _, v in items],
            textposition="auto",
            marker_color=COLORS["feasible"],
        )
    )
    _layout(fig, height=max(220, 60 + 40 * len(items)))
    fig.update_xaxes(title_text="importance (%)")
    return ReportSection("Parameter importances", data.importance_note, figures=[fig], anchor="importances")


def builtin_sections(data: ReportData) -> list[ReportSection]:
    return [
        s
        for s in (history_section(data), pareto_section(data), distribution_section(data), importance_section(data))
        if s is not None
    ]


def render_html(data: ReportData, sections: Sequence[ReportSection] = ()) -> str:
    """The page: summary, winner card, built-in and extra sections, the trials table.

    Args:
        data: the facts (slotune/tuner/report/markdown.py: `gather`).
        sections: extra sections, after the built-in ones.
    """
    import jinja2  # heavy: the tuner's dependency, only for report.html
    from plotly.offline import get_plotlyjs

    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(resources.files("slotune.tuner") / "templates")),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    figures = []
    for s in [*builtin_sections(data), *sections]:
        divs = [
            f.to_html(
                full_html=False,
                include_plotlyjs=False,
                div_id=f"fig-{s.id}-{i}",
                config={"displaylogo": False, "responsive": True},
            )
            for i, f in enumerate(s.figures)
        ]
        figures.append((s, divs))
    return env.get_template("report.html.j2").render(
        data=data,
        winner=data.winner,
        sections=figures,
        plotly_js=get_plotlyjs(),
        gates=data.winner.gates_table() if data.winner and data.winner.gates else [],
        trials=data.trials_table(),
        infeasible={t.number for t in data.trials if t.feasible is False},
    )
