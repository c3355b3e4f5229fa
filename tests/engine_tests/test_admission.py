"""Admission control: every rejection reason, fast and explicit; nothing that fits waits forever."""

from __future__ import annotations

import pytest

from slotune.engine import RequestRejected, SamplingParams

ADMISSION = {"max_prompt_tokens": 100, "max_output_tokens": 50, "max_queued_requests": 2, "max_tokens_in_flight": 150}


@pytest.fixture(scope="module")
def llm8(make_llm):
    """8 blocks of 16 tokens: 128 tokens of KV in all."""
    return make_llm(num_kv_blocks=8, block_size=16, max_model_len=256, admission=ADMISSION)


@pytest.fixture(autouse=True)
def drained(request):
    yield
    if "llm8" in request.fixturenames:
        eng = request.getfixturevalue("llm8").engine
        for rid in list(eng.seqs):
            eng.abort_request(rid)


def _reject(engine, prompt, params, reason: str) -> RequestRejected:
    before = dict(engine.stats().num_rejected)
    n_seqs, n_wait = len(engine.seqs), len(engine.scheduler.waiting)
    with pytest.raises(RequestRejected) as info:
        engine.add_request(f"rej-{reason}-{len(before)}", prompt, params)
    assert info.value.reason == reason
    # counted, and no state left behind
    assert engine.stats().num_rejected[reason] == before.get(reason, 0) + 1
    assert (len(engine.seqs), len(engine.scheduler.waiting)) == (n_seqs, n_wait)
    return info.value


def test_prompt_too_long(llm8):
    e = _reject(llm8.engine, [1] * 101, SamplingParams(max_tokens=1), "prompt_too_long")
    assert "101" in e.message and "100" in e.message
    _reject(llm8.engine, [], SamplingParams(max_tokens=1), "prompt_too_long")


def test_invalid_prompt_token_ids(llm8):
    _reject(llm8.engine, [1, 10**7], SamplingParams(max_tokens=1), "invalid_prompt")
    _reject(llm8.engine, [-1], SamplingParams(max_tokens=1), "invalid_prompt")


def test_max_tokens_too_large(llm8, llm):
    e = _reject(llm8.engine, [1] * 4, SamplingParams(max_tokens=51), "max_tokens_too_large")
    assert "max_output_tokens=50" in e.message
    # without an admission cap, prompt + max_tokens must still fit max_model_len (1024 here)
    e = _reject(llm.engine, [1] * 1000, SamplingParams(max_tokens=100), "max_tokens_too_large")
    assert "max_model_len (1024)" in e.message


def test_never_fits_is_rejected_at_once_not_queued(llm8):
    # 90 + 45 tokens = 9 blocks of 16 > the 8 blocks the cache has in all
    e = _reject(llm8.engine, [1] * 90, SamplingParams(max_tokens=45), "never_fits")
    assert "9 KV blocks" in e.message and "8 in all" in e.message


def test_queue_full_then_admitted_once_the_queue_drains(llm8):
    eng = llm8.engine
    p = SamplingParams(max_tokens=2, ignore_eos=True)
    eng.add_request("q0", [1] * 5, p)
    eng.add_request("q1", [2] * 5, p)
    _reject(eng, [3] * 5, p, "queue_full")
    eng.step()  # both admitted into the running batch: the queue is empty again
    assert not eng.scheduler.waiting
    eng.add_request("q2", [3] * 5, p)


def test_tokens_in_flight(llm8):
    eng = llm8.engine
    eng.add_request("t0", [1] * 97, SamplingParams(max_tokens=3, ignore_eos=True))  # 100 in flight
    e = _reject(eng, [2] * 30, SamplingParams(max_tokens=30), "tokens_in_flight")  # +60 > 150
    assert "100 tokens in flight" in e.message
    eng.add_request("t1", [2] * 47, SamplingParams(max_tokens=3, ignore_eos=True))  # +50 = 150: fits
    while eng.has_unfinished_requests():
        eng.step()
    eng.add_request("t2", [2] * 30, SamplingParams(max_tokens=30))  # all finished: room again


def test_speculative_slots_count_toward_never_fits(make_llm):
    # 120 + 8 = 128 tokens fill the 8 blocks exactly; 4 draft slots on top no longer fit
    spec = make_llm(num_kv_blocks=8, block_size=16, speculative={"method": "ngram", "num_speculative_tokens": 4})
    _reject(spec.engine, [1] * 120, SamplingParams(max_tokens=8), "never_fits")


def test_everything_admitted_finishes_under_block_pressure(make_llm):
    """Three requests of 5 blocks each through an 8-block cache: two start (4 blocks each), both
    outgrow their 4th block, one is preempted and recomputed; never a deadlock."""
    eng = make_llm(num_kv_blocks=8, block_size=16).engine
    p = SamplingParams(max_tokens=4, ignore_eos=True)
    outs = {}
    for i in range(2):
        eng.add_request(f"b{i}", [5 + i] * 62, p)
    steps = 0
    while eng.has_unfinished_requests():
        if steps == 1:
            eng.add_request("b2", [9] * 62, p)
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o
        steps += 1
        assert steps < 200
    assert sorted(outs) == ["b0", "b1", "b2"]
    assert all(len(o.output_token_ids) == 4 for o in outs.values())
    st = eng.stats()
    assert st.num_preemptions > 0 and st.num_free_blocks == 8
