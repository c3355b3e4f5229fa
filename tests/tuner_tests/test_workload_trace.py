"""Workloads that replay a trace (`trace: {path: ...}`) or draw bursty gaps (`arrivals: gamma`): validation,
generation, path resolution in workload and tuning specs, `tune workload fit` through the real CLI, and a
study on a trace workload whose report names the traffic window."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import numpy as np
import pytest
import yaml
from pydantic import ValidationError
from slotune.tuner.cli import app
from slotune.tuner.spec.preflight import preflight
from slotune.tuner.spec.trace_reader import load_trace
from slotune.tuner.spec.traces import TraceSource
from slotune.tuner.spec.tuning_spec import TuningSpec
from slotune.tuner.spec.workload_spec import WorkloadSpec
from slotune.tuner.spec.yaml_reader import MissingFileError, SpecError
from slotune.tuner.workload.fit import requests_to_trace, summarize
from slotune.tuner.workload.requests import describe_replay, generate_requests
from typer.testing import CliRunner

from tests.tuner_tests.conftest import write_spec
from tests.tuner_tests.test_workload_fit import WordTokenizer

DATA = Path(__file__).resolve().parents[1] / "data" / "traces"
RECORDED = DATA / "recorded.jsonl"  # 120 requests, 512-token blocks, measured finish times
BASE = "name: h\nobjective: {kind: latency, metric: ttft}\n"


def cli(*args: str):
    r = CliRunner().invoke(app, list(args))
    return r.exit_code, r.stdout, r.stderr


def _gaps(spec: WorkloadSpec) -> np.ndarray:
    reqs = [r for r in generate_requests(spec, WordTokenizer()) if not r.is_warmup]
    return np.diff([r.arrival_offset_s for r in reqs])


# --- gamma arrivals -----------------------------------------------------------------------------------
@pytest.mark.parametrize("sampling", ["stratified", "independent"])
@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_gamma_gaps_have_the_rate_and_the_cv(burstiness, sampling):
    """Mean within 5% of 1/rate, CV within 10% of 1/sqrt(burstiness), whether the gaps are stratified
    (the default) or drawn independently. Enough gaps that 5% is 3 standard errors of independent
    gaps' mean (CV / sqrt(n)): 4000, 14400 at burstiness 0.25 (CV 2); stratified ones are closer."""
    n = max(4000, int(3600 / burstiness))
    gaps = _gaps(
        WorkloadSpec(
            arrivals="gamma",
            rate=5.0,
            burstiness=burstiness,
            num_requests=n + 1,
            warmup_requests=0,
            prompt_len={"kind": "fixed", "value": 2},
            arrival_sampling=sampling,
        )
    )
    assert gaps.mean() == pytest.approx(1 / 5.0, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(1 / np.sqrt(burstiness), rel=0.1)


@pytest.mark.parametrize("arrivals", [{"arrivals": "poisson"}, {"arrivals": "gamma", "burstiness": 0.25}])
def test_stratified_gaps_take_one_from_each_eighth_and_pin_the_rate(arrivals):
    """Stratified: each block of 8 gaps holds one gap from each eighth of the gaps' distribution
    (exponential: F(g) = 1 - exp(-rate g); gamma: its regularised incomplete gamma function), so over
    200 seeds the span of 24 arrivals varies less than half as much as with independent gaps."""
    from scipy.special import gammainc

    spec = WorkloadSpec(
        rate=2.0, num_requests=25, warmup_requests=0, prompt_len={"kind": "fixed", "value": 2}, **arrivals
    )
    k = spec.burstiness or 1.0
    for seed in range(5):
        cdf = gammainc(k, _gaps(spec.model_copy(update={"seed": seed})) * spec.rate * k)
        for block in cdf.reshape(3, 8):
            assert sorted(np.floor(block * 8).astype(int)) == list(range(8))

    def span_cv(sampling: str) -> float:
        wl = spec.model_copy(update={"arrival_sampling": sampling, "num_requests": 24})
        spans = [_gaps(wl.model_copy(update={"seed": s})).sum() for s in range(200)]
        return float(np.std(spans) / np.mean(spans))

    assert span_cv("stratified") < 0.5 * span_cv("independent")


def test_prompts_and_lengths_do_not_depend_on_the_arrivals():
    """Gaps come from a generator of their own: the same seed gives the same prompts and lengths
    whether its requests arrive closed loop, at a fixed rate, or as stratified or independent
    Poisson or gamma arrivals; only the arrival offsets differ."""
    base = WorkloadSpec(
        num_requests=12,
        warmup_requests=1,
        prompt_len={"kind": "uniform", "min": 4, "max": 40},
        output_len={"kind": "lognormal", "mean": 16, "sigma": 0.5, "min": 1, "max": 64},
        shared_prefix={"num_tokens": 8, "fraction": 0.5},
        seed=7,
    )
    variants = [
        {},
        {"arrivals": "fixed_rate", "rate": 3.0},
        {"arrivals": "poisson", "rate": 3.0},
        {"arrivals": "poisson", "rate": 3.0, "arrival_sampling": "independent"},
        {"arrivals": "gamma", "rate": 3.0, "burstiness": 0.5},
    ]
    drawn = [generate_requests(WorkloadSpec(**(base.model_dump() | v)), WordTokenizer()) for v in variants]
    first = [(r.request_id, r.prompt_token_ids, r.output_len) for r in drawn[0]]
    for reqs in drawn[1:]:
        assert [(r.request_id, r.prompt_token_ids, r.output_len) for r in reqs] == first
    assert len({tuple(r.arrival_offset_s for r in reqs) for reqs in drawn}) == len(variants)


@pytest.mark.parametrize(
    ("doc", "needle"),
    [
        ({"arrivals": "gamma", "rate": 2.0}, "burstiness is required when arrivals is 'gamma'"),
        ({"arrivals": "gamma", "burstiness": 0.5}, "rate is required when arrivals is 'gamma'"),
        ({"arrivals": "poisson", "rate": 2.0, "burstiness": 0.5}, "burstiness applies to arrivals 'gamma' only"),
        ({"arrivals": "gamma", "rate": 2.0, "burstiness": 0}, "greater than 0"),
        ({"arrivals": "trace"}, "arrivals 'trace' replays a trace's own arrival times"),
        ({"arrivals": "trace", "trace": "lengths.jsonl"}, "got a lengths file"),
    ],
)
def test_arrival_mistakes_are_named(doc, needle):
    with pytest.raises(ValidationError, match=needle):
        WorkloadSpec.load(doc)


# --- trace workloads: validation ---------------------------------------------------------------------
def test_trace_mapping_defaults_to_trace_arrivals_and_the_whole_trace():
    spec = WorkloadSpec.load({"trace": {"path": str(RECORDED)}})
    assert spec.arrivals == "trace" and not spec.is_closed_loop and spec.num_requests is None
    assert spec.trace_source == TraceSource(path=str(RECORDED))
    # a trial gets the workload as JSON and validates it again (slotune/tuner/measure/trial_process.py: trial_request)
    dumped = spec.model_dump(mode="json")
    assert "prompt_len" not in dumped and "output_len" not in dumped  # a replay has no length distributions
    assert WorkloadSpec.model_validate(json.loads(json.dumps(dumped))) == spec


def test_workloads_written_before_gamma_and_traces_fingerprint_the_same():
    """spec_fingerprint dumps without defaults (slotune/tuner/search/study.py): the new fields must not show up in an old
    workload's dump, or every existing study would be refused as changed."""
    assert WorkloadSpec.load({}).model_dump(mode="json", exclude_defaults=True) == {"num_requests": 16}
    old = {"arrivals": "poisson", "rate": 2.0, "trace": "t.jsonl", "prompt_len": {"kind": "fixed", "value": 8}}
    assert WorkloadSpec.load(old).model_dump(mode="json", exclude_defaults=True) == {
        **old,
        "prompt_len": {"value": 8},
        "num_requests": 16,
    }  # kind: fixed is the default kind


@pytest.mark.parametrize(
    ("extra", "needles"),
    [
        (
            {"prompt_len": {"kind": "fixed", "value": 8}},
            ["prompt_len cannot be set beside a trace mapping", "its prompt lengths"],
        ),
        ({"rate": 2.0, "duration_s": 5}, ["rate, duration_s cannot be set", "trace.window"]),
        ({"num_requests": 10}, ["num_requests", "trace.max_requests"]),
        (
            {"shared_prefix": {"num_tokens": 8}, "output_len": {"kind": "fixed", "value": 8}},
            ["output_len, shared_prefix", "block hash ids"],
        ),
        ({"arrivals": "poisson", "rate": 2.0}, ["arrivals 'poisson': a trace mapping replays", "--empirical"]),
        ({"mode": "chat"}, ["mode 'chat' with a trace mapping"]),
        ({"length_sampling": "independent"}, ["length_sampling cannot be set", "its lengths"]),
        ({"arrival_sampling": "independent"}, ["arrival_sampling cannot be set", "its arrival times"]),
        ({"trace": {"path": "x", "speed": 2}}, ["trace.speed\n  Extra inputs are not permitted"]),
    ],
)
def test_fields_a_trace_decides_are_refused_by_name(extra, needles):
    doc = {"trace": {"path": str(RECORDED)}, **extra}
    with pytest.raises(ValidationError) as err:
        WorkloadSpec.load(doc)
    for n in needles:
        assert n in str(err.value)


def test_trace_path_relative_to_the_workload_yaml(tmp_path, monkeypatch):
    d = tmp_path / "w"
    (d / "rec").mkdir(parents=True)
    (d / "rec" / "requests-000.jsonl").write_text(RECORDED.read_text())
    (d / "wl.yaml").write_text("trace: {path: rec, window: [0, 30]}\nwarmup_requests: 0\n")
    monkeypatch.chdir(tmp_path)
    spec = WorkloadSpec.load(Path("w") / "wl.yaml")
    assert spec.trace_source.path == str(d / "rec") and spec.trace_source.window == (0.0, 30.0)
    (d / "gone.yaml").write_text("trace: {path: nope.jsonl}\n")
    with pytest.raises(MissingFileError, match=r"gone.yaml: trace.path: trace not found: .*/w/nope.jsonl"):
        WorkloadSpec.load(d / "gone.yaml")
    (d / "bad.yaml").write_text("trace: {path: rec, time_scale: 0}\n")
    with pytest.raises(SpecError, match=r"bad.yaml: trace.time_scale: .*greater than 0"):
        WorkloadSpec.load(d / "bad.yaml")


def test_a_recording_given_as_a_lengths_file_says_how_to_replay_it(tmp_path):
    spec = WorkloadSpec.load({"trace": str(RECORDED), "num_requests": 2})
    with pytest.raises(SpecError, match=r"recorded or Mooncake trace: replay it with `trace: \{path: FILE\}`"):
        generate_requests(spec, WordTokenizer())


# --- trace workloads: generation -----------------------------------------------------------------------
def test_replay_keeps_arrivals_lengths_and_prefix_sharing():
    src = load_trace(RECORDED, window=(0, 40), time_scale=0.5)
    spec = WorkloadSpec.load(
        {"trace": {"path": str(RECORDED), "window": [0, 40], "time_scale": 0.5}, "warmup_requests": 3}
    )
    reqs = generate_requests(spec, WordTokenizer())
    warm, measured = [r for r in reqs if r.is_warmup], [r for r in reqs if not r.is_warmup]
    assert len(warm) == 3 and len(measured) == len(src) < 120
    assert [r.arrival_offset_s for r in measured] == [r.arrival_s for r in src.requests]
    assert [len(r.prompt_token_ids) for r in measured] == [r.prompt_tokens for r in src.requests]
    assert [r.output_len for r in measured] == [max(1, r.output_tokens) for r in src.requests]
    assert [len(r.prompt_token_ids) for r in warm] == [r.prompt_tokens for r in src.requests[:3]]
    rebuilt = summarize(requests_to_trace(reqs, block_size=src.block_size))
    assert rebuilt.cacheable_share == pytest.approx(summarize(src).cacheable_share, abs=0.01)
    # warm-up prompts share no block with a measured prompt, at the engine's block size as at the trace's
    for bs in (16, src.block_size):
        warm_blocks = {
            tuple(r.prompt_token_ids[i : i + bs]) for r in warm for i in range(0, len(r.prompt_token_ids) - bs + 1, bs)
        }
        measured_firsts = {tuple(r.prompt_token_ids[:bs]) for r in measured}
        assert not warm_blocks & measured_firsts
    # another seed: other tokens, the same sharing and times
    other = generate_requests(spec, WordTokenizer(), seed=5)
    assert [r.prompt_token_ids for r in other] != [r.prompt_token_ids for r in reqs]
    assert summarize(requests_to_trace(other, block_size=512)).cacheable_share == rebuilt.cacheable_share
    assert generate_requests(spec, WordTokenizer(), max_requests=4)[-1].request_id == "req-3"


def test_describe_replay_names_the_window():
    spec = WorkloadSpec.load(
        {"trace": {"path": str(RECORDED), "window": [10, 40], "time_scale": 2.0, "max_requests": 30}}
    )
    n = len(load_trace(spec.trace_source))
    text = describe_replay(spec)
    assert f"trace {RECORDED} (recorded), window [10, 40) s, first 30 requests, time_scale 2" in text
    assert f"{n} requests over" in text and "replayed open loop at the traced times" in text
    assert describe_replay(WorkloadSpec.load({})) is None


# --- tuning specs with a trace workload -----------------------------------------------------------------
def _trace_project(tmp_path: Path, workload: str) -> Path:
    d = tmp_path / "project"
    (d / "recording").mkdir(parents=True)
    lines = RECORDED.read_text().splitlines(keepends=True)
    (d / "recording" / "requests-000.jsonl").write_text("".join(lines[:60]))
    (d / "recording" / "requests-001.jsonl").write_text("".join(lines[60:]))
    spec = d / "spec.yaml"
    spec.write_text(BASE + f"workload: {workload}\noutput_dir: out\n")
    return spec


def test_tuning_spec_resolves_the_nested_trace_path_and_preflights_it(tmp_path, monkeypatch):
    spec_path = _trace_project(tmp_path, "{trace: {path: recording/, window: [0, 30]}, warmup_requests: 0}")
    monkeypatch.chdir(tmp_path)
    spec = TuningSpec.from_yaml(os.path.relpath(spec_path))
    wl = spec.workload
    assert wl.trace_source.path == str(spec_path.parent / "recording") and wl.arrivals == "trace"
    code, out, err = cli("validate", os.path.relpath(spec_path))
    assert code == 0, err
    assert "traffic: trace" in out and "window [0, 30) s" in out
    # the trace's own problems come at preflight, under workload.trace
    bad = _trace_project(tmp_path / "b", "{trace: {path: recording, window: [5000, 6000]}}")
    with pytest.raises(SpecError, match=r"workload.trace: .*recording: window: no request arrives inside window"):
        preflight(TuningSpec.from_yaml(bad))
    missing = _trace_project(tmp_path / "m", "{trace: {path: nowhere/}}")
    code, _, err = cli("validate", str(missing))
    assert (
        code == 2 and f"{missing}: workload: workload.trace.path: trace not found: {missing.parent / 'nowhere'}" in err
    )
    refused = _trace_project(tmp_path / "r", "{trace: {path: recording}, rate: 3}")
    code, _, err = cli("validate", str(refused))
    assert code == 2 and "rate cannot be set beside a trace mapping" in err and "Traceback" not in err


def test_study_on_a_trace_workload_reports_the_traffic_window(tmp_path, fake_trials):
    """A tiny study (fake measurement: study mechanics only, fake_trials) on `workload: {trace: recording/}`;
    its report says which traffic window it tuned on."""
    spec_path = write_spec(tmp_path, budget={"n_trials": 2})
    doc = yaml.safe_load(spec_path.read_text())
    doc["workload"] = {"trace": {"path": "recording/", "window": [0, 30], "time_scale": 0.5}, "warmup_requests": 0}
    (tmp_path / "recording").mkdir()
    (tmp_path / "recording" / "requests-000.jsonl").write_text(RECORDED.read_text())
    spec_path.write_text(yaml.safe_dump(doc))
    from slotune.tuner.run import run_command

    run_command(spec_path, progress=False, trial_runner=fake_trials)
    n = len(load_trace(tmp_path / "recording", window=(0, 30)))
    report = (tmp_path / "out" / "report.md").read_text()
    assert (
        f"Traffic: tuned on trace {tmp_path / 'recording'} (recorded), window [0, 30) s, time_scale 0.5: "
        f"{n} requests over"
    ) in report
    assert "replayed open loop at the traced times" in report
    assert "window [0, 30) s" in (tmp_path / "out" / "report.html").read_text()


# --- `tune workload fit`, through the CLI ------------------------------------------------------------------
def test_workload_fit_cli_prints_the_summary_and_writes_a_spec(tmp_path):
    out = tmp_path / "served.yaml"
    code, stdout, err = cli(
        "workload",
        "fit",
        str(RECORDED),
        "-o",
        str(out),
        "--window",
        "0",
        "40",
        "--time-scale",
        "2",
        "--max-requests",
        "60",
    )
    assert code == 0, err
    for needle in (
        "prompt",
        "output",
        "p95",
        "p99",
        "mean rate",
        "peak rate",
        "burstiness (inter-arrival CV)",
        "peak concurrency",
        "cacheable-prefix share",
        f"wrote {out}",
    ):
        assert needle in stdout, needle
    spec = WorkloadSpec.load(out)
    src = summarize(load_trace(RECORDED, window=(0, 40), time_scale=2.0, max_requests=60))
    assert spec.name == "served" and spec.num_requests == src.num_requests
    assert spec.rate == pytest.approx(src.mean_rate, rel=1e-3) and spec.shared_prefix is not None
    code, _, err = cli("workload", "fit", str(RECORDED), "-o", str(tmp_path / "e.yaml"), "--empirical")
    assert code == 0, err
    assert WorkloadSpec.load(tmp_path / "e.yaml").trace == str(tmp_path / "e.lengths.jsonl")


@pytest.mark.parametrize(
    ("args", "where", "needle"),
    [
        (["--window", "30", "3"], "recorded.jsonl", "window: need 0 <= start_s < end_s"),
        (["--block-size", "16"], "recorded.jsonl", "block_size applies to mooncake traces only"),
        (["--max-requests", "1"], "recorded.jsonl", "needs two or more distinct arrival times"),
        (["--format", "azure"], "recorded.jsonl", "missing column(s) TIMESTAMP"),
        (["--time-scale", "-1"], "recorded.jsonl", "time_scale: Input should be greater than 0"),
    ],
)
def test_workload_fit_cli_errors_are_path_message_lines(tmp_path, args, where, needle):
    code, _, err = cli("workload", "fit", str(RECORDED), "-o", str(tmp_path / "w.yaml"), *args)
    assert code == 2 and "Traceback" not in err
    assert all(line.startswith(str(DATA / where)) for line in err.splitlines()) and needle in err, err
    assert not (tmp_path / "w.yaml").exists()


def test_workload_fit_cli_missing_trace_and_unwritable_output(tmp_path):
    code, _, err = cli("workload", "fit", str(tmp_path / "nope.csv"), "-o", str(tmp_path / "w.yaml"))
    assert code == 2 and err.strip() == f"{tmp_path / 'nope.csv'}: trace not found"
    code, _, err = cli("workload", "fit", str(RECORDED), "-o", str(tmp_path / "no" / "dir" / "w.yaml"))
    assert code == 2 and f"{tmp_path / 'no' / 'dir' / 'w.yaml'}: No such file or directory" in err


def _make_samples():
    spec = importlib.util.spec_from_file_location("make_samples", DATA / "make_samples.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize(("burstiness", "num_requests"), [(1.0, 400), (0.5, 1600)])
def test_fitted_spec_from_the_cli_replays_like_the_recording(tmp_path, burstiness, num_requests):
    """A recording (make_samples' synthetic traffic: system prompts, follow-ups; gamma gaps at 2 req/s with
    the given shape) -> `tune workload fit` -> the YAML it wrote -> WorkloadSpec's own generation -> summarize:
    within the tolerances test_workload_fit states for the function-level fit (p50 lengths and mean rate
    within 15%, cacheable share within 0.1, CV within 0.2), and bursty traffic fitted as gamma.

    Bursty gaps make the mean rate noisier (its relative error is CV / sqrt(n) for each of source and
    replay), so the bursty case has 1600 requests: 15% is then about 3 standard errors of the difference."""
    samples = _make_samples()
    traffic = samples.make_trace(num_requests, rate=2.0, seed=11)
    gaps = np.random.default_rng(3).gamma(burstiness, 1000.0 / (2.0 * burstiness), len(traffic))
    for r, t_ms in zip(traffic, np.concatenate([[0.0], np.cumsum(gaps[1:])])):
        r["arrival_ms"] = int(round(t_ms))
    recording = tmp_path / "recording"
    recording.mkdir()
    (recording / "requests-000.jsonl").write_text("\n".join(samples.recorded_lines(traffic)) + "\n")
    out = tmp_path / "fitted.yaml"
    code, _, err = cli("workload", "fit", str(recording), "-o", str(out))
    assert code == 0, err

    source = load_trace(recording)
    src = summarize(source)
    spec = WorkloadSpec.load(out)
    assert spec.arrivals == ("poisson" if abs(src.interarrival_cv - 1) <= 0.25 else "gamma")
    assert spec.arrivals == ("poisson" if burstiness == 1.0 else "gamma")
    gen = summarize(requests_to_trace(generate_requests(spec, WordTokenizer()), block_size=source.block_size))
    assert gen.num_requests == src.num_requests == num_requests
    assert gen.prompt_tokens.p50 == pytest.approx(src.prompt_tokens.p50, rel=0.15)
    assert gen.output_tokens.p50 == pytest.approx(src.output_tokens.p50, rel=0.15)
    assert gen.mean_rate == pytest.approx(src.mean_rate, rel=0.15)
    assert gen.interarrival_cv == pytest.approx(src.interarrival_cv, abs=0.2)
    assert gen.cacheable_share == pytest.approx(src.cacheable_share, abs=0.1)
