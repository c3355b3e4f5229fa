"""The trial record (slotune/tuner/search/records.py) and the typed measurement (slotune/tuner/measure/measurement.py) read
what studies store, unchanged: every trial of the committed pre-redesign study (data/pre_redesign, made at
commit 758a977) reads back to the same attributes, and its metrics to the same stored dict."""

from __future__ import annotations

from pathlib import Path

import optuna
from slotune.tuner.measure.measurement import Measurement
from slotune.tuner.measure.metrics import ci_keys
from slotune.tuner.search import records
from slotune.tuner.search.records import TrialRecord

STUDY = Path(__file__).parent / "data" / "pre_redesign" / "study.db"


def _old_study():
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    return optuna.load_study(study_name="pre-redesign", storage=f"sqlite:///{STUDY}")


def test_a_pre_redesign_trial_reads_back_whole():
    study = _old_study()
    assert study.trials
    for t in study.trials:
        ua, r = t.user_attrs, TrialRecord.of(t)
        assert (r.number, r.state, r.params, r.values) == (t.number, t.state, t.params, tuple(t.values))
        for k in ("config", "violations", "feasible", "early_stopped", "fail_reason", "tag", "host", "pid"):
            assert getattr(r, k) == ua.get(k), k
        assert (r.machine, r.measure, r.is_measured, r.budget_share) == (
            ua.get("machine"),
            ua.get("measure"),
            True,
            1.0,
        )
        assert r.metrics.to_dict() == ua["metrics"]  # the stored form, unchanged
        for key in r.metrics:
            lo, hi = ci_keys(key)
            expected = (ua["metrics"][lo], ua["metrics"][hi]) if lo in ua["metrics"] else None
            assert r.metrics.interval(key) == expected, key
    assert records.stored_winner(study) == study.user_attrs["winner_trial"]
    assert records.stored_confirmation(study) == study.user_attrs["confirm"]
    assert records.stored_fingerprint(study) == study.user_attrs["spec_fingerprint"]
    assert records.stored_parent_run(study) == study.user_attrs["mlflow_parent_run_id"]


def test_the_objectives_writers_store_what_the_record_reads():
    """A trial written through the writers (as the objective writes it) reads back to the same record,
    its metrics stored in the flat form; a repeat copies its outcome, not its latencies."""
    study = optuna.create_study()
    m = Measurement({"tpot_p95": 0.045, "num_requests": 8}, {"tpot_p95": (0.04, 0.05)})
    t = study.ask()
    records.set_fail_reason(t, records.ORPHANED_REASON)
    records.set_config(t, {"max_num_seqs": 2})
    records.set_measurement(
        t, metrics=m, violations={"ttft": 0.0}, feasible=True, early_stopped=False, latencies={"ttft": [0.1]}
    )
    records.set_fail_reason(t, None)
    study.tell(t, 0.045)
    first = study.trials[0]
    assert first.user_attrs["metrics"] == {
        "tpot_p95": 0.045,
        "num_requests": 8,
        "tpot_p95_ci_low": 0.04,
        "tpot_p95_ci_high": 0.05,
    }
    r = TrialRecord.of(first)
    assert (r.metrics, r.metrics.interval("tpot_p95"), r.feasible, r.fail_reason) == (m, (0.04, 0.05), True, None)
    again = study.ask()
    records.set_repeat(again, r)
    study.tell(again, 0.045)
    ua = study.trials[1].user_attrs
    assert ua["metrics"] == first.user_attrs["metrics"] and ua["repeat_of"] == 0 and "latencies" not in ua
    assert ua["unmeasured"] == records.UNMEASURED_REPEAT and not TrialRecord.of(study.trials[1]).is_measured


def test_a_lone_interval_key_stays_a_value():
    """Only a pair of numbers is an interval; anything else round-trips as a value."""
    d = {"x": 1.0, "x_ci_low": 0.5, "y": 2.0, "y_ci_low": None, "y_ci_high": 3.0}
    m = Measurement.from_dict(d)
    assert m.to_dict() == d and m.interval("x") is None and m.interval("y") is None
    assert Measurement.from_dict(None) == {} and not Measurement.from_dict(None)
