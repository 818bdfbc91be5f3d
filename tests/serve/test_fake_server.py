"""The full HTTP path with a scripted engine double: tool calls, reasoning, keep-alives, 503, auth, limits.

The double replays crafted model output (a Hermes tool call, a think span ...) so what
the real small model rarely writes is still driven end to end through the official SDKs.
"""
from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

from lodestar.serve import ServeConfig, build_app

from serve_helpers import MODEL, serve_in_thread

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
ANTHROPIC_TOOLS = [{"name": "get_weather", "description": "Current weather for a city",
                    "input_schema": TOOLS[0]["function"]["parameters"]}]
RESPONSES_TOOLS = [{"type": "function", "name": "get_weather", "description": "Current weather for a city",
                    "parameters": TOOLS[0]["function"]["parameters"]}]
HERMES_CALL = ("<tool_call>", '\n{"name": "get_weather", ', '"arguments": {"city": ', '"Par', 'is"}}', "\n</tool_call>")
THINKING = ("<think>", "\nLet me", " think.", "\n</think>", "\n\nIt is", " sunny.")


@pytest.fixture()
def oai(fake_url):
    return openai.OpenAI(base_url=fake_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture()
def ant(fake_url):
    return anthropic.Anthropic(base_url=fake_url, api_key="unused", max_retries=0)


# -- tool calls ------------------------------------------------------------------------------
def test_openai_chat_streams_a_tool_call_with_argument_deltas(oai, script, fake_engine):
    script.pieces = ("Checking.", *HERMES_CALL)
    chunks = list(oai.chat.completions.create(model=MODEL, stream=True, tools=TOOLS, messages=[
        {"role": "user", "content": "Weather in Paris?"}]))
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert content == "Checking."
    assert deltas[0].id.startswith("call_") and deltas[0].function.name == "get_weather"
    arg_deltas = [d.function.arguments for d in deltas[1:]]
    assert len(arg_deltas) >= 2                                # arguments arrive in pieces
    assert json.loads("".join(arg_deltas)) == {"city": "Paris"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # the template ignores tools, so the prompt carries the Hermes tools block
    assert "<tools>" in fake_engine.prompt_text() and '"name": "get_weather"' in fake_engine.prompt_text()


def test_openai_chat_tool_round_trip(oai, script, fake_engine):
    script.pieces = HERMES_CALL
    first = oai.chat.completions.create(model=MODEL, tools=TOOLS, messages=[
        {"role": "user", "content": "Weather in Paris?"}])
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}

    script.pieces = ("It is 18 C", " in Paris.")
    second = oai.chat.completions.create(model=MODEL, tools=TOOLS, messages=[
        {"role": "user", "content": "Weather in Paris?"},
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "18 C, sunny"}])
    assert second.choices[0].message.content == "It is 18 C in Paris."
    assert second.choices[0].finish_reason == "stop"
    prompt = fake_engine.prompt_text()
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert "<tool_response>\n18 C, sunny\n</tool_response>" in prompt


def test_malformed_tool_markup_comes_back_as_content(oai, script):
    script.pieces = ("<tool_call>", "{not json}", "</tool_call>")
    msg = oai.chat.completions.create(model=MODEL, tools=TOOLS, messages=[{"role": "user", "content": "x"}])
    assert msg.choices[0].message.content == "<tool_call>{not json}</tool_call>"
    assert msg.choices[0].message.tool_calls is None and msg.choices[0].finish_reason == "stop"


def test_tool_choice_none_leaves_markup_as_text(oai, script, fake_engine):
    script.pieces = HERMES_CALL
    msg = oai.chat.completions.create(model=MODEL, tools=TOOLS, tool_choice="none",
                                      messages=[{"role": "user", "content": "x"}])
    assert msg.choices[0].message.tool_calls is None
    assert "<tools>" not in fake_engine.prompt_text()


def test_anthropic_streams_tool_use_and_takes_tool_result(ant, script, fake_engine):
    script.pieces = ("Let me look.", *HERMES_CALL)
    with ant.messages.stream(model=MODEL, max_tokens=100, tools=ANTHROPIC_TOOLS,
                             messages=[{"role": "user", "content": "Weather in Paris?"}]) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert [b.type for b in final.content] == ["text", "tool_use"]
    tool_use = final.content[1]
    assert tool_use.name == "get_weather" and tool_use.input == {"city": "Paris"}
    assert final.stop_reason == "tool_use"

    script.pieces = ("Sunny, 18 C.",)
    reply = ant.messages.create(model=MODEL, max_tokens=100, tools=ANTHROPIC_TOOLS, messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in final.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool_use.id, "content": "18 C"}]}])
    assert reply.content[0].text == "Sunny, 18 C." and reply.stop_reason == "end_turn"
    prompt = fake_engine.prompt_text()
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt
    assert "<tool_response>\n18 C\n</tool_response>" in prompt


def test_anthropic_non_streaming_tool_use(ant, script):
    script.pieces = HERMES_CALL
    msg = ant.messages.create(model=MODEL, max_tokens=100, tools=ANTHROPIC_TOOLS,
                              messages=[{"role": "user", "content": "Weather?"}])
    assert [b.type for b in msg.content] == ["tool_use"]
    assert msg.content[0].input == {"city": "Paris"} and msg.stop_reason == "tool_use"


def test_responses_function_call_round_trip(oai, script, fake_engine):
    script.pieces = HERMES_CALL
    events = list(oai.responses.create(model=MODEL, input="Weather in Paris?", tools=RESPONSES_TOOLS, stream=True))
    types = [e.type for e in events]
    assert types[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert types.count("response.function_call_arguments.delta") >= 2
    assert types[-3:] == ["response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    call = events[-1].response.output[0]
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris"}

    script.pieces = ("18 C and sunny.",)
    resp = oai.responses.create(model=MODEL, tools=RESPONSES_TOOLS, input=[
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "18 C"}])
    assert resp.output_text == "18 C and sunny." and resp.status == "completed"
    assert "<tool_response>\n18 C\n</tool_response>" in fake_engine.prompt_text()


def test_anthropic_final_assistant_message_is_continued(ant, script, fake_engine):
    script.pieces = (" red, green and blue.",)
    msg = ant.messages.create(model=MODEL, max_tokens=20, messages=[
        {"role": "user", "content": "Name three colors."}, {"role": "assistant", "content": "The colors are"}])
    assert msg.content[0].text == " red, green and blue."
    assert fake_engine.prompt_text().endswith("<|im_start|>assistant\nThe colors are")


# -- reasoning -------------------------------------------------------------------------------
def test_reasoning_is_split_from_content_in_every_api(oai, ant, script, fake_engine):
    script.pieces = THINKING
    chunks = list(oai.chat.completions.create(model=MODEL, stream=True, reasoning_effort="high",
                                              messages=[{"role": "user", "content": "Weather?"}]))
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert (reasoning, content) == ("Let me think.", "It is sunny.")

    msg = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather?"}])
    assert msg.choices[0].message.content == "It is sunny."
    assert msg.choices[0].message.model_extra["reasoning_content"] == "Let me think."

    with ant.messages.stream(model=MODEL, max_tokens=50, thinking={"type": "enabled", "budget_tokens": 1024},
                             messages=[{"role": "user", "content": "Weather?"}]) as stream:
        final = stream.get_final_message()
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in final.content] == [
        ("thinking", "Let me think."), ("text", "It is sunny.")]

    resp = oai.responses.create(model=MODEL, input="Weather?", reasoning={"effort": "low"})
    assert [o.type for o in resp.output] == ["reasoning", "message"]
    assert resp.output[0].content[0].text == "Let me think." and resp.output_text == "It is sunny."


# -- streaming mechanics ---------------------------------------------------------------------
def test_keepalives_while_waiting_for_the_first_token(fake_url, script):
    """Chat Completions sends SSE comments; Messages its own ``ping`` event and Responses a
    ``keepalive`` event, since Claude Code and Codex reset their idle timers on events only."""
    script.first_delay = 0.6         # the server's keep-alive interval is 0.1 s
    for path, body, mark in [
            ("/v1/chat/completions", {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "hi"}]},
             ": keep-alive"),
            ("/v1/messages", {"model": MODEL, "stream": True, "max_tokens": 10,
                              "messages": [{"role": "user", "content": "hi"}]}, 'data: {"type":"ping"}'),
            ("/v1/responses", {"model": MODEL, "stream": True, "input": "hi"}, '"type":"keepalive"')]:
        with httpx.stream("POST", fake_url + path, json=body, timeout=10) as r:
            lines = [line for line in r.iter_lines() if line]
        first_text = next(i for i, line in enumerate(lines) if "Hello" in line)
        keepalives = [i for i, line in enumerate(lines) if mark in line]
        assert len(keepalives) >= 2, path
        assert all(i < first_text for i in keepalives), path
        if path == "/v1/responses":
            seqs = [json.loads(line[5:])["sequence_number"] for line in lines if line.startswith("data:")]
            assert seqs == list(range(len(seqs))), "sequence numbers count the keep-alive events too"


def test_stream_options_usage_and_n_choices(oai, script):
    chunks = list(oai.chat.completions.create(model=MODEL, n=2, stream=True, stream_options={"include_usage": True},
                                              messages=[{"role": "user", "content": "hi"}]))
    by_choice = {0: "", 1: ""}
    for c in chunks:
        for ch in c.choices:
            by_choice[ch.index] += ch.delta.content or ""
    assert by_choice == {0: "Hello, world!", 1: "Hello, world!"}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert all(c.usage is None for c in chunks[:-1])
    msg = oai.chat.completions.create(model=MODEL, n=3, messages=[{"role": "user", "content": "hi"}])
    assert [c.index for c in msg.choices] == [0, 1, 2]


def test_client_disconnect_stops_the_request(fake_url, fake_engine, script):
    import time
    script.pieces = ("tick ",) * 400
    script.step_delay = 0.01
    body = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "count"}]}
    with httpx.stream("POST", fake_url + "/v1/chat/completions", json=body, timeout=10) as r:
        # Keep the line iterator referenced: a dropped one is closed at once, and closing it
        # closes the response, which is the disconnect this test makes only below.
        lines = r.iter_lines()
        for i, _ in enumerate(lines):
            if i > 5:
                break
        assert fake_engine.running == 1
    deadline = time.monotonic() + 5
    while fake_engine.running and time.monotonic() < deadline:
        time.sleep(0.02)
    assert fake_engine.running == 0


# -- errors and limits -----------------------------------------------------------------------
def test_queue_full_is_503_with_retry_after(oai, ant, fake_engine):
    fake_engine.max_queued = 0
    try:
        with pytest.raises(openai.InternalServerError) as e:
            oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
        assert e.value.status_code == 503 and e.value.response.headers["retry-after"] == "1"
        with pytest.raises(anthropic.APIStatusError) as e:
            ant.messages.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "hi"}])
        assert e.value.status_code == 503 and e.value.body["error"]["type"] == "overloaded_error"
        assert e.value.response.headers["retry-after"] == "1"
    finally:
        fake_engine.max_queued = 256


def test_engine_failure_mid_stream_is_reported_in_each_grammar(oai, ant, script):
    script.fail_after = 2
    with pytest.raises(openai.APIError) as e:
        list(oai.chat.completions.create(model=MODEL, stream=True, messages=[{"role": "user", "content": "hi"}]))
    assert "simulated failure" in e.value.message
    with pytest.raises(anthropic.APIStatusError) as e:
        with ant.messages.stream(model=MODEL, max_tokens=10, messages=[{"role": "user", "content": "hi"}]) as s:
            list(s)
    assert e.value.body["error"]["type"] == "overloaded_error"
    events = list(oai.responses.create(model=MODEL, input="hi", stream=True))
    assert [e.type for e in events[-2:]] == ["error", "response.failed"]
    assert events[-1].response.status == "failed"


def test_api_key_required_when_set(fake_engine):
    app = build_app(fake_engine, ServeConfig(model_names=(MODEL,), api_key="s3cret"))
    with serve_in_thread(app) as url:
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
        assert [m.id for m in openai.OpenAI(base_url=url + "/v1", api_key="s3cret").models.list()] == [MODEL]
        with pytest.raises(anthropic.AuthenticationError) as e:
            anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0).messages.create(
                model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "hi"}])
        assert e.value.body["error"]["type"] == "authentication_error"
        for client in (anthropic.Anthropic(base_url=url, api_key="s3cret"),          # x-api-key
                       anthropic.Anthropic(base_url=url, auth_token="s3cret")):     # Bearer
            assert client.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": "hi"}]
                                                ).input_tokens > 0
        assert httpx.get(url + "/health").status_code == 200
        assert httpx.get(url + "/metrics").status_code == 401


def test_cors_only_when_enabled(fake_engine, fake_url):
    preflight = {"Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST"}
    r = httpx.options(fake_url + "/v1/chat/completions", headers=preflight)
    assert "access-control-allow-origin" not in r.headers
    app = build_app(fake_engine, ServeConfig(model_names=(MODEL,), cors_origins=("http://localhost:3000",)))
    with serve_in_thread(app) as url:
        r = httpx.options(url + "/v1/chat/completions", headers=preflight)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://localhost:3000"


def test_oversized_body_is_413_in_each_api_shape(fake_engine):
    app = build_app(fake_engine, ServeConfig(model_names=(MODEL,), max_body_bytes=2000))
    big = "x" * 5000
    with serve_in_thread(app) as url:
        r = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": [
            {"role": "user", "content": big}]})
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        r = httpx.post(url + "/v1/messages", content=json.dumps({"model": MODEL, "max_tokens": 5, "messages": [
            {"role": "user", "content": big}]}).encode(), headers={"content-type": "application/json",
                                                                   "transfer-encoding": "chunked"})
        assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"


def test_unsupported_content_is_a_400_naming_the_field(oai, ant):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": [
            {"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": "data:,"}}]}])
    assert e.value.body["param"] == "messages[0].content[1]"
    with pytest.raises(anthropic.BadRequestError) as e:
        ant.messages.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}])
    assert "messages[0].content[0]" in e.value.message


def test_index_page_placeholder_and_static_file(fake_engine, fake_url, tmp_path):
    bare = build_app(fake_engine, ServeConfig(model_names=(MODEL,), static_dir=tmp_path / "none"))
    with serve_in_thread(bare) as url:
        r = httpx.get(url + "/")
        assert r.status_code == 200 and "lodestar" in r.text and MODEL in r.text
    assert "<script" in httpx.get(fake_url + "/").text      # the shipped chat page
    (tmp_path / "index.html").write_text("<h1>chat ui</h1>")
    (tmp_path / "app.js").write_text("console.log(1)")
    app = build_app(fake_engine, ServeConfig(model_names=(MODEL,), static_dir=tmp_path))
    with serve_in_thread(app) as url:
        assert httpx.get(url + "/").text == "<h1>chat ui</h1>"
        assert httpx.get(url + "/static/app.js").text == "console.log(1)"


def test_openapi_document_lists_every_route(fake_url):
    paths = httpx.get(fake_url + "/openapi.json").json()["paths"]
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages",
                 "/v1/messages/count_tokens", "/v1/models", "/v1/models/{model_id}", "/health", "/metrics"):
        assert path in paths, path
