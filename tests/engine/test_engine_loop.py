"""Continuous batching, prefix cache and preemption give each request exactly its solo tokens.

Run on both weight paths: packed (the default) and fp32.
"""
import json
import re
import random
from pathlib import Path

import pytest

from lodestar.engine.kv_cache import BlockPool, prefix_hashes
from lodestar.engine.llm_engine import EngineConfig, LLMEngine
from lodestar.engine.loader import load_model
from lodestar.engine.sampling import SamplingParams

GOLDENS = Path(__file__).resolve().parents[1] / "goldens"
CASES = {c["name"]: c for c in json.loads((GOLDENS / "generate_smollm2-135m.json").read_text())["cases"]}
NAMES = ["chat_hello", "raw_code", "raw_unicode", "chat_math", "chat_code", "raw_list", "chat_system", "raw_count"]


def _engine(mode="fp32", **kw):
    return LLMEngine(load_model("default", mode=mode, progress=False), EngineConfig(**kw))


@pytest.fixture(scope="module", params=["packed", "fp32"])
def solo(request, smollm_path):
    """Reference: each request alone, prefix cache off; (mode, tokens per request)."""
    e = _engine(request.param, enable_prefix_cache=False)
    params = _params()
    return request.param, [e.generate([CASES[n]["prompt_ids"]], params[i])[0].token_ids
                            for i, n in enumerate(NAMES)]


def _params():
    # mixed lengths and sampling settings; seeded sampling is reproducible under batching
    out = []
    for i in range(len(NAMES)):
        if i % 3 == 2:
            out.append(SamplingParams(temperature=0.8, top_p=0.9, seed=100 + i, max_tokens=4 + 3 * i,
                                      ignore_eos=True))
        else:
            out.append(SamplingParams(temperature=0.0, max_tokens=4 + 3 * i, ignore_eos=True))
    return out


def _staggered(engine, prompts, params, arrive_at):
    got, ids, step = {}, {}, 0
    while len(ids) < len(prompts) or engine.has_unfinished():
        for i, s in enumerate(arrive_at):
            if s == step and i not in ids:
                ids[i] = engine.add_request(prompts[i], params[i])
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.token_ids)
        step += 1
    return [got[ids[i]] for i in range(len(prompts))]


def test_eight_concurrent_staggered_equal_solo(solo):
    mode, want = solo
    e = _engine(mode, max_num_seqs=8, max_num_batched_tokens=64)   # small budget: chunked prefills
    prompts = [CASES[n]["prompt_ids"] for n in NAMES]
    got = _staggered(e, prompts, _params(), arrive_at=[0, 0, 1, 3, 3, 4, 7, 9])
    assert got == want
    assert e.pool.num_used == 0


def test_prefix_cache_hits_equal_solo(solo):
    mode, want = solo
    e = _engine(mode, max_num_seqs=8, max_num_batched_tokens=128)
    prompts = [CASES[n]["prompt_ids"] for n in NAMES]
    first = _staggered(e, prompts, _params(), arrive_at=[0] * 8)
    second = _staggered(e, prompts, _params(), arrive_at=[0, 1, 2, 3, 4, 5, 6, 7])
    assert first == want and second == want
    assert e.stats["cached_tokens"] > 0


def test_long_prompt_second_time_is_cached_and_identical(smollm_path):
    e = _engine(max_num_batched_tokens=256)
    case = CASES["chat_long"]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outs = [list(e.stream(case["prompt_ids"], params)) for _ in range(2)]
    assert [t for o in outs[0] for t in o.token_ids] == case["tokens"][:16]
    assert [t for o in outs[1] for t in o.token_ids] == case["tokens"][:16]
    assert outs[0][-1].cached_tokens == 0
    bs = e.pool.block_size
    assert outs[1][-1].cached_tokens == (len(case["prompt_ids"]) - 1) // bs * bs


def test_preemption_keeps_outputs_exact(solo):
    mode, want = solo
    e = _engine(mode, max_num_seqs=8, max_num_batched_tokens=128, kv_tokens=160)
    prompts = [CASES[n]["prompt_ids"] for n in NAMES]
    got = _staggered(e, prompts, _params(), arrive_at=[0] * 8)
    assert e.stats["preemptions"] > 0
    assert got == want
    assert e.pool.num_used == 0


def test_random_aborts_leak_nothing(smollm_path):
    e = _engine("packed", max_num_seqs=8, max_num_batched_tokens=96, kv_tokens=2048)   # bookkeeping: any weights do
    rng = random.Random(0)
    free0 = e.pool.num_free
    live = []
    for i in range(100):
        p = CASES[NAMES[i % len(NAMES)]]["prompt_ids"][: rng.randint(3, 60)]
        live.append(e.add_request(p, SamplingParams(temperature=0.5, max_tokens=rng.randint(1, 30), seed=i)))
        for _ in range(rng.randint(0, 2)):
            e.step()
        if live and rng.random() < 0.6:
            e.abort(live.pop(rng.randrange(len(live))))
    while e.has_unfinished():
        e.step()
    assert e.pool.num_free == free0
    assert all(rc == 0 for rc in e.pool.ref_counts)


@pytest.mark.parametrize("prefix_cache", [False, True])
def test_bookkeeping_stays_bounded_over_many_requests(smollm_path, prefix_cache):
    """Per-block records live only as long as the prefix cache holds the block: none at all
    without a prefix cache (they once grew by one per block of every request served)."""
    e = _engine(mode="packed", max_num_seqs=4, kv_tokens=512, enable_prefix_cache=prefix_cache)
    for i in range(24):
        prompt = CASES[NAMES[i % len(NAMES)]]["prompt_ids"] + [i + 10] * 40
        e.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    assert not e.requests and e.pool.num_used == 0
    assert len(e._block_meta) == len(e.pool.cached) <= e.pool.num_blocks
    if not prefix_cache:
        assert not e._block_meta


def test_block_pool_lru_eviction_keeps_prefix_order():
    pool = BlockPool(4, 2)
    hashes = prefix_hashes([1, 2, 3, 4, 5, 6], 2, "fp")
    blocks = pool.allocate(3)
    for b, h in zip(blocks, hashes):
        pool.register(b, h)
    pool.free(blocks)
    assert pool.num_free == 4
    assert pool.lookup(hashes) == blocks           # all three still cached
    pool.free(blocks)
    pool.allocate(2)                               # the empty block, then the chain's tail
    assert pool.lookup(hashes) == blocks[:2]


def test_a_long_prefill_logs_its_progress(smollm_path, caplog, monkeypatch):
    monkeypatch.setattr("lodestar.engine.llm_engine.PREFILL_LOG_S", 0.0)    # a line for every chunk
    e = _engine("packed", max_num_batched_tokens=32)
    caplog.set_level("INFO", logger="lodestar.engine")
    prompt = CASES["chat_code"]["prompt_ids"] * 3
    e.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0))
    lines = [r.getMessage() for r in caplog.records if r.name == "lodestar.engine"]
    done = [int(m.group(1)) for m in map(re.compile(r"request \d+: prefill (\d+)/(\d+) prompt tokens").match, lines) if m]
    assert done == list(range(32, len(prompt), 32))
    assert re.match(rf"request \d+: prefill done, {len(prompt)} prompt tokens \(0 from the prefix cache\) in ", lines[-1])
    assert len(lines) == len(done) + 1          # decode steps are not prefill
