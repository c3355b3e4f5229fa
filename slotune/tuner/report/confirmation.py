"""The winner's confirmation in words: the progress lines, best.yaml's header, the report's section
and a shoot-out's comparison of its servers."""

from __future__ import annotations

from slotune.tuner.decide.confirm import FAR_DEFAULT, Confirmation, Run
from slotune.tuner.decide.standings import Standing
from slotune.tuner.measure.units import format_value, metric_label, seeds_words, value_with_ci
from slotune.tuner.report.facts import ReportSection
from slotune.tuner.search.references import DEFAULT_TAG


def _label(trial: int | None) -> str:
    return DEFAULT_TAG if trial is None else f"trial {trial}"


def progress_line(run: Run, i: int, n: int, key: str) -> str:
    """'confirm 3/8: trial 4 on workload seed 1001: tpot_p95 = 16.3 ms'."""
    head = f"confirm {i}/{n}: {_label(run.trial)} on workload seed {run.seed}"
    if run.skipped:
        return f"{head}: skipped, it missed the SLO on an earlier seed"
    if run.metrics is None:
        return f"{head} failed: {run.error}"
    return f"{head}: {key} = {format_value(key, run.metrics.get(key))}" + (
        f" (misses the SLO: {'; '.join(run.missed)})" if run.missed else ""
    )


def best_yaml_header(spec, best, c: Confirmation, declared: dict) -> str:
    """best.yaml's first line: the study, the winner, how it was chosen and its declared value."""
    key = c.key
    if not c.seeds:
        how, again = "unconfirmed: confirm.candidates is 0", ""
    else:
        how = f"{'confirmed' if c.confirmed else 'unconfirmed'} among the best {len(c.candidates)} re-measured"
        value = (declared.get("metrics") or {}).get(key)
        again = f", re-measured on {seeds_words(declared['seeds'] or c.seeds)}: " + (
            f"{value:.6g}" if value is not None else f"failed ({declared.get('error')})"
        )
    if declared.get("reasons"):
        how += "; its declared numbers miss the SLO"
    return (
        f"# slotune best config for study '{spec.name}' (trial {best.number}, {how}); "
        f"{key} = {best.values[0]:.6g}{again}; metrics in best_metrics.json\n"
    )


def confirmation_section(c: Confirmation, trial_values: dict[int, float], study_seed: int) -> ReportSection:
    """The report's section: each candidate and the default on each seed, their medians, the winner."""
    label = metric_label(c.key)
    if not c.seeds:
        text = (
            f"No confirmation (confirm.candidates: 0): trial {c.winner}, the best on its own measurement "
            f"(workload seed {study_seed}), won unconfirmed; its numbers are that trial's."
        )
        return ReportSection("Confirmation", text, anchor="confirmation")
    k = len(c.candidates)
    text = (
        f"The default config and the best {k} feasible trial{'s' if k > 1 else ''} were measured again, each "
        f"started once and replayed on workload {seeds_words(c.seeds)} (the study measured on seed "
        f"{study_seed}). The winner is the candidate with the best median {label} that held the SLO on every "
        f"seed; its declared numbers are that median, beside the default's on the same seeds. A config "
        f"that missed the SLO on a seed was not replayed on the next."
    )
    if len(c.default_seeds) < len(c.seeds):
        text += (
            f" The default, more than {FAR_DEFAULT:g}x worse than the best candidate in the search, was replayed "
            f"on {seeds_words(c.default_seeds)} only: a gap that wide needs no second seed."
        )
    first = c.candidates[0]
    if not c.confirmed:
        text += (
            f"\nNo candidate held the SLO on every seed: the winner is trial {c.winner}, the best on its own "
            f"measurement, unconfirmed."
        )
    elif c.winner != first:
        text += f"\nTrial {c.winner} won; trial {first}, first on its own measurement, {_why_not(c, first)}."
    declared = c.declared()
    if declared.get("reasons"):
        text += f" Its declared numbers miss the SLO: {'; '.join(declared['reasons'])}."
    close = c.within_noise()
    if close:
        mine = value_with_ci(c.median(c.winner), c.key)
        parts = [f"trial {n}, {value_with_ci(c.median(n), c.key)}{_differences(c, n)}" for n in close]
        text += (
            f"\nWithin noise of the winner's {mine} (the intervals overlap, and the SLO held): "
            f"{'; '.join(parts)}. On these seeds this machine cannot tell "
            f"{'it' if len(close) == 1 else 'them'} from the winner."
        )
    rows = [["config", f"own trial {label}", *(f"seed {s}" for s in c.seeds), "median", "held on every seed", "winner"]]
    for n in (*c.candidates, None):
        runs = {r.seed: r for r in c.runs_of(n)}
        cells = [_cell(c, runs.get(s)) for s in c.seeds]
        own = "–" if n is None else format_value(c.key, trial_values.get(n))
        held = "–" if n is None else ("yes" if c.held(n) else "no")
        rows.append([_label(n), own, *cells, value_with_ci(c.median(n), c.key), held, "yes" if n == c.winner else ""])
    return ReportSection("Confirmation", text, table=rows, anchor="confirmation")


def _cell(c: Confirmation, run: Run | None) -> str:
    if run is None:
        return "–"
    if run.skipped:
        return "skipped (missed before)"
    if run.metrics is None:
        return f"failed: {run.error}"
    return format_value(c.key, run.metrics.get(c.key)) + (f" (missed: {'; '.join(run.missed)})" if run.missed else "")


def _why_not(c: Confirmation, trial: int) -> str:
    """Why a candidate did not win, in words."""
    runs = c.runs_of(trial)
    failed = next((r for r in runs if r.metrics is None and not r.skipped), None)
    if failed is not None:
        return f"failed on seed {failed.seed}: {failed.error}"
    missed = [r for r in runs if r.missed]
    if missed:
        return "missed the SLO on " + "; ".join(f"seed {r.seed} ({', '.join(r.missed)})" for r in missed)
    return f"measured {format_value(c.key, (c.median(trial) or {}).get(c.key))} again" + (
        ", within noise (below)" if trial in c.within_noise() else ""
    )


def _differences(c: Confirmation, trial: int) -> str:
    """How `trial`'s params differ from the winner's: ', with quantization int8 (the winner: int4)'; a knob
    only one of them samples (a conditional one) is left out: the knob it depends on differs."""
    mine, theirs = c.params.get(c.winner, {}), c.params.get(trial, {})
    diff = [f"{k} {theirs[k]} (the winner: {mine[k]})" for k in mine if k in theirs and theirs[k] != mine[k]]
    return f", with {', '.join(diff)}" if diff else ""


def shootout_section(table: list[Standing], key: str) -> ReportSection:
    """The report's shoot-out section: each server's best, re-measured beside the others, and its ratio."""
    label = metric_label(key)
    won = table[0]
    text = (
        f"Each server's best candidate was measured in the confirmation beside the others, on the same "
        f"seeds. The best server is {won.server} (trial {won.trial})."
        if won.held
        else "No server's candidate held the SLO on every seed of the confirmation."
    )
    rows = [["server", "best trial", f"median {label}", "held on every seed", "the winner is better by"]]
    for s in table:
        rows.append(
            [
                s.server,
                "–" if s.trial is None else str(s.trial),
                format_value(key, s.value) if s.value is not None else "–",
                "yes" if s.held else "no",
                "–" if s.vs_winner is None else f"{s.vs_winner:.2f}x",
            ]
        )
    return ReportSection("Servers compared", text, rows, anchor="servers")
