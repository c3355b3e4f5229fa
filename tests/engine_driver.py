"""Driving an `LLMEngine` by token ids in tests: no tokenizer files, greedy outputs per prompt."""

from __future__ import annotations

from slotune.engine import SamplingParams
from slotune.engine.llm_engine import LLMEngine
from slotune.engine.tokenizer import Tokenizer


class IdsTokenizer:
    """Prompts are token ids; nothing to encode, decoded text is not compared."""

    eos_token_id = None
    eos_token_ids = frozenset()

    def decode(self, ids, skip_special_tokens=True):
        return ""

    decode_delta = Tokenizer.decode_delta  # the engine's incremental decoding, over the decode above


def generate(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy output token ids of each prompt (ignore_eos), all submitted at once, in prompt order."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.output_token_ids
    return [done[f"r{i}"] for i in range(len(prompts))]
