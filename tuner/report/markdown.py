"""The study report: facts gathered once from the study (`gather`), rendered twice from them.

`write_report` = gather -> `render_markdown` (report.md, here) and `report_html.render_html`
(report.html: a self-contained page with plotly figures). Both show the same facts in the same
words: numbers with their units (`format_value`: 45.1 ms, 63.9 tok/s, 129 MiB, 100%), infeasible
trials explained by tuner/reasons.py (`slo.judge`'s words and the gates'), and the winner in
one sentence. Other parts of slotune add sections (load curves, ...) as `ReportSection`s passed
to `write_report`; neither renderer changes for them.
"""

from __future__ import annotations

import os
import secrets
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slotune.evals.gate_spec import GateSpec
from slotune.tuner.decide.confirm import declared_as
from slotune.tuner.search.objective import is_screened_out
from slotune.tuner.spec.tuning_spec import COST_METRICS
from slotune.tuner.search.references import DEFAULT_TAG, reference_metrics, reference_results, trial_label
from slotune.tuner.report.reasons import gate_words, infeasible_reasons
from slotune.tuner.report.html import ReportSection, render_html
from slotune.tuner.spec.slo import SLOLimits, judge, metric_key
from slotune.tuner.measure.units import format_value, interval, metric_label, number, overlaps, seeds_words, value_with_ci
from slotune.tuner.spec.workload_spec import describe_replay

MIN_TRIALS_FOR_IMPORTANCE = 4  # fANOVA on fewer complete trials says nothing


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
    metrics: dict[str, Any]
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
    metrics: dict[str, Any]
    references: dict[str, dict | None]  # metrics of the reference configs: default, naive
    default: dict | None  # the default config's metrics
    default_latencies: dict[str, list[float]] | None  # its per-request TTFT/TPOT, when stored

    def gates_table(self) -> list[list[str]]:
        """gate | kind | result in words | unquantized | winner | pass (header first)."""
        rows = [["gate", "kind", "result", "unquantized", "winner", "pass"]]
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
                    ", ".join(f"{k}={v}" for k, v in t.params.items()),
                    t.note,
                ]
            )
        return rows


def _gate_facts(gates: Mapping[str, Any] | None, gate_specs: Sequence[GateSpec]) -> list[GateFacts]:
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


def config_words(params: Mapping[str, Any], default: Mapping[str, Any]) -> str:
    """The knobs where `params` differ from the default config, in words:
    'int8 weights + int8 KV + 2 sequences per step'; 'the default config' when none differ."""
    changed = [(k, v) for k, v in params.items() if default.get(k, object()) != v]
    if not changed:
        return "the default config"
    return " + ".join(_KNOB_WORDS[k](v) if k in _KNOB_WORDS else f"{k}={v}" for k, v in changed)


def _config_value(config: Mapping[str, Any], dotted: str) -> Any:
    v: Any = config
    for part in dotted.split("."):
        if not isinstance(v, Mapping) or part not in v:
            return None
        v = v[part]
    return v


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
    bm: dict,
    default: dict | None,
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


def _noise_note(key: str, direction: str, bm: dict, default: dict | None) -> str | None:
    """Say plainly when the win over the default is small: within noise (intervals overlap) when
    both have intervals; without intervals, only that it is small and unproven."""
    if not default or default.get(key) is None or bm.get(key) is None:
        return None
    a, b = interval(bm, key), interval(default, key)
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


def _attainment(m: Mapping[str, Any]) -> str:
    share, n = m.get("slo_attainment"), m.get("num_requests")
    if share is None:
        return "not measured"
    return format_value("slo_attainment", share) + (
        f" of requests ({share * n:.0f} of {n:.0f})" if n else " of requests"
    )


def _winner(spec, best, remeasure, refs: dict[str, dict | None], default_latencies, limits: SLOLimits) -> WinnerFacts:
    obj = spec.objective
    key, direction = obj.metric_key(), obj.direction()
    bm = best.user_attrs["metrics"]
    rm = (remeasure or {}).get("metrics") or {}
    seed = (remeasure or {}).get("seed", spec.robustness_seed)
    # declared on the declaration measurements' seeds (tuner/confirm.py), else on the round's
    seeds = (remeasure or {}).get("seeds") or [seed]
    on_seeds = f"workload {seeds_words(seeds)}"
    default = refs.get(DEFAULT_TAG)
    # Measured together in the confirmation round (tuner/confirm.py), the winner and the default
    # are compared on those numbers: same seed, same moment; else on their trials.
    rdefault = (remeasure or {}).get("default") or {}
    card, card_default = (rm, rdefault) if rm and rdefault else (bm, default)
    # A near miss (tuner/confirm.py) ran its gates in the confirmation round, not on its trial.
    gates = _gate_facts((remeasure or {}).get("gates") or best.user_attrs.get("gates"), spec.quality_gates)
    base = spec.base_config().model_dump(mode="json")
    defaults = {k: _config_value(base, k) for k in best.params}

    # The default config won: its trial and its measurements in the round are the same config, so
    # the card claims no improvement over it (a ratio between them is the machine's drift).
    is_default = best.user_attrs.get("tag") == DEFAULT_TAG or best.user_attrs.get("config") == base
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
    if (remeasure or {}).get("near"):
        notes.append(
            f"Its own trial missed the SLO, by less than that measurement's noise "
            f"({'; '.join(remeasure['near'])}); so it was measured again in the confirmation round and "
            f"met the SLO there"
            + (", and passed the quality gates run there" if spec.quality_gates else "")
            + " (the confirmation section)."
        )
    noise = None if is_default else _noise_note(key, direction, card, card_default)
    if noise:
        notes.append(noise)
    if rm and card is rm and (remeasure or {}).get("seeds"):
        notes.append(
            f"Declared on {len(seeds)} measurement{'s' if len(seeds) > 1 else ''} after the confirmation "
            f"round, each beside the default config, on {on_seeds}: {metric_label(key)} "
            f"{value_with_ci(rm, key)} (their {declared_as(len(seeds))}; default {value_with_ci(rdefault, key)}"
            + (
                ""
                if (remeasure or {}).get("default_seeds") == seeds
                else f", measured in the round on workload seed {seed}: its declaration measurements failed"
            )
            + "); the comparison above "
            "is on these numbers."
        )
    elif rm and card is rm:
        notes.append(
            f"Measured again on workload seed {seed} in one round with the default config: "
            f"{metric_label(key)} {value_with_ci(rm, key)} (default {value_with_ci(rdefault, key)}); "
            f"the comparison above is on these numbers."
        )
    elif rm:
        notes.append(f"Re-measured on {on_seeds}: {metric_label(key)} {value_with_ci(rm, key)}.")
    elif remeasure and "error" in remeasure:
        notes.append(f"The re-measurement on workload seed {seed} failed: {remeasure['error']}")
    if (remeasure or {}).get("declare_error"):
        notes.append(
            f"The declaration measurements after the round failed ({remeasure['declare_error']}): the "
            f"numbers above are the round's, which picked this config and so favour it."
        )
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
        columns[f"default re-measured ({seeds_words((remeasure or {}).get('default_seeds') or [seed])})"] = rdefault
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

    params = [["parameter", "winner", "default"]] + [[k, str(v), str(defaults.get(k))] for k, v in best.params.items()]
    return WinnerFacts(
        number=best.number,
        config_words=config_words(best.params, defaults),
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


def _importances(study, trials: list[TrialFacts]) -> tuple[dict[str, float] | None, str]:
    done = [t for t in trials if t.state == "COMPLETE" and t.values]
    if len(done) < MIN_TRIALS_FOR_IMPORTANCE:
        return None, (
            f"Parameter importances need at least {MIN_TRIALS_FOR_IMPORTANCE} complete trials; "
            f"this study has {len(done)}."
        )
    import optuna  # heavy: the tuner's own dependency, imported only where a report is written

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            imp = optuna.importance.get_param_importances(study, target=lambda t: t.values[0])
    except Exception as exc:  # a constant space, a single distinct value: no importance to report
        return None, f"Parameter importances could not be computed: {type(exc).__name__}: {exc}"
    if not imp:
        return None, "Parameter importances: no parameter varied across the complete trials."
    return dict(imp), (
        "How much of the variation of the first objective each parameter explains "
        "(Optuna's fANOVA over the complete trials)."
    )


def gather(spec, study, best, remeasure) -> ReportData:
    """The report's facts, read once from the study.

    Args:
        spec: the TuningSpec.
        study: the finished Optuna study (trials with their user attributes).
        best: the winning FrozenTrial, or None when no trial was feasible.
        remeasure: the winner's re-measurement on a fresh workload seed (`metrics` or `error`; with
            `default`, the default config's metrics in the same round: the winner card compares those).
    """
    obj = spec.objective
    limits = SLOLimits.from_objective(obj)
    keys = [obj.metric_key(m) for m in obj.metrics]
    trials = []
    for t in study.trials:
        ua = t.user_attrs
        trials.append(
            TrialFacts(
                number=t.number,
                tag=trial_label(ua),
                state=t.state.name,
                values=tuple(t.values) if t.values else None,
                feasible=ua.get("feasible"),
                params=dict(t.params),
                reasons=[] if ua.get("feasible") else infeasible_reasons(ua, limits, spec.quality_gates),
                early_stopped=bool(ua.get("early_stopped")),
                metrics=dict(ua.get("metrics") or {}),
                latencies=ua.get("latencies") or None,
            )
        )
    states = [t.state for t in trials]
    gates = ", ".join(g.name for g in spec.quality_gates) or "none"
    summary = [
        f"Objective: {obj.direction()} {metric_label(keys[0])}"
        + (f", Pareto with {', '.join(metric_label(k) for k in keys[1:])}" if keys[1:] else "")
        + ".",
        f"SLO: {limits.describe()}; quality gates: {gates}.",
        f"Sampler {spec.sampler}; {len(states)} trials ({states.count('COMPLETE')} complete, "
        f"{states.count('FAIL')} failed, {states.count('PRUNED')} pruned).",
    ]
    if spec.screening.enabled:
        from slotune.tuner.search.screening import screened_in  # optuna: only where a study exists

        out = [t for t in study.trials if is_screened_out(t) and t.user_attrs.get("repeat_of") is None]
        summary.append(
            f"Screening: each searched trial replayed {spec.screening.describe(spec.workload)} first; "
            f"{len(out)} were screened out there (each holding {number(spec.screening.share(spec.workload))} "
            f"of a budget slot), {len(screened_in(study))} passed and were measured in full."
        )
    machines = sorted({t.user_attrs["machine"] for t in study.trials if t.user_attrs.get("machine")})
    if machines:  # a latency is a fact about the machine that measured it
        summary.append(
            f"Measured on {machines[0]}."
            if len(machines) == 1
            else f"Measured on {len(machines)} machines: {'; '.join(machines)}."
        )
    replay = describe_replay(spec.workload)
    if replay is not None:  # a trace workload: which traffic window the numbers are about
        summary.append(f"Traffic: tuned on {replay}.")
    refs = reference_metrics(study)
    winner = (
        _winner(spec, best, remeasure, refs, reference_results(study, "latencies")[DEFAULT_TAG], limits)
        if best is not None
        else None
    )
    front: set[int] = set()
    if len(keys) > 1:
        front = {t.number for t in study.best_trials if t.user_attrs.get("feasible")}
    importances, note = _importances(study, trials)
    closest = _closest(study, trials) if winner is None else ""
    return ReportData(
        name=spec.name,
        objective_keys=keys,
        directions=[obj.direction(m) for m in obj.metrics],
        summary=summary,
        winner=winner,
        trials=trials,
        pareto_front=front,
        importances=importances,
        importance_note=note,
        closest=closest,
        context_keys=[metric_key("ttft", obj.percentile), "output_tokens_per_s"],
    )


def _closest(study, trials: list[TrialFacts]) -> str:
    """The measured trial that missed least (the sum of its relative misses: 0.15 = 15% beyond a limit;
    a failed gate or an early stop counts 1), with its misses in words; "" when nothing was measured."""
    missed = {
        t.number: sum(max(float(v), 0.0) for v in (t.user_attrs.get("violations") or {}).values())
        for t in study.trials
        if t.state.name == "COMPLETE" and t.user_attrs.get("violations")
    }
    if not missed:
        return ""
    number = min(missed, key=lambda n: (missed[n], n))
    facts = next(t for t in trials if t.number == number)
    params = ", ".join(f"{k}={v}" for k, v in facts.params.items()) or "the base config"
    return f"Closest to feasible: trial {number} ({params}): " + "; ".join(facts.reasons or ["no reason stored"]) + "."


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
