"""PagedScorer and the lm-eval adapter against the engine's own per-sequence scoring."""

from __future__ import annotations

import pytest

from slotune.evals.scoring import PagedScorer


def test_scores_match_prompt_logprobs(llm):
    tok = llm.tokenizer
    texts = [
        "The quick brown fox jumps over the lazy dog.",
        "In the beginning God created the heaven and the earth.",
        "Hello world",
        "Q: What is 2 plus 3?\nA: 5",
    ]
    reqs = [(tok.encode(t), min(3, len(tok.encode(t)) - 1)) for t in texts]
    reqs.append((tok.encode(texts[1]), len(tok.encode(texts[1])) - 1))  # every position
    batched = PagedScorer(llm).score(reqs)
    alone = [PagedScorer(llm).score([r])[0] for r in reqs]  # the lone-sequence path
    for (ids, n), b, a in zip(reqs, batched, alone):
        ref = llm.prompt_logprobs([ids])[0]
        assert b.logprobs == pytest.approx(ref.token_logprobs[-n:], abs=1e-3)
        assert a.logprobs == pytest.approx(ref.token_logprobs[-n:], abs=1e-3)
        assert b.is_greedy == ref.is_greedy[-n:]
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks  # all blocks returned


def test_small_batches_and_bad_requests(llm):
    ids = llm.tokenizer.encode("one two three four five six seven eight")
    sc = PagedScorer(llm, max_batch_tokens=len(ids))  # one sequence per forward
    out = sc.score([(ids, 2)] * 3)
    assert out[0].logprobs == pytest.approx(out[2].logprobs, abs=1e-4)
    with pytest.raises(ValueError, match="cannot score 0 of"):
        sc.score([(ids, 0)])
    with pytest.raises(ValueError, match="cannot score"):
        sc.score([(ids * 200, 1)])


def test_adapter_requests(llm):
    from lm_eval.api.instance import Instance

    from slotune.evals.lm_eval_adapter import SlotuneLM

    lm = SlotuneLM(llm)
    mk = lambda kind, args: Instance(request_type=kind, doc={}, arguments=args, idx=0)  # noqa: E731
    (good, good_greedy), (bad, _) = lm.loglikelihood(
        [
            mk("loglikelihood", ("The capital of France is", " Paris")),
            mk("loglikelihood", ("The capital of France is", " banana")),
        ]
    )
    assert good > bad and good < 0
    # trailing context space moves onto the continuation: same tokens either way
    ((a, _),) = lm.loglikelihood([mk("loglikelihood", ("The capital of France is ", "Paris"))])
    assert a == pytest.approx(good, abs=1e-4)
    text = "In the beginning God created the heaven and the earth. " * 30
    (whole,) = lm.loglikelihood_rolling([mk("loglikelihood_rolling", (text,))])
    lm.max_length = 64  # forces several disjoint windows
    (windowed,) = lm.loglikelihood_rolling([mk("loglikelihood_rolling", (text,))])
    assert whole < 0 and windowed < 0 and windowed != pytest.approx(whole)
    (out,) = lm.generate_until(
        [mk("generate_until", ("Q: What is 2 plus 2?\nA:", {"until": ["\n"], "max_gen_toks": 8}))]
    )
    assert "\n" not in out and len(out) > 0
