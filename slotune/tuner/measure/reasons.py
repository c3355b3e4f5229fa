"""Quality gate results in words (`gate_words`, `failed_gates`): a trial's judgement and the report."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from slotune.evals.gate_spec import GateSpec

GATE_METRIC_WORDS = {
    "top1": "top-1 agreement",
    "match": "greedy match",
    "acc": "accuracy",
    "acc_norm": "normalized accuracy",
    "exact_match": "exact match",
    "word_perplexity": "word perplexity",
    "byte_perplexity": "byte perplexity",
}


def _num(v: float) -> str:
    return f"{v:.3g}"


def gate_words(result: Mapping[str, Any], spec: GateSpec | None = None) -> str:
    """One gate's outcome as a comparison, without its name.

    Args:
        result: a `GateResult` as a dict (slotune/evals/gate_spec.py `GateReport.to_dict()["gates"][i]`).
        spec: the gate of the tuning spec (`quality_gates[i]`), for limits the result
            does not carry (an agreement gate's `max_mean_kl`) and the decision rule (`mode`).

    Returns:
        'top-1 agreement 0.956 >= 0.9', 'accuracy 0.41 vs 0.47 unquantized: drop 0.06 > allowed 0.05',
        or the gate's own reason when it errored or decides by a confidence bound.
    """
    reason = str(result.get("reason") or "")
    cand, margin = result.get("candidate"), result.get("margin")
    metric = str(result.get("metric") or "")
    what = GATE_METRIC_WORDS.get(metric, metric or "metric")
    if cand is None or reason.startswith("error"):
        return reason or "not evaluated"
    if (
        spec is not None and spec.mode == "non_inferiority"
    ):  # passed or failed on a confidence bound: its own words say how
        return f"{what} {_num(cand)} ({reason.removeprefix('ok: ').removeprefix('failed: ')})"
    parts = []
    if result.get("kind") == "greedy_match" and margin is not None:
        floor = 1 - float(margin)
        return (
            f"{what} {_num(cand)} {'>=' if cand >= floor - 1e-12 else '<'} {floor:.3g} of the default launch's answers"
        )
    if result.get("kind") == "agreement":
        if margin is not None:
            floor = 1 - float(margin)
            parts.append(f"{what} {_num(cand)} {'>=' if cand >= floor - 1e-12 else '<'} {floor:.3g}")
        kl, max_kl = (result.get("details") or {}).get("mean_kl"), (spec.max_mean_kl if spec is not None else None)
        if kl is not None and max_kl is not None:
            parts.append(f"mean KL {_num(kl)} {'<=' if kl <= max_kl else '>'} {max_kl:g} nats")
        return "; ".join(parts) or reason
    base, drop = result.get("baseline"), result.get("drop")
    if base is None or drop is None or margin is None:
        return reason
    change = "increase" if result.get("kind") == "perplexity" else "drop"
    return (
        f"{what} {_num(cand)} vs {_num(base)} unquantized: {change} {_num(drop)} "
        f"{'<=' if drop <= margin else '>'} allowed {_num(margin)}"
    )


def failed_gates(gates: Mapping[str, Any] | None, gate_specs: Iterable[GateSpec] = ()) -> list[str]:
    """'gate NAME: words' for each failed gate of a trial's stored gate report."""
    specs = {g.name: g for g in gate_specs}
    return [
        f"gate {g['name']}: {gate_words(g, specs.get(g['name']))}"
        for g in (gates or {}).get("gates", [])
        if not g.get("passed")
    ]
