"""Prefix caching at the engine level: hits on a shared system prompt, identical outputs, accounting."""

from __future__ import annotations

import pytest

from slotune.engine import SamplingParams

GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)
SYSTEM = "You are a careful assistant. Answer briefly and cite the source. " * 4  # ~60 tokens
QUESTIONS = ["Question: what is 2+2?", "Question: what is the capital of Spain?", "Question: name a prime number."]


@pytest.fixture(scope="module")
def cached(make_llm):
    return make_llm(enable_prefix_caching=True, block_size=8, num_kv_blocks=48)


@pytest.fixture(scope="module")
def reference(make_llm):
    plain = make_llm(enable_prefix_caching=False, block_size=8, num_kv_blocks=48)
    return [o.output_token_ids for o in plain.generate([SYSTEM + q for q in QUESTIONS], GREEDY)]


def test_second_request_hits_the_cache_and_outputs_are_unchanged(cached, reference):
    n_sys = len(cached.tokenizer.encode(SYSTEM))
    first = cached.generate(SYSTEM + QUESTIONS[0], GREEDY)[0]
    assert first.metrics.num_cached_prompt_tokens == 0
    # later requests (one at a time, then concurrently) reuse every full block of the system prompt
    second = cached.generate(SYSTEM + QUESTIONS[1], GREEDY)[0]
    assert second.metrics.num_cached_prompt_tokens >= (n_sys // 8 - 1) * 8
    together = cached.generate([SYSTEM + q for q in QUESTIONS], GREEDY)
    assert all(o.metrics.num_cached_prompt_tokens >= (n_sys // 8 - 1) * 8 for o in together)
    assert [first.output_token_ids, second.output_token_ids] == reference[:2]
    assert [o.output_token_ids for o in together] == reference
    st = cached.engine.stats()
    assert 0.5 < st.prefix_cache_hit_rate < 1
    # every block is back on the free list (refcount 0), hashed ones still findable
    assert st.num_free_blocks == st.num_total_blocks
    assert all(r == 0 for r in cached.engine.block_manager.ref_counts)


def test_identical_prompt_recomputes_only_its_last_token(cached):
    ids = cached.tokenizer.encode(SYSTEM + QUESTIONS[2])
    cached.generate(ids, GREEDY)
    again = cached.generate(ids, GREEDY)[0]
    # at least one prompt token is always computed (the step needs its logits)
    assert again.metrics.num_cached_prompt_tokens == (len(ids) - 1) // 8 * 8


def test_eviction_under_pressure_is_lru_and_stays_correct(cached, reference):
    """Fill the cache with unrelated prompts: the system prompt's blocks are evicted, outputs stay right."""
    bm = cached.engine.block_manager
    filler = [f"Unrelated text number {i}: " + "lorem ipsum dolor sit amet " * 12 for i in range(6)]
    cached.generate(filler, SamplingParams(max_tokens=1))  # ~60 blocks through a 48-block cache
    out = cached.generate(SYSTEM + QUESTIONS[0], GREEDY)[0]
    assert out.metrics.num_cached_prompt_tokens < len(cached.tokenizer.encode(SYSTEM)) - 8
    assert out.output_token_ids == reference[0]
    assert bm.num_free_blocks == bm.num_blocks


def test_prefix_cache_with_sampling_seed_is_reproducible(cached, make_llm):
    p = SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)
    a = cached.generate(SYSTEM + QUESTIONS[1], p)[0]
    b = cached.generate(SYSTEM + QUESTIONS[1], p)[0]
    assert b.metrics.num_cached_prompt_tokens > 0
    assert a.output_token_ids == b.output_token_ids
