"""Incremental detokenization (`Tokenizer.decode_delta`): the streamed deltas add up to what one
decode of all the output ids gives, for the bundled byte-level BPE and a SentencePiece GGUF, on
multi-byte text and on random ids (incomplete UTF-8, special tokens) fed 1-3 tokens per step.

SentencePiece's byte fallback is not prefix-stable on invalid UTF-8 (a run of byte tokens that
does not decode becomes one U+FFFD per byte, also for bytes that looked valid on their own), so
no stream can match it there; its random ids leave byte tokens out, and its real text keeps
them (emoji, CJK)."""

from __future__ import annotations

import random


from slotune.engine.loader import resolve_model_path
from slotune.engine.tokenizer import Tokenizer
from slotune.tuner.workload.requests import corpus_text
from tests.tokenizer_files import EXTRA_TEXT


def _stream(tok: Tokenizer, ids: list[int], rng: random.Random) -> list[str]:
    """Deltas as the engine makes them: a step appends 1-3 ids (speculative decoding adds several)."""
    deltas, offsets, n = [], (0, 0), 0
    while n < len(ids):
        n = min(len(ids), n + rng.randint(1, 3))
        delta, *offsets = tok.decode_delta(ids[:n], *offsets, final=n == len(ids))
        deltas.append(delta)
    return deltas


def _sequences(tok: Tokenizer, rng: random.Random, random_ids: list[int]) -> list[list[int]]:
    text = corpus_text()[:3000] + EXTRA_TEXT
    lines = [ln for ln in text.splitlines() if ln.strip()]
    seqs = [tok.encode(ln) for ln in lines[:40] + EXTRA_TEXT.splitlines()] + [tok.encode(text[-2000:])]
    seqs += [[rng.choice(random_ids) for _ in range(rng.randint(1, 60))] for _ in range(200)]
    return seqs


def _check(tok: Tokenizer, random_ids: list[int] | None = None) -> None:
    rng = random.Random(0)
    held = 0
    for ids in _sequences(tok, rng, random_ids or list(range(tok.vocab_size))):
        deltas = _stream(tok, ids, rng)
        assert "".join(deltas) == tok.decode(ids), ids
        held += sum(1 for d in deltas[:-1] if d == "")
    assert held > 0  # the windows really waited on incomplete characters somewhere


def test_deltas_add_up_to_the_whole_decode_byte_level_bpe():
    _check(Tokenizer.from_model_path(resolve_model_path("smollm2-135m")))


def test_deltas_add_up_to_the_whole_decode_sentencepiece(tmp_path):
    from tests.engine_tests.test_tokenizer_families import sentencepiece_gguf

    sp, path = sentencepiece_gguf(tmp_path)
    n = sp.vocab_size()
    _check(Tokenizer.from_gguf(path), random_ids=[i for i in range(n) if not sp.IsByte(i)])
