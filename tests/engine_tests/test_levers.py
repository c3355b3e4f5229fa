"""Engine levers: quantized weights, KV precision, prefix caching, speculative decoding."""

from __future__ import annotations

import pytest
import torch

from slotune.engine import LLM, EngineConfig, SamplingParams
from slotune.engine.quantize import FP8Linear, Int4Linear, Int8Linear
from slotune.engine.speculative import NgramProposer, rejection_sample

GREEDY = SamplingParams(max_tokens=16, ignore_eos=True)
PROMPTS = ["The capital of France is", "one two three one two three one two three one two"]


@pytest.mark.parametrize(("cls", "args", "tol"), [(Int8Linear, (), 0.02), (Int4Linear, (32,), 0.25), (FP8Linear, (), 0.15)])
def test_quantized_linear_matches_its_dequantized_weights(cls, args, tol):
    torch.manual_seed(0)
    w, x = torch.randn(96, 128), torch.randn(5, 128)
    m = cls(w, *args)
    deq = m.dequantize()
    assert (deq - w).abs().max() < tol * w.abs().max() * 2
    rel = (m(x) - x @ deq.T).norm() / (x @ deq.T).norm()
    assert rel < 1e-2  # only the bf16 activation cast differs
    assert m.weight_bytes() < w.numel() * 4 / 3


def test_quantization_shrinks_weight_bytes_and_keeps_the_top_token(llm):
    sizes = {}
    ids = llm.tokenizer.encode("The capital of France is")
    ref = llm.logits(ids)[-1]
    for q in ("int8", "int4"):
        qllm = LLM(EngineConfig(quantization=q, num_kv_blocks=32, max_model_len=256))
        sizes[q] = qllm.engine.weight_bytes
        assert qllm.logits(ids)[-1].argmax() == ref.argmax()
    assert sizes["int4"] < sizes["int8"] < llm.engine.weight_bytes / 3


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_kv_precision_blocks_grow_with_same_budget_and_tokens_mostly_agree(llm, kv_dtype):
    base = LLM(EngineConfig(kv_cache_memory_gb=0.01, max_model_len=256))
    low = LLM(EngineConfig(kv_cache_memory_gb=0.01, max_model_len=256, kv_dtype=kv_dtype))
    assert low.engine.kv_bytes_per_token < base.engine.kv_bytes_per_token / 3
    assert low.engine.runner.num_blocks > 3 * base.engine.runner.num_blocks
    a = base.generate(PROMPTS[0], GREEDY)[0].output_token_ids
    b = low.generate(PROMPTS[0], GREEDY)[0].output_token_ids
    assert a[:4] == b[:4]


def test_prefix_cache_hits_and_outputs_unchanged():
    cfg = EngineConfig(enable_prefix_caching=True, num_kv_blocks=64, block_size=8, max_model_len=512)
    llm = LLM(cfg)
    system = "You are a careful assistant. Answer briefly and cite the source. " * 4
    first = llm.generate(system + "Question: what is 2+2?", GREEDY)[0]
    second = llm.generate(system + "Question: what is the capital of Spain?", GREEDY)[0]
    assert first.metrics.num_cached_prompt_tokens == 0 and second.metrics.num_cached_prompt_tokens >= 32
    plain = LLM(cfg.with_updates({"enable_prefix_caching": False}))
    assert plain.generate(system + "Question: what is the capital of Spain?", GREEDY)[0].output_token_ids == second.output_token_ids
    st = llm.engine.stats()
    assert st.prefix_cache_hit_rate > 0 and st.num_free_blocks == st.num_total_blocks


def test_ngram_lookup_finds_latest_longest_match():
    p = NgramProposer.__new__(NgramProposer)
    p.n_max, p.n_min = 3, 1
    assert p.draft([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3], 2) == [7, 5]
    assert p.draft([4, 5, 6], 2) == []


@pytest.mark.parametrize("spec", [{"method": "ngram", "num_speculative_tokens": 3},
                                  {"method": "early_exit", "early_exit_layers": 20, "num_speculative_tokens": 2},
                                  {"method": "quantized", "draft_quantization": "int8", "num_speculative_tokens": 3}])
def test_speculative_greedy_is_lossless(llm, spec):
    ref = [o.output_token_ids for o in llm.generate(PROMPTS, GREEDY)]
    s = LLM(EngineConfig(speculative=spec, num_kv_blocks=64, max_model_len=256))
    outs = s.generate(PROMPTS, GREEDY)
    assert [o.output_token_ids for o in outs] == ref
    st = s.engine.stats()
    assert st.num_draft_tokens > 0 and st.num_accepted_tokens > 0
    assert st.num_free_blocks == st.num_total_blocks


def test_rejection_sampling_preserves_the_target_distribution():
    """Small-vocabulary case: tokens sampled via draft+verify follow the target p exactly."""
    torch.manual_seed(0)
    p = torch.tensor([0.05, 0.4, 0.25, 0.2, 0.1])
    probs = torch.stack([p, torch.full((5,), 0.2)])
    g = torch.Generator().manual_seed(1)
    n = 20000
    counts = torch.zeros(5)
    for _ in range(n):
        counts[rejection_sample(probs, [1], g)[0]] += 1  # draft always proposes token 1
    expected = p * n
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 18.5  # chi-square, 4 dof, p = 0.001
