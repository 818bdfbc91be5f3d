"""Request shapes the coding tools send today, and prompts that do not fit the context.

Claude Code puts ``system`` messages inside ``messages``; Codex declares ``namespace``
groups, a freeform ``custom`` tool and hosted tools (``web_search``) and echoes its
``reasoning`` items back; opencode asks for a fixed output cap whatever its prompt. Each
body below is shaped after what those clients send, driven over HTTP against the scripted
engine double: what the server cannot run is left out with an ``x-lodestar-warning``
header, what is malformed is still a 400 naming the field, and a prompt that does not fit
is a 400 with the numbers and the fix.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest

from lodestar.serve import ServeConfig, build_app

from serve_helpers import MODEL, ScriptedEngine, serve_in_thread

WARNING = "x-lodestar-warning"
SHELL_SCHEMA = {"type": "object", "properties": {"command": {"type": "array", "items": {"type": "string"}}},
                "required": ["command"], "additionalProperties": False}
APPLY_PATCH_GRAMMAR = 'start: begin_patch hunk+ end_patch\nbegin_patch: "*** Begin Patch" LF\n'


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=30)


def _events(url: str, path: str, body: dict) -> tuple[httpx.Headers, list[tuple[str, dict]]]:
    """(headers, [(event name, data)]) of a named-event SSE stream."""
    with httpx.stream("POST", url + path, json=body, timeout=30) as r:
        assert r.status_code == 200, r.read()
        events, name = [], None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                events.append((name, json.loads(line[len("data: "):])))
        return r.headers, events


# -- Claude Code: system messages inside messages --------------------------------------------
def claude_code_body(**extra) -> dict:
    """The shape of a Claude Code 2.1 request: system blocks with cache_control, a system-role
    message after the first user turn, tools with a server tool among them, many optional fields."""
    return {
        "model": MODEL, "max_tokens": 32000, "stream": False,
        "system": [{"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude.",
                    "cache_control": {"type": "ephemeral"}},
                   {"type": "text", "text": "You are an interactive agent that helps with software tasks."}],
        "messages": [
            {"role": "user", "content": [
                {"type": "text", "text": "<system-reminder>Use the tools.</system-reminder>"},
                {"type": "text", "text": "Say hi", "cache_control": {"type": "ephemeral"}}]},
            {"role": "system", "content": "Working directory: /tmp/project"},
            {"role": "system", "content": [{"type": "text", "text": "Platform: linux"}]},
        ],
        "tools": [{"name": "Bash", "description": "Run a shell command",
                   "input_schema": {"type": "object", "properties": {"command": {"type": "string"}},
                                    "required": ["command"]}},
                  {"type": "web_search_20250305", "name": "web_search", "max_uses": 5}],
        "metadata": {"user_id": "user_abc_account__session_123"},
        "thinking": {"type": "adaptive"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "high"},
        **extra,
    }


def test_claude_code_request_with_system_messages_is_served(fake_url, script, fake_engine):
    r = _post(fake_url, "/v1/messages", claude_code_body())
    assert r.status_code == 200, r.text
    assert r.json()["content"][0]["text"] == "Hello, world!"
    prompt = fake_engine.prompt_text()
    # one system prompt: the system field, then the system messages in order; then the user turn
    system_at = [prompt.index(s) for s in ("official CLI for Claude", "interactive agent",
                                           "Working directory: /tmp/project", "Platform: linux")]
    assert system_at == sorted(system_at)
    assert prompt.count("<|im_start|>system") == 1
    assert system_at[-1] < prompt.index("Say hi")
    assert '"name": "Bash"' in prompt and "web_search" not in prompt
    warning = r.headers[WARNING]
    assert "tools[1]" in warning and "web_search" in warning
    assert "max_tokens=32000 lowered to" in warning


def test_claude_code_streams_with_system_messages(fake_url, script, fake_engine):
    headers, events = _events(fake_url, "/v1/messages", claude_code_body(stream=True))
    assert [name for name, _ in events][0] == "message_start" and events[-1][0] == "message_stop"
    assert "web_search" in headers[WARNING]
    assert "Platform: linux" in fake_engine.prompt_text()


def test_developer_messages_fold_into_the_system_prompt_in_order(fake_url, script, fake_engine):
    r = _post(fake_url, "/v1/messages", {"model": MODEL, "max_tokens": 10, "system": "First.", "messages": [
        {"role": "developer", "content": "Second."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "system", "content": "Third."},
        {"role": "user", "content": "Again"}]})
    assert r.status_code == 200, r.text
    prompt = fake_engine.prompt_text()
    assert "First.\n\nSecond.\n\nThird.<|im_end|>" in prompt
    assert prompt.index("Third.") < prompt.index("Hi") < prompt.index("Hello.") < prompt.index("Again")
    assert WARNING not in r.headers
    counted = _post(fake_url, "/v1/messages/count_tokens", {"model": MODEL, "messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]})
    assert counted.status_code == 200 and counted.json()["input_tokens"] > 3


def test_anthropic_leaves_out_server_tool_blocks_with_a_warning(fake_url, script, fake_engine):
    r = _post(fake_url, "/v1/messages", {"model": MODEL, "max_tokens": 10, "messages": [
        {"role": "user", "content": "Search the web for lodestar."},
        {"role": "assistant", "content": [
            {"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search", "input": {"query": "lodestar"}},
            {"type": "web_search_tool_result", "tool_use_id": "srvtoolu_1", "content": []},
            {"type": "text", "text": "Nothing found."}]},
        {"role": "user", "content": "Thanks"}]})
    assert r.status_code == 200, r.text
    assert "server_tool_use" in r.headers[WARNING] and "web_search_tool_result" in r.headers[WARNING]
    assert "Nothing found." in fake_engine.prompt_text()


@pytest.mark.parametrize("messages, where", [
    ([{"role": "tool", "content": "x"}], "messages[0].role"),
    ([{"role": "system", "content": "Only a system prompt."}], "messages"),
    ([{"role": "user", "content": [{"text": "no type"}]}], "messages[0].content[0].type"),
    ([{"role": "user", "content": [{"type": "text", "text": 5}]}], "messages[0].content[0].text"),
    ([{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                "data": "AA=="}}]}], "messages[0].content[0]"),
    ([{"role": "system", "content": [{"type": "image", "source": {}}]}, {"role": "user", "content": "Hi"}],
     "messages[0].content[0]"),
])
def test_malformed_anthropic_messages_are_still_400(fake_url, messages, where):
    r = _post(fake_url, "/v1/messages", {"model": MODEL, "max_tokens": 10, "messages": messages})
    assert r.status_code == 400, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert where in body["error"]["message"]


# -- Codex: namespace groups, custom and hosted tools, reasoning items ------------------------
def codex_body(**extra) -> dict:
    """The shape of a Codex CLI 0.171 Responses request (multi-agent on, web search on)."""
    return {
        "model": MODEL,
        "instructions": "You are Codex, a coding agent.",
        "input": [
            {"type": "message", "role": "developer", "content": [
                {"type": "input_text", "text": "<permissions instructions>sandbox: workspace-write"}]},
            {"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": "<environment_context><cwd>/tmp/p</cwd></environment_context>"}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "List the files."}]},
            {"type": "reasoning", "summary": [], "content": None, "encrypted_content": "gAAAAABo-opaque"},
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": "**Listing files**"}]},
            {"type": "function_call", "name": "shell", "arguments": '{"command":["ls"]}', "call_id": "call_1"},
            {"type": "function_call_output", "call_id": "call_1", "output": "README.md\nsrc"},
            {"type": "web_search_call", "status": "completed", "action": {"type": "search", "query": "x"}},
        ],
        "tools": [
            {"type": "function", "name": "shell", "description": "Runs a shell command", "strict": False,
             "parameters": SHELL_SCHEMA},
            {"type": "custom", "name": "apply_patch", "description": "Edit files with a patch.",
             "format": {"type": "grammar", "syntax": "lark", "definition": APPLY_PATCH_GRAMMAR}},
            {"type": "web_search", "external_web_access": False},
            {"type": "namespace", "name": "agents", "description": "Tools in the agents namespace.", "tools": [
                {"type": "function", "name": "spawn_agent", "description": "Spawn a sub-agent", "strict": False,
                 "parameters": {"type": "object", "properties": {"message": {"type": "string"}},
                                "required": ["message"], "additionalProperties": False}},
                {"type": "function", "name": "wait_agent", "description": "Wait for agents", "strict": False,
                 "parameters": {"type": "object", "properties": {}}}]},
            {"type": "image_generation", "output_format": "png"},
        ],
        "tool_choice": "auto", "parallel_tool_calls": False,
        "reasoning": {"effort": "xhigh", "summary": "auto"},
        "store": False, "stream": True, "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "0199-session", "text": {"verbosity": "low"},
        "client_metadata": {"originator": "codex_exec"}, "service_tier": "auto",
        **extra,
    }


def test_codex_request_with_namespace_and_hosted_tools_streams(fake_url, script, fake_engine):
    headers, events = _events(fake_url, "/v1/responses", codex_body())
    assert events[0][0] == "response.created" and events[-1][0] == "response.completed"
    warning = headers[WARNING]
    for dropped in ("tools[2] of type 'web_search'", "tools[4] of type 'image_generation'",
                    "input[7] of type 'web_search_call'"):
        assert dropped in warning
    prompt = fake_engine.prompt_text()
    for name in ('"name": "shell"', '"name": "apply_patch"', '"name": "spawn_agent"', '"name": "wait_agent"'):
        assert name in prompt
    assert "web_search" not in prompt and "image_generation" not in prompt
    assert APPLY_PATCH_GRAMMAR.splitlines()[0] in prompt           # the freeform tool's grammar is described
    assert "sandbox: workspace-write" in prompt and "List the files." in prompt
    assert '{"name": "shell", "arguments": {"command": ["ls"]}}' in prompt
    assert "<tool_response>\nREADME.md\nsrc\n</tool_response>" in prompt


def test_a_namespaced_tool_call_carries_its_namespace(fake_url, script):
    script.pieces = ("<tool_call>", '\n{"name": "spawn_agent", "arguments": {"message": "go"}}', "\n</tool_call>")
    r = _post(fake_url, "/v1/responses", codex_body(stream=False))
    assert r.status_code == 200, r.text
    [call] = r.json()["output"]
    assert (call["type"], call["name"], call["namespace"]) == ("function_call", "spawn_agent", "agents")
    assert json.loads(call["arguments"]) == {"message": "go"}

    _, events = _events(fake_url, "/v1/responses", codex_body())
    done = [d for name, d in events if name == "response.output_item.done"]
    assert done[-1]["item"]["namespace"] == "agents" and done[-1]["item"]["name"] == "spawn_agent"
    added = [d for name, d in events if name == "response.output_item.added"]
    assert added[-1]["item"]["namespace"] == "agents"


def test_the_namespaced_call_goes_back_into_the_prompt(fake_url, script, fake_engine):
    body = codex_body(stream=False)
    body["input"] += [
        {"type": "function_call", "namespace": "agents", "name": "spawn_agent", "arguments": '{"message":"go"}',
         "call_id": "call_2"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "agent-7"}]}]
    r = _post(fake_url, "/v1/responses", body)
    assert r.status_code == 200, r.text
    prompt = fake_engine.prompt_text()
    assert '{"name": "spawn_agent", "arguments": {"message": "go"}}' in prompt and "agent-7" in prompt


def test_a_custom_tool_is_called_with_its_freeform_input(fake_url, script, fake_engine):
    patch = "*** Begin Patch\n*** Add File: a.txt\n+hi\n*** End Patch"
    script.pieces = ("<tool_call>", "\n" + json.dumps({"name": "apply_patch", "arguments": {"input": patch}}),
                     "\n</tool_call>")
    r = _post(fake_url, "/v1/responses", codex_body(stream=False))
    [call] = r.json()["output"]
    assert (call["type"], call["name"], call["input"]) == ("custom_tool_call", "apply_patch", patch)
    assert "namespace" not in call and call["id"].startswith("ctc_")

    _, events = _events(fake_url, "/v1/responses", codex_body())
    names = [name for name, _ in events]
    assert "response.function_call_arguments.delta" not in names
    assert names[-4:] == ["response.custom_tool_call_input.delta", "response.custom_tool_call_input.done",
                          "response.output_item.done", "response.completed"]
    assert events[-3][1]["input"] == patch and events[-2][1]["item"]["input"] == patch

    script.pieces = ("Done.",)
    body = codex_body(stream=False)
    body["input"] += [{"type": "custom_tool_call", "status": "completed", "call_id": "call_3", "name": "apply_patch",
                       "input": patch},
                      {"type": "custom_tool_call_output", "call_id": "call_3", "output": "Success. Updated a.txt"}]
    r = _post(fake_url, "/v1/responses", body)
    assert r.status_code == 200, r.text
    prompt = fake_engine.prompt_text()
    assert json.dumps({"name": "apply_patch", "arguments": {"input": patch}}, ensure_ascii=False) in prompt
    assert "Success. Updated a.txt" in prompt


def test_tool_choice_naming_a_hosted_or_namespaced_tool(fake_url, script, fake_engine):
    r = _post(fake_url, "/v1/responses", codex_body(stream=False, tool_choice={"type": "web_search_preview"}))
    assert r.status_code == 200 and "tool_choice of type 'web_search_preview'" in r.headers[WARNING]
    r = _post(fake_url, "/v1/responses", codex_body(stream=False, tool_choice={
        "type": "function", "namespace": "agents", "name": "wait_agent"}))
    assert r.status_code == 200, r.text
    prompt = fake_engine.prompt_text()
    assert "Wait for agents" in prompt and "Runs a shell command" not in prompt
    r = _post(fake_url, "/v1/responses", codex_body(stream=False, tool_choice={
        "type": "allowed_tools", "mode": "auto", "tools": [{"type": "function", "name": "shell"}]}))
    assert r.status_code == 200, r.text
    prompt = fake_engine.prompt_text()
    assert "Runs a shell command" in prompt and "Spawn a sub-agent" not in prompt


@pytest.mark.parametrize("change, where", [
    ({"tools": [{"name": "no_type", "parameters": {}}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "parameters": {}}]}, "tools[0].name"),
    ({"tools": [{"type": "function", "name": "f", "parameters": "not a schema"}]}, "tools[0].parameters"),
    ({"tools": [{"type": "namespace", "name": "agents"}]}, "tools[0]"),
    ({"tools": [{"type": "namespace", "name": "a", "tools": ["x"]}]}, "tools[0].tools[0]"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"input": [{"type": "function_call", "name": "shell", "arguments": {"command": "ls"}}]}, "input[0]"),
    ({"input": [{"type": "message", "role": "critic", "content": "x"}]}, "input[0].role"),
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"reasoning": {"effort": "maximal"}}, "reasoning.effort"),
])
def test_malformed_responses_requests_are_still_400(fake_url, change, where):
    r = _post(fake_url, "/v1/responses", codex_body(stream=False, **change))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == where, r.json()


# -- chat completions: non-function tools ---------------------------------------------------
def test_chat_drops_tools_it_cannot_run(fake_url, script, fake_engine):
    r = _post(fake_url, "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "reasoning_effort": "xhigh",
        "tools": [{"type": "function", "function": {"name": "read", "parameters": {"type": "object"}}},
                  {"type": "custom", "custom": {"name": "patch", "description": "freeform"}},
                  {"type": "web_search"}],
        "web_search_options": {}, "prompt_cache_key": "k", "store": False})
    assert r.status_code == 200, r.text
    assert "tools[1] of type 'custom'" in r.headers[WARNING] and "tools[2] of type 'web_search'" in r.headers[WARNING]
    assert '"name": "read"' in fake_engine.prompt_text()
    r = _post(fake_url, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                                  "tools": [{"type": "function"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools[0].function"


# -- context overflow -------------------------------------------------------------------------
CONTEXT = 96


@pytest.fixture(scope="module")
def small(tokenizer):
    """A server whose context is 96 tokens; the double says the model was trained for 8192."""
    engine = ScriptedEngine(tokenizer, max_model_len=CONTEXT)
    engine.trained_context = 8192
    with serve_in_thread(build_app(engine, ServeConfig(model_names=(MODEL,), keepalive_s=0.1))) as url:
        yield url, engine


LONG = "alpha beta gamma delta " * 40          # ~160 tokens: more than the context


def _bodies(text: str) -> dict[str, dict]:
    return {"/v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": text}]},
            "/v1/completions": {"model": MODEL, "prompt": text},
            "/v1/responses": {"model": MODEL, "input": text},
            "/v1/messages": {"model": MODEL, "max_tokens": 10, "messages": [{"role": "user", "content": text}]}}


@pytest.mark.parametrize("stream", [False, True])
def test_a_prompt_that_does_not_fit_is_a_400_with_the_numbers_and_the_fix(small, stream):
    url, engine = small
    for path, body in _bodies(LONG).items():
        r = _post(url, path, {**body, "stream": stream})
        assert r.status_code == 400, (path, r.text)
        if path == "/v1/messages":
            message = r.json()["error"]["message"]
            # Claude Code reads the numbers with this pattern and reports "Prompt is too long"
            m = re.match(r"prompt is too long[^0-9]*(\d+)\s*tokens?\s*>\s*(\d+)", message)
            assert m and int(m.group(1)) > CONTEXT and int(m.group(2)) == CONTEXT, message
        else:
            error = r.json()["error"]
            assert error["code"] == "context_length_exceeded" and error["param"] in ("messages", "prompt", "input")
            message = error["message"]
            assert f"maximum context length is {CONTEXT} tokens" in message
            assert re.search(r"the prompt has \d+ tokens", message), message
        suggested = int(re.search(r"lodestar serve --ctx (\d+)", message).group(1))
        assert suggested % 1024 == 0 and suggested > CONTEXT and "supports up to 8192" in message, message
        assert "client's own settings" in message


def test_a_prompt_beyond_the_trained_context_says_so(tokenizer):
    engine = ScriptedEngine(tokenizer, max_model_len=CONTEXT)
    engine.trained_context = CONTEXT
    with serve_in_thread(build_app(engine, ServeConfig(model_names=(MODEL,)))) as url:
        r = _post(url, "/v1/chat/completions", _bodies(LONG)["/v1/chat/completions"])
    message = r.json()["error"]["message"]
    assert r.status_code == 400 and f"this model supports at most {CONTEXT} tokens" in message
    assert "--ctx" not in message


def test_an_output_cap_beyond_the_context_is_lowered_to_fit(small):
    url, engine = small
    engine.script.pieces = ("x",) * 200
    try:
        r = _post(url, "/v1/chat/completions", {"model": MODEL, "max_tokens": 2048,
                                                "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200, r.text
        prompt_tokens = r.json()["usage"]["prompt_tokens"]
        room = CONTEXT - prompt_tokens
        assert engine.requests[-1][1].max_tokens == room
        assert r.json()["choices"][0]["finish_reason"] == "length"
        assert r.json()["usage"]["completion_tokens"] == room
        assert f"max_tokens=2048 lowered to {room}" in r.headers[WARNING]
        assert f"prompt has {prompt_tokens} tokens and the context is {CONTEXT}" in r.headers[WARNING]

        r = _post(url, "/v1/responses", {"model": MODEL, "input": "hi", "max_output_tokens": 4096})
        assert r.status_code == 200 and r.json()["status"] == "incomplete"
        assert r.json()["incomplete_details"] == {"reason": "max_output_tokens"}
        assert "max_output_tokens=4096 lowered to" in r.headers[WARNING]

        r = _post(url, "/v1/messages", {"model": MODEL, "max_tokens": 32000,
                                        "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200 and r.json()["stop_reason"] == "max_tokens"
        assert "max_tokens=32000 lowered to" in r.headers[WARNING]

        r = _post(url, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 500})
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
        assert engine.requests[-1][1].max_tokens == CONTEXT - r.json()["usage"]["prompt_tokens"]

        headers, events = _events(url, "/v1/messages", {"model": MODEL, "max_tokens": 32000, "stream": True,
                                                        "messages": [{"role": "user", "content": "hi"}]})
        assert "lowered to" in headers[WARNING]
        assert [d for name, d in events if name == "message_delta"][0]["delta"]["stop_reason"] == "max_tokens"
    finally:
        engine.script.pieces = ("Hello", ",", " world", "!")


def test_an_uncapped_request_gets_the_rest_of_the_context(small):
    url, engine = small
    r = _post(url, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200 and WARNING not in r.headers
    assert engine.requests[-1][1].max_tokens == CONTEXT - r.json()["usage"]["prompt_tokens"]
    r = _post(url, "/v1/chat/completions", {"model": MODEL, "max_tokens": 5,
                                            "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200 and WARNING not in r.headers and engine.requests[-1][1].max_tokens == 5


# -- sampling defaults for requests that set none ----------------------------------------------
def test_server_sampling_defaults_fill_what_a_request_leaves_out(tokenizer):
    engine = ScriptedEngine(tokenizer)
    defaults = {"temperature": 0.2, "top_p": 0.9, "top_k": 20}
    with serve_in_thread(build_app(engine, ServeConfig(model_names=(MODEL,), sampling_defaults=defaults))) as url:
        for path, body in _bodies("hi").items():
            assert _post(url, path, body).status_code == 200, path
            p = engine.requests[-1][1]
            assert (p.temperature, p.top_p, p.top_k) == (0.2, 0.9, 20), path
            r = _post(url, path, {**body, "temperature": 0.7, "top_p": 0.5})
            p = engine.requests[-1][1]
            assert (p.temperature, p.top_p, p.top_k) == (0.7, 0.5, 20), path      # the request's own win
            if path == "/v1/responses":
                assert (r.json()["temperature"], r.json()["top_p"]) == (0.7, 0.5)
        r = _post(url, "/v1/responses", {"model": MODEL, "input": "hi"})
        assert (r.json()["temperature"], r.json()["top_p"]) == (0.2, 0.9)


def test_the_servers_output_cap_applies_to_requests_that_set_none(tokenizer):
    engine = ScriptedEngine(tokenizer)
    config = ServeConfig(model_names=(MODEL,), sampling_defaults={"max_tokens": 7})     # serve --max-tokens 7
    with serve_in_thread(build_app(engine, config)) as url:
        for path, body in _bodies("hi").items():
            assert _post(url, path, body).status_code == 200, path
            if path != "/v1/completions":                # its API default is 16, as in OpenAI's
                assert engine.requests[-1][1].max_tokens == (7 if "max_tokens" not in body else body["max_tokens"]), path
        r = _post(url, "/v1/chat/completions", {"model": MODEL, "max_tokens": 30,
                                                "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200 and engine.requests[-1][1].max_tokens == 30     # a request's own cap wins
    from argparse import Namespace

    from lodestar.cli import sampling_defaults
    assert sampling_defaults(Namespace(temperature=None, top_p=None, top_k=None, default_max_tokens=512), {}) \
        == {"max_tokens": 512}


def test_serve_sampling_defaults_come_from_flags_then_the_model_file():
    from argparse import Namespace

    from lodestar.cli import CLIError, sampling_defaults
    none = Namespace(temperature=None, top_p=None, top_k=None)
    assert sampling_defaults(none, {}) == {}
    md = {"general.sampling.temp": 0.6, "general.sampling.top_p": 0.95, "general.sampling.top_k": 40}
    assert sampling_defaults(none, md) == {"temperature": 0.6, "top_p": 0.95, "top_k": 40}
    flags = Namespace(temperature=0.0, top_p=None, top_k=None)
    assert sampling_defaults(flags, md) == {"temperature": 0.0, "top_p": 0.95, "top_k": 40}
    assert sampling_defaults(none, {"general.sampling.temp": "hot"}) == {}
    with pytest.raises(CLIError, match=r"top_p must be in \(0, 1\].*got 1.5"):
        sampling_defaults(Namespace(temperature=None, top_p=1.5, top_k=None), {})


# -- what the real clients sent, replayed --------------------------------------------------------
RECORDED = sorted((Path(__file__).parents[1] / "clients" / "fixtures").glob("*.json"))


@pytest.fixture(scope="module")
def roomy(tokenizer):
    """A server whose context holds every client's default prompt, serving the clients' model name."""
    engine = ScriptedEngine(tokenizer, max_model_len=32768)
    with serve_in_thread(build_app(engine, ServeConfig(model_names=(MODEL,), keepalive_s=0.1))) as url:
        yield url


@pytest.mark.parametrize("recorded", RECORDED, ids=[p.stem for p in RECORDED])
def test_requests_the_real_clients_sent_are_accepted(roomy, recorded):
    """Each request body captured from Codex CLI, Claude Code, opencode and aider (with the
    documented settings and with the short ones) is answered 200, streamed without an error event."""
    for req in json.loads(recorded.read_text())["requests"]:
        url = roomy + req["path"] + (f"?{req['query']}" if req.get("query") else "")
        with httpx.stream("POST", url, json=req["body"], timeout=60) as r:
            text = r.read().decode()
        assert r.status_code == 200, f"{recorded.stem} {req['path']}: {text[:500]}"
        assert '"type":"error"' not in text and "event: error" not in text, text[-500:]
        if req["body"].get("stream"):
            assert "Hello" in text
