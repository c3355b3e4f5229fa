"""The report's data: what `gather` collects from a study, and the sections every renderer (markdown, HTML) draws."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from slotune.evals.gate_spec import GateSpec
from slotune.tuner.measure.measurement import Measurement
from slotune.tuner.measure.reasons import gate_words
from slotune.tuner.measure.units import (
    format_params,
    format_value,
    metric_label,
    number,
)


@dataclass(frozen=True)
class TrialFacts:
    """One trial as the report shows it; `values` and `metrics` raw, for the plots."""

    number: int
    tag: str
    state: str  # COMPLETE | FAIL | PRUNED | RUNNING | WAITING
    values: tuple[float, ...] | None
    feasible: bool | None
    params: dict[str, Any]
    reasons: list[str]  # why it cannot win, in words ([] for a feasible trial)
    early_stopped: bool
    metrics: Measurement
    latencies: dict[str, list[float]] | None  # per-request TTFT/TPOT in seconds, when stored

    @property
    def note(self) -> str:
        return "; ".join((["early-stopped"] if self.early_stopped else []) + self.reasons)


@dataclass(frozen=True)
class GateFacts:
    name: str
    kind: str
    metric: str
    baseline: float | None
    candidate: float | None
    passed: bool
    words: str  # 'top-1 agreement 0.956 >= 0.9'


@dataclass(frozen=True)
class WinnerFacts:
    """The winning trial against the default and naive configs."""

    number: int
    config_words: str  # 'int8 weights + int8 KV + 2 sequences per step'
    claims: list[str]  # 'p95 TPOT 45 ms (default 86 ms), 1.9x better', 'p95 TTFT 1.44 s within the 2 s limit', ...
    notes: list[str]  # improvements, noise, re-measurement, cost
    comparison: list[list[str]]  # metric | winner | re-measured | default | naive (header first)
    attainment: str  # '100% of requests (8 of 8) met the per-request limits'
    slo: list[list[str]]  # check | limit | winner | pass | re-measured | pass (header first)
    gates: list[GateFacts]
    params: list[list[str]]  # parameter | winner | default (header first)
    metrics: Measurement
    references: dict[str, Measurement | None]  # metrics of the reference configs: default, naive
    default: Measurement | None  # the default config's metrics
    default_latencies: dict[str, list[float]] | None  # its per-request TTFT/TPOT, when stored

    def gates_table(self) -> list[list[str]]:
        """gate | kind | result in words | reference | winner | pass (header first). The reference is the
        unquantized model, or for an external server its default launch."""
        rows = [["gate", "kind", "result", "reference", "winner", "pass"]]
        for g in self.gates:
            rows.append(
                [
                    g.name,
                    g.kind,
                    g.words,
                    "–" if g.baseline is None else number(g.baseline),
                    "–" if g.candidate is None else number(g.candidate),
                    "yes" if g.passed else "no",
                ]
            )
        return rows

    @property
    def headline(self) -> str:
        return f"{self.config_words}: " + "; ".join(self.claims)


@dataclass(frozen=True)
class ReportData:
    """Everything the report says, gathered once from the study (`gather`)."""

    name: str
    objective_keys: list[str]  # first = the one the winner is chosen on
    directions: list[str]
    summary: list[str]  # objective, SLO and gates, sampler and trial counts, traffic
    winner: WinnerFacts | None
    trials: list[TrialFacts]
    pareto_front: set[int]
    importances: dict[str, float] | None
    importance_note: str
    context_keys: list[str]  # shown beside the objective in the trials table: pXX TTFT, output tokens/s
    closest: str = ""  # with no winner: the measured trial nearest to feasible and what it missed, in words

    @property
    def is_multi_objective(self) -> bool:
        return len(self.objective_keys) > 1

    def trials_table(self) -> list[list[str]]:
        """# | tag | state | objective value(s) | feasible | context metrics | parameters | why not feasible."""
        extra = [k for k in self.context_keys if k not in self.objective_keys]
        rows = [
            [
                "#",
                "tag",
                "state",
                *(metric_label(k) for k in self.objective_keys),
                "feasible",
                *(metric_label(k) for k in extra),
                "parameters",
                "why not feasible",
            ]
        ]
        for t in self.trials:
            vals = [
                format_value(k, t.values[i]) if t.values and i < len(t.values) else "–"
                for i, k in enumerate(self.objective_keys)
            ]
            feasible = "–" if t.feasible is None else ("yes" if t.feasible else "no")
            rows.append(
                [
                    str(t.number),
                    t.tag,
                    t.state.lower(),
                    *vals,
                    feasible,
                    *(format_value(k, t.metrics.get(k)) for k in extra),
                    format_params(t.params),
                    t.note,
                ]
            )
        return rows


@dataclass(frozen=True)
class ReportSection:
    """A section of both reports: a title, text, a table, plotly figures.

    The built-in plots are sections, and so is anything another part adds (`write_report(...,
    sections=[...])`): both renderers lay out every section the same way.

    Attributes:
        title: the heading.
        text: plain text; each line a paragraph.
        table: rows of cells, the header first (empty: none).
        figures: plotly figures (`plotly.graph_objects.Figure`); drawn in report.html, counted in report.md.
        anchor: the HTML id of the section (default: from the title).
    """

    title: str
    text: str = ""
    table: Sequence[Sequence[str]] = ()
    figures: Sequence[Any] = ()
    anchor: str = ""

    @property
    def id(self) -> str:
        return self.anchor or re.sub(r"[^a-z0-9]+", "-", self.title.lower()).strip("-")


def gate_facts(gates: Mapping[str, Any] | None, gate_specs: Sequence[GateSpec]) -> list[GateFacts]:
    specs = {g.name: g for g in gate_specs}
    return [
        GateFacts(
            g["name"],
            g.get("kind", ""),
            g.get("metric", ""),
            g.get("baseline"),
            g.get("candidate"),
            bool(g.get("passed")),
            gate_words(g, specs.get(g["name"])),
        )
        for g in (gates or {}).get("gates", [])
    ]
