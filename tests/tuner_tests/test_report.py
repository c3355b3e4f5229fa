"""The study report's facts and words (slotune/tuner/report/markdown.py, slotune/tuner/measure/units.py, slotune/tuner/measure/reasons.py).

The studies here are real Optuna studies whose trials are added with `optuna.trial.create_trial`
and carry the user attributes slotune/tuner/search/records.py stores (metrics, violations, gates, latencies,
fail reasons): measuring configs whose gates fail, whose TTFT misses the limit and whose metrics
carry uncertainty intervals and costs (not produced by the trial process yet) would take real
engine runs for no more report code covered.
"""

from __future__ import annotations

import html
import re

import optuna
import pytest
from slotune.tuner.measure.units import format_value, metric_label
from slotune.tuner.report.facts import ReportSection
from slotune.tuner.report.gather import gather
from slotune.tuner.report.markdown import write_report
from slotune.tuner.search.trials import best_trial
from slotune.tuner.spec.tuning_spec import TuningSpec

from tests.tuner_tests.conftest import write_spec

GATE = {"name": "agreement", "kind": "agreement", "min_top1": 0.9, "max_mean_kl": 0.1, "limit": 8}
SPACE = {
    "name": "q",
    "knobs": [
        {"name": "quantization", "type": "categorical", "choices": ["none", "int8"]},
        {"name": "kv_dtype", "type": "categorical", "choices": ["auto", "int8"]},
        {"name": "max_num_seqs", "type": "int", "low": 1, "high": 16},
    ],
}
DISTRIBUTIONS = {
    "quantization": optuna.distributions.CategoricalDistribution(["none", "int8"]),
    "kv_dtype": optuna.distributions.CategoricalDistribution(["auto", "int8"]),
    "max_num_seqs": optuna.distributions.IntDistribution(1, 16),
}


@pytest.mark.parametrize(
    ("key", "value", "text"),
    [
        ("tpot_p95", 0.04509, "45.1 ms"),
        ("ttft_p95", 1.4404, "1.44 s"),
        ("ttft_mean", 0.5, "500 ms"),
        ("output_tokens_per_s", 63.88, "63.9 tok/s"),
        ("total_tokens_per_s", 1234.5, "1,234 tok/s"),
        ("goodput_rps", 2.04, "2.04 req/s"),
        ("slo_attainment", 1.0, "100%"),
        ("prefix_cache_hit_rate", 0.4567, "45.7%"),
        ("weight_bytes", 1.35e8, "129 MiB"),
        ("weight_bytes", 5.381e9, "5.01 GiB"),
        ("peak_memory_mb", 1334, "1.3 GiB"),
        ("peak_memory_mb", 512, "512 MiB"),
        ("peak_kv_blocks", 17.0, "17"),
        ("num_requests", 1200.0, "1,200"),
        ("usd_per_1m_output_tokens", 0.1234, "$0.123"),
        ("load_time_s", 12.5, "12.5 s"),
        ("spec_mean_accepted_length", 2.5, "2.5"),
        ("ttft_p95", None, "–"),
    ],
)
def test_values_read_with_their_units(key, value, text):
    assert format_value(key, value) == text


def test_an_interval_is_shown_as_plus_minus_in_the_values_unit():
    assert format_value("tpot_p95", 0.045, (0.042, 0.048)) == "45 ms ± 3"
    assert metric_label("tpot_p95") == "p95 TPOT" and metric_label("ttft_mean") == "mean TTFT"


def measured(tpot, ttft, tput, ci=None, **extra):
    m = {
        "tpot_p50": tpot * 0.9,
        "tpot_p95": tpot,
        "ttft_p50": ttft * 0.6,
        "ttft_p95": ttft,
        "output_tokens_per_s": tput,
        "goodput_rps": tput / 24,
        "slo_attainment": 1.0,
        "num_requests": 8.0,
        "num_completed": 8.0,
        "weight_bytes": 1.35e8,
        **extra,
    }
    if ci:
        m.update(tpot_p95_ci_low=tpot - ci, tpot_p95_ci_high=tpot + ci)
    return m


def gate_report(top1, kl=0.02):
    margin = 0.1
    passed = 1 - top1 <= margin and kl <= GATE["max_mean_kl"]
    reason = (
        f"{'ok' if 1 - top1 <= margin else 'failed'}: top-1 disagreement {1 - top1:.4g} "
        f"{'<=' if 1 - top1 <= margin else '>'} margin 0.1; ok: mean KL {kl:.4g} <= margin 0.1"
    )
    return {
        "passed": passed,
        "gates": [
            {
                "name": "agreement",
                "kind": "agreement",
                "passed": passed,
                "baseline": 1.0,
                "candidate": top1,
                "stderr": 0.01,
                "drop": 1 - top1,
                "reason": reason,
                "metric": "top1",
                "margin": margin,
                "num_items": 8,
                "seconds": 1.0,
                "details": {"top1": top1, "mean_kl": kl},
            }
        ],
    }


def _trial(
    params,
    metrics=None,
    *,
    feasible=True,
    gates=None,
    ttft_violation=0.0,
    tag=None,
    fail_reason=None,
    latencies=None,
    values=None,
):
    ua = {"fail_reason": fail_reason} if fail_reason else {}
    if tag:
        ua["tag"] = tag
    if metrics is not None:
        ua.update(
            metrics=metrics,
            feasible=feasible,
            early_stopped=False,
            violations={
                "ttft": ttft_violation,
                "tpot": 0.0,
                "throughput": 0.0,
                "early_stop": 0.0,
                "quality_gates": 0.0 if gates is None or gates["passed"] else 1.0,
            },
        )
    if gates is not None:
        ua["gates"] = gates
    if latencies is not None:
        ua["latencies"] = latencies
    state = optuna.trial.TrialState.COMPLETE if metrics is not None else optuna.trial.TrialState.FAIL
    if values is None and metrics is not None:
        values = [metrics["tpot_p95"]]
    return optuna.trial.create_trial(
        state=state, params=params, distributions=DISTRIBUTIONS, values=values, user_attrs=ua
    )


def made_study(tmp_path, *, multi=False, default_tpot=0.086, default_ci=0.003, winner_ci=0.003, cost=True):
    """(spec, study): the default config, a winner (int8 weights + int8 KV + 2 sequences per step), a
    trial over the TTFT limit, one failing the agreement gate, a failed trial and one more feasible."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    objective = {"ttft_limit_s": 2.0, "percentile": 95}
    if multi:
        objective["pareto_with"] = ["output_tokens_per_s"]
    spec = TuningSpec.from_yaml(
        write_spec(
            tmp_path,
            objective=objective,
            quality_gates=[GATE],
            search_space=SPACE,
            sampler="nsga2" if multi else "random",
        )
    )
    study = optuna.create_study(
        directions=["minimize", "maximize"] if multi else ["minimize"],
        storage=f"sqlite:///{tmp_path / 'study.db'}",
        study_name="t",
    )
    costs = {"usd_per_1m_output_tokens": 0.12, "usd_per_1m_total_tokens": 0.05} if cost else {}
    lat = {"ttft": [0.4, 0.9, 1.1, 1.3, 1.44], "tpot": [0.038, 0.041, 0.043, 0.045]}
    rows = [
        (
            {"quantization": "none", "kv_dtype": "auto", "max_num_seqs": 16},
            dict(
                metrics=measured(default_tpot, 1.2, 60.4, default_ci, **costs and {k: v * 2 for k, v in costs.items()}),
                gates=gate_report(1.0, 0.0),
                tag="default",
                latencies={"ttft": [0.3, 0.8, 1.0, 1.2], "tpot": [0.07, 0.08, 0.085, 0.086]},
            ),
        ),
        (
            {"quantization": "int8", "kv_dtype": "int8", "max_num_seqs": 2},
            dict(metrics=measured(0.045, 1.44, 63.9, winner_ci, **costs), gates=gate_report(0.956), latencies=lat),
        ),
        (
            {"quantization": "none", "kv_dtype": "auto", "max_num_seqs": 8},
            dict(metrics=measured(0.07, 2.31, 110.0), feasible=False, ttft_violation=0.155),
        ),
        (
            {"quantization": "int8", "kv_dtype": "int8", "max_num_seqs": 1},
            dict(metrics=measured(0.04, 1.1, 30.0), feasible=False, gates=gate_report(0.81)),
        ),
        (
            {"quantization": "int8", "kv_dtype": "auto", "max_num_seqs": 4},
            dict(fail_reason="timeout: trial exceeded budget.trial_timeout_s=120 (during: replay 5/8)"),
        ),
        (
            {"quantization": "int8", "kv_dtype": "auto", "max_num_seqs": 3},
            dict(metrics=measured(0.05, 1.3, 70.0), gates=gate_report(0.97)),
        ),
    ]
    for params, kw in rows:
        if multi and "metrics" in kw:
            kw["values"] = [kw["metrics"]["tpot_p95"], kw["metrics"]["output_tokens_per_s"]]
        study.add_trial(_trial(params, **kw))
    return spec, study


def remeasured(study, spec):
    best = best_trial(study, spec)
    return best, {"seed": 1000, "metrics": measured(0.046, 1.5, 62.0)}


def test_the_winner_is_said_in_words_with_units_limits_and_gates(tmp_path):
    spec, study = made_study(tmp_path)
    best, again = remeasured(study, spec)
    paths = write_report(spec, study, best, again, tmp_path)
    md = paths["md"].read_text()
    assert (
        "Trial 1: int8 weights + int8 KV + 2 sequences per step: p95 TPOT 45 ms ± 3 (default 86 ms ± 3), "
        "1.9x better; p95 TTFT 1.44 s within the 2 s limit; top-1 agreement 0.956 >= 0.9; "
        "mean KL 0.02 <= 0.1 nats."
    ) in md
    assert "- 1.9x improvement over default on p95 TPOT (86 ms -> 45 ms)" in md
    assert "- cost per 1M output tokens: $0.12 (default $0.24)" in md
    assert "Re-measured on workload seed 1000: p95 TPOT 46 ms." in md
    assert "100% of requests (8 of 8) met the per-request limits" in md
    assert "| p95 TTFT | <= 2 s | 1.44 s | yes | 1.5 s | yes |" in md
    assert "| agreement | agreement | top-1 agreement 0.956 >= 0.9; mean KL 0.02 <= 0.1 nats | 1 | 0.956 | yes |" in md
    assert "| weights | 129 MiB |" in md
    assert "within noise" not in md  # 45 ± 3 and 86 ± 3 do not overlap
    rows = {r.split(" | ")[0].strip("| "): r for r in md.splitlines() if re.match(r"\| \d+ \|", r)}
    assert rows["2"].endswith("| p95 TTFT 2.31 s > limit 2 s (+16%) |")
    assert rows["3"].endswith("| gate agreement: top-1 agreement 0.81 < 0.9; mean KL 0.02 <= 0.1 nats |")
    assert rows["4"].endswith("| timeout: trial exceeded budget.trial_timeout_s=120 (during: replay 5/8) |")
    assert "| 1 |  | complete | 45 ms | yes | 1.44 s | 63.9 tok/s |" in rows["1"]
    assert "**" not in md and "`" not in md
    page = paths["html"].read_text()
    text = re.sub(r"<script.*?</script>", "", page, flags=re.S)
    assert "**" not in text and "`" not in text
    assert "gate agreement: top-1 agreement 0.81 &lt; 0.9" in text
    assert "int8 weights + int8 KV + 2 sequences per step" in text


def test_overlapping_intervals_are_called_noise_and_a_small_win_without_them_unproven(tmp_path):
    spec, study = made_study(tmp_path / "a", default_tpot=0.047, default_ci=0.004)
    w = gather(spec, study, *remeasured(study, spec)).winner
    assert any("within noise: the intervals overlap (45 ms ± 3 vs 47 ms ± 4)" in n for n in w.notes)
    spec, study = made_study(tmp_path / "b", default_tpot=0.046, default_ci=None, winner_ci=None, cost=False)
    w = gather(spec, study, *remeasured(study, spec)).winner
    assert any("is small (2%); the measurements carry no uncertainty intervals" in n for n in w.notes)
    assert not any("cost" in n for n in w.notes)
    assert "±" not in w.headline


def test_the_winner_card_compares_the_round_it_was_confirmed_in(tmp_path):
    """With the default re-measured beside it (slotune/tuner/decide/confirm.py), the headline and the noise
    verdict use those numbers, not the trials': here 45 vs 86 ms in the trials, 46 ± 4 vs 48 ± 4 ms
    measured together, which is within noise."""
    spec, study = made_study(tmp_path)
    best = best_trial(study, spec)
    again = {
        "seed": 1000,
        "seeds": [1000],
        "default_seeds": [1000],
        "metrics": measured(0.046, 1.5, 62.0, 0.004, usd_per_1m_output_tokens=0.13),
        "default": measured(0.048, 1.3, 61.0, 0.004, usd_per_1m_output_tokens=0.14),
    }
    w = gather(spec, study, best, again).winner
    assert w.claims[0] == "p95 TPOT 46 ms ± 4 (default 48 ms ± 4), 1.04x better"
    assert any("within noise: the intervals overlap (46 ms ± 4 vs 48 ms ± 4)" in n for n in w.notes)
    assert any(
        n.startswith(
            "Declared on 1 measurement in the confirmation, each beside the default config, on workload seed 1000"
        )
        for n in w.notes
    )
    assert "cost per 1M output tokens: $0.13 (default $0.14)" in w.notes
    assert not any("interval is ±" in n for n in w.notes)  # ± 4 on 46 ms: within 10%, no note
    assert w.comparison[0][-1] == "default re-measured (seed 1000)" and w.comparison[1][-1] == "48 ms ± 4"
    # without the default measured beside it, the trials are compared
    w = gather(spec, study, best, {"seed": 1000, "metrics": again["metrics"], "default": None}).winner
    assert w.claims[0].startswith("p95 TPOT 45 ms ± 3 (default 86 ms ± 3)")


def test_importances_and_the_pareto_front_are_gathered_or_explained(tmp_path):
    spec, study = made_study(tmp_path, multi=True)
    data = gather(spec, study, *remeasured(study, spec))
    assert data.objective_keys == ["tpot_p95", "output_tokens_per_s"]
    assert data.pareto_front == {1, 5}  # feasible: 0 (86 ms, 60), 1 (45 ms, 63.9), 5 (50 ms, 70)
    assert set(data.importances) == {"quantization", "kv_dtype", "max_num_seqs"}
    few = optuna.create_study(storage=f"sqlite:///{tmp_path / 'few.db'}", study_name="t")
    few.add_trial(
        _trial(
            {"quantization": "int8", "kv_dtype": "int8", "max_num_seqs": 2},
            measured(0.045, 1.44, 63.9),
            gates=gate_report(0.956),
        )
    )
    (tmp_path / "few").mkdir()
    one = TuningSpec.from_yaml(write_spec(tmp_path / "few", quality_gates=[GATE], search_space=SPACE))
    data = gather(one, few, best_trial(few, one), None)
    assert data.importances is None and "need at least 4 complete trials; this study has 1" in data.importance_note


def test_extra_sections_plug_into_both_reports(tmp_path):
    """A part that adds a section (load curves) hands it to write_report; neither renderer changes."""
    import plotly.graph_objects as go

    spec, study = made_study(tmp_path)
    curve = go.Figure(go.Scatter(x=[1, 2, 4], y=[45, 52, 80]))
    section = ReportSection(
        "Load curve", "p95 TPOT against offered load.", table=[["rps", "p95 TPOT"], ["1", "45 ms"]], figures=[curve]
    )
    paths = write_report(spec, study, *remeasured(study, spec), tmp_path, sections=[section])
    md = paths["md"].read_text()
    assert (
        "## Load curve\n\np95 TPOT against offered load.\n\n| rps | p95 TPOT |" in md
        and "(1 figure in report.html)" in md
    )
    page = paths["html"].read_text()
    assert '<section id="load-curve"' in page and 'id="fig-load-curve-0"' in page


def test_no_feasible_trial_says_why_for_each(tmp_path):
    spec, study = made_study(tmp_path)
    infeasible = optuna.create_study(storage=f"sqlite:///{tmp_path / 'none.db'}", study_name="t")
    for t in study.trials:
        if not t.user_attrs.get("feasible"):
            infeasible.add_trial(
                _trial(
                    t.params,
                    t.user_attrs.get("metrics"),
                    feasible=False,
                    gates=t.user_attrs.get("gates"),
                    fail_reason=t.user_attrs.get("fail_reason"),
                    ttft_violation=(t.user_attrs.get("violations") or {}).get("ttft", 0.0),
                )
            )
    paths = write_report(spec, infeasible, None, None, tmp_path)
    md = paths["md"].read_text()
    assert "## No feasible trial" in md and "## Winner" not in md
    assert "p95 TTFT 2.31 s > limit 2 s" in md and "gate agreement: top-1 agreement 0.81 < 0.9" in md
    assert "No feasible trial" in paths["html"].read_text()
    # the nearest miss is named with what it missed and by how much (15% over a limit beats a failed gate)
    closest = next(line for line in md.splitlines() if line.startswith("Closest to feasible: trial"))
    assert "p95 TTFT 2.31 s > limit 2 s (+16%)" in closest and "gate" not in closest
    assert html.escape(closest, quote=False) in paths["html"].read_text()


def test_a_default_that_wins_claims_no_improvement_over_itself(tmp_path):
    """The default config won (a slow default, 20 ms p95 TPOT, beats every searched trial): measured again
    in the round beside its own second measurement, a ratio between them would only be the machine's drift,
    so the card says it is the default and claims no improvement over it; the naive config still counts."""
    spec, study = made_study(tmp_path, default_tpot=0.02)
    default_trial = study.trials[0]
    again = {"seed": 1000, "metrics": measured(0.03, 1.2, 60.0), "default": measured(0.06, 1.2, 60.0)}
    md = write_report(spec, study, default_trial, again, tmp_path)["md"].read_text()
    card = next(line for line in md.splitlines() if line.startswith("Trial 0:"))
    assert "the default config itself; no searched config beat it" in card and "better" not in card
    assert "improvement over default" not in md and "within noise" not in md
