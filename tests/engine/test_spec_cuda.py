"""Speculative decoding on the GPU: verify runs replayed through the decode graphs.

Skipped without a CUDA device. Uses the real default model when installed (carried to the
device). The packed CUDA kernels give each row the bits of a one-row step, so greedy
speculation must give plain decoding's tokens exactly, beside plain (overlapped) rows.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

GOLDENS = Path(__file__).resolve().parents[1] / "goldens"


def _load(mode="packed"):
    from lodestar.engine.loader import load_model
    from lodestar.formats.catalog import ModelNotFoundError, known_model_path
    try:
        known_model_path("default")
    except ModelNotFoundError as e:
        pytest.skip(str(e))
    return load_model("default", mode=mode, progress=False, device="cuda")


@pytest.fixture(scope="module")
def engine():
    from lodestar.engine.llm_engine import EngineConfig, LLMEngine
    from lodestar.engine.spec import SpecConfig
    # no prefix cache: on the GPU a prompt whose prefix is cached prefills its rest in another
    # shape than a whole-prompt prefill (other bits), which is not what this test is about
    return LLMEngine(_load(), EngineConfig(max_num_seqs=8, kv_tokens=8192, device="cuda", enable_prefix_cache=False,
                                           spec=SpecConfig("ngram", num_spec_tokens=4, ngram_min=1, ngram_max=3,
                                                           adaptive=False)))


def _prompts(n=4):
    cases = json.loads((GOLDENS / "generate_smollm2-135m.json").read_text())["cases"]
    return [c["prompt_ids"] for c in cases[:n]]


def test_greedy_speculation_matches_plain_decoding_on_cuda(engine):
    from lodestar.engine.sampling import SamplingParams
    prompts = _prompts()
    off = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, speculate=False))
    replays = engine.runner.graph_replays
    on = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    assert engine.stats["spec_accepted"] > 0 and engine.runner.graph_replays > replays
    # both kinds in one batch: the plain rows are unaffected
    mixed = engine.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True,
                                                     speculate=bool(i % 2)) for i in range(len(prompts))])
    assert [o.token_ids for o in mixed] == [o.token_ids for o in off]
    assert engine.pool.num_free == engine.pool.num_blocks


def test_grammar_and_sampled_speculation_on_cuda(engine):
    from lodestar.engine.grammar import GrammarSpec
    from lodestar.engine.sampling import SamplingParams
    schema = {"type": "object", "properties": {"xs": {"type": "array", "items": {"enum": ["ab", "cd"]},
                                                      "minItems": 6, "maxItems": 6}}, "required": ["xs"]}
    prompt = engine.tokenizer.encode('JSON: {"xs": ["ab", "cd", "ab", "cd", "ab", "cd"]}\nJSON:')
    g = GrammarSpec("json_schema", json.dumps(schema))
    a = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=60, grammar=g))[0]
    b = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=60, grammar=g, speculate=False))[0]
    assert a.token_ids == b.token_ids and json.loads(a.text)["xs"]
    kw = dict(temperature=0.8, top_p=0.95, seed=11, max_tokens=32, ignore_eos=True)
    s1 = engine.generate([prompt], SamplingParams(**kw))[0]
    s2 = engine.generate([prompt], SamplingParams(**kw))[0]
    assert s1.token_ids == s2.token_ids and len(s1.token_ids) == 32


def test_draft_model_on_cuda():
    from lodestar.engine.llm_engine import EngineConfig, LLMEngine
    from lodestar.engine.sampling import SamplingParams
    from lodestar.engine.spec import SpecConfig
    target = _load("packed")
    engine = LLMEngine(target, EngineConfig(max_num_seqs=4, kv_tokens=4096, device="cuda", enable_prefix_cache=False,
                                            spec=SpecConfig("draft", num_spec_tokens=4)), draft=_load("packed"))
    prompts = _prompts(2)
    on = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
    off = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, speculate=False))
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    assert engine.stats["spec_accepted"] > 0.9 * engine.stats["spec_drafted"] > 0
