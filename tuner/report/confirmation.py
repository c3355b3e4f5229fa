"""The confirmation round and the declaration in words: the report's "Confirmation round" section."""

from __future__ import annotations

from slotune.tuner.decide.aggregate import declared_as
from slotune.tuner.decide.confirm import Confirmation, Measured, judged
from slotune.tuner.measure.units import format_value, metric_label, value_with_ci
from slotune.tuner.report.facts import ReportSection


def _drift_words(c: Confirmation) -> str | None:
    """The default's two measurements in words, when both exist: how much the round drifted."""
    ends = [m.metrics.get(c.key) for m in c.of(None) if m.metrics]
    if len(ends) != 2 or not all(isinstance(v, (int, float)) for v in ends) or not ends[0]:
        return None
    return (
        f"the default measured {format_value(c.key, ends[0])} first and {format_value(c.key, ends[1])} "
        f"last ({ends[1] / ends[0] - 1:+.0%} over the round)"
    )


def confirmation_section(c: Confirmation, trial_values: dict[int, float]) -> ReportSection:
    """The report's section: every measurement of the round with its interval, the winner marked."""
    label = metric_label(c.key)
    rank = {n: i for i, n in enumerate(c.by_trial)}
    if c.is_round:
        feasible = len(c.by_trial) - len(c.near)
        text = (
            f"The best {feasible} feasible trial{'s' if feasible > 1 else ''}"
            + (
                f", and {len(c.near)} that missed the SLO by less than {'its' if len(c.near) == 1 else 'their'} "
                f"own measurement's noise,"
                if c.near
                else ""
            )
            + f" were measured again on workload seed {c.seed}, one after the other, between two "
            f"measurements of the default config, and the winner picked on these numbers (the SLO judged again)."
        )
        text += _near_words(c)
        drift = _drift_words(c)
        if drift:
            text += f" Drift: {drift}."
        if c.passes > 1:
            text += _passes_words(c)
    else:
        text = (
            f"No confirmation round (budget.confirm_top_k: 0): the best trial won on its own measurement "
            f"and was measured once more, alone, on workload seed {c.seed}."
        )
    wins, declared = c.declared_of(c.winner), c.remeasure()
    if wins:
        vals = ", ".join(format_value(c.key, d["metrics"].get(c.key)) for d in wins)
        text += (
            f"\nThe winner was then measured {len(wins)} more time{'s' if len(wins) > 1 else ''} on fresh "
            f"workload seeds ({vals}), each time beside the default; the numbers declared for it are their "
            f"{declared_as(len(wins))} ({format_value(c.key, declared['metrics'].get(c.key))}), "
            f"compared with the default's on the same seeds: the round picked it on its own numbers there, "
            f"which favour it."
        )
        width = declared.get("half_width")
        if width is not None:
            text += f" The 95% interval of their mean (Student's t) is ±{width:.1%} of it"
            if c.declare_precision is None:
                text += "."
            elif width <= c.declare_precision:
                text += f", within the ±{c.declare_precision:.0%} asked (budget.declare_precision)."
            else:
                text += (
                    f", wider than the ±{c.declare_precision:.0%} asked (budget.declare_precision): the "
                    f"measurements stopped at budget.declare_max_repeats; the value is less certain than asked."
                )
        missed = declared.get("missed") or []
        if missed:
            text += (
                f" It missed the SLO on {len(missed)} of those {len(wins)} seeds ("
                + "; ".join(f"seed {m['seed']}: {', '.join(m['reasons'])}" for m in missed)
                + ")."
            )
        if declared["reasons"]:
            text += f" Its declared numbers miss the SLO: {'; '.join(declared['reasons'])}."
    elif c.declared:
        text += (
            f"\nThe declaration measurements of the winner failed ({declared.get('declare_error')}); "
            f"its declared numbers are the round's."
        )
    rivals = c.rivals()
    rival_trials = {m.trial for m in rivals}
    if not c.is_confirmed:
        text += (
            f"\n{'No candidate' if c.is_round else 'The winner'} met the SLO when measured again: the "
            f"winner is trial {c.winner}, the best on its own measurement, unconfirmed."
        )
    elif c.is_round and c.winner != c.by_trial[0]:
        first = c.standing(c.by_trial[0])
        how = (
            "did worse when measured again" + (", but within noise (below)" if first.trial in rival_trials else "")
            if first.feasible
            else "did not qualify when measured again: " + "; ".join(first.reasons)
            if first.metrics is not None
            else f"failed when measured again: {first.error}"
        )
        text += (
            f"\nThe winner, trial {c.winner}, ranked {_ordinal(rank[c.winner] + 1)} on its own trial; "
            f"trial {c.by_trial[0]}, first there, {how}."
        )
    text += _rivals_words(c, rivals)
    rows = [["#", "measured", f"own trial {label}", f"re-measured {label}", "meets the SLO", "winner"]]
    after = [
        (judged(len(c.measured) + i + 1, d, c.limits, c.key), f" (declaration, seed {d['seed']})")
        for i, d in enumerate(c.declared)
    ]
    for m, where in [(m, f" (pass {m.pass_no})" if m.pass_no > 1 else "") for m in c.measured] + after:
        own = (
            "–"
            if m.trial is None
            else format_value(c.key, trial_values.get(m.trial))
            + (" (missed the SLO within noise)" if m.trial in c.near else "")
        )
        again = value_with_ci(m.metrics, c.key) if m.metrics is not None else f"failed: {m.error}"
        ok = "–" if m.metrics is None else ("yes" if m.feasible else "no: " + "; ".join(m.reasons))
        mark = "yes" if m.trial == c.winner else "within noise" if m.trial in rival_trials else ""
        rows.append([str(m.position), m.label + where, own, again, ok, mark])
    return ReportSection("Confirmation round", text, table=rows, anchor="confirmation")


def _near_words(c: Confirmation) -> str:
    """Which candidates entered as near misses, what their own trials missed, and what the round
    asked of them (module docstring)."""
    if not c.near:
        return ""
    parts = [f"trial {n} ({'; '.join(words)})" for n, words in c.near.items()]
    return f" Near misses: {', '.join(parts)}: the interval holds the limit, so the config may meet it. " + (
        "Such a candidate's quality gates were not run on its trial (only SLO-meeting trials run them); "
        "the round ran them, and it can win only if its re-measurement meets the SLO and its gates pass."
        if c.gated
        else "It can win only if its re-measurement meets the SLO."
    )


def _passes_words(c: Confirmation) -> str:
    """What the further passes measured, and each contender's standing over them."""
    again = [n for n in c.by_trial if len(c.of(n)) > 1]
    parts = [
        f"trial {n} {value_with_ci(c.standing(n).metrics, c.key)} over {len(c.of(n))} passes "
        f"({', '.join(format_value(c.key, (m.metrics or {}).get(c.key)) for m in c.of(n))})"
        for n in again
    ]
    return (
        f"\nThe winner's interval overlapped another candidate's, so the winner and the candidates within "
        f"noise of it were measured again on the same seed, in reverse order each pass, {c.passes} passes "
        f"in all (at most budget.confirm_passes), and judged on their mean: {'; '.join(parts)}."
    )


def _rivals_words(c: Confirmation, rivals: list[Measured]) -> str:
    """Say plainly which candidates (`rivals`) the round could not tell from the winner, and how they differ."""
    if not rivals:
        return ""
    mine = value_with_ci(c.standing(c.winner).metrics, c.key)
    parts = []
    for m in rivals:
        diff = c.differences(m.trial)
        parts.append(
            f"trial {m.trial}, {metric_label(c.key)} {value_with_ci(m.metrics, c.key)} against the "
            f"winner's {mine}" + (f", with {', '.join(diff)}" if diff else "")
        )
    over = f" after {c.passes} passes" if c.passes > 1 else ""
    return (
        f"\nWithin noise of the winner in this round{over} (the intervals overlap, and the SLO held): "
        f"{'; '.join(parts)}. The round cannot tell {'it' if len(rivals) == 1 else 'them'} from the winner "
        f"on this machine: the winner's lead is within noise, and the differences listed are not "
        f"shown to matter."
    )


def _ordinal(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"
