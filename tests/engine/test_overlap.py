"""Overlapped decode (the next greedy step queued before this one's tokens are read) gives
exactly the step-by-step engine's outputs, frees the same blocks and caches the same
prefixes, whatever stops, aborts or arrives while a step is in flight.

On the CPU ``ModelRunner.launch`` runs each step at once, so these tests check the
engine's bookkeeping; the CUDA path (graph replays fed from the device) is compared the
same way in tests/engine/test_cuda_exactness.py.
"""
import json
from pathlib import Path

import pytest

from lodestar.engine.llm_engine import EngineConfig, LLMEngine
from lodestar.engine.loader import load_model
from lodestar.engine.sampling import SamplingParams

GOLDENS = Path(__file__).resolve().parents[1] / "goldens"
CASES = json.loads((GOLDENS / "generate_smollm2-135m.json").read_text())["cases"]
PROMPTS = [c["prompt_ids"] for c in CASES[:4]]


@pytest.fixture(scope="module")
def model(smollm_path):
    return load_model("default", progress=False)


def _engine(model, overlap, **kw):
    return LLMEngine(model, EngineConfig(overlap_decode=overlap, **kw))


def _run(engine, prompts, params, hook=None):
    """Step to the end; ``hook(engine, step, ids)`` may add or abort requests between steps."""
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    got, reasons, step = {}, {}, 0
    while engine.has_unfinished() or engine._inflight is not None:
        if hook is not None:
            hook(engine, step, ids)
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.token_ids)
            if out.finished:
                reasons[out.request_id] = out.finish_reason
        step += 1
    return [(got.get(i, []), reasons.get(i)) for i in ids]


def _params():
    return [SamplingParams(temperature=0.0, max_tokens=6 + 9 * i) for i in range(len(PROMPTS))]


def test_same_outputs_blocks_and_cache_as_step_by_step(model):
    base = _engine(model, False, block_size=4)     # small blocks: decode crosses many boundaries
    want = _run(base, PROMPTS, _params())
    # a stop token taken from the middle of one answer makes that row stop mid-batch
    stop_tok = want[3][0][len(want[3][0]) // 2]
    params = _params()
    params[3] = SamplingParams(temperature=0.0, max_tokens=6 + 9 * 3, stop_token_ids=[stop_tok])
    base = _engine(model, False, block_size=4)
    want = _run(base, PROMPTS, params)
    e = _engine(model, True, block_size=4)
    got = _run(e, PROMPTS, params)
    assert got == want
    assert want[3][1] == "stop" and len(want[3][0]) < 6 + 9 * 3
    assert e.stats["overlapped_steps"] > 10
    assert e.pool.num_free == e.pool.num_blocks == base.pool.num_free
    assert set(e.pool.cached) == set(base.pool.cached)         # same prefixes registered


def test_abort_and_arrival_while_a_step_is_in_flight(model):
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True) for _ in range(3)]
    solo = [_run(_engine(model, False), [p], [sp])[0] for p, sp in zip(PROMPTS[:3], params)]
    late = {}

    def hook(engine, step, ids):
        if step == 6:
            assert engine._inflight is not None          # a step is queued right now
            engine.abort(ids[1])
        if step == 9:
            late["id"] = engine.add_request(PROMPTS[2], params[2])

    e = _engine(model, True)
    got = _run(e, PROMPTS[:2], params[:2], hook)
    assert got[0] == solo[0]
    assert got[1][0] == solo[1][0][:len(got[1][0])] and len(got[1][0]) < 24   # cut short, no stray token
    while e.has_unfinished():
        e.step()
    assert e.pool.num_free == e.pool.num_blocks
    assert e.stats["overlapped_steps"] > 0


def test_late_request_gets_its_solo_tokens(model):
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    solo = _run(_engine(model, False), [PROMPTS[1]], [params])[0]
    e = _engine(model, True)
    first = e.add_request(PROMPTS[0], params)
    outs = {}
    for step in range(40):
        if step == 5:
            second = e.add_request(PROMPTS[1], params)
        for out in e.step():
            outs.setdefault(out.request_id, []).extend(out.token_ids)
        if not e.has_unfinished() and e._inflight is None:
            break
    assert (outs[second], "length") == (solo[0], solo[1])
    assert len(outs[first]) == 20


def test_sampled_or_logprob_rows_run_step_by_step(model):
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.9, seed=7, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)]
    want = _run(_engine(model, False), PROMPTS[:3], params)
    e = _engine(model, True)
    assert _run(e, PROMPTS[:3], params) == want
    assert e.stats["overlapped_steps"] == 0


def test_overlap_is_off_by_default_on_the_cpu(model):
    assert not _engine(model, None).overlap


def test_turning_overlap_off_finishes_the_queued_step_first(model):
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    want = _run(_engine(model, False), [PROMPTS[0]], [params])[0][0]
    e = _engine(model, True)
    e.add_request(PROMPTS[0], params)
    got = []
    for _ in range(6):
        for out in e.step():
            got += out.token_ids
    assert e._inflight is not None
    e.overlap = False
    launched = e.stats["overlapped_steps"]
    while e.has_unfinished() or e._inflight is not None:
        for out in e.step():
            got += out.token_ids
    assert got == want
    assert e.stats["overlapped_steps"] == launched      # nothing queued after the switch


def test_graph_captures_hold_the_garbage_collector_off_and_restore_it():
    """A collection inside a CUDA-graph capture could destroy an earlier engine's graphs (a
    CUDA call that invalidates the capture); the runner's captures run with it held off."""
    import gc

    from lodestar.engine.collector import paused as _no_gc
    assert gc.isenabled()
    with _no_gc():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError), _no_gc():
        raise RuntimeError("capture failed")
    assert gc.isenabled()
    gc.disable()
    try:
        with _no_gc():
            pass
        assert not gc.isenabled()           # left as the caller had it
    finally:
        gc.enable()

