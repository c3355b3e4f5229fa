import json
import math
from pathlib import Path

import numpy as np
import pytest
import yaml
from slotune.tuner.commands import fit_command
from slotune.tuner.spec.trace_reader import load_trace
from slotune.tuner.spec.traces import Trace, TraceRequest, block_hash_ids
from slotune.tuner.spec.workload_spec import WorkloadSpec
from slotune.tuner.workload.fit import fit, requests_to_trace, summarize
from slotune.tuner.workload.prompts import build_prompts
from slotune.tuner.workload.requests import corpus_token_ids, generate_requests

DATA = Path(__file__).resolve().parents[1] / "data" / "traces"
FIT_SAMPLE = DATA / "mooncake_fit.jsonl"  # 400 requests, Poisson arrivals, system prompts and follow-ups


class WordTokenizer:
    """Whitespace words as tokens: enough for WorkloadSpec's generation, and no model to load (a test seam)."""

    def __init__(self) -> None:
        self.vocab: dict[str, int] = {}

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:  # no BOS
        return [self.vocab.setdefault(w, len(self.vocab)) for w in text.split()]

    def decode(self, ids: list[int]) -> str:
        words = {i: w for w, i in self.vocab.items()}
        return " ".join(words[i] for i in ids)

    def apply_chat_template(self, messages, add_generation_prompt=True) -> str:
        return " ".join(m["content"] for m in messages)


# A hand-made trace, block size 4: ids 1, 2 shared; id 3 reused at another position (2 tokens of it).
HAND = [
    TraceRequest(0.0, 10, 5, (1, 2, 3), is_chat=True),  # blocks of 4, 4, 2 tokens
    TraceRequest(1.0, 8, 3, (1, 2), is_chat=False),  # 8 cacheable
    TraceRequest(1.5, 9, 0, (1, 5, 6)),  # 4 cacheable
    TraceRequest(4.0, 6, 10, (7, 3)),  # 2 cacheable: id 3 covers the last 2 tokens
    TraceRequest(4.2, 7, 2),
]  # no hash ids: left out of the cacheable share


def _hand(**over) -> Trace:
    reqs = [
        TraceRequest(
            r.arrival_s, r.prompt_tokens, r.output_tokens, r.hash_ids, r.is_chat, e2e_s=over.get("e2e", [None] * 5)[i]
        )
        for i, r in enumerate(HAND)
    ]
    return Trace(reqs, "hand.jsonl", "mooncake", 4)


def test_summary_of_a_hand_made_trace():
    s = summarize(_hand(), prefill_tokens_per_s=10.0, tpot_s=1.0)
    assert s.num_requests == 5 and s.duration_s == pytest.approx(4.2)
    assert (s.prompt_tokens.p50, s.prompt_tokens.mean, s.prompt_tokens.min, s.prompt_tokens.max) == (8, 8, 6, 10)
    assert s.prompt_tokens.p95 == pytest.approx(9.8) and s.prompt_tokens.p99 == pytest.approx(9.96)  # linear
    assert (s.output_tokens.p50, s.output_tokens.mean, s.num_zero_output) == (3, 4, 1)
    # gaps 1, 0.5, 2.5, 0.2: mean 1.05, population variance 3.13 / 4
    assert s.mean_rate == pytest.approx(1 / 1.05)
    assert s.interarrival_cv == pytest.approx(math.sqrt(3.13 / 4) / 1.05)
    assert s.peak_rate_1s == 2.0  # [1, 2) holds 1.0 and 1.5; [4, 5) holds 4.0 and 4.2
    assert s.peak_rate_10s == 0.5  # all five in [0, 10)
    # service = prompt / 10 + output * 1: [0, 6) [1, 4.8) [1.5, 2.4) [4, 14.6) [4.2, 6.9) -> 4 at 4.2
    assert (s.peak_concurrency, s.concurrency_source) == (4, "estimated")
    assert s.cacheable_share == pytest.approx((8 + 4 + 2) / (10 + 8 + 9 + 6))
    assert s.chat_share == 0.5 and s.block_size == 4 and s.cached_share is None


def test_measured_service_times_when_every_request_has_one():
    s = summarize(_hand(e2e=[1.0, 0.4, 0.2, 1.0, 1.0]))
    # [0, 1) [1, 1.4) [1.5, 1.7) [4, 5) [4.2, 5.2): one ends as the next starts (not overlapping) -> 2 at 4.2
    assert (s.peak_concurrency, s.concurrency_source) == (2, "measured")
    partly = summarize(_hand(e2e=[1.0, None, 0.2, 1.0, 1.0]), prefill_tokens_per_s=10.0, tpot_s=1.0)
    assert (partly.peak_concurrency, partly.concurrency_source) == (4, "estimated")


def test_summary_without_hash_ids_or_spread():
    s = summarize(load_trace(DATA / "azure.csv"))
    assert s.cacheable_share is None and s.block_size is None and s.chat_share is None
    one = summarize(Trace([TraceRequest(0.0, 5, 5)], "one", "azure", None))
    assert one.mean_rate is None and one.interarrival_cv is None and one.peak_rate_1s == 1.0
    with pytest.raises(ValueError, match="two or more distinct arrival times"):
        fit(Trace([TraceRequest(0.0, 5, 5), TraceRequest(0.0, 6, 5)], "same", "azure", None))


def test_recording_reports_measured_concurrency_others_estimate():
    rec, moon = summarize(load_trace(DATA / "recorded.jsonl")), summarize(load_trace(DATA / "mooncake.jsonl"))
    assert (rec.concurrency_source, moon.concurrency_source) == ("measured", "estimated")
    # the sample's server cached exactly the full blocks seen before: what was cacheable at block size 512
    assert rec.cached_share == pytest.approx(rec.cacheable_share) and moon.cached_share is None


@pytest.mark.parametrize(
    "name", ["recorded.jsonl", "recorded_rotated", "mooncake.jsonl", "azure.csv", "burstgpt.csv", "mooncake_fit.jsonl"]
)
def test_fit_validates_as_a_workload_spec(name):
    trace = load_trace(DATA / name)
    doc = fit(trace)
    spec = WorkloadSpec.load(doc)
    assert spec.arrivals == "poisson" and spec.num_requests == len(trace) and spec.mode == "completion"
    assert spec.prompt_len.kind == spec.output_len.kind == "lognormal"
    assert (spec.shared_prefix is not None) == (trace.block_size is not None)
    if spec.shared_prefix is not None:
        assert spec.shared_prefix.num_tokens % trace.block_size == 0
    assert doc == fit(trace) and json.loads(json.dumps(doc)) == doc  # deterministic, plain data


def test_fitted_spec_generates_traffic_like_the_trace():
    """Source vs WorkloadSpec's own generation from the fitted spec (400 requests, seed 0):
    p50 lengths within 15%, mean rate within 15%, cacheable share within 0.1, CV within 0.2."""
    trace = load_trace(FIT_SAMPLE)
    src = summarize(trace)
    assert src.num_requests == 400 and src.cacheable_share > 0.5
    spec = WorkloadSpec.load(fit(trace))
    gen = summarize(requests_to_trace(generate_requests(spec, WordTokenizer()), block_size=trace.block_size))
    assert gen.num_requests == src.num_requests
    assert gen.prompt_tokens.p50 == pytest.approx(src.prompt_tokens.p50, rel=0.15)
    assert gen.output_tokens.p50 == pytest.approx(src.output_tokens.p50, rel=0.15)
    assert gen.prompt_tokens.mean == pytest.approx(src.prompt_tokens.mean, rel=0.15)
    assert gen.mean_rate == pytest.approx(src.mean_rate, rel=0.15)
    assert gen.interarrival_cv == pytest.approx(src.interarrival_cv, abs=0.2)
    assert gen.cacheable_share == pytest.approx(src.cacheable_share, abs=0.1)


def test_bursty_trace_fits_gamma_arrivals():
    rng = np.random.default_rng(0)
    # bursts of 10 requests 10 ms apart, 20 s between bursts: CV far above 1
    times = [b * 20.0 + k * 0.01 for b in range(10) for k in range(10)]
    trace = Trace([TraceRequest(t, int(rng.integers(50, 150)), 20) for t in times], "bursty.csv", "azure", None)
    s = summarize(trace)
    assert s.interarrival_cv > 2 and s.peak_rate_1s == 10.0
    doc = fit(trace)
    assert doc["arrivals"] == "gamma" and f"Inter-arrival CV {s.interarrival_cv:.2f}" in doc["description"]
    assert doc["burstiness"] == pytest.approx(1 / s.interarrival_cv**2, rel=1e-3)
    assert "burstier" in doc["description"] and "shared_prefix" not in doc
    WorkloadSpec.load(doc)
    even = Trace([TraceRequest(0.5 * i, 10, 5) for i in range(20)], "even.csv", "azure", None)
    assert fit(even)["arrivals"] == "fixed_rate" and "burstiness" not in fit(even)


def test_empirical_lengths_keep_pairs(tmp_path):
    trace = load_trace(DATA / "burstgpt.csv")
    doc = fit(trace, lengths_path=tmp_path / "lengths.jsonl")
    assert "prompt_len" not in doc and doc["trace"] == str(tmp_path / "lengths.jsonl")
    rows = [json.loads(line) for line in (tmp_path / "lengths.jsonl").read_text().splitlines()]
    assert rows == [{"prompt_len": r.prompt_tokens, "output_len": r.output_tokens} for r in trace.requests]
    reqs = generate_requests(WorkloadSpec.load(doc), WordTokenizer())
    measured = [r for r in reqs if not r.is_warmup]
    assert [len(r.prompt_token_ids) for r in measured] == [r.prompt_tokens for r in trace.requests]


def test_fit_command_writes_a_workload_file(tmp_path, capsys):
    out = tmp_path / "served.yaml"
    summary = fit_command(DATA / "mooncake.jsonl", out, empirical=True, max_requests=50, time_scale=2.0)
    assert summary.num_requests == 50
    assert yaml.safe_load(out.read_text())["trace"] == "served.lengths.jsonl"  # relative to the YAML
    spec = WorkloadSpec.load(out)
    assert spec.name == "served" and Path(spec.trace).is_file() and spec.num_requests == 50
    assert "peak concurrency" in capsys.readouterr().out


def test_replayed_prompts_reproduce_the_cacheable_share():
    """build_prompts on the workload corpus, re-hashed: the same blocks shared as in the trace."""
    trace = load_trace(DATA / "mooncake.jsonl")
    prompts = build_prompts(trace, corpus_token_ids(WordTokenizer()))
    rebuilt = Trace(
        [
            TraceRequest(r.arrival_s, len(p), r.output_tokens, tuple(block_hash_ids(p, 512)))
            for r, p in zip(trace.requests, prompts)
        ],
        "rebuilt",
        "recorded",
        512,
    )
    assert summarize(rebuilt).cacheable_share == pytest.approx(summarize(trace).cacheable_share, abs=0.01)
