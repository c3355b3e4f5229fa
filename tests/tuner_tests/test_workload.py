import pytest
from pydantic import ValidationError

from slotune.tuner.workload import WorkloadSpec, builtin_workloads, generate_requests


@pytest.fixture(scope="module")
def tok(llm):
    return llm.tokenizer


def test_builtins_load():
    names = builtin_workloads()
    assert {"chat-small", "batch-mixed", "shared-prefix"} <= set(names)
    for n in names:
        assert WorkloadSpec.load(n).name == n


def test_same_seed_same_requests_other_seed_differs(tok):
    spec = WorkloadSpec.load("batch-mixed")
    a, b = generate_requests(spec, tok), generate_requests(spec, tok)
    assert [(r.prompt_token_ids, r.output_len) for r in a] == [(r.prompt_token_ids, r.output_len) for r in b]
    c = generate_requests(spec, tok, seed=1)
    assert [r.prompt_token_ids for r in a] != [r.prompt_token_ids for r in c]


def test_lengths_follow_distribution_bounds(tok):
    spec = WorkloadSpec(num_requests=50, prompt_len={"kind": "uniform", "min": 10, "max": 20},
                        output_len={"kind": "lognormal", "mean": 30, "sigma": 1.0, "min": 5, "max": 40})
    reqs = generate_requests(spec, tok)
    assert all(10 <= len(r.prompt_token_ids) <= 20 and 5 <= r.output_len <= 40 for r in reqs)
    assert len({r.output_len for r in reqs}) > 3


def test_poisson_arrivals_and_shared_prefix(tok):
    spec = WorkloadSpec.load("shared-prefix")
    reqs = generate_requests(spec, tok)
    offs = [r.arrival_offset_s for r in reqs]
    assert offs == sorted(offs) and offs[-1] > 0
    prefix = reqs[0].prompt_token_ids[:384]
    assert all(r.prompt_token_ids[:384] == prefix for r in reqs)


def test_trace_file(tok, tmp_path):
    (tmp_path / "t.jsonl").write_text('{"prompt": "hello there", "output_len": 3}\n{"prompt_len": 7, "output_len": 5}\n')
    (tmp_path / "w.yaml").write_text("trace: t.jsonl\nnum_requests: 4\nwarmup_requests: 0\n")
    reqs = generate_requests(WorkloadSpec.load(tmp_path / "w.yaml"), tok)
    assert reqs[0].prompt_token_ids == tok.encode("hello there") and [r.output_len for r in reqs] == [3, 5, 3, 5]
    assert len(reqs[1].prompt_token_ids) == 7


def test_bad_specs_name_the_problem():
    with pytest.raises(ValidationError, match="rate is required"):
        WorkloadSpec(arrivals="poisson")
    with pytest.raises(ValidationError, match="min"):
        WorkloadSpec(prompt_len={"kind": "uniform", "min": 9, "max": 2})
    with pytest.raises(ValueError, match="unknown workload 'nope'"):
        WorkloadSpec.load("nope")
