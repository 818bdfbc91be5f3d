"""The API-neutral core: engine outputs in, deltas and results out (no HTTP)."""
import asyncio

from lodestar.engine.llm_engine import RequestOutput
from lodestar.engine.sampling import SamplingParams
from lodestar.serve.generation import Generation, GenerationSpec, build_params
from lodestar.serve.state import ServeConfig, ServeState

TOOL_CALLS_ID = 5   # a special token the detokenizer drops from the text


class Vocab:
    def piece_to_id(self, piece):
        return TOOL_CALLS_ID if piece == "[TOOL_CALLS]" else None

    def is_special(self, tid):
        return tid == TOOL_CALLS_ID

    def token_bytes(self, tid):
        return b"[TOOL_CALLS]" if tid == TOOL_CALLS_ID else f"t{tid}".encode()

    def encode(self, text, add_special_tokens=True):
        return [ord(c) for c in text]


class Replay:
    """Yields one RequestOutput per (token id, text) step."""

    def __init__(self, steps, finish="stop"):
        self.tokenizer, self.steps, self.finish, self.max_model_len = Vocab(), steps, finish, 4096

    def stats(self):
        return {"waiting": 0, "running": 0, "kv_blocks_used": 0, "kv_blocks_total": 1}

    async def generate(self, prompt_ids, params):
        for i, (tid, text) in enumerate(self.steps):
            last = i == len(self.steps) - 1
            lp = [(-0.5, [(tid, -0.5)])] if params.logprobs is not None else None
            yield RequestOutput(0, [tid], text, last, self.finish if last else None, lp, len(prompt_ids), i + 1, 3)


def run(engine, spec, stream):
    gen = Generation(ServeState(engine, ServeConfig()), spec, stream=stream)

    async def go():
        return [d async for d in gen.events()], gen.result

    return asyncio.run(go())


def test_dropped_special_marker_is_restored_for_the_tool_parser():
    steps = [(TOOL_CALLS_ID, ""), (10, '[{"name": "search", '), (11, '"arguments": {"q": "x"}}]')]
    spec = GenerationSpec([1, 2], SamplingParams(max_tokens=50), frozenset({"search"}))
    _, result = run(Replay(steps), spec, stream=False)
    assert result.content == "" and result.finish_reason == "tool_calls"
    assert [(c.name, c.arguments) for c in result.tool_calls] == [("search", '{"q": "x"}')]
    deltas, result = run(Replay(steps), spec, stream=True)
    assert [d.kind for d in deltas if d.kind != "tool_args"] == ["tool_start", "tool_end"]
    assert result.finish_reason == "tool_calls" and result.cached_tokens == 3


def test_stop_string_is_stripped_and_reported():
    params = build_params({}, stop=["END"], max_tokens=50)
    assert params.include_stop_str_in_output        # the server strips it itself, knowing which matched
    steps = [(10, "Hello "), (11, "world END")]
    for stream in (False, True):
        deltas, result = run(Replay(steps), GenerationSpec([1], params), stream)
        text = result.content if not stream else "".join(d.text for d in deltas if d.kind == "content")
        assert text == "Hello world " and result.stop_sequence == "END"


def test_logprobs_ride_on_the_content_they_produced():
    steps = [(10, "<think>"), (11, "hmm"), (12, "</think>"), (13, "Yes")]
    deltas, result = run(Replay(steps), GenerationSpec([1], SamplingParams(max_tokens=9, logprobs=1)), True)
    content = [d for d in deltas if d.kind == "content"]
    assert [d.text for d in content] == ["Yes"]
    assert [e.token for e in content[0].logprobs] == ["t10", "t11", "t12", "t13"]
    assert [d.text for d in deltas if d.kind == "reasoning"] == ["hmm"]
