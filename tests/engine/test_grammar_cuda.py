"""Constrained decoding on the GPU: masks applied to logits that CUDA graphs computed.

Skipped without a CUDA device. Uses the real default model when installed (carried to the
device), so the outputs mean something; the mask path itself is the same for any model.
"""
from __future__ import annotations

import json
import re

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 40},
                         "age": {"type": "integer", "minimum": 0, "maximum": 130},
                         "job": {"enum": ["engineer", "doctor", "artist"]}},
          "required": ["name", "age", "job"], "additionalProperties": False}


@pytest.fixture(scope="module")
def engine():
    from lodestar.engine.llm_engine import EngineConfig, LLMEngine
    from lodestar.engine.loader import load_model
    from lodestar.formats.catalog import ModelNotFoundError, known_model_path
    try:
        known_model_path("default")
    except ModelNotFoundError as e:
        pytest.skip(str(e))
    return LLMEngine(load_model("default", mode="packed", progress=False, device="cuda"),
                     EngineConfig(max_num_seqs=8, kv_tokens=8192, device="cuda"))


def _chat(engine, text):
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return engine.tokenizer.encode(prompt, add_special_tokens=False)


def test_constrained_outputs_are_valid_in_a_mixed_batch_on_cuda(engine):
    import jsonschema
    from lodestar.engine.grammar import GrammarSpec
    from lodestar.engine.sampling import SamplingParams
    prompts = [_chat(engine, f"Person {i} as JSON.") for i in range(8)]
    params = []
    for i in range(8):
        if i % 4 == 0:
            params.append(SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
        elif i % 4 == 1:
            params.append(SamplingParams(temperature=0.8, seed=i, max_tokens=80, grammar=GrammarSpec("json_schema", PERSON)))
        elif i % 4 == 2:
            params.append(SamplingParams(temperature=0.0, max_tokens=80, grammar=GrammarSpec("json_schema", PERSON)))
        else:
            params.append(SamplingParams(temperature=0.0, max_tokens=40, grammar=GrammarSpec("regex", r"\d{3}-\d{4}")))
    out = engine.generate(prompts, params)
    for c, p in zip(out, params):
        if p.grammar is None:
            assert len(c.token_ids) == 24
        elif p.grammar.kind == "regex":
            assert re.fullmatch(r"\d{3}-\d{4}", c.text) and c.finish_reason == "stop"
        else:
            assert c.finish_reason == "stop", c.text
            jsonschema.validate(json.loads(c.text), PERSON)
    assert engine.pool.num_free == engine.pool.num_blocks


def test_mask_after_graph_replay_equals_eager_on_cuda(engine):
    """Decode graphs and eager decode give the same greedy tokens (tests/engine/test_cuda_exactness.py);
    the grammar mask, applied after either, keeps them equal."""
    from lodestar.engine.grammar import GrammarSpec
    from lodestar.engine.sampling import SamplingParams
    prompt = _chat(engine, "A person as JSON.")
    params = SamplingParams(temperature=0.0, max_tokens=80, jump_forward=False, grammar=GrammarSpec("json_schema", PERSON))
    runner = engine.runner
    saved = runner.cuda_graphs
    try:
        got = {}
        for graphs in (True, False):
            runner.cuda_graphs = graphs
            engine.pool.reset_cache()
            got[graphs] = engine.generate([prompt], params)[0].token_ids
    finally:
        runner.cuda_graphs = saved
    assert got[True] == got[False]


def test_pipelined_constrained_decode_equals_step_by_step_on_cuda(engine):
    """Greedy grammar rows ride the overlapped decode path: the next step is queued before the
    host reads this one's tokens, and each step's masked pick is queued behind its graph. The
    tokens equal the step-by-step loop's (jump-forward off: with it, a forced run changes which
    steps are graphs and which are eager chunks)."""
    import jsonschema
    from lodestar.engine.grammar import GrammarSpec
    from lodestar.engine.sampling import SamplingParams
    prompts = [_chat(engine, f"Person {i} as JSON.") for i in range(3)]
    params = [SamplingParams(temperature=0.0, max_tokens=80, jump_forward=False, grammar=GrammarSpec("json_schema", PERSON)),
              SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=40, jump_forward=False,
                             grammar=GrammarSpec("regex", r"[a-z]+( [a-z]+){5,9}\."))]
    saved = engine.overlap
    try:
        got = {}
        for overlap in (False, True):
            engine.overlap = overlap
            engine.pool.reset_cache()
            before = engine.stats["overlapped_steps"]
            got[overlap] = [c.token_ids for c in engine.generate(prompts, params)]
            steps = engine.stats["overlapped_steps"] - before
        assert steps > 20
        assert got[True] == got[False]
        jsonschema.validate(json.loads(engine.tokenizer.decode(got[True][0])), PERSON)
        # with jump-forward the pipeline breaks at each forced run and resumes after it
        engine.overlap = True
        jf = engine.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=80,
                                                         grammar=GrammarSpec("json_schema", PERSON)))[0]
        jsonschema.validate(json.loads(jf.text), PERSON)
        assert engine.pool.num_free == engine.pool.num_blocks
    finally:
        engine.overlap = saved


def test_a_fed_run_replays_as_graph_rows_with_the_bits_of_one_step_each_on_cuda(engine):
    """A run of decoded tokens (jump-forward's forced run) goes through the decode graph as one
    row per token, each attending up to its own position: the logits after it are those of
    feeding the run one decode step at a time."""
    from fed_run import feed_run
    prompt = _chat(engine, "A person as JSON.")
    run = engine.tokenizer.encode('{"name": "Ada", "age": 36, "job": "', add_special_tokens=False)
    (chunk, replays), (steps, _) = feed_run(engine, prompt, run, False), feed_run(engine, prompt, run, True)
    assert replays == 1
    assert torch.equal(chunk, steps)
