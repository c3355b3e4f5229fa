"""End-to-end engine behaviour on the real bundled SmolLM2-135M model (CPU)."""

from __future__ import annotations

import pytest
import torch

from slotune.engine import EngineConfig, RequestRejected, SamplingParams

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]


def _greedy_reference(llm, ids: list[int], n: int) -> list[int]:
    """Greedy decoding by full recomputation, with no KV cache: the ground truth for the paged path."""
    out = list(ids)
    for _ in range(n):
        out.append(int(llm.logits(out)[-1].argmax()))
    return out[len(ids) :]


def test_batched_paged_greedy_equals_recompute(llm):
    ids = [llm.tokenizer.encode(p) for p in PROMPTS]
    outs = llm.generate(ids, SamplingParams(max_tokens=12, ignore_eos=True))
    for prompt_ids, out in zip(ids, outs):
        assert out.output_token_ids == _greedy_reference(llm, prompt_ids, 12)
        assert out.finish_reason == "length"


def test_chunked_prefill_and_preemption_do_not_change_tokens(llm):
    from slotune.engine import LLM

    tight = LLM(
        EngineConfig(max_num_batched_tokens=16, num_kv_blocks=6, block_size=8, max_num_seqs=4, max_model_len=64)
    )
    ids = [llm.tokenizer.encode(p * 3) for p in PROMPTS]
    outs = tight.generate(ids, SamplingParams(max_tokens=10, ignore_eos=True))
    ref = llm.generate(ids, SamplingParams(max_tokens=10, ignore_eos=True))
    assert [o.output_token_ids for o in outs] == [o.output_token_ids for o in ref]
    st = tight.engine.stats()
    assert st.num_preemptions > 0  # the tiny cache forced recompute
    assert st.num_free_blocks == st.num_total_blocks


def test_step_counters_account_for_every_token_and_second(llm):
    """EngineStats' step counters (exported on /metrics): tokens through the model and loop time."""
    ids = [llm.tokenizer.encode(p) for p in PROMPTS]
    before = llm.engine.stats()
    llm.generate(ids, SamplingParams(max_tokens=5, ignore_eos=True))
    after = llm.engine.stats()
    # every prompt token once (no prefix cache hit on these), then 4 decode tokens per request
    assert after.num_step_tokens - before.num_step_tokens == sum(len(x) for x in ids) + 4 * len(ids)
    steps = after.num_steps - before.num_steps
    model_s, step_s = after.execute_seconds - before.execute_seconds, after.step_seconds - before.step_seconds
    assert steps >= 5 and 0 < model_s < step_s


def test_stop_strings_tokens_and_max_tokens(llm):
    base = llm.generate(PROMPTS[2], SamplingParams(max_tokens=20, ignore_eos=True))[0]
    word = base.text.split()[2]
    out = llm.generate(PROMPTS[2], SamplingParams(max_tokens=20, stop=[word], ignore_eos=True))[0]
    assert out.finish_reason == "stop" and word not in out.text and base.text.startswith(out.text)
    tok = base.output_token_ids[3]
    out = llm.generate(PROMPTS[2], SamplingParams(max_tokens=20, stop_token_ids=[tok], ignore_eos=True))[0]
    assert out.output_token_ids[-1] == tok and out.finish_reason == "stop"
    assert len(llm.generate(PROMPTS[2], SamplingParams(max_tokens=5, ignore_eos=True))[0].output_token_ids) == 5


def test_chat_template_answer_stops_at_eos(llm):
    prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    out = llm.generate(prompt, SamplingParams(max_tokens=40))[0]
    assert out.finish_reason == "stop" and "Paris" in out.text
    assert out.output_token_ids[-1] == llm.tokenizer.eos_token_id


def test_seeded_sampling_is_reproducible_and_varies_by_seed(llm):
    p = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95, top_k=50, seed=7, ignore_eos=True)
    a = llm.generate(PROMPTS[2], p)[0].output_token_ids
    b = llm.generate([PROMPTS[2], PROMPTS[0]], [p, p])[0].output_token_ids  # batch mates don't matter
    c = llm.generate(PROMPTS[2], SamplingParams(max_tokens=16, temperature=1.0, seed=8, ignore_eos=True))[
        0
    ].output_token_ids
    assert a == b and a != c


def test_timestamps_are_ordered(llm):
    out = llm.generate(PROMPTS[0], SamplingParams(max_tokens=6, ignore_eos=True))[0]
    m = out.metrics
    assert m.arrival_time <= m.scheduled_time <= m.first_token_time <= m.finish_time
    assert len(m.token_times) == 6 and m.token_times == sorted(m.token_times)
    assert m.ttft > 0 and m.tpot >= 0


@pytest.mark.parametrize(
    ("field", "value", "reason"),
    [("max_prompt_tokens", 3, "prompt_too_long"), ("max_output_tokens", 2, "max_tokens_too_large")],
)
def test_admission_rejects_with_reason(llm, field, value, reason):
    from slotune.engine import LLM

    small = LLM(EngineConfig(num_kv_blocks=8, max_model_len=256, admission={field: value}))
    with pytest.raises(RequestRejected) as exc:
        small.engine.add_request("x", PROMPTS[2], SamplingParams(max_tokens=4))
    assert exc.value.reason == reason and str(value) in exc.value.message
    assert small.engine.stats().num_rejected == {reason: 1}


def test_request_that_can_never_fit_is_rejected_at_once(llm):
    from slotune.engine import LLM

    small = LLM(EngineConfig(num_kv_blocks=2, block_size=8, max_model_len=256))
    with pytest.raises(RequestRejected, match="KV blocks") as exc:
        small.engine.add_request("x", PROMPTS[2], SamplingParams(max_tokens=64))
    assert exc.value.reason == "never_fits"
    assert not small.engine.has_unfinished_requests()


def test_abort_frees_blocks(llm):
    eng = llm.engine
    eng.add_request("abort-me", PROMPTS[1], SamplingParams(max_tokens=50, ignore_eos=True))
    eng.step()
    assert eng.stats().num_free_blocks < eng.stats().num_total_blocks
    out = eng.abort_request("abort-me")
    assert out.finish_reason == "abort" and out.finished
    assert eng.stats().num_free_blocks == eng.stats().num_total_blocks


def test_prompt_logprobs_match_logits(llm):
    ids = llm.tokenizer.encode(PROMPTS[0])
    lp = llm.prompt_logprobs([ids])[0]
    ref = torch.log_softmax(llm.logits(ids), -1)
    assert len(lp.token_logprobs) == len(ids) - 1
    assert lp.token_logprobs[0] == pytest.approx(ref[0, ids[1]].item(), abs=1e-4)


def test_a_step_hook_sees_every_step_and_its_aborts_reach_the_outputs(llm):
    """The engine's extension point for per-step checks (the trial runner's in-flight early stop):
    the hook runs after each step with its outputs; outputs it returns are emitted by that step;
    removing it stops the calls. Nothing replaces `engine.step`."""
    eng = llm.engine
    seen: list[int] = []

    def hook(engine, outputs):
        seen.append(len(outputs))
        if len(seen) == 3:  # abort everything in flight, as the early stop does
            return [o for rid in list(engine.seqs) for o in [engine.abort_request(rid)] if o is not None]
        return None

    remove = eng.add_step_hook(hook)
    try:
        for i, p in enumerate(PROMPTS):
            eng.add_request(f"hook-{i}", p, SamplingParams(max_tokens=50, ignore_eos=True))
        finished = {}
        while eng.has_unfinished_requests():
            finished |= {o.request_id: o.finish_reason for o in eng.step() if o.finished}
    finally:
        remove()
    assert len(seen) == 3 and finished == {f"hook-{i}": "abort" for i in range(3)}
    eng.add_request("after", PROMPTS[0], SamplingParams(max_tokens=2, ignore_eos=True))
    while eng.has_unfinished_requests():
        eng.step()
    assert len(seen) == 3  # removed: not called again
    assert eng.stats().num_free_blocks == eng.stats().num_total_blocks


def test_stats_window_peak_counts_from_its_start_and_lifetime_peak_is_kept(llm):
    eng = llm.engine
    llm.generate([llm.tokenizer.encode(p * 4) for p in PROMPTS], SamplingParams(max_tokens=4, ignore_eos=True))
    lifetime = eng.stats().peak_blocks_used
    eng.start_stats_window()
    assert eng.stats().window_peak_blocks == 0  # nothing in flight
    llm.generate([llm.tokenizer.encode(PROMPTS[0])], SamplingParams(max_tokens=2, ignore_eos=True))
    st = eng.stats()
    assert 0 < st.window_peak_blocks < lifetime and st.peak_blocks_used == lifetime
