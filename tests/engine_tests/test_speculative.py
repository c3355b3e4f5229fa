"""Speculative decoding: n-gram, early-exit, quantized-copy and draft-model proposers; lossless verify."""

from __future__ import annotations


import pytest
import torch

from slotune.engine import SamplingParams
from slotune.engine.loader import resolve_model_path
from slotune.engine.sampler import Sampler
from slotune.engine.scheduler import ScheduledSeq
from slotune.engine.sequence import Sequence
from slotune.engine.speculative import DraftSampler, NgramProposer, rejection_sample, verify_batch

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)
PROMPTS = ["The capital of France is", "one two three one two three one two three one two"]
CHI2_P001 = {4: 18.47, 5: 20.52, 7: 24.32, 35: 66.62}  # chi-square critical values at p = 0.001


def _chi2(counts: torch.Tensor, expected: torch.Tensor) -> float:
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token with zero target probability was emitted"
    return (((counts - expected) ** 2)[keep] / expected[keep]).sum().item()


# --- proposers, unit level ------------------------------------------------------------------
def test_ngram_lookup_finds_latest_longest_match():
    p = NgramProposer.__new__(NgramProposer)
    p.n_max, p.n_min = 3, 1
    assert p.draft([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3], 2) == [7, 5]  # latest match of the 3-gram
    assert p.draft([8, 1, 2, 7, 1, 2], 3) == [7, 1, 2]
    assert p.draft([4, 5, 6], 2) == []
    p.n_min = 2
    assert p.draft([5, 9, 1, 3, 1], 2) == []  # only a 1-gram matches


# --- verification math, small vocabularies --------------------------------------------------
def test_point_mass_draft_preserves_the_target_distribution():
    p = torch.tensor([0.05, 0.4, 0.25, 0.2, 0.1])
    probs = torch.stack([p, torch.full((5,), 0.2)])
    g = torch.Generator().manual_seed(1)
    n = 20000
    counts = torch.zeros(5)
    for _ in range(n):
        counts[rejection_sample(probs, [1], g)[0]] += 1  # the draft always proposes token 1
    assert _chi2(counts, p * n) < CHI2_P001[4]


def test_sampled_drafts_give_the_target_joint_distribution_over_two_tokens():
    """k = 2 drafts sampled from q; the emitted (t0, t1) must follow p(t0) p(t1 | t0).

    Target: p0 for t0, then p1 if t0 == the first draft, else r(t0) (a different distribution
    for every other prefix), as in real decoding where position 2's target depends on t0.
    """
    V = 6
    g = torch.Generator().manual_seed(0)
    p0 = torch.tensor([0.3, 0.25, 0.2, 0.1, 0.1, 0.05])
    q0 = torch.tensor([0.1, 0.1, 0.3, 0.3, 0.1, 0.1])
    r = torch.softmax(torch.randn(V, V, generator=g), -1)  # r[t0] = target after prefix t0
    q1 = torch.tensor([0.5, 0.1, 0.1, 0.1, 0.1, 0.1])
    n = 30000
    counts = torch.zeros(V, V)
    for _ in range(n):
        d0 = int(torch.multinomial(q0, 1, generator=g))
        d1 = int(torch.multinomial(q1, 1, generator=g))
        p1 = r[d0]  # the target after the draft prefix
        p2 = torch.full((V,), 1 / V)
        out = rejection_sample(torch.stack([p0, p1, p2]), [d0, d1], g, torch.stack([q0, q1]))
        t0 = out[0]
        t1 = out[1] if len(out) > 1 else int(torch.multinomial(r[t0], 1, generator=g))  # next step
        counts[t0, t1] += 1
    expected = p0[:, None] * r * n
    assert _chi2(counts.flatten(), expected.flatten()) < CHI2_P001[35]


def test_draft_equal_to_target_is_always_accepted():
    p = torch.tensor([[0.2, 0.3, 0.5], [0.6, 0.2, 0.2], [1 / 3, 1 / 3, 1 / 3]])
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        assert len(rejection_sample(p, [1, 0], g, p[:2])) == 3


@pytest.mark.parametrize(
    "params", [SamplingParams(temperature=0.7, top_k=4), SamplingParams(temperature=1.3, top_p=0.8)]
)
def test_verify_batch_samples_the_filtered_target(params):
    """The engine's glue: temperature/top-k/top-p target via Sampler.probs, drafts via DraftSampler."""
    V = 8
    torch.manual_seed(0)
    target_logits = torch.randn(2, V) * 2
    draft_logits = target_logits[:1] + torch.randn(1, V)  # a close-but-different draft model

    sampler = Sampler(torch.device("cpu"), seed=3)
    drafts = DraftSampler(sampler)
    p_target = sampler.probs(target_logits[:1], [params])[0]
    n = 2500
    counts = torch.zeros(V)
    accepted = 0
    for _ in range(n):
        seq = Sequence("r", [1, 2], params, 0.0)
        drafts.reset()
        seq.spec_token_ids = drafts.choose([seq], draft_logits)
        toks = verify_batch([(ScheduledSeq(seq, 2, 1), target_logits)], sampler, drafts.draft_probs)[0]
        counts[toks[0]] += 1
        accepted += len(toks) == 2
    assert _chi2(counts, p_target * n) < CHI2_P001[7]
    q = sampler.probs(draft_logits, [params])[0]
    assert accepted / n == pytest.approx(torch.minimum(p_target, q).sum().item(), abs=0.04)  # 1 - TV(p, q)
    assert not drafts.draft_probs  # consumed


# --- engine level --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def reference(llm):
    return [o.output_token_ids for o in llm.generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize(
    "spec",
    [
        {"method": "ngram", "num_speculative_tokens": 3},
        {"method": "early_exit", "early_exit_layers": 6, "num_speculative_tokens": 2},
        {"method": "quantized", "draft_quantization": "int8", "num_speculative_tokens": 3},
    ],
    ids=["ngram", "early_exit", "quantized"],
)
def test_greedy_is_lossless(make_llm, reference, spec):
    s = make_llm(speculative=spec)
    assert [o.output_token_ids for o in s.generate(PROMPTS, GREEDY)] == reference
    st = s.engine.stats()
    assert st.num_draft_tokens > 0 and st.num_accepted_tokens > 0
    assert st.num_spec_verifications > 0 and 1 < st.spec_mean_accepted_length <= spec["num_speculative_tokens"] + 1
    assert st.num_free_blocks == st.num_total_blocks


@pytest.mark.parametrize(
    "spec",
    [
        {"method": "early_exit", "early_exit_layers": 30, "num_speculative_tokens": 4},
        {"method": "model", "draft_model": str(resolve_model_path("smollm2-135m")), "num_speculative_tokens": 4},
    ],
    ids=["early_exit_all_layers", "model_same_weights"],
)
def test_a_draft_identical_to_the_target_is_always_accepted(make_llm, reference, spec):
    """All 30 layers as the 'early exit', or the target's own file as the draft model: every draft
    must be accepted, which checks that the draft's KV (shared or its own) is exactly right."""
    s = make_llm(speculative=spec)
    assert [o.output_token_ids for o in s.generate(PROMPTS, GREEDY)] == reference
    st = s.engine.stats()
    assert st.spec_acceptance_rate == 1.0
    assert st.spec_mean_accepted_length > 3
    if spec["method"] == "model":
        bm = s.engine.proposer.bm
        assert bm.num_free_blocks == bm.num_blocks  # mirrors freed with their sequences


def test_early_exit_with_int8_kv_and_prefix_caching_is_lossless(make_llm):
    """The early-exit draft writes layers < k of the shared (quantized, prefix-cached) cache."""
    common = {"kv_dtype": "int8", "enable_prefix_caching": True, "block_size": 8, "max_num_seqs": 1}
    prompts = [PROMPTS[1], PROMPTS[1] + " three"]
    plain = make_llm(**common)
    ref = [o.output_token_ids for o in plain.generate(prompts, GREEDY)]
    del plain
    s = make_llm(**common, speculative={"method": "early_exit", "early_exit_layers": 8, "num_speculative_tokens": 3})
    outs = [s.generate(p, GREEDY)[0] for p in prompts]  # the second one starts from the first's blocks
    assert [o.output_token_ids for o in outs] == ref
    assert outs[1].metrics.num_cached_prompt_tokens > 0


def test_seeded_sampling_with_a_model_draft_is_reproducible(make_llm):
    s = make_llm(speculative={"method": "quantized", "draft_quantization": "int8", "num_speculative_tokens": 3})
    p = SamplingParams(max_tokens=10, temperature=0.8, seed=11, ignore_eos=True)
    a = s.generate(PROMPTS[1], p)[0].output_token_ids
    b = s.generate(PROMPTS[1], p)[0].output_token_ids
    assert a == b and len(a) == 10
    st = s.engine.stats()
    assert st.num_draft_tokens > 0
    assert not s.engine.proposer.drafts.draft_probs or all(
        len(v) <= 3 for v in s.engine.proposer.drafts.draft_probs.values()
    )


def test_drafts_respect_max_tokens(make_llm):
    s = make_llm(speculative={"method": "ngram", "num_speculative_tokens": 8})
    for n in (1, 2, 5):
        out = s.generate(PROMPTS[1], SamplingParams(max_tokens=n, ignore_eos=True))[0]
        assert len(out.output_token_ids) == n
