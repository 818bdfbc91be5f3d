"""BlockPool placement: sequences get consecutive blocks where possible; placement never
changes results (the CPU attention reads consecutive blocks as one slice, others by a
gather, and both give the same bits)."""
import json
import random
from pathlib import Path

import pytest

from lodestar.engine.kv_cache import BlockPool, OutOfBlocksError, prefix_hashes
from lodestar.engine.llm_engine import EngineConfig, LLMEngine
from lodestar.engine.loader import load_model
from lodestar.engine.sampling import SamplingParams

GOLDENS = Path(__file__).resolve().parents[1] / "goldens"
CASES = {c["name"]: c for c in json.loads((GOLDENS / "generate_smollm2-135m.json").read_text())["cases"]}


def _consecutive(blocks: list[int]) -> bool:
    return blocks == list(range(blocks[0], blocks[0] + len(blocks)))


def test_interleaved_growth_keeps_each_sequence_consecutive():
    pool = BlockPool(64, 4)
    tables = [pool.allocate(2) for _ in range(4)]
    for _ in range(6):                      # decode: each grows one block in turn
        for t in tables:
            t += pool.allocate(1, after=t[-1])
    assert all(_consecutive(t) for t in tables)
    assert len({b for t in tables for b in t}) == 4 * 8
    assert pool.num_free == 64 - 32


def test_new_run_starts_halfway_into_the_room_after_a_held_block():
    pool = BlockPool(64, 4)
    a = pool.allocate(4)
    b = pool.allocate(4)
    assert a == [0, 1, 2, 3]
    assert b == [32, 33, 34, 35]            # 4 + (60 - 4) // 2: room for both to grow
    pool.free(a)
    assert pool.allocate(2) == [0, 1]       # nothing held before block 0: start there


def test_fragmented_pool_still_hands_out_every_free_block():
    pool = BlockPool(16, 4)
    held = pool.allocate(16)
    assert pool.num_free == 0
    pool.free(held[1::2])                   # eight single empty blocks
    got = pool.allocate(5, after=held[0])
    assert got[0] == 1 and len(set(got)) == 5 and set(got) <= set(held[1::2])
    assert pool.num_free == 3
    with pytest.raises(OutOfBlocksError):
        pool.allocate(4)


def test_growth_does_not_evict_a_cached_block_while_empty_ones_remain():
    pool = BlockPool(8, 2)
    a = pool.allocate(1)
    cached = pool.allocate(2, after=a[-1])
    hashes = prefix_hashes([1, 2, 3, 4], 2, "fp")
    for blk, h in zip(cached, hashes):
        pool.register(blk, h)
    pool.free(cached)                       # ref 0, still cached, right after a's block
    grown = pool.allocate(2, after=a[-1])
    assert not set(grown) & set(cached)
    assert pool.lookup(hashes) == cached


def test_random_allocate_free_keeps_the_books():
    rng = random.Random(0)
    pool = BlockPool(48, 2)
    tables: list[list[int]] = []
    for i in range(2000):
        op = rng.random()
        if op < 0.5 and pool.num_free:
            n = rng.randint(1, min(4, pool.num_free))
            if tables and rng.random() < 0.6:
                t = rng.choice(tables)
                t += pool.allocate(n, after=t[-1])
            else:
                tables.append(pool.allocate(n))
            if rng.random() < 0.3:
                t = rng.choice(tables)
                pool.register(t[0], bytes([i % 256, i // 256]) * 8)
        elif tables:
            pool.free(tables.pop(rng.randrange(len(tables))))
        held = [b for t in tables for b in t]
        assert len(held) == len(set(held))                     # no block held twice
        assert pool.num_free == 48 - len(held)
        assert all(pool.ref_counts[b] == 1 for b in held)


def _run_alone(engine: LLMEngine, prompt: list[int], params: SamplingParams):
    """Generate one request step by step; (completion tokens, logprobs, block table)."""
    rid = engine.add_request(prompt, params)
    tokens, logprobs, table = [], [], []
    while engine.has_unfinished():
        outs = engine.step()
        if engine.running:
            table = list(engine.running[0].block_table)
        for out in outs:
            assert out.request_id == rid
            tokens += out.token_ids
            logprobs += out.logprobs or []
    return tokens, logprobs, table


def test_block_placement_does_not_change_results(smollm_path):
    engine = LLMEngine(load_model("default", mode="packed", progress=False),
                       EngineConfig(enable_prefix_cache=False, kv_tokens=2048))
    prompt = CASES["chat_multiturn"]["prompt_ids"]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=3)
    sliced = _run_alone(engine, prompt, params)
    assert len(sliced[2]) > 2 and _consecutive(sliced[2])    # context read as one slice

    hold = engine.pool.allocate(engine.pool.num_blocks)
    engine.pool.free(hold[1::2])                             # only single free blocks remain
    gathered = _run_alone(engine, prompt, params)
    assert not _consecutive(gathered[2])                     # context gathered block by block
    engine.pool.free(hold[0::2])
    assert gathered[:2] == sliced[:2]                        # same tokens, same log-probabilities
    assert engine.pool.num_free == engine.pool.num_blocks


def test_concurrent_requests_get_consecutive_blocks(smollm_path):
    engine = LLMEngine(load_model("default", mode="packed", progress=False),
                       EngineConfig(max_num_seqs=8, enable_prefix_cache=False))
    names = ["chat_hello", "raw_code", "raw_unicode", "chat_math", "chat_code", "raw_list", "chat_system",
             "raw_count"]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for n in names:
        engine.add_request(CASES[n]["prompt_ids"], params)
    grew = 0
    while engine.has_unfinished():
        engine.step()
        for s in engine.running:
            assert _consecutive(s.block_table), s.block_table
            grew = max(grew, len(s.block_table))
    assert grew >= 3                                         # the tables did grow while decoding
