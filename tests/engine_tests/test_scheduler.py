from slotune.engine.block_manager import BlockManager
from slotune.engine.sampling_params import SamplingParams
from slotune.engine.scheduler import Scheduler
from slotune.engine.sequence import Sequence, SequenceStatus


def _sched(num_blocks=64, block_size=4, **kw):
    kw.setdefault("max_num_seqs", 4)
    kw.setdefault("max_num_batched_tokens", 32)
    return Scheduler(BlockManager(num_blocks, block_size), **kw)


def _seq(n, rid, max_tokens=8):
    return Sequence(rid, list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens), 0.0)


def _advance(out):
    """Pretend the model ran: mark tokens computed and append one token to finished prefills."""
    for s in out.scheduled:
        s.seq.num_computed_tokens += s.num_new_tokens
        if s.seq.num_computed_tokens == s.seq.num_tokens:
            s.seq.token_ids.append(5)


def test_chunked_prefill_splits_long_prompt_within_budget():
    sch = _sched(max_num_batched_tokens=16)
    sch.add(_seq(40, "long"))
    sizes = []
    for _ in range(3):
        out = sch.schedule()
        sizes.append(out.num_batched_tokens)
        _advance(out)
    assert sizes == [16, 16, 8]


def test_decodes_and_new_prefill_share_a_step():
    sch = _sched(max_num_batched_tokens=20)
    sch.add(_seq(10, "a"))
    _advance(sch.schedule())
    sch.add(_seq(30, "b"))
    out = sch.schedule()
    assert [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 1), ("b", 19)]


def test_max_num_seqs_caps_running():
    sch = _sched(max_num_seqs=2)
    for i in range(4):
        sch.add(_seq(3, f"r{i}"))
    out = sch.schedule()
    assert len(out.scheduled) == 2 and len(sch.waiting) == 2


def test_no_chunking_waits_for_room():
    sch = _sched(max_num_batched_tokens=16, enable_chunked_prefill=False)
    sch.add(_seq(10, "a"))
    sch.add(_seq(10, "b"))
    out = sch.schedule()
    assert [s.seq.request_id for s in out.scheduled] == ["a"]


def test_preemption_by_recompute_when_blocks_run_out():
    sch = _sched(num_blocks=4, block_size=4, max_num_batched_tokens=64)
    a, b = _seq(8, "a"), _seq(8, "b")
    sch.add(a)
    sch.add(b)
    _advance(sch.schedule())  # both prefilled: 4 blocks used, each has 9 tokens now
    out = sch.schedule()  # a needs a 3rd block: b (newest) is preempted
    assert out.preempted == [b]
    assert b.status == SequenceStatus.WAITING and b.num_computed_tokens == 0 and b.block_table == []
    assert sch.waiting[0] is b and [s.seq for s in out.scheduled] == [a]


def test_static_batching_admits_only_between_batches():
    sch = _sched(static_batching=True)
    sch.add(_seq(4, "a"))
    _advance(sch.schedule())
    sch.add(_seq(4, "b"))
    out = sch.schedule()
    assert [s.seq.request_id for s in out.scheduled] == ["a"]
    sch.finish(sch.running[0], "length")
    out = sch.schedule()
    assert [s.seq.request_id for s in out.scheduled] == ["b"]


def test_finish_frees_blocks():
    sch = _sched()
    s = _seq(9, "a")
    sch.add(s)
    sch.schedule()
    sch.finish(s, "stop")
    assert sch.block_manager.num_free_blocks == 64 and s.finish_reason == "stop"


def _admitted(sch) -> list[str]:
    out = sch.schedule()
    _advance(out)
    return [s.seq.request_id for s in out.scheduled]


def test_shortest_prompt_first_admits_short_prompts_before_an_earlier_long_one():
    for policy, first in (("fcfs", ["long", "s1"]), ("shortest_prompt_first", ["s1", "s2"])):
        sch = _sched(max_num_seqs=2, max_num_batched_tokens=64, policy=policy)
        for rid, n in (("long", 40), ("s1", 5), ("s2", 6)):
            sch.add(_seq(n, rid))
        assert _admitted(sch) == first, policy


def test_shortest_prompt_first_passes_a_long_prompt_over_a_bounded_number_of_times():
    from slotune.engine.scheduler import MAX_BYPASS

    sch = _sched(num_blocks=4096, max_num_seqs=1, max_num_batched_tokens=64, policy="shortest_prompt_first")
    sch.add(_seq(40, "long"))
    admitted = []
    for i in range(MAX_BYPASS + 5):  # a new short request arrives before every admission
        sch.add(_seq(3, f"short{i}"))
        admitted += _admitted(sch)
        for seq in list(sch.running):
            sch.finish(seq, "stop")
    assert "long" in admitted
    assert admitted.index("long") == MAX_BYPASS  # after exactly MAX_BYPASS later arrivals
