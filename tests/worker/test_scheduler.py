"""The token-budget scheduler on its own: no model, sequences advanced by hand."""

from worker.engine.block_manager import BlockManager
from worker.engine.sampling_params import SamplingParams
from worker.engine.scheduler import Scheduler
from worker.engine.sequence import Sequence, SequenceStatus

BS = 4


def make(num_blocks=64, budget=16, max_seqs=8):
    return Scheduler(BlockManager(num_blocks, BS, "m"), budget, max_seqs)


def add(sched, n_tokens, rid, start=0):
    s = Sequence(rid, list(range(start, start + n_tokens)), SamplingParams())
    sched.add(s)
    return s


def advance(batch, bm=None, new_token=7):
    """What the engine does after a step: count computed tokens, cache full blocks, append a token."""
    for item in batch:
        samples = item.samples
        item.seq.num_computed_tokens += item.num_new_tokens
        if bm is not None:
            bm.cache_full_blocks(item.seq)
        if samples:
            item.seq.token_ids.append(new_token)


def test_long_prompt_is_chunked_and_decodes_are_not_stalled():
    sched = make(budget=8)
    short = add(sched, 3, "short")
    batch, _ = sched.schedule()
    assert [(b.seq.request_id, b.num_new_tokens) for b in batch] == [("short", 3)]
    advance(batch)
    long = add(sched, 30, "long", start=100)
    chunks = []
    for _ in range(4):
        batch, _ = sched.schedule()
        names = [(b.seq.request_id, b.num_new_tokens) for b in batch]
        assert names[0] == ("short", 1), "the running decode goes first every step"
        assert sum(n for _, n in names) <= 8
        chunks += [n for r, n in names if r == "long"]
        advance(batch)
    assert chunks == [7, 7, 7, 7]
    assert long.num_computed_tokens == 28 and short.num_output_tokens == 5


def test_first_come_first_served_and_seq_cap():
    sched = make(budget=100, max_seqs=2)
    for i in range(4):
        add(sched, 5, f"r{i}", start=10 * i)
    batch, _ = sched.schedule()
    assert [b.seq.request_id for b in batch] == ["r0", "r1"]
    assert [s.request_id for s in sched.waiting] == ["r2", "r3"]


def test_waiting_request_that_does_not_fit_blocks_those_behind_it():
    sched = make(num_blocks=4, budget=100)
    add(sched, 12, "big")  # 3 blocks
    add(sched, 8, "too-big-now", start=50)  # 2 blocks: only 1 left
    add(sched, 2, "small", start=90)
    batch, _ = sched.schedule()
    assert [b.seq.request_id for b in batch] == ["big"]


def test_preemption_frees_the_newest_and_it_recomputes():
    sched = make(num_blocks=4, budget=100)
    a = add(sched, 8, "a")  # 2 blocks
    b = add(sched, 8, "b", start=50)  # 2 blocks
    batch, _ = sched.schedule()
    advance(batch, sched.bm)  # both sampled one token: 9 tokens each, need a 3rd block each
    batch, _ = sched.schedule()
    assert [x.seq.request_id for x in batch] == ["a"]
    assert b.status is SequenceStatus.WAITING and b.block_table == [] and b.num_computed_tokens == 0
    assert sched.num_preemptions == 1
    sched.check_integrity()
    advance(batch, sched.bm)
    sched.finish(a, "stop")
    batch, _ = sched.schedule()
    # b comes back and recomputes. a's third block was taken by evicting b's *tail* block
    # (freed tail first), so b's head block is still cached and only the rest is recomputed.
    assert [x.seq.request_id for x in batch] == ["b"]
    assert b.num_computed_tokens == 4 and batch[0].num_new_tokens == 5
    assert b.num_cached_tokens == 0, "the client is told about the first admission's cache hit"
    sched.check_integrity()


def test_a_sequence_larger_than_the_pool_overflows_instead_of_looping():
    sched = make(num_blocks=2, budget=100)
    s = add(sched, 8, "s")
    batch, _ = sched.schedule()
    advance(batch)
    batch, overflow = sched.schedule()
    assert batch == [] and overflow == [s]
    sched.finish(s, "length")
    assert sched.bm.num_free_blocks == 2
    sched.check_integrity()
