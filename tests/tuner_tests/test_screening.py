"""Multi-fidelity screening (spec `screening`, slotune/tuner/search/objective.py `TrialObjective._screen`): a short replay
first, the full replay only for configs Optuna's pruner finds promising.

Study-mechanics tests measure with the stand-in trial process (fake_trials:
tests/tuner_tests/fake_trial_runner.py, numbers a function of the config; its `workload_requests`
metric says how many requests it was asked to replay). The last test runs the real engine.
"""

from __future__ import annotations

import optuna
import pytest
from pydantic import ValidationError
from slotune.tuner.run import run_command
from slotune.tuner.search.trials import budget_share, is_measured, is_screened_out
from slotune.tuner.spec.tuning_spec import TuningSpec

from tests.tuner_tests.conftest import write_spec

SPACE = {
    "name": "s",
    "knobs": [
        {"name": "max_num_seqs", "type": "int", "low": 1, "high": 16},
        {"name": "quantization", "type": "categorical", "choices": ["none", "int8"]},
    ],
    # enqueued in this order after the default: the best config first, then three worse ones
    "starts": [
        {
            "name": f"s{i}",
            "why": "test order",
            "objectives": ["latency"],
            "params": {"max_num_seqs": n, "quantization": q},
        }
        for i, (n, q) in enumerate([(1, "int8"), (8, "none"), (4, "none"), (2, "int8")])
    ],
}
WORKLOAD = {"num_requests": 8, "concurrency": 2}
SCREENING = {"enabled": True, "fraction": 0.25, "min_requests": 2, "n_startup_trials": 1}


def _study(out):
    return optuna.load_study(study_name="t", storage=f"sqlite:///{out / 'study.db'}")


def test_configs_worse_than_the_median_on_the_short_replay_are_screened_out(tmp_path, fake_trials):
    """Budget 4 slots. (1, int8) passes screening (no trial measured in full yet) and is measured in
    full; the three worse starts replay 2 of 8 requests, are screened out at a quarter slot each,
    and the budget goes on to further configs."""
    spec = write_spec(
        tmp_path,
        search_space=SPACE,
        workload=WORKLOAD,
        screening=SCREENING,
        budget={"n_trials": 4},
        confirm={"candidates": 1, "seeds": 1},
    )
    summary = run_command(spec, progress=False, trial_runner=fake_trials)
    study = _study(tmp_path / "out")
    by_start = {t.user_attrs.get("tag") or t.user_attrs.get("start"): t for t in study.trials}
    default, best = by_start["default"], by_start["s0"]
    assert (
        default.intermediate_values == {} and default.user_attrs["metrics"]["workload_requests"] == 8
    )  # never screened
    assert best.state.name == "COMPLETE" and best.user_attrs["metrics"]["workload_requests"] == 8
    assert best.user_attrs["screen"]["num_requests"] == 2 and best.intermediate_values[0] == pytest.approx(
        best.values[0]
    )
    for name in ("s1", "s2", "s3"):
        t = by_start[name]
        assert t.state.name == "PRUNED" and is_screened_out(t) and budget_share(t) == 0.25
        assert t.user_attrs["metrics"]["workload_requests"] == 2 and t.user_attrs["feasible"] is False
        assert t.user_attrs["fail_reason"].startswith("screened out after 2 of 8 requests: p95 TPOT ")
        assert t.user_attrs["fail_reason"].endswith(
            "worse than the median (16.2 ms) of the 1 trials measured in full that met the SLO"
        )
        assert t.intermediate_values[0] > best.intermediate_values[0]
    measured = [t for t in study.trials if is_measured(t) and t.state.name != "RUNNING"]
    held = sum(budget_share(t) for t in measured)
    assert 4 <= held < 5 and len(measured) > 4  # more configs than slots
    assert summary["trial"] == best.number  # a screened-out trial is never a candidate
    report = (tmp_path / "out" / "report.md").read_text()
    assert "Screening: each searched trial replayed 2 of 8 requests first;" in report
    assert "screened out after 2 of 8 requests" in report  # the reason in the trials table

    # Resumed with one more slot and a screened-out config enqueued first: it is not replayed again,
    # it stays screened out with its reason, and holds no budget.
    worse = by_start["s1"]
    study.enqueue_trial(worse.params)
    run_command(
        write_spec(
            tmp_path,
            search_space=SPACE,
            workload=WORKLOAD,
            screening=SCREENING,
            budget={"n_trials": 5},
            confirm={"candidates": 1, "seeds": 1},
        ),
        progress=False,
        trial_runner=fake_trials,
    )
    study = _study(tmp_path / "out")
    repeat = next(t for t in study.trials if t.user_attrs.get("repeat_of") == worse.number)
    assert repeat.state.name == "PRUNED" and budget_share(repeat) == 0
    assert repeat.user_attrs["fail_reason"] == worse.user_attrs["fail_reason"]
    assert repeat.intermediate_values == worse.intermediate_values


def test_screening_refuses_what_it_cannot_screen(tmp_path):
    base = {"search_space": SPACE, "workload": WORKLOAD}
    cases = [
        ({"objective": {"pareto_with": ["output_tokens_per_s"]}}, "Optuna prunes single-objective studies only"),
        ({"sampler": "grid", "search_space": {"name": "g", "knobs": [SPACE["knobs"][1]]}}, "use sampler tpe or random"),
        ({"sampler": "gp"}, "learns nothing from screened-out"),
        ({"workload": {**WORKLOAD, "num_requests": None, "duration_s": 5}}, "needs num_requests"),
        ({"screening": {**SCREENING, "min_requests": 8}}, "the short replay would be the whole workload"),
    ]
    for i, (over, words) in enumerate(cases):
        d = tmp_path / str(i)
        d.mkdir()
        with pytest.raises(ValidationError) as exc:
            TuningSpec.from_yaml(write_spec(d, **{**base, "screening": SCREENING, **over}))
        assert "screening.enabled" in str(exc.value) and words in str(exc.value)


def test_real_engine_screening_replays_the_head_of_the_workload(tmp_path):
    """Real trial processes and engine: with screening on, the first searched trial replays 2 of 6
    requests, passes (nothing to compare with yet) and is measured in full; the second either
    passes too or ends screened out with the short replay's own numbers, 2 requests measured."""
    space = {
        "name": "s",
        "knobs": [{"name": "max_num_seqs", "type": "categorical", "choices": [1, 4]}],
        "starts": [
            {"name": f"n{n}", "why": "test order", "objectives": ["latency"], "params": {"max_num_seqs": n}}
            for n in (1, 4)
        ],
    }
    spec = write_spec(
        tmp_path,
        search_space=space,
        screening={**SCREENING, "fraction": 0.3},
        workload={"num_requests": 6, "concurrency": 2, "output_len": {"kind": "fixed", "value": 4}},
        budget={"n_trials": 2, "trial_timeout_s": 600},
        confirm={"candidates": 0},
    )
    run_command(spec, progress=False)
    study = _study(tmp_path / "out")
    first, second = (next(t for t in study.trials if t.user_attrs.get("start") == f"n{n}") for n in (1, 4))
    assert first.state.name == "COMPLETE" and first.user_attrs["metrics"]["num_completed"] == 6
    assert first.user_attrs["screen"]["num_requests"] == 2 and 0 in first.intermediate_values
    if second.state.name == "PRUNED":
        assert second.user_attrs["metrics"]["num_completed"] == 2
        assert second.user_attrs["fail_reason"].startswith("screened out after 2 of 6 requests: p95 TPOT")
    else:
        assert second.state.name == "COMPLETE" and second.user_attrs["metrics"]["num_completed"] == 6
    assert second.intermediate_values[0] == pytest.approx(second.user_attrs["screen"]["value"])
