"""Constrained decoding in the engine: masks, end of output, jump-forward, batching, bad grammars."""
import json
import re

import jsonschema
import pytest
import torch
from fed_run import feed_run

from lodestar.engine.grammar import GrammarError, GrammarSpec, apply_masks
from lodestar.engine.llm_engine import EngineConfig, LLMEngine
from lodestar.engine.loader import load_model
from lodestar.engine.sampling import SamplingParams

PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 40},
                         "age": {"type": "integer", "minimum": 0, "maximum": 130},
                         "job": {"enum": ["engineer", "doctor", "artist"]},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3}},
          "required": ["name", "age", "job", "tags"], "additionalProperties": False}


@pytest.fixture(scope="module", params=["packed", "fp32"])
def engine(request, smollm_path):
    return LLMEngine(load_model("default", mode=request.param, progress=False),
                     EngineConfig(max_num_seqs=8, max_num_batched_tokens=256))


@pytest.fixture(scope="module")
def packed(smollm_path):
    return LLMEngine(load_model("default", progress=False), EngineConfig(max_num_seqs=8, max_num_batched_tokens=256))


def _chat(engine, text):
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return engine.tokenizer.encode(prompt, add_special_tokens=False)


def _bits(mask_row: torch.Tensor, vocab: int) -> list[int]:
    shifts = torch.arange(32, dtype=torch.int32)
    return ((mask_row.unsqueeze(-1) >> shifts) & 1).reshape(-1)[:vocab].nonzero().flatten().tolist()


# -- compiler and matcher ------------------------------------------------------------------
def test_compile_is_cached_by_content(packed):
    g = packed.grammars
    spec = GrammarSpec("json_schema", {"type": "object", "properties": {"zz_cache_probe": {"type": "integer"}}})
    before = g.misses
    g.compile(spec)
    g.compile(GrammarSpec("json_schema", json.loads(json.dumps(spec.value)), field="another.field"))
    assert g.misses == before + 1 and g.hits >= 1


@pytest.mark.parametrize("spec, words", [
    (GrammarSpec("json_schema", {"type": "strin"}, field="response_format.json_schema.schema"), "strin"),
    (GrammarSpec("json_schema", {"$ref": "#/definitions/missing"}, field="guided_json"), "missing"),
    (GrammarSpec("json_schema", "{not json", field="guided_json"), "not valid JSON"),
    (GrammarSpec("regex", "[a-z", field="guided_regex"), "unclosed character class"),
    (GrammarSpec("grammar", "start: undefined_rule", field="guided_grammar"), "undefined_rule"),
    (GrammarSpec("choice", [], field="guided_choice"), "non-empty list"),
])
def test_bad_specs_name_the_field_and_the_reason(packed, spec, words):
    with pytest.raises(GrammarError) as e:
        packed.grammars.compile(spec)
    assert e.value.field == spec.field
    assert words in e.value.reason


def test_a_grammar_nothing_can_start_is_refused(packed):
    # a character class intersection that is empty: the language has no string at all
    for regex in ("[a&&b]x", r"[^\s\S]"):
        with pytest.raises(GrammarError) as e:
            packed.grammars.compile(GrammarSpec("regex", regex, field="guided_regex"))
        assert e.value.field == "guided_regex"
        assert "no token of the model's vocabulary can start this grammar" in e.value.reason, e.value.reason


def test_matcher_mask_follows_accepted_tokens_and_rolls_back(packed):
    tok, g = packed.tokenizer, packed.grammars
    m = g.matcher(GrammarSpec("regex", "ab+c"))
    mask = torch.zeros((1, g.words), dtype=torch.int32)
    g.fill_masks([m], mask)
    first = _bits(mask[0], g.n_vocab)
    assert first and all(tok.token_bytes(t)[:1] == b"a" for t in first)
    ids = tok.encode("abbbc", add_special_tokens=False)
    assert all(m.accept(t) for t in ids)
    assert m.is_stopped()
    m.rollback(len(ids))
    g.fill_masks([m], mask)
    assert _bits(mask[0], g.n_vocab) == first


def test_apply_masks_bans_every_other_token_and_the_padded_tail():
    logits = torch.zeros(3, 70)
    masks = torch.zeros(2, 2, dtype=torch.int32)
    masks[0, 0] = 0b101          # tokens 0 and 2
    masks[1, 1] = -(1 << 31)     # token 63 (the sign bit of word 1)
    apply_masks(logits, [0, 2], masks)
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [0, 2]
    assert torch.isfinite(logits[1]).all()                       # a row without a grammar
    assert torch.isfinite(logits[2]).nonzero().flatten().tolist() == [63]   # 64..69 are past the mask


# -- decoding --------------------------------------------------------------------------------
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_schema_output_is_valid_json_every_time(packed, temperature):
    prompt = _chat(packed, "Describe a person as JSON.")
    params = [SamplingParams(temperature=temperature, seed=s, max_tokens=120, grammar=GrammarSpec("json_schema", PERSON))
              for s in range(4)]
    for c in packed.generate([prompt] * 4, params):
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), PERSON)


def test_regex_and_choice_outputs_match(packed):
    prompt = _chat(packed, "What is the date of the first moon landing?")
    date, pick = packed.generate([prompt, prompt], [
        SamplingParams(temperature=0.7, seed=1, max_tokens=20, grammar=GrammarSpec("regex", r"\d{4}-\d{2}-\d{2}")),
        SamplingParams(temperature=0.0, max_tokens=20, grammar=GrammarSpec("choice", ["yes", "no", "maybe later"]))])
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", date.text) and date.finish_reason == "stop"
    assert pick.text in ("yes", "no", "maybe later") and pick.finish_reason == "stop"


def test_gbnf_grammar(packed):
    gbnf = 'root ::= "The answer is " digit digit "."\ndigit ::= [0-9]'
    c = packed.generate([_chat(packed, "Pick a number.")],
                        SamplingParams(temperature=0.0, max_tokens=20, grammar=GrammarSpec("grammar", gbnf)))[0]
    assert re.fullmatch(r"The answer is \d\d\.", c.text) and c.finish_reason == "stop"


def test_end_of_sequence_only_where_the_grammar_accepts(packed):
    """Unconstrained, this prompt ends after a few tokens; the grammar needs 30 letters first."""
    prompt = _chat(packed, "Say hi.")
    free = packed.generate([prompt], SamplingParams(temperature=0.0, max_tokens=40))[0]
    assert free.finish_reason == "stop" and len(free.token_ids) < 30
    c = packed.generate([prompt], SamplingParams(temperature=0.0, max_tokens=200,
                                                 grammar=GrammarSpec("regex", "[a-z ]{30,40}")))[0]
    assert re.fullmatch("[a-z ]{30,40}", c.text) and c.finish_reason == "stop"


def test_max_tokens_inside_an_open_structure_is_length(packed):
    c = packed.generate([_chat(packed, "A person as JSON.")],
                        SamplingParams(temperature=0.0, max_tokens=5, jump_forward=False,
                                       grammar=GrammarSpec("json_schema", PERSON)))[0]
    assert c.finish_reason == "length" and len(c.token_ids) == 5
    with pytest.raises(ValueError):
        json.loads(c.text)


def test_jump_forward_gives_the_same_text_in_fewer_steps(packed):
    schema = {"type": "object", "properties": {
        "customer_billing_address_postal_code": {"type": "string", "maxLength": 10},
        "customer_shipping_preference_description": {"type": "string", "maxLength": 20},
        "number_of_items_in_the_current_order": {"type": "integer"}},
        "required": ["customer_billing_address_postal_code", "customer_shipping_preference_description",
                     "number_of_items_in_the_current_order"], "additionalProperties": False}
    prompt = _chat(packed, "An order record as JSON.")
    runs = {}
    for jf in (False, True):
        packed.stats.clear()
        steps = 0
        rid = packed.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=120, jump_forward=jf,
                                                        grammar=GrammarSpec("json_schema", schema)))
        outs = []
        while packed.has_unfinished():
            steps += 1
            outs += [o for o in packed.step() if o.request_id == rid]
        runs[jf] = ([t for o in outs for t in o.token_ids], "".join(o.text for o in outs), steps,
                    outs[-1].forced_tokens, outs[-1].finish_reason)
    (ids0, text0, steps0, forced0, r0), (ids1, text1, steps1, forced1, r1) = runs[False], runs[True]
    assert r0 == r1 == "stop"
    jsonschema.validate(json.loads(text1), schema)
    assert ids1 == ids0 and text1 == text0       # the run's rows attend as their own steps would
    assert forced0 == 0 and forced1 >= 20
    assert steps1 <= steps0 - forced1 + 2     # one pass per forced run, not per forced token


def test_no_jump_forward_with_logprobs(packed):
    c = packed.generate([_chat(packed, "A person as JSON.")],
                        SamplingParams(temperature=0.0, max_tokens=80, logprobs=1,
                                       grammar=GrammarSpec("json_schema", PERSON)))[0]
    assert len(c.logprobs) == len(c.token_ids)      # every token sampled, so every token has one
    json.loads(c.text)


def test_constrained_request_alone_equals_in_a_mixed_batch(engine):
    prompts = [_chat(engine, f"Person number {i} as JSON, please.") for i in range(8)]
    spec = GrammarSpec("json_schema", PERSON)
    constrained = SamplingParams(temperature=0.0, max_tokens=60, grammar=spec)
    alone = engine.generate([prompts[0]], constrained)[0]
    mixed = [constrained if i % 2 == 0 else SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
             for i in range(8)]
    mixed[2] = SamplingParams(temperature=0.0, max_tokens=60, grammar=GrammarSpec("regex", "[A-Z][a-z]+( [a-z]+)*\\."))
    together = engine.generate(prompts, mixed)
    assert together[0].token_ids == alone.token_ids
    jsonschema.validate(json.loads(together[4].text), PERSON)
    assert engine.pool.num_free == engine.pool.num_blocks


def test_bad_grammar_mid_batch_leaves_the_others_alone(packed):
    prompts = [_chat(packed, "Count to five."), _chat(packed, "A person as JSON.")]
    params = [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=80, grammar=GrammarSpec("json_schema", PERSON))]
    expected = [c.token_ids for c in packed.generate(prompts, params)]
    ids = [packed.add_request(p, sp) for p, sp in zip(prompts, params)]
    got = {i: [] for i in ids}
    for step in range(200):
        if step == 3:
            with pytest.raises(GrammarError):
                packed.add_request(prompts[0], SamplingParams(grammar=GrammarSpec("regex", "(unclosed")))
        for out in packed.step():
            got[out.request_id] += out.token_ids
        if not packed.has_unfinished():
            break
    assert [got[i] for i in ids] == expected
    assert packed.pool.num_free == packed.pool.num_blocks


def test_a_fed_run_of_output_tokens_gives_the_bits_of_one_step_each(engine):
    """Jump-forward feeds forced tokens as one chunk; on the CPU each of its rows attends as its
    own decode step would, so the logits after the run are those of feeding it token by token:
    the same bits on the packed path (row-invariant linear kernels); on the fp32 path MKL's GEMM
    rounds a row by the number of rows, so the last bits may differ there (as in batching)."""
    prompt = _chat(engine, "A person as JSON.")
    run = engine.tokenizer.encode('{"name": "Ada", "age": 36, "job": "', add_special_tokens=False)
    (chunk, _), (steps, _) = feed_run(engine, prompt, run, False), feed_run(engine, prompt, run, True)
    if engine.loaded.mode == "packed":
        assert torch.equal(chunk, steps)
    else:
        assert torch.allclose(chunk, steps, rtol=0, atol=1e-4) and torch.equal(chunk.argmax(-1), steps.argmax(-1))


def test_a_grammar_that_allows_nothing_ends_the_output_instead_of_failing_the_batch(packed, monkeypatch):
    prompts = [_chat(packed, "Count to five."), _chat(packed, "A person as JSON.")]
    params = [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=40, grammar=GrammarSpec("regex", "[a-z]+"))]
    real = type(packed.grammars).fill_masks

    def dead_after_three(self, matchers, out):
        real(self, matchers, out)
        for i, m in enumerate(matchers):
            if m is not None and m.llmatcher.is_accepting():     # after a letter: pretend a dead end
                out[i].zero_()

    monkeypatch.setattr(type(packed.grammars), "fill_masks", dead_after_three)
    free, dead = packed.generate(prompts, params)
    assert len(free.token_ids) == 8
    assert dead.finish_reason == "stop" and dead.token_ids[-1] in packed.tokenizer.eos_ids
