"""Prefix-cache hits are exact matches, whatever the block hash does (vLLM GHSA-rm76-4mrf-v9r8).

A weak hash is injected through BlockManager's `hash_fn`: a constant (every block collides
with every other) and one that ignores the parent (equal blocks after different prefixes
collide). Neither may hand one request's KV to a different prompt: outputs equal those of an
engine without prefix caching, and the only hits are the blocks whose whole prefix matches.
"""

from __future__ import annotations

import pytest

from slotune.engine import SamplingParams
from slotune.engine.block_manager import BlockManager, sha256_block_key
from slotune.engine.llm_engine import LLMEngine
from slotune.engine.scheduler import Scheduler
from slotune.engine.sequence import Sequence

GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)
BLOCK = 8
SENTENCES = [
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "In the beginning there was only darkness and the sound of the sea.",
    "My favourite recipe for bread uses flour, water, salt and yeast.",
    "The stock market fell sharply on Monday after the bank reported losses.",
]
TAILS = [
    " Question: what happens next in this story? Answer:",
    " Please continue the text:",
    " Summarize this in one word:",
]


def constant_hash(parent, token_ids):
    return 0


def parent_blind_hash(parent, token_ids):
    return hash(token_ids)


def _seq(tokens, rid):
    return Sequence(rid, tokens, SamplingParams(max_tokens=1), 0.0)


def _prefill(bm: BlockManager, seq: Sequence) -> None:
    bm.match_prefix(seq)
    assert bm.allocate(seq, seq.num_uncomputed_tokens)
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_full_blocks(seq)


# --- block manager -----------------------------------------------------------------------
def test_sha256_keys_chain_the_parent():
    a = sha256_block_key(None, (1, 2, 3, 4))
    assert isinstance(a, bytes) and len(a) == 32
    assert sha256_block_key(a, (5, 6, 7, 8)) != sha256_block_key(None, (5, 6, 7, 8))
    assert sha256_block_key(None, (1, 2, 3, 4)) == a


@pytest.mark.parametrize("hash_fn", [constant_hash, parent_blind_hash], ids=["constant", "parent_blind"])
def test_weak_hash_never_matches_other_contents(hash_fn):
    bm = BlockManager(num_blocks=32, block_size=4, enable_prefix_caching=True, hash_fn=hash_fn)
    x, y, p, q = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16]
    _prefill(bm, _seq(x + q + [0], "t"))
    _prefill(bm, _seq(p + y + [0], "s"))
    other = _seq(p + q + [0], "other")  # shares no block-aligned prefix with t's cached X
    bm.match_prefix(other)
    query = _seq(x + y + [0], "query")  # X is truly cached; Y only after P
    bm.match_prefix(query)
    same = _seq(x + q + [0], "same")
    bm.match_prefix(same)
    if hash_fn is constant_hash:  # one key in all: only t's first block is cached
        assert other.num_cached_tokens == 0
        assert query.num_cached_tokens == 4 and same.num_cached_tokens == 4
    else:  # every block is keyed by its tokens; p's block is a true match, q after p is not
        assert other.num_cached_tokens == 4 and other.block_table[0] != same.block_table[0]
        assert query.num_cached_tokens == 4
        assert same.num_cached_tokens == 8
    assert bm.num_hash_collisions > 0


def test_sha256_cache_still_hits_shared_prefixes():
    bm = BlockManager(num_blocks=32, block_size=4, enable_prefix_caching=True)
    _prefill(bm, _seq(list(range(12)) + [0], "a"))
    b = _seq(list(range(12)) + [99], "b")
    bm.match_prefix(b)
    assert b.num_cached_tokens == 12 and bm.num_hash_collisions == 0


def test_the_same_block_computed_twice_is_one_cache_entry():
    bm = BlockManager(num_blocks=32, block_size=4, enable_prefix_caching=True)
    a, b = _seq(list(range(9)), "a"), _seq(list(range(9)), "b")
    for s in (a, b):  # both admitted before either has computed anything
        bm.match_prefix(s)
        assert bm.allocate(s, s.num_uncomputed_tokens)
    for s in (a, b):
        s.num_computed_tokens = s.num_tokens
        bm.cache_full_blocks(s)
    assert len(bm.hash_to_block) == 2 and bm.num_hash_collisions == 0
    c = _seq(list(range(9)), "c")
    bm.match_prefix(c)
    assert c.num_cached_tokens == 8 and c.block_table == a.block_table[:2]


# --- the engine ----------------------------------------------------------------------------
class _EngineWithHash(LLMEngine):
    """LLMEngine builds its BlockManager itself, with no parameter for one (slotune/engine/llm_engine.py
    is outside this change): this subclass builds the block manager and scheduler once more, in
    its constructor, before any request exists."""

    def __init__(self, llm, hash_fn) -> None:
        super().__init__(llm.config, runner=llm.engine.runner, tokenizer=llm.tokenizer)
        self.block_manager = BlockManager(self.runner.num_blocks, self.cfg.block_size, True, hash_fn=hash_fn)
        self.scheduler = Scheduler.from_config(self.block_manager, self.cfg)


def _generate(engine: LLMEngine, prompts: list[list[int]]):
    """One request at a time, so every request can see everything cached before it."""
    outs = []
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{i}", ids, GREEDY)
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    outs.append(o)
    return outs


@pytest.fixture(scope="module")
def prompts(make_llm):
    plain = make_llm(enable_prefix_caching=False, block_size=BLOCK, num_kv_blocks=48)
    x, p, q, y = (plain.tokenizer.encode(s)[:BLOCK] for s in SENTENCES)
    tails = [plain.tokenizer.encode(t) for t in TAILS]
    ids = [
        x + q + tails[0],  # caches X, then Q after X
        p + y + tails[1],  # differs from the first block on: no hit
        x + y + tails[2],  # X is a true hit; Y was cached only after P
        q + x + tails[0],  # nothing cached starts with Q
        x + q + tails[1],
    ]  # X and Q after X: true hits
    reference = [o.output_token_ids for o in _generate(plain.engine, ids)]
    return ids, reference


@pytest.mark.parametrize("hash_fn", [constant_hash, parent_blind_hash], ids=["constant", "parent_blind"])
def test_weak_hash_gives_no_cross_request_kv_and_outputs_equal_no_cache(make_llm, prompts, hash_fn):
    ids, reference = prompts
    llm = make_llm(enable_prefix_caching=True, block_size=BLOCK, num_kv_blocks=48)
    engine = _EngineWithHash(llm, hash_fn)
    outs = _generate(engine, ids)
    assert [o.output_token_ids for o in outs] == reference
    cached = [o.metrics.num_cached_prompt_tokens for o in outs]
    # Only blocks whose whole prefix equals the request's are reused; with a constant hash the
    # cache holds one block (X), the first one ever cached.
    assert cached == ([0, 0, BLOCK, 0, BLOCK] if hash_fn is constant_hash else [0, 0, BLOCK, 0, 2 * BLOCK])
    assert engine.block_manager.num_hash_collisions > 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
