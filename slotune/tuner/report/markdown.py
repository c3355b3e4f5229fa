"""The study report: facts gathered once from the study (`gather`), rendered twice from them.

`write_report` = gather -> `render_markdown` (report.md, here) and `html.render_html`
(report.html: a self-contained page with plotly figures). Both show the same facts in the same
words: numbers with their units (`format_value`: 45.1 ms, 63.9 tok/s, 129 MiB, 100%), infeasible
trials explained by slotune/tuner/measure/reasons.py (`slo.judge`'s words and the gates'), and the winner in
one sentence. Other parts of slotune add sections (load curves, ...) as `ReportSection`s passed
to `write_report`; neither renderer changes for them.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Sequence
from pathlib import Path

from slotune.tuner.report.facts import ReportData, ReportSection
from slotune.tuner.report.gather import gather
from slotune.tuner.report.html import render_html


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
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise OSError(exc.errno, f"{exc.strerror or exc}: could not write {path}") from exc
        raise


# --- the facts -------------------------------------------------------------------------------


# --- markdown --------------------------------------------------------------------------------


def _md_cell(text: str) -> str:
    return str(text).replace("|", "/").replace("\n", " ")


def _md_table(rows: Sequence[Sequence[str]]) -> list[str]:
    if not rows:
        return []
    head, *body = rows
    return (
        ["| " + " | ".join(map(_md_cell, head)) + " |", "|" + "---|" * len(head)]
        + ["| " + " | ".join(map(_md_cell, r)) + " |" for r in body]
        + [""]
    )


def render_markdown(data: ReportData, sections: Sequence[ReportSection] = ()) -> str:
    """report.md: the same facts as report.html, as plain markdown (the plots are named, not drawn)."""
    lines = [
        f"# slotune study report: {data.name}",
        "",
        *data.summary,
        "",
        "Plots (optimization history, distributions, importances"
        + (", Pareto front" if data.is_multi_objective else "")
        + "): report.html beside this file.",
        "",
    ]
    w = data.winner
    if w is not None:
        lines += ["## Winner", "", f"Trial {w.number}: {w.headline}.", ""]
        lines += [f"- {n}" for n in w.notes] + [""]
        lines += _md_table(w.comparison)
        lines += ["## SLO attainment of the winner", "", w.attainment, ""] + _md_table(w.slo)
        if w.gates:
            lines += ["## Quality gates of the winner", ""] + _md_table(w.gates_table())
        lines += ["## Parameters of the winner", ""] + _md_table(w.params)
    else:
        lines += [
            "## No feasible trial",
            "",
            "No trial met the SLO and the quality gates; the trials table says why.",
            "",
        ]
        if data.closest:
            lines += [data.closest, ""]
    lines += ["## Parameter importances", ""]
    if data.importances:
        lines += [data.importance_note, ""] + [f"- {k}: {v:.0%}" for k, v in data.importances.items()] + [""]
    else:
        lines += [data.importance_note, ""]
    lines += ["## Trials", ""] + _md_table(data.trials_table())
    for s in sections:
        lines += [f"## {s.title}", ""] + [ln for line in s.text.splitlines() if line for ln in (line, "")]
        lines += _md_table(s.table)
        if s.figures:
            lines += [f"({len(s.figures)} figure{'s' if len(s.figures) > 1 else ''} in report.html)", ""]
    return "\n".join(lines).rstrip() + "\n"


def write_report(spec, study, best, remeasure, out: Path, sections: Sequence[ReportSection] = ()) -> dict[str, Path]:
    """Write report.md and report.html into `out`.

    Args:
        spec, study, best, remeasure: as for `gather`.
        out: output directory.
        sections: extra sections (load curves, ...), after the built-in ones in both files.

    Returns:
        Paths written: {"md", "html"}.
    """
    data = gather(spec, study, best, remeasure)
    md, page = render_markdown(data, sections), render_html(data, sections)
    paths = {"md": Path(out) / "report.md", "html": Path(out) / "report.html"}
    write_atomic(paths["md"], md)  # first: the shorter file, so a full disk is named on it
    write_atomic(paths["html"], page)
    return paths
