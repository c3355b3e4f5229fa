"""The SLO verdict where people read it: the report's SLO text and trials table, and the MLflow
child runs' `slotune.slo_pass` / `slotune.slo_reasons` tags. One `judge` (slotune/tuner/spec/slo.py) writes all."""

from __future__ import annotations

from slotune.tuner.run import run_command
from slotune.tuner.tracking import tracking_summary

from tests.tuner_tests.conftest import write_spec


def test_failing_trials_say_why_in_words(tmp_path, fake_trials):
    """The fake measurement (fake_trials): unquantized max_num_seqs=4 has TTFT p95 = 0.0864 s, over
    the 0.08 s limit; int8 (0.0605 s) holds it."""
    spec = write_spec(
        tmp_path,
        sampler="grid",
        budget={"n_trials": 2},
        objective={"ttft_limit_s": 0.08},
        search_space={
            "name": "q",
            "knobs": [
                {"name": "max_num_seqs", "type": "categorical", "choices": [4]},
                {"name": "quantization", "type": "categorical", "choices": ["none", "int8"]},
            ],
        },
    )
    run_command(spec, progress=False, trial_runner=fake_trials)
    out = tmp_path / "out"
    runs = [r for r in tracking_summary(f"sqlite:///{out / 'mlflow.db'}", "t") if r["tags"].get("mlflow.parentRunId")]
    by_quant = {r["params"]["quantization"]: r["tags"] for r in runs}
    assert by_quant["int8"]["slotune.slo_pass"] == "True" and "slotune.slo_reasons" not in by_quant["int8"]
    assert by_quant["none"]["slotune.slo_pass"] == "False"
    assert by_quant["none"]["slotune.slo_reasons"] == "p95 TTFT 86.4 ms > limit 80 ms (+8%)"
    report = (out / "report.md").read_text()
    assert "SLO: p95 TTFT <= 80 ms;" in report
    assert "| p95 TTFT 86.4 ms > limit 80 ms (+8%) |" in report  # the infeasible trial's note
    assert "| p95 TTFT | <= 80 ms | 60.5 ms | yes |" in report  # the winner's SLO row, in units
