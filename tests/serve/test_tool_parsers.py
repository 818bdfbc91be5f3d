import json

import pytest

from lodestar.serve.tool_parsers import ToolCallParser, parse_tool_calls

NAMES = {"get_weather", "search"}

VALID = [
    # Hermes / Qwen, with text before, nested JSON and a brace inside a string
    ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, {"x": "}"}]}}\n'
     '</tool_call>', "Let me check.\n", [("get_weather", {"city": "Paris", "days": [1, {"x": "}"}]})]),
    # two Hermes calls, escaped quote
    ('<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>\n'
     '<tool_call>{"name": "search", "arguments": {"q": "say \\"hi\\""}}</tool_call>',
     "", [("get_weather", {"city": "Oslo"}), ("search", {"q": 'say "hi"'})]),
    # Hermes with keys in another order and a missing closing tag
    ('<tool_call>{"arguments": {"q": "x"}, "name": "search"}', "", [("search", {"q": "x"})]),
    # Hermes with string-encoded arguments
    ('<tool_call>{"name": "search", "arguments": "{\\"q\\": \\"x\\"}"}</tool_call>', "", [("search", {"q": "x"})]),
    # Llama 3 bare JSON, two calls joined by ';'
    ('{"name": "get_weather", "parameters": {"city": "Rome"}}; {"name": "search", "parameters": {}}',
     "", [("get_weather", {"city": "Rome"}), ("search", {})]),
    # Llama 3 python tag
    ('<|python_tag|>{"name": "search", "parameters": {"q": "llamas"}}', "", [("search", {"q": "llamas"})]),
    # Mistral list
    ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Nice"}}, {"name": "search", "arguments": {"q": 1}}]',
     "", [("get_weather", {"city": "Nice"}), ("search", {"q": 1})]),
    # Mistral name[ARGS] form
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Lyon"}[TOOL_CALLS]search[ARGS]{"q": "z"}',
     "", [("get_weather", {"city": "Lyon"}), ("search", {"q": "z"})]),
    # extra keys after the arguments; text after the call
    ('<tool_call>{"name": "search", "arguments": {"q": "a"}, "id": "c1"}</tool_call> Done.', " Done.",
     [("search", {"q": "a"})]),
]

MALFORMED = [
    '<tool_call>{"name": "unknown_tool", "arguments": {}}</tool_call>',   # not a declared tool
    '<tool_call>{"name": "search", "arguments": {"q": </tool_call>',      # arguments cut by the closing tag
    '<tool_call>{"name": "search", "arguments": {"q": "unterminated',      # output ended inside the call
    '<tool_call>not json at all</tool_call>',
    'The JSON {"name": "search", "parameters": {}} appears mid-text.',     # bare JSON only counts at the start
    '{"name": "Ada", "age": 36}',                                          # JSON that is not a tool call
    '[TOOL_CALLS] nonsense here',
    'a < b and [x] <tool no call',
]


def _calls(calls):
    return [(c.name, json.loads(c.arguments)) for c in calls]


def _stream(text: str, size: int):
    parser = ToolCallParser(NAMES)
    events = []
    for i in range(0, len(text), size):
        events += parser.feed(text[i:i + size])
    events += parser.finish()
    return parser, events


@pytest.mark.parametrize("text,content,calls", VALID)
def test_whole_parse(text, content, calls):
    got_content, got_calls = parse_tool_calls(text, NAMES)
    assert got_content == content
    assert _calls(got_calls) == calls


@pytest.mark.parametrize("text,content,calls", VALID)
@pytest.mark.parametrize("size", [1, 2, 5, 13, 10_000])
def test_streaming_parse_matches_whole(text, content, calls, size):
    parser, events = _stream(text, size)
    assert "".join(e.text for e in events if e.kind == "content") == content
    args: dict[int, str] = {}
    starts = [(e.index, e.name) for e in events if e.kind == "start"]
    ends = [e.index for e in events if e.kind == "end"]
    for e in events:
        if e.kind == "args":
            args[e.index] = args.get(e.index, "") + e.text
    assert [name for _, name in starts] == [name for name, _ in calls]
    assert ends == [i for i, _ in starts]
    assert [json.loads(args[i]) for i, _ in starts] == [a for _, a in calls]
    assert all(c.complete for c in parser.calls)


def test_arguments_stream_before_the_call_ends():
    parser = ToolCallParser(NAMES)
    events = parser.feed('<tool_call>{"name": "search", "arguments": {"q": "long')
    assert [e.kind for e in events] == ["start", "args"]
    assert events[0].name == "search" and events[1].text == '{"q": "long'
    more = parser.feed(' query"}}</tool_call>')
    assert [(e.kind, e.text) for e in more] == [("args", ' query"}'), ("end", "")]


@pytest.mark.parametrize("text", MALFORMED)
def test_malformed_markup_is_plain_content(text):
    content, calls = parse_tool_calls(text, NAMES)
    assert (content, calls) == (text, [])


@pytest.mark.parametrize("text", [t for t in MALFORMED if "arguments\": {\"q\"" not in t])
@pytest.mark.parametrize("size", [1, 4, 10_000])
def test_malformed_markup_streams_back_as_content(text, size):
    parser, events = _stream(text, size)
    assert not parser.calls
    assert "".join(e.text for e in events) == text


@pytest.mark.parametrize("size", [1, 10_000])
def test_call_broken_after_it_started_is_marked_incomplete(size):
    parser, events = _stream('<tool_call>{"name": "search", "arguments": {"q": </tool_call> sorry', size)
    kinds = [e.kind for e in events if e.kind != "args"]
    assert kinds[:2] == ["start", "end"] and set(kinds[2:]) == {"content"}
    assert "".join(e.text for e in events if e.kind == "content") == " sorry"
    assert parser.calls[0].complete is False


def test_without_declared_tools_bare_json_is_content():
    parser = ToolCallParser(None)
    text = '{"name": "search", "parameters": {}}'
    events = parser.feed(text) + parser.finish()
    assert [(e.kind, e.text) for e in events] == [("content", text)]
