"""Prompts rebuilt from a trace's block hash ids: requests that share hash ids share prompt tokens."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence

from slotune.tuner.spec.traces import Trace


def build_prompts(trace: Trace, corpus_ids: Sequence[int], *, seed: int = 0) -> list[list[int]]:
    """`iter_prompts` as a list (a long trace's prompts take memory: a replay should iterate)."""
    return list(iter_prompts(trace, corpus_ids, seed=seed))


def iter_prompts(trace: Trace, corpus_ids: Sequence[int], *, seed: int = 0, stream: int = 0) -> Iterator[list[int]]:
    """Prompt token ids for every request of `trace`, reproducing its prefix sharing.

    Block i of a request is the corpus window that its hash id picks (start = a hash of seed and id,
    wrapping around the corpus), cut to the block's length (a last, partial block keeps its first
    tokens): the same id always gives the same tokens, so requests that shared blocks share them
    again. The rest of the prompt, past the hashed blocks, is a window picked by (seed, request
    index): fresh per request. Requests without hash ids are fresh throughout.

    Args:
        trace: from `load_trace`.
        corpus_ids: the token ids to draw from (requests.corpus_token_ids(tokenizer)).
        seed: another seed gives other tokens with the same sharing.
        stream: another stream gives other fresh parts with the same seed (warm-up requests use
            stream 1, as in requests.py, so that they never cache a measured request's tokens).
    Yields:
        One list of `prompt_tokens` ids per request, in the trace's order.
    """
    if not corpus_ids:
        raise ValueError("corpus_ids is empty")
    corpus = list(corpus_ids)
    doubled = corpus + corpus  # a window that wraps is one slice
    bs = trace.block_size or 0
    blocks: dict[int, list[int]] = {}  # one entry per distinct id: bounded by the trace's distinct blocks
    for i, r in enumerate(trace.requests):
        ids: list[int] = []
        for j, h in enumerate(r.hash_ids or ()):
            if h not in blocks:
                blocks[h] = _window(doubled, len(corpus), _pick(seed, "block", h), bs)
            ids.extend(blocks[h][: min(bs, r.prompt_tokens - j * bs)])
        num_rest = r.prompt_tokens - len(ids)
        if num_rest > 0:
            ids.extend(_window(doubled, len(corpus), _pick(seed, f"fresh{stream}", i), num_rest))
        yield ids


def _pick(seed: int, kind: str, n: int) -> int:
    return int.from_bytes(hashlib.blake2b(f"{seed}:{kind}:{n}".encode(), digest_size=8).digest(), "little")


def _window(doubled: list[int], n_corpus: int, start: int, length: int) -> list[int]:
    start %= n_corpus
    if length <= n_corpus:
        return doubled[start : start + length]
    return [doubled[(start + k) % n_corpus] for k in range(length)]
