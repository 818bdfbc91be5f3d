"""The Scheduler alone, without a model: token budget, chunked prefill, preemption, prefix
cache hits, aborts and the overlapped decode path's ``can_continue``.

``_advance`` plays the engine's part of a step: the fed tokens become computed, full
blocks go to the prefix cache, rows that reach their last known token get one new token,
and a row at ``max_tokens`` finishes.
"""
from lodestar.engine.kv_cache import BlockPool
from lodestar.engine.sampling import SamplingParams
from lodestar.engine.scheduler import ScheduledBatch, Scheduler
from lodestar.engine.sequence import Sequence, SequenceStatus


def _scheduler(num_blocks: int = 64, block_size: int = 4, max_num_seqs: int = 8, budget: int = 64,
               prefix_cache: bool = True) -> Scheduler:
    return Scheduler(BlockPool(num_blocks, block_size, prefix_cache), "test-weights", max_num_seqs, budget,
                     max_model_len=1024)


def _add(sched: Scheduler, seq_id: int, prompt: list[int], max_tokens: int = 4) -> Sequence:
    seq = Sequence(seq_id, list(prompt), SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    sched.add(seq)
    return seq


def _advance(sched: Scheduler, batch: ScheduledBatch) -> None:
    bs = sched.pool.block_size
    for s, n in zip(batch.seqs, batch.num_new):
        assert len(s.block_table) * bs >= s.num_computed + n       # the scheduler reserved the blocks
        s.num_computed += n
        sched.register_full_blocks(s)
    for s in batch.sampled:
        s.output_ids.append(1000 + 10 * s.seq_id + len(s.output_ids))
        if len(s.output_ids) >= s.params.max_tokens:
            sched.finish(s, "length")


def _step(sched: Scheduler) -> ScheduledBatch:
    batch = sched.schedule()
    _advance(sched, batch)
    return batch


def _rows(batch: ScheduledBatch) -> list[tuple[int, int, bool]]:
    return [(s.seq_id, n, w) for s, n, w in zip(batch.seqs, batch.num_new, batch.want_logits)]


def test_token_budget_splits_prompts_and_puts_decode_rows_first():
    sched = _scheduler(budget=8)
    for i in range(3):
        _add(sched, i, [5, 6, 7])
    # 3 + 3 + 2 = the budget: the third prompt gets a 2-token chunk and no logits yet
    assert _rows(_step(sched)) == [(0, 3, True), (1, 3, True), (2, 2, False)]
    assert [s.seq_id for s in sched.running] == [0, 1] and [s.seq_id for s in sched.waiting] == [2]
    # decode rows first, oldest first, then the rest of the third prompt
    batch = _step(sched)
    assert _rows(batch) == [(0, 1, True), (1, 1, True), (2, 1, True)]
    assert batch.is_decode
    assert [s.seq_id for s in sched.running] == [0, 1, 2] and not sched.waiting


def test_max_num_seqs_holds_a_prompt_back_until_a_row_finishes():
    sched = _scheduler(max_num_seqs=2)
    seqs = [_add(sched, i, [1, 2], max_tokens=2) for i in range(3)]
    assert _rows(_step(sched)) == [(0, 2, True), (1, 2, True)]
    assert _rows(_step(sched)) == [(0, 1, True), (1, 1, True)]      # both reach max_tokens
    assert seqs[0].is_finished and seqs[1].is_finished
    assert _rows(_step(sched)) == [(2, 2, True)]


def test_long_prompt_is_prefilled_in_chunks_across_steps():
    sched = _scheduler(block_size=4, budget=8)
    long = _add(sched, 0, list(range(100, 120)), max_tokens=3)          # 20 tokens
    assert _rows(_step(sched)) == [(0, 8, False)]
    assert long.status is SequenceStatus.WAITING and len(long.block_table) == 2 and long.num_computed == 8
    late = _add(sched, 1, [1, 2, 3])
    assert _rows(_step(sched)) == [(0, 8, False)]                      # the chunk takes the whole budget
    assert len(long.block_table) == 4 and late.num_computed == 0 and not late.block_table
    # the last 4 prompt tokens, and the late prompt in the 4 tokens of budget left
    assert _rows(_step(sched)) == [(0, 4, True), (1, 3, True)]
    assert long.status is SequenceStatus.RUNNING and len(long.block_table) == 5
    assert long.output_ids == [1000]
    assert _rows(_step(sched)) == [(0, 1, True), (1, 1, True)]
    assert len(long.block_table) == 6                                   # token 21 opened a sixth block


def test_preemption_frees_the_newest_request_which_resumes_and_finishes():
    sched = _scheduler(num_blocks=6, block_size=2, prefix_cache=False)
    seqs = [_add(sched, i, [7, 8, 9], max_tokens=3) for i in range(3)]
    assert _rows(_step(sched)) == [(0, 3, True), (1, 3, True), (2, 3, True)]
    assert sched.pool.num_free == 0                                     # 2 blocks each
    assert _rows(_step(sched)) == [(0, 1, True), (1, 1, True), (2, 1, True)]   # token 4 fits block 2
    # token 5 needs a third block each: the newest request gives its two back
    batch = _step(sched)
    assert _rows(batch) == [(0, 1, True), (1, 1, True)]
    assert sched.stats["preemptions"] == 1
    c = seqs[2]
    assert c.status is SequenceStatus.WAITING and c in sched.waiting and not c.block_table and c.num_computed == 0
    assert c.output_ids == [1020, 1021]                                 # its tokens so far are kept
    assert seqs[0].is_finished and seqs[1].is_finished and sched.pool.num_free == 6
    # the preempted request recomputes prompt + outputs in one chunk and gets its last token
    assert _rows(_step(sched)) == [(2, 5, True)]
    assert c.is_finished and c.output_ids == [1020, 1021, 1022]
    assert not sched.has_unfinished() and sched.pool.num_free == 6


def test_a_row_that_nobody_newer_can_make_room_for_preempts_itself():
    sched = _scheduler(num_blocks=4, block_size=2, prefix_cache=False)
    a = _add(sched, 0, [1, 2, 3], max_tokens=2)
    b = _add(sched, 1, [4, 5, 6, 7], max_tokens=2)
    assert _rows(_step(sched)) == [(0, 3, True), (1, 4, True)]
    assert sched.pool.num_free == 0
    # b's next token needs a third block and no newer request holds one: b steps back, and
    # is readmitted at once with as much of its recompute as the freed blocks hold
    assert _rows(_step(sched)) == [(0, 1, True), (1, 4, False)]
    assert sched.stats["preemptions"] == 1 and a.is_finished
    assert _rows(_step(sched)) == [(1, 1, True)]
    assert b.is_finished and b.output_ids == [1010, 1011]


def test_prefix_cache_hits_reuse_full_blocks():
    sched = _scheduler(num_blocks=16, block_size=4)
    a = _add(sched, 0, list(range(10)))
    assert _rows(_step(sched)) == [(0, 10, True)]
    assert len(a.block_hashes) == 2 and len(sched.pool.cached) == 2    # its two full blocks are cached
    a_blocks = a.block_table[:2]
    b = _add(sched, 1, list(range(8)) + [50, 51, 52])                   # same two full blocks, own tail
    c = _add(sched, 2, list(range(8)))                                  # exactly those two blocks
    batch = _step(sched)
    # b feeds only its 3-token tail; c reuses one block (one token must be left to run)
    assert _rows(batch) == [(0, 1, True), (1, 3, True), (2, 4, True)]
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert c.block_table[0] == a.block_table[0] and c.block_table[1] not in a.block_table
    assert (b.cached_tokens, c.cached_tokens) == (8, 4)
    assert sched.stats["cached_tokens"] == 12 and sched.stats["prompt_tokens"] == 10 + 11 + 8
    assert sched.pool.ref_counts[a.block_table[0]] == 3 and sched.pool.ref_counts[a.block_table[1]] == 2
    while sched.has_unfinished():
        _step(sched)
    assert sched.pool.num_free == 16                                    # cached blocks count as free
    again = _add(sched, 3, list(range(10)))                             # after everyone finished
    _step(sched)
    assert again.cached_tokens == 8 and again.block_table[:2] == a_blocks


def test_extend_prefix_hook_can_extend_the_memory_hit():
    """The engine's disk tier plugs in here: it may load more cached blocks than memory had."""
    calls = []

    def from_disk(seq: Sequence, hashes: list[bytes], limit: int) -> None:
        calls.append((seq.seq_id, len(hashes), limit, seq.num_computed))
        seq.block_table += sched.pool.allocate(limit - len(seq.block_table))
        seq.block_hashes = hashes[:limit]
        seq.num_computed = limit * sched.pool.block_size

    sched = Scheduler(BlockPool(16, 4), "test-weights", 8, 64, 1024, extend_prefix=from_disk)
    seq = _add(sched, 0, list(range(9)))
    assert _rows(_step(sched)) == [(0, 1, True)]                        # 8 of 9 tokens came from the hook
    assert calls == [(0, 2, 2, 0)]
    assert seq.cached_tokens == 8 and sched.stats["cached_tokens"] == 8 and len(seq.block_table) == 3


def test_aborts_free_blocks_and_leave_the_queues():
    sched = _scheduler(num_blocks=16, block_size=4, budget=8)
    long = _add(sched, 0, list(range(20)))
    short = _add(sched, 1, [1, 2, 3])
    assert _rows(_step(sched)) == [(0, 8, False)]
    sched.finish(long, "abort")                                         # mid-prefill
    assert long.is_finished and long.finish_reason == "abort" and not long.block_table
    assert sched.waiting == [short] and sched.pool.num_free == 16
    assert _rows(_step(sched)) == [(1, 3, True)]
    sched.finish(short, "abort")                                        # while decoding
    assert not sched.running and not sched.has_unfinished() and sched.pool.num_free == 16
    assert len(sched.schedule()) == 0


def test_can_continue_reserves_the_running_batchs_next_blocks():
    sched = _scheduler(num_blocks=8, block_size=4, max_num_seqs=2)
    a = _add(sched, 0, [1, 2, 3, 4], max_tokens=16)
    b = _add(sched, 1, [5, 6, 7, 8], max_tokens=16)
    _step(sched)
    batch = _step(sched)                                                # a decode step: blocks for position 4
    rows = batch.seqs
    assert rows == [a, b] and sched.pool.num_free == 4
    for _ in range(3):                                                  # positions 5, 6, 7: blocks held
        assert sched.can_continue(rows) and sched.pool.num_free == 4
        _advance(sched, ScheduledBatch(rows, [1, 1], [True, True]))
    assert sched.can_continue(rows)                                     # position 8: a third block each
    assert [len(s.block_table) for s in rows] == [3, 3] and sched.pool.num_free == 2
    c = _add(sched, 2, [9, 9])
    assert sched.can_continue(rows)                                     # max_num_seqs rows already run
    sched.max_num_seqs = 3
    assert not sched.can_continue(rows)                                 # c could be admitted now
    sched.finish(c, "abort")
    sched.pool.allocate(sched.pool.num_free)                            # no block left for position 12
    for _ in range(4):
        _advance(sched, ScheduledBatch(rows, [1, 1], [True, True]))
    assert not sched.can_continue(rows)
    assert [len(s.block_table) for s in rows] == [3, 3]                 # nothing reserved
    sched.finish(b, "stop")
    assert not sched.can_continue(rows)                                 # a row of the batch is gone
