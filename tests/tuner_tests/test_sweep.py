"""The load sweep (slotune/tuner/sweep.py): a real config on the bundled model swept up the load as trials are
measured (served over HTTP, each point its own process), its capacity and replicas; `tune sweep`;
the sweep after a study and its report section, drawn in headless Chromium."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import yaml
from slotune.engine.config import EngineConfig
from slotune.tuner.cli import app
from slotune.tuner.measure.load_sweep import (
    LoadCurve,
    LoadPoint,
    SweepResult,
    concurrency_steps,
    num_requests,
    point_workload,
    probe_workload,
    rate_steps,
    run_sweep,
    verdict,
)
from slotune.tuner.report.markdown import write_report
from slotune.tuner.report.sweep_figures import report_sections
from slotune.tuner.run import run_command
from slotune.tuner.spec.slo import SLOLimits
from slotune.tuner.spec.trace_reader import load_trace
from slotune.tuner.spec.tuning_spec import TuningSpec
from slotune.tuner.spec.workload_spec import WorkloadSpec
from typer.testing import CliRunner

from tests.tuner_tests.conftest import TINY_WORKLOAD, write_spec
from tests.tuner_tests.test_report import made_study, remeasured
from tests.tuner_tests.test_report_html import chromium, drawn, needs_chromium

PEAK_RPS = 25.0
TRACES = Path(__file__).resolve().parents[1] / "data" / "traces"


def test_loads_rise_to_twice_the_batch_or_past_saturation_keeping_the_workloads_shapes():
    assert concurrency_steps(16, 6) == [1, 2, 4, 8, 16, 32]
    assert concurrency_steps(2, 3) == [1, 2, 4] and concurrency_steps(2, 8) == [1, 2, 3, 4]
    rates = rate_steps(10.0, 6)
    assert rates == sorted(rates) and rates[0] == pytest.approx(2.0) and rates[-1] == pytest.approx(12.0)
    wl = WorkloadSpec(
        name="rag",
        arrivals="gamma",
        rate=3.0,
        burstiness=0.5,
        duration_s=30,
        mode="chat",
        shared_prefix={"num_tokens": 128, "fraction": 0.5},
        prompt_len={"kind": "uniform", "min": 8, "max": 64},
    )
    at = point_workload(wl, 7.5, num_requests(wl, 7.5, 8, 64))
    assert (at.arrivals, at.rate, at.burstiness, at.num_requests, at.duration_s) == ("gamma", 7.5, 0.5, 30, None)
    assert (at.prompt_len, at.output_len, at.shared_prefix, at.mode, at.seed) == (
        wl.prompt_len,
        wl.output_len,
        wl.shared_prefix,
        wl.mode,
        wl.seed,
    )
    probe = probe_workload(wl, 16, 32)
    assert (probe.arrivals, probe.concurrency, probe.rate, probe.num_requests) == ("closed_loop", 16, None, 32)
    closed = point_workload(WorkloadSpec(**TINY_WORKLOAD), 8, num_requests(WorkloadSpec(**TINY_WORKLOAD), 8, 3, 64))
    assert (closed.concurrency, closed.num_requests) == (8, 16)
    # A replayed trace: the same first requests at every rate, their arrival times scaled to it.
    traced = WorkloadSpec(trace={"path": str(TRACES / "mooncake.jsonl"), "time_scale": 3.0})
    n = num_requests(traced, 1.0, 8, 64)
    for rate in (0.5, 2.0):
        t = load_trace(point_workload(traced, rate, n).trace_source)
        assert len(t) == n and (len(t) - 1) / t.requests[-1].arrival_s == pytest.approx(rate)
    assert load_trace(probe_workload(traced, 16, n).trace_source).requests[-1].arrival_s < 1e-3  # all at once


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    """`tune sweep` of a real config (max_num_seqs 2: concurrency 1, 2, 4) on a tiny workload."""
    d = tmp_path_factory.mktemp("sweep")
    (d / "best.yaml").write_text("max_num_seqs: 2\n")
    (d / "tiny.yaml").write_text(yaml.safe_dump({**TINY_WORKLOAD, "name": "tiny"}))
    r = CliRunner().invoke(
        app,
        [
            "sweep",
            str(d / "best.yaml"),
            "-w",
            str(d / "tiny.yaml"),
            "--steps",
            "3",
            "--ttft-limit",
            "30",
            "--peak-rps",
            str(PEAK_RPS),
            "--json",
            str(d / "sweep.json"),
            "--html",
            str(d / "sweep.html"),
        ],
    )
    assert r.exit_code == 0, r.output
    return d, r.output, SweepResult.from_dict(json.loads((d / "sweep.json").read_text()))


def test_tune_sweep_measures_a_real_config_up_the_load(swept):
    d, output, result = swept
    (curve,) = result.curves
    assert curve.load == "concurrency" and curve.config["max_num_seqs"] == 2
    assert [p.offered for p in curve.points] == [1, 2, 4]  # monotone, up to 2 x max_num_seqs
    # max(min_requests 8, 2 x concurrency) requests each, all served
    assert [p.metrics["num_completed"] for p in curve.points] == [8, 8, 8]
    for p in curve.points:
        assert p.achieved_rps > 0 and p.tokens_per_s > 0 and 0 < p.metrics["ttft_p50"] <= p.metrics["ttft_p95"]
        assert p.passed == verdict(p.metrics, result.limits)[0]
    assert "p95 TTFT <= 30 s" in output and "4 concurrent" in output and "capacity of best:" in output


def test_capacity_is_the_highest_load_within_the_slo_and_sets_the_replicas(swept):
    _, output, result = swept
    (curve,) = result.curves
    passed = [p for p in curve.points if p.passed]
    assert curve.capacity == max(passed, key=lambda p: p.offered)
    assert curve.replicas(PEAK_RPS) == math.ceil(PEAK_RPS / curve.capacity.achieved_rps) >= 1
    assert json.loads((swept[0] / "sweep.json").read_text())["curves"][0]["replicas"] == curve.replicas(PEAK_RPS)
    assert f"takes {curve.replicas(PEAK_RPS)} replica" in output
    # The same measured points under a TTFT limit between the lightest and the heaviest load's TTFT:
    # capacity is the highest load still within it, and a limit none meets leaves no capacity.
    ttfts = sorted(p.metrics["ttft_p95"] for p in curve.points)
    for limit in (ttfts[0] * 1.0001, ttfts[-1] * 0.9999, 1e-6):
        limits = SLOLimits(ttft_s=limit)
        judged = LoadCurve(
            curve.name,
            curve.load,
            curve.config,
            tuple(LoadPoint(p.offered, p.num_requests, p.metrics, *verdict(p.metrics, limits)) for p in curve.points),
            "",
        )
        within = [p.offered for p in judged.points if p.metrics["ttft_p95"] <= limit]
        assert (judged.capacity.offered if judged.capacity else None) == (max(within) if within else None)
        assert judged.replicas(PEAK_RPS) == (math.ceil(PEAK_RPS / judged.capacity.achieved_rps) if within else None)


def test_an_open_loop_sweep_offers_rates_up_to_past_the_measured_saturation(tmp_path):
    """Poisson arrivals: a closed-loop probe at max_num_seqs measures the saturation requests/s; the rates
    are fractions of it up to 1.2x."""
    spec = TuningSpec.model_validate(
        {
            "name": "s",
            "output_dir": str(tmp_path),
            "objective": {"kind": "latency", "metric": "tpot", "ttft_limit_s": 30.0},
            "workload": {**TINY_WORKLOAD, "arrivals": "poisson", "rate": 1.0},
        }
    )
    probes = []
    curve = run_sweep(
        spec,
        EngineConfig(max_num_seqs=2),
        name="c",
        steps=2,
        min_requests=3,
        max_requests=6,
        on_point=lambda name, load, p: probes.append(p) if math.isinf(p.offered) else None,
    )
    assert curve.load == "rate" and len(probes) == 1 and probes[0].num_requests == 4  # 2 x max_num_seqs
    assert curve.saturation_rps == probes[0].achieved_rps > 0
    assert [p.offered for p in curve.points] == pytest.approx([0.6 * curve.saturation_rps, 1.2 * curve.saturation_rps])
    assert all(p.metrics["num_completed"] == p.num_requests >= 3 for p in curve.points)


def test_tune_sweep_with_a_bad_workload_names_the_file_and_field(tmp_path):
    (tmp_path / "c.yaml").write_text("max_num_seqs: 2\n")
    bad = tmp_path / "wl.yaml"
    bad.write_text("arrivals: poisson\nconcurrency: 0\nrate: 2\n")
    r = CliRunner().invoke(app, ["sweep", str(tmp_path / "c.yaml"), "-w", str(bad)])
    assert r.exit_code == 2 and f"{bad}: concurrency: " in r.output, r.output


def test_a_study_with_the_sweep_on_writes_sweep_json_and_the_report_section(tmp_path, fake_trials):
    """Wiring in `finalize`, with the stand-in measurement (fake_trials): its numbers do not depend on
    the load, so throughput is flat and every sweep ends after three points on the plateau rule."""
    spec = write_spec(tmp_path, budget={"n_trials": 2}, peak_rps=100.0, sweep={"enabled": True, "steps": 5})
    summary = run_command(spec, progress=False, trial_runner=fake_trials)
    doc = json.loads((tmp_path / "out" / "sweep.json").read_text())
    assert [c["name"] for c in doc["curves"]] == ["winner", "default", "naive"] and doc["peak_rps"] == 100.0
    for c in doc["curves"]:
        offered = [p["offered"] for p in c["points"]]
        assert len(offered) == 3 and offered == sorted(set(offered)) and "stopped rising" in c["stopped"], c
    assert doc["curves"][0]["config"] == EngineConfig.from_yaml(tmp_path / "out" / "best.yaml").model_dump(mode="json")
    md = (tmp_path / "out" / "report.md").read_text()
    assert "## Latency against load" in md and "## Load sweep points" in md and "replicas for 100 req/s peak" in md
    assert summary is not None
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'out' / 'mlflow.db'}")
    parent = client.get_run(summary["mlflow_run_id"])
    assert "sweep.json" in [a.path for a in client.list_artifacts(parent.info.run_id)]  # the curves, with the report


@pytest.mark.skipif(shutil.which("llama-server") is None, reason="needs llama.cpp's llama-server on PATH")
def test_a_llama_server_study_sweeps_its_winner_up_to_twice_its_slots(tmp_path):
    """The sweep after a study of the real llama-server: its default launch (llama-server's 4 slots,
    the engine file's `slots: parallel`) swept in closed loop from 1 to 8 users, each point a launch."""
    data = {
        "name": "ls",
        "server": {"engine": "llama-server", "knobs": {"threads": 2, "ctx_per_slot": 256}},
        "workload": {**TINY_WORKLOAD, "output_len": {"kind": "fixed", "value": 8}},
        "objective": {"kind": "latency", "metric": "tpot", "percentile": 95, "ttft_limit_s": 30.0},
        "search_space": {
            "name": "one",
            "engine": "llama-server",
            "knobs": [{"name": "parallel", "type": "categorical", "choices": [4]}],
        },
        "budget": {"n_trials": 1, "trial_timeout_s": 300},
        "confirm": {"candidates": 0},
        "sweep": {"enabled": True, "steps": 3, "min_requests": 4},
        "output_dir": str(tmp_path / "out"),
    }
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(data))
    run_command(path, progress=False)
    doc = json.loads((tmp_path / "out" / "sweep.json").read_text())
    curve = doc["curves"][0]
    assert curve["name"].startswith("winner") and curve["config"]["engine"] == "llama-server"
    assert [p["offered"] for p in curve["points"]][0] == 1 and all(p.get("metrics") for p in curve["points"])
    assert max(p["offered"] for p in curve["points"]) <= 8 == concurrency_steps(4, 3)[-1]
    assert "## Latency against load" in (tmp_path / "out" / "report.md").read_text()


def test_sweep_is_off_by_default_and_checked():
    base = {"name": "x", "objective": {"kind": "latency", "metric": "tpot"}}
    spec = TuningSpec.model_validate(base)
    assert spec.sweep.enabled is False and spec.peak_rps is None
    for bad in ({"peak_rps": 0}, {"sweep": {"steps": 1}}, {"sweep": {"enable": True}}):
        with pytest.raises(ValueError, match="peak_rps|sweep"):
            TuningSpec.model_validate({**base, **bad})


@needs_chromium
def test_the_report_with_a_sweep_section_draws_the_curve(tmp_path, swept):
    """The real sweep's section in a study report (test_report.made_study), and `tune sweep --html`'s page."""
    spec, study = made_study(tmp_path / "study")
    paths = write_report(spec, study, *remeasured(study, spec), tmp_path, sections=report_sections(swept[2]))
    figs = drawn(chromium(paths["html"], "--dump-dom", profile=tmp_path / "profile"))
    assert figs.svgs.get("fig-sweep-0", 0) > 0, figs.svgs
    page = drawn(chromium(swept[0] / "sweep.html", "--dump-dom", profile=tmp_path / "profile2"))
    assert set(page.svgs) == {"fig-sweep-0"} and page.svgs["fig-sweep-0"] > 0
    assert "## Latency against load" in paths["md"].read_text()
