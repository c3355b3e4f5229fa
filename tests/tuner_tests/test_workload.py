from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError
from slotune.tuner.spec.workload_spec import WorkloadSpec, builtin_workloads
from slotune.tuner.workload.requests import generate_requests, iter_requests

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE_WORKLOADS = sorted((ROOT / "examples" / "workloads").glob("*.yaml"))


@pytest.fixture(scope="module")
def tok(llm):
    return llm.tokenizer


def _key(reqs):
    return [(r.request_id, r.prompt_token_ids, r.output_len, r.arrival_offset_s) for r in reqs]


def test_builtins_load_by_name_and_generate(tok):
    names = builtin_workloads()
    assert {"chat-small", "batch-mixed", "shared-prefix"} <= set(names)
    for n in names:
        spec = WorkloadSpec.load(n)
        assert spec.name == n
        reqs = generate_requests(spec, tok)
        assert len(reqs) == spec.num_requests + spec.warmup_requests


@pytest.mark.parametrize("path", EXAMPLE_WORKLOADS, ids=lambda p: p.stem)
def test_example_workloads_load_and_generate(path, tok):
    spec = WorkloadSpec.load(path)
    reqs = generate_requests(spec, tok, max_requests=64)
    assert reqs and all(r.prompt_token_ids and r.output_len >= 1 for r in reqs)


def test_examples_exist():
    assert len(EXAMPLE_WORKLOADS) >= 2


def test_same_seed_same_requests_other_seed_differs(tok):
    spec = WorkloadSpec.load("batch-mixed")
    a, b = generate_requests(spec, tok), generate_requests(spec, tok)
    assert _key(a) == _key(b)
    c = generate_requests(spec, tok, seed=1)
    assert [r.prompt_token_ids for r in a] != [r.prompt_token_ids for r in c]


def test_measured_requests_do_not_depend_on_count_or_warmup(tok):
    base = WorkloadSpec(
        arrivals="poisson",
        rate=5,
        num_requests=10,
        warmup_requests=0,
        prompt_len={"kind": "uniform", "min": 4, "max": 40},
    )
    more = base.model_copy(update={"num_requests": 20, "warmup_requests": 3})
    a = generate_requests(base, tok)
    b = [r for r in generate_requests(more, tok) if not r.is_warmup]
    assert _key(a) == _key(b[:10])


def test_lengths_follow_distribution_bounds(tok):
    spec = WorkloadSpec(
        num_requests=50,
        prompt_len={"kind": "uniform", "min": 10, "max": 20},
        output_len={"kind": "lognormal", "mean": 30, "sigma": 1.0, "min": 5, "max": 40},
    )
    reqs = generate_requests(spec, tok)
    assert all(10 <= len(r.prompt_token_ids) <= 20 and 5 <= r.output_len <= 40 for r in reqs)
    assert len({r.output_len for r in reqs}) > 3


def test_stratified_lengths_cover_every_stratum_in_each_block_of_eight(tok):
    """Stratified (the default), each block of 8 requests takes one length from each eighth of the
    distribution: uniform 1..8 gives every value once per block, whatever the seed, so seeds differ
    in order, not in total tokens; independent draws repeat values and change the total."""
    spec = WorkloadSpec(
        num_requests=24,
        warmup_requests=0,
        output_len={"kind": "uniform", "min": 1, "max": 8},
        prompt_len={"kind": "uniform", "min": 9, "max": 16},
    )
    orders = set()
    for seed in range(4):
        reqs = generate_requests(spec, tok, seed=seed)
        for b in range(0, 24, 8):
            block = reqs[b : b + 8]
            assert sorted(r.output_len for r in block) == list(range(1, 9))
            assert sorted(len(r.prompt_token_ids) for r in block) == list(range(9, 17))
        orders.add(tuple(r.output_len for r in reqs))
    assert len(orders) == 4  # the order is the seed's
    independent = spec.model_copy(update={"length_sampling": "independent"})
    totals = {sum(r.output_len for r in generate_requests(independent, tok, seed=s)) for s in range(4)}
    assert len(totals) > 1


def test_stratified_lognormal_lengths_keep_the_median(tok):
    """The quantile transform is the distribution's: the median of many stratified lognormal lengths
    is the spec's median (`mean`), and a short run (the screening head) is the long run's beginning."""
    spec = WorkloadSpec(
        num_requests=400,
        warmup_requests=0,
        prompt_len={"kind": "fixed", "value": 4},
        output_len={"kind": "lognormal", "mean": 40, "sigma": 0.8, "min": 1, "max": 4000},
    )
    lens = sorted(r.output_len for r in generate_requests(spec, tok))
    assert 38 <= lens[200] <= 42
    head = generate_requests(spec.model_copy(update={"num_requests": 12}), tok)
    assert _key(head) == _key(generate_requests(spec, tok)[:12])


def test_prompts_are_windows_of_the_real_corpus(tok):
    reqs = generate_requests(WorkloadSpec(num_requests=3, prompt_len={"kind": "fixed", "value": 40}), tok)
    text = tok.decode(reqs[0].prompt_token_ids)
    assert sum(c.isalpha() or c.isspace() for c in text) / len(text) > 0.8  # English prose, not random ids


def test_poisson_and_fixed_rate_arrivals(tok):
    reqs = generate_requests(WorkloadSpec(arrivals="poisson", rate=4.0, num_requests=400, warmup_requests=0), tok)
    offs = [r.arrival_offset_s for r in reqs]
    assert offs[0] == 0 and offs == sorted(offs)
    assert 3.0 < len(offs) / offs[-1] < 5.0  # mean rate close to 4/s
    fixed = generate_requests(WorkloadSpec(arrivals="fixed_rate", rate=2.0, num_requests=3, warmup_requests=0), tok)
    assert [r.arrival_offset_s for r in fixed] == [0.0, 0.5, 1.0]


def test_duration_bounds_open_loop_and_closed_loop_needs_a_cap(tok):
    spec = WorkloadSpec(arrivals="fixed_rate", rate=10.0, duration_s=1.0, warmup_requests=0)
    assert spec.num_requests is None
    assert len(generate_requests(spec, tok)) == 11  # t = 0.0 .. 1.0
    closed = WorkloadSpec(duration_s=1.0, warmup_requests=0)
    with pytest.raises(ValueError, match="unbounded"):
        generate_requests(closed, tok)
    assert len(generate_requests(closed, tok, max_requests=5)) == 5
    assert WorkloadSpec().num_requests == 16


def test_shared_prefix_tokens_fraction_and_text(tok):
    spec = WorkloadSpec.load("shared-prefix")
    reqs = generate_requests(spec, tok)
    offs = [r.arrival_offset_s for r in reqs]
    assert offs == sorted(offs) and offs[-1] > 0
    prefix = reqs[0].prompt_token_ids[:384]
    assert all(r.prompt_token_ids[:384] == prefix for r in reqs)
    half = WorkloadSpec(num_requests=200, shared_prefix={"num_tokens": 32, "fraction": 0.5})
    n = sum(r.prompt_token_ids[:32] == prefix[:32] for r in generate_requests(half, tok))
    assert 70 < n < 130
    text = WorkloadSpec(num_requests=2, shared_prefix={"text": "You are a terse assistant."})
    ids = tok.encode("You are a terse assistant.")
    assert all(r.prompt_token_ids[: len(ids)] == ids for r in generate_requests(text, tok))


def test_chat_mode_applies_the_template_with_prefix_as_system(tok):
    spec = WorkloadSpec(
        mode="chat", num_requests=2, warmup_requests=0, shared_prefix={"text": "You are a terse assistant."}
    )
    for r in generate_requests(spec, tok):
        text = tok.decode(r.prompt_token_ids, skip_special_tokens=False)
        assert text.startswith("<|im_start|>system\nYou are a terse assistant.<|im_end|>\n<|im_start|>user\n")
        assert text.endswith("<|im_start|>assistant\n")


def test_trace_file_relative_to_the_workload_yaml(tok, tmp_path):
    (tmp_path / "t.jsonl").write_text(
        '{"prompt": "hello there", "output_len": 3}\n\n{"prompt_len": 7, "output_len": 5}\n'
    )
    (tmp_path / "w.yaml").write_text("trace: t.jsonl\nnum_requests: 4\nwarmup_requests: 0\n")
    reqs = generate_requests(WorkloadSpec.load(tmp_path / "w.yaml"), tok)
    assert reqs[0].prompt_token_ids == tok.encode("hello there") and [r.output_len for r in reqs] == [3, 5, 3, 5]
    assert len(reqs[1].prompt_token_ids) == 7
    (tmp_path / "bad.jsonl").write_text('{"prompt_len": 7}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1: each line needs output_len"):
        generate_requests(WorkloadSpec(trace=str(tmp_path / "bad.jsonl")), tok)


def test_iter_requests_is_lazy_for_unbounded_closed_loop(tok):
    stream = iter_requests(WorkloadSpec(duration_s=5.0, warmup_requests=1), tok)
    first = [next(stream) for _ in range(100)]
    assert first[0].is_warmup and first[1].request_id == "req-0" and first[-1].request_id == "req-98"


def test_bad_specs_name_the_problem(tmp_path):
    with pytest.raises(ValidationError, match="rate is required"):
        WorkloadSpec(arrivals="poisson")
    with pytest.raises(ValidationError, match="min"):
        WorkloadSpec(prompt_len={"kind": "uniform", "min": 9, "max": 2})
    with pytest.raises(ValidationError, match="exactly one of num_tokens or text"):
        WorkloadSpec(shared_prefix={"fraction": 0.5})
    with pytest.raises(ValidationError, match="extra"):
        WorkloadSpec(prompt_length=5)
    with pytest.raises(ValueError, match="unknown workload 'nope'"):
        WorkloadSpec.load("nope")
    with pytest.raises(FileNotFoundError, match="missing.yaml"):
        WorkloadSpec.load(tmp_path / "missing.yaml")
    (tmp_path / "list.yaml").write_text(yaml.safe_dump([1, 2]))
    with pytest.raises(ValueError, match="must hold a mapping"):
        WorkloadSpec.load(tmp_path / "list.yaml")
