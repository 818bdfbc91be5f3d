"""Speculative decoding: drafters, exact verification, KV release, stops inside a run.

Greedy speculation must give the tokens of plain decoding (ARCHITECTURE.md §4): on the
fp32 path those are the oracle's goldens; on the packed path (row-invariant kernels,
attention row by row for a verify run) the log-probabilities are bit-equal too. The
exactness tests draft with n-grams from length 1 and a fixed gamma, so nearly every step
carries drafts and both acceptances and rejections are exercised.
"""
import json
from pathlib import Path

import pytest

from lodestar.engine.grammar import GrammarSpec
from lodestar.engine.llm_engine import EngineConfig, LLMEngine
from lodestar.engine.loader import load_model
from lodestar.engine.sampling import SamplingParams
from lodestar.engine.spec import SpecConfig, SpecStats
from lodestar.engine.spec.drafters import NgramDrafter
from lodestar.engine.spec.verify import MISS_LIMIT, SpecState, best_gamma
from lodestar.engine.sequence import Sequence

GOLDENS = Path(__file__).resolve().parents[1] / "goldens"
CPU_COST = lambda g: 1 + 0.1 * g    # noqa: E731
EAGER = SpecConfig("ngram", num_spec_tokens=4, ngram_min=1, ngram_max=3, adaptive=False)


def _cases(name: str, picks: list[str]) -> list[dict]:
    by_name = {c["name"]: c for c in json.loads((GOLDENS / f"generate_{name}.json").read_text())["cases"]}
    return [by_name[p] for p in picks]


# -- drafters and the adaptive gamma (no model) ------------------------------------
def _seq(prompt, out=(), _ids=iter(range(10**6))):
    s = Sequence(next(_ids), list(prompt), SamplingParams())
    s.output_ids = list(out)
    return s


def test_ngram_proposes_what_followed_the_latest_longest_match():
    d = NgramDrafter(2, 3)
    # "5 6 7" occurs twice before the suffix; the latest occurrence is followed by 9 9
    s = _seq([5, 6, 7, 1, 2, 5, 6, 7, 9, 9, 3, 5, 6, 7])
    assert d.propose([s], [2])[0].tokens == [9, 9]
    assert d.propose([s], [5])[0].tokens == [9, 9, 3, 5, 6]
    # the suffix does not match itself; no earlier occurrence of (4, 8) -> nothing
    s2 = _seq([1, 2, 3], [4, 8])
    assert d.propose([s2], [3])[0].tokens == []


def test_ngram_index_follows_new_output():
    d = NgramDrafter(2, 2)
    s = _seq([1, 2, 3, 4])
    assert d.propose([s], [2])[0].tokens == []
    s.output_ids += [1, 2]                 # now "1 2" repeats: 3 4 followed it
    assert d.propose([s], [2])[0].tokens == [3, 4]
    s.output_ids += [3, 4, 7]
    assert d.propose([s], [2])[0].tokens == []
    d.release(s)


def test_adaptive_gamma_turns_off_when_drafts_fail_and_comes_back():
    st = SpecState(SpecConfig("ngram", num_spec_tokens=6))
    assert st.active and st.next_gamma(100) == 6 and st.next_gamma(3) == 3
    for _ in range(6):
        st.record(drafted=st.next_gamma(100) or 1, accepted=0, cost=CPU_COST)
        if not st.active:
            break
    assert not st.active and st.next_gamma(100) == 0
    for _ in range(st.cooldown):
        st.tick()
    assert st.active
    for _ in range(20):
        g = st.next_gamma(100)
        st.record(drafted=g, accepted=g, cost=CPU_COST)
    assert st.gamma == 6
    assert best_gamma(0.05, CPU_COST, 8) == 0 and best_gamma(0.9, lambda g: 1 + 0.03 * g, 8) == 8
    # a GPU bucket curve like a quantized 8B's (k rows cost ~k/2 past two): short drafts
    q4 = {0: 1.0, 1: 1.31, 2: 1.98, 3: 1.98, 4: 3.3, 5: 3.3, 6: 3.3, 7: 3.3, 8: 3.4}
    assert best_gamma(0.6, q4.get, 8) == 1 and best_gamma(0.3, q4.get, 8) == 0


def test_no_draft_streak_pauses_drafting():
    st = SpecState(SpecConfig("ngram"))
    for _ in range(MISS_LIMIT):
        st.no_draft()
    assert not st.active


def test_spec_config_rejects_bad_values():
    with pytest.raises(ValueError, match="num_spec_tokens"):
        SpecConfig("ngram", num_spec_tokens=0)
    with pytest.raises(ValueError, match="method"):
        SpecConfig("medusa")
    with pytest.raises(ValueError, match="ngram_min"):
        SpecConfig("ngram", ngram_min=4, ngram_max=2)
    with pytest.raises(ValueError, match="speculate"):
        SamplingParams(speculate="yes")


# -- the engine on the real default model -----------------------------------------
@pytest.fixture(scope="module")
def engine(smollm_path):
    """The packed path (the default), where verify rows are bit-equal to decode steps."""
    return LLMEngine(load_model("default", mode="packed", progress=False),
                     EngineConfig(max_num_seqs=8, max_num_batched_tokens=512, spec=EAGER))


def _gen(engine, prompts, **kw):
    kw.setdefault("temperature", 0.0)
    out = engine.generate(prompts, SamplingParams(**kw))
    assert not engine.running and not engine.waiting
    return out


@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m"])
def test_fp32_greedy_speculation_gives_the_oracle_tokens(name, smollm_path, gemma_path):
    """fp32 CPU with drafts at nearly every step: the oracle's goldens (its GEMMs round by row
    count, so only the tokens are compared)."""
    engine = LLMEngine(load_model(name, mode="fp32", progress=False),
                       EngineConfig(max_num_seqs=4, max_num_batched_tokens=512, spec=EAGER))
    cases = [c for c in json.loads((GOLDENS / f"generate_{name}.json").read_text())["cases"]
             if len(c["prompt_ids"]) < 200][1:3]
    on = _gen(engine, [c["prompt_ids"] for c in cases], max_tokens=16, ignore_eos=True)
    for c, a in zip(cases, on):
        assert a.token_ids == c["tokens"][:16], c["name"]
    assert engine.stats["spec_verify_steps"] > 0 and 0 < engine.stats["spec_accepted"] < engine.stats["spec_drafted"]


def test_packed_verify_rows_are_bit_equal_to_decode_steps(engine):
    """Tokens and log-probabilities of plain decoding, drafts accepted and rejected."""
    prompts = [c["prompt_ids"] for c in _cases("smollm2-135m", ["raw_code", "chat_hello", "raw_unicode"])]
    on = _gen(engine, prompts, max_tokens=24, ignore_eos=True, logprobs=3)
    off = _gen(engine, prompts, max_tokens=24, ignore_eos=True, logprobs=3, speculate=False)
    for a, b in zip(on, off):
        assert a.token_ids == b.token_ids
        assert a.logprobs == b.logprobs
    assert engine.stats["spec_verify_steps"] > 0 and 0 < engine.stats["spec_accepted"] < engine.stats["spec_drafted"]
    assert engine.pool.num_free == engine.pool.num_blocks     # cached blocks count as free


def test_stops_inside_an_accepted_run_are_exact(engine):
    """A repetitive continuation (long accepted runs): max_tokens, a stop string and a stop
    token that fall inside a run end the output where plain decoding ends it, and leave the
    prefix cache as plain decoding does (no extra cached token)."""
    tok = engine.tokenizer
    prompt = tok.encode("1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2,")
    base = _gen(engine, [prompt], max_tokens=24, ignore_eos=True, speculate=False)[0]
    stop_tok = base.token_ids[13]
    stop_str = tok.decode(base.token_ids[9:12])
    for kw in ({"max_tokens": 17}, {"max_tokens": 24, "stop": [stop_str]}, {"max_tokens": 24,
                                                                            "stop_token_ids": [stop_tok]}):
        runs, cached = [], []
        for spec in (False, True):
            before = dict(engine.stats)
            c = _gen(engine, [prompt], ignore_eos=True, speculate=spec, **kw)[0]
            runs.append((c.token_ids, c.text, c.finish_reason))
            cached.append(set(engine.pool.cached))
            if spec:
                assert engine.stats["spec_accepted"] > before.get("spec_accepted", 0), kw
        assert runs[0] == runs[1], kw
        assert cached[0] == cached[1], kw       # the speculative run cached no block the plain one did not


def test_kv_of_rejected_drafts_is_released_at_once(engine):
    prompt = engine.tokenizer.encode("The list: apple, pear, apple, plum, apple, fig, apple, kiwi, apple,")
    before = dict(engine.stats)
    rid = engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    seq = engine.requests[rid]
    checked = 0
    while engine.has_unfinished():
        engine.step()
        if not seq.is_finished:
            assert not seq.draft_ids
            assert seq.num_computed == seq.num_tokens - 1
            assert len(seq.block_table) == engine.pool.blocks_needed(seq.num_tokens)
            checked += 1
    drafted = engine.stats["spec_drafted"] - before.get("spec_drafted", 0)
    assert checked and drafted > engine.stats["spec_accepted"] - before.get("spec_accepted", 0)
    assert engine.pool.num_free == engine.pool.num_blocks     # cached blocks count as free


def test_mixed_batch_with_prefill_and_plain_requests(engine):
    """Verify runs beside plain decode rows and a prefill chunk that arrives mid-way."""
    cases = _cases("smollm2-135m", ["raw_code", "chat_hello", "raw_unicode"])
    alone = [_gen(engine, [c["prompt_ids"]], max_tokens=20, ignore_eos=True, speculate=False)[0].token_ids
             for c in cases]
    p = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    ids = [engine.add_request(cases[0]["prompt_ids"], p),
           engine.add_request(cases[1]["prompt_ids"], SamplingParams(temperature=0.0, max_tokens=20,
                                                                      ignore_eos=True, speculate=False))]
    got = {i: [] for i in ids}
    steps = 0
    while engine.has_unfinished():
        for o in engine.step():
            got[o.request_id] += o.token_ids
            if o.request_id == ids[1]:
                assert o.speculation is None
        steps += 1
        if steps == 3:
            ids.append(engine.add_request(cases[2]["prompt_ids"], p))
            got[ids[-1]] = []
    assert [got[i] for i in ids] == alone


def test_grammar_requests_speculate_within_the_grammar(engine):
    spec = GrammarSpec("json_schema", json.dumps({
        "type": "object", "properties": {"items": {"type": "array", "items": {"type": "string", "enum": ["ab", "cd"]},
                                                   "minItems": 6, "maxItems": 6}},
        "required": ["items"]}))
    prompt = engine.tokenizer.encode('JSON: {"items": ["ab", "cd", "ab", "cd", "ab", "cd"]}\nJSON:')
    on = _gen(engine, [prompt], max_tokens=60, grammar=spec)[0]
    off = _gen(engine, [prompt], max_tokens=60, grammar=spec, speculate=False)[0]
    assert on.token_ids == off.token_ids and on.finish_reason == "stop"
    assert json.loads(on.text)["items"]


def test_request_output_reports_speculation(engine):
    prompt = engine.tokenizer.encode("a b c d a b c d a b c d a b c d a b c d a b")
    outs = list(engine.stream(prompt, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)))
    st = outs[-1].speculation
    assert isinstance(st, SpecStats) and st.verify_steps > 0 and st.accepted > 0
    assert sum(len(o.token_ids) for o in outs) == 16
    d = st.to_dict()
    assert set(d) == {"drafted_tokens", "accepted_tokens", "acceptance_rate", "verify_steps", "mean_tokens_per_step"}


def test_sampled_speculation_is_seeded_and_runs(engine):
    prompt = engine.tokenizer.encode("a b c d a b c d a b c d a b c d a b c d a b")
    kw = dict(temperature=0.7, top_k=20, top_p=0.95, min_p=0.02, repetition_penalty=1.05, seed=7,
              max_tokens=24, ignore_eos=True)
    a = _gen(engine, [prompt], **kw)[0]
    b = _gen(engine, [prompt], **kw)[0]
    assert a.token_ids == b.token_ids and len(a.token_ids) == 24


def test_engine_refuses_bad_speculation_settings(engine):
    """Refused before the engine allocates anything (the module's engine shares the model)."""
    from lodestar.engine.spec.drafters import DraftModelError, check_vocabularies
    with pytest.raises(DraftModelError, match="needs a draft model"):
        LLMEngine(engine.loaded, EngineConfig(spec=SpecConfig("draft")))
    with pytest.raises(ValueError, match="own tokens"):
        LLMEngine(engine.loaded, EngineConfig(spec=SpecConfig("ngram")), draft=engine.loaded)
    with pytest.raises(ValueError, match="needs EngineConfig.spec"):
        LLMEngine(engine.loaded, EngineConfig(), draft=engine.loaded)

    class Other:
        vocab_size = engine.tokenizer.vocab_size

        @staticmethod
        def token_bytes(i):
            return b"x" if i == 7 else engine.tokenizer.token_bytes(i)
    with pytest.raises(DraftModelError, match="differ at token 7"):
        check_vocabularies(engine.tokenizer, Other(), "target.gguf", "draft.gguf")
    Other.vocab_size += 1
    with pytest.raises(DraftModelError, match="vocabulary of"):
        check_vocabularies(engine.tokenizer, Other(), "target.gguf", "draft.gguf")


def test_draft_model_speculation(smollm_path):
    """The default model drafting for itself at another precision (packed Q4_1 draft, fp32
    target): greedy output is the oracle's, most drafts are accepted; sampled requests use
    the draft's distribution q."""
    target = load_model("default", mode="fp32", progress=False)
    draft = load_model("default", mode="packed", progress=False)
    engine = LLMEngine(target, EngineConfig(max_num_seqs=4, spec=SpecConfig("draft", num_spec_tokens=4)), draft=draft)
    cases = _cases("smollm2-135m", ["raw_count"])
    out = _gen(engine, [c["prompt_ids"] for c in cases], max_tokens=16, ignore_eos=True)
    for c, o in zip(cases, out):
        assert o.token_ids == c["tokens"][:16], c["name"]
    assert engine.stats["spec_accepted"] > 0.8 * engine.stats["spec_drafted"] > 0
    a = _gen(engine, [cases[0]["prompt_ids"]], temperature=0.8, seed=3, max_tokens=8, ignore_eos=True)[0]
    assert len(a.token_ids) == 8
    assert engine.drafter.pool.num_free == engine.drafter.pool.num_blocks      # shadows released
