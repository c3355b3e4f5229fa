"""The winner's card: its declared numbers against the default and naive configs, in words and units."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from slotune.tuner.measure.measurement import Measurement
from slotune.tuner.measure.units import (
    format_value,
    metric_label,
    number,
    overlaps,
    seeds_words,
    value_with_ci,
)
from slotune.tuner.report.facts import GateFacts, WinnerFacts, gate_facts
from slotune.tuner.search.records import TrialRecord
from slotune.tuner.search.references import DEFAULT_TAG
from slotune.tuner.spec.slo import SLOLimits, judge, metric_key
from slotune.tuner.spec.tuning_spec import COST_METRICS

_KNOB_WORDS = {
    "quantization": lambda v: "unquantized weights" if v == "none" else f"{v} weights",
    "kv_dtype": lambda v: "model-dtype KV" if v == "auto" else f"{v} KV",
    "dtype": lambda v: "model dtype" if v == "auto" else f"{v} compute",
    "max_num_seqs": lambda v: f"{v} sequence{'s' if v != 1 else ''} per step",
    "max_num_batched_tokens": lambda v: f"{v} tokens per step",
    "enable_prefix_caching": lambda v: "prefix caching" if v else "no prefix caching",
    "scheduling": lambda v: "static batches" if v == "static" else f"{v} scheduling",
    "scheduling_policy": lambda v: f"{str(v).replace('_', '-')} scheduling",
    "speculative.method": lambda v: "no speculation" if v == "none" else f"{str(v).replace('_', '-')} speculation",
    "speculative.num_speculative_tokens": lambda v: f"{v} draft tokens",
}
WIDE = 0.10  # a declared value whose interval reaches further than this share of it gets a note


def config_words(params: Mapping[str, Any], default: Mapping[str, Any]) -> str:
    """The knobs where `params` differ from the default config, in words:
    'int8 weights + int8 KV + 2 sequences per step'; 'the default config' when none differ."""
    changed = [(k, v) for k, v in params.items() if default.get(k, object()) != v]
    if not changed:
        return "the default config"
    return " + ".join(_KNOB_WORDS[k](v) if k in _KNOB_WORDS else f"{k}={v}" for k, v in changed)


def _default_value(base, name: str) -> Any:
    """A knob's value in the study's base config; None for a name it no longer has (an older study)."""
    try:
        return base.value_at(name)
    except (AttributeError, KeyError):
        return None


def _ratio(winner: float, ref: float, direction: str) -> float | None:
    """How many times better the winner is (> 1: better), or None when undefined."""
    if not winner or not ref:
        return None
    return ref / winner if direction == "minimize" else winner / ref


def _times(r: float) -> str:
    """1.9x, 2.45x -> '2.5x': two significant digits, as a reader compares them; three below 1.1x,
    where two would print a small win or loss (1.04x, 0.97x) as '1x'."""
    return f"{number(r, 3 if 0.9 < r < 1.1 else 2)}x"


def _claims(
    key: str,
    direction: str,
    bm: Measurement,
    default: Measurement | None,
    limits: SLOLimits,
    gates: list[GateFacts],
    is_default: bool = False,
) -> list[str]:
    first = f"{metric_label(key)} {value_with_ci(bm, key)}"
    r = _ratio(bm.get(key), (default or {}).get(key), direction)
    if is_default:  # compared with itself, a ratio would only measure the machine's drift
        first += ": the default config itself; no searched config beat it"
    elif r is not None:
        misses = "" if judge(default, limits).passed else ", which misses the SLO"
        first += f" (default {value_with_ci(default, key)}{misses}), {_times(r)} {'better' if r >= 1 else 'worse'}"
    out = [first]
    for c in judge(bm, limits).checks:
        if c.key == key or c.value is None:
            continue
        limit = format_value(c.key, c.limit)
        if c.name == "throughput":
            out.append(
                f"{c.label} {format_value(c.key, c.value)} {'above' if c.passed else 'below'} the {limit} minimum"
            )
        else:
            out.append(f"{c.label} {format_value(c.key, c.value)} {'within' if c.passed else 'over'} the {limit} limit")
    out += [g.words for g in gates]
    return out


def _noise_note(key: str, direction: str, bm: Measurement, default: Measurement | None) -> str | None:
    """Say plainly when the win over the default is small: within noise (intervals overlap) when
    both have intervals; without intervals, only that it is small and unproven."""
    if not default or default.get(key) is None or bm.get(key) is None:
        return None
    a, b = bm.interval(key), default.interval(key)
    if a is not None and b is not None:
        if overlaps(a, b):
            return (
                f"The improvement over the default on {metric_label(key)} is within noise: the intervals "
                f"overlap ({value_with_ci(bm, key)} vs {value_with_ci(default, key)})."
            )
        return None
    r = _ratio(bm[key], default[key], direction)
    if r is not None and 1 <= r < 1.05:
        return (
            f"The improvement over the default on {metric_label(key)} is small ({r - 1:.0%}); the measurements "
            f"carry no uncertainty intervals, so whether it is more than noise is unknown."
        )
    return None


def _wide_note(workload, m: Measurement, key: str) -> str | None:
    """Say when the declared value's interval reaches further than WIDE of it either way, and the lever:
    longer replays (docs/design/confirmation.md, Known limits)."""
    ci, v = m.interval(key), m.get(key)
    if ci is None or not v:
        return None
    half = round(100 * (ci[1] - ci[0]) / 2 / abs(v))  # in whole percent, as the note shows it
    if half <= 100 * WIDE:
        return None
    if workload.trace is None and workload.duration_s is None:
        lever = f"each replay sends {workload.num_requests} requests, and more (workload.num_requests) narrow it"
    elif workload.trace is None and workload.num_requests is None:
        lever = f"each replay lasts {number(workload.duration_s)} s, and longer ones (workload.duration_s) narrow it"
    else:
        lever = "longer replays narrow it"
    return f"The declared {metric_label(key)}'s interval is ±{half}% of it: {lever}."


def _attainment(m: Mapping[str, Any]) -> str:
    share, n = m.get("slo_attainment"), m.get("num_requests")
    if share is None:
        return "not measured"
    return format_value("slo_attainment", share) + (
        f" of requests ({share * n:.0f} of {n:.0f})" if n else " of requests"
    )


def winner_facts(
    spec, best, remeasure, refs: dict[str, Measurement | None], default_latencies, limits: SLOLimits
) -> WinnerFacts:
    obj = spec.objective
    key, direction = obj.metric_key(), obj.direction()
    best = TrialRecord.of(best)
    bm = best.metrics or Measurement()
    rm = Measurement.from_dict((remeasure or {}).get("metrics"))
    seeds = (remeasure or {}).get("seeds") or [
        spec.robustness_seed
    ]  # the confirmation's (slotune/tuner/decide/confirm.py)
    on_seeds = f"workload {seeds_words(seeds)}"
    default = refs.get(DEFAULT_TAG)
    # Measured beside each other in the confirmation, the winner and the default are compared on
    # those numbers: same seeds, same minutes; else on their trials.
    rdefault = Measurement.from_dict((remeasure or {}).get("default"))
    card, card_default = (rm, rdefault) if rm and rdefault else (bm, default)
    gates = gate_facts(best.gates, spec.quality_gates)
    base_config = spec.base_config()
    base = base_config.model_dump(mode="json")
    defaults = {k: _default_value(base_config, k) for k in best.params}
    # a server flag left off (None) is the engine's own default, not a change
    shown = {k: defaults[k] if v is None else v for k, v in best.params.items()}

    # The default config won: its trial and its confirmation measurements are the same config, so
    # the card claims no improvement over it (a ratio between them is the machine's drift).
    is_default = best.tag == DEFAULT_TAG or best.config == base
    notes = []
    for name, m in refs.items():
        if is_default and name == DEFAULT_TAG:
            continue
        r = _ratio(bm.get(key), (m or {}).get(key), direction)
        if r is not None:
            notes.append(
                f"{_times(r)} improvement over {name} on {metric_label(key)} "
                f"({format_value(key, m[key])} -> {format_value(key, bm[key])})"
            )
    noise = None if is_default else _noise_note(key, direction, card, card_default)
    if noise:
        notes.append(noise)
    if rm and card is rm:
        default_seeds = (remeasure or {}).get("default_seeds") or seeds
        where = (
            f"each beside the default config, on {on_seeds}"
            if default_seeds == seeds
            else f"on {on_seeds} (the default config beside it on {seeds_words(default_seeds)})"
        )
        notes.append(
            f"Declared on {len(seeds)} measurement{'s' if len(seeds) > 1 else ''} in the confirmation, {where}: "
            f"{metric_label(key)} {value_with_ci(rm, key)} ("
            + ("their median; " if len(seeds) > 1 else "")
            + f"default {value_with_ci(rdefault, key)}"
            + "); the comparison above is on these numbers."
        )
        wide = _wide_note(spec.workload, rm, key)
        if wide:
            notes.append(wide)
    elif rm:
        notes.append(f"Re-measured on {on_seeds}: {metric_label(key)} {value_with_ci(rm, key)}.")
    elif remeasure and "error" in remeasure:
        notes.append(f"The re-measurement on {on_seeds} failed: {remeasure['error']}")
    if (remeasure or {}).get("reasons"):
        notes.append(f"Its declared numbers miss the SLO: {'; '.join(remeasure['reasons'])}.")
    for k in COST_METRICS:
        if card.get(k) is not None:
            d = (card_default or {}).get(k)
            notes.append(
                f"{metric_label(k)}: {value_with_ci(card, k)}"
                + (f" (default {value_with_ci(card_default, k)})" if d is not None else "")
            )

    keys = dict.fromkeys(
        (
            key,
            *(obj.metric_key(m) for m in obj.pareto_with),
            metric_key("ttft", 50),
            metric_key("ttft", obj.percentile),
            metric_key("tpot", 50),
            metric_key("tpot", obj.percentile),
            "output_tokens_per_s",
            "goodput_rps",
            "slo_attainment",
            *COST_METRICS,
            "weight_bytes",
            "peak_kv_blocks",
            "peak_memory_mb",
        )
    )
    columns = {"winner": bm, f"re-measured ({seeds_words(seeds)})": rm, **refs}
    if rdefault:
        columns[f"default re-measured ({seeds_words((remeasure or {}).get('default_seeds') or seeds)})"] = rdefault
    comparison = [["metric", *columns]]
    for k in keys:
        row = [value_with_ci(m, k) if m else "–" for m in columns.values()]
        if any(c != "–" for c in row):
            comparison.append([metric_label(k), *row])

    slo = [["check", "limit", "winner", "pass", "re-measured", "pass"]]
    again = {c.key: c for c in judge(rm, limits).checks} if rm else {}
    for c in judge(bm, limits).checks:
        r = again.get(c.key)
        slo.append(
            [
                c.label,
                f"{'>=' if c.name == 'throughput' else '<='} {format_value(c.key, c.limit)}",
                format_value(c.key, c.value),
                "yes" if c.passed else "no",
                format_value(c.key, r.value) if r else "–",
                ("yes" if r.passed else "no") if r else "–",
            ]
        )
    attainment = f"{_attainment(bm)} met the per-request limits"
    if rm:
        attainment += f"; re-measured: {_attainment(rm)}"

    params = [["parameter", "winner", "default"]] + [[k, str(v), str(defaults.get(k))] for k, v in shown.items()]
    return WinnerFacts(
        number=best.number,
        config_words=config_words(shown, defaults),
        claims=_claims(key, direction, card, card_default, limits, gates, is_default),
        notes=notes,
        comparison=comparison,
        attainment=attainment + ".",
        slo=slo,
        gates=gates,
        params=params,
        metrics=bm,
        references=refs,
        default=default,
        default_latencies=default_latencies,
    )
