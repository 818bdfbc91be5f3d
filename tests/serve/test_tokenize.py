"""POST /tokenize: counts what the chat and completions routes would feed the engine, in vLLM's shape."""
from __future__ import annotations

import httpx
import pytest
from serve_helpers import MODEL, serve_in_thread

from lodestar.serve import ServeConfig, build_app

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
TOOL_CONVERSATION = [
    {"role": "system", "content": "You are a weather bot."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C and sunny"},
]


def tokenize(url: str, body: dict, **kwargs) -> httpx.Response:
    return httpx.post(url + "/tokenize", json=body, **kwargs)


def test_chat_count_is_the_chat_routes_prompt_tokens(real_url, oai, tokenizer):
    r = tokenize(real_url, {"model": MODEL, "messages": TOOL_CONVERSATION, "tools": TOOLS})
    assert r.status_code == 200
    got = r.json()
    reply = oai.chat.completions.create(model=MODEL, messages=TOOL_CONVERSATION, tools=TOOLS, max_tokens=1)
    assert got["count"] == reply.usage.prompt_tokens
    assert got["count"] == len(got["tokens"]) and got["max_model_len"] == 2048
    text = tokenizer.decode(got["tokens"])
    assert "<tools>" in text and "18 C and sunny" in text and '"city": "Paris"' in text


def test_prompt_count_is_the_completions_routes_prompt_tokens(real_url, oai, tokenizer):
    prompt = "The capital of France is"
    got = tokenize(real_url, {"prompt": prompt}).json()
    assert got["count"] == oai.completions.create(model=MODEL, prompt=prompt, max_tokens=1).usage.prompt_tokens
    assert got["tokens"] == tokenizer.encode(prompt)


def test_without_generation_prompt_the_assistant_opening_is_left_out(fake_url, tokenizer):
    messages = [{"role": "user", "content": "hi"}]
    with_cue = tokenize(fake_url, {"messages": messages}).json()["tokens"]
    without = tokenize(fake_url, {"messages": messages, "add_generation_prompt": False}).json()["tokens"]
    assert with_cue[:len(without)] == without
    assert tokenizer.decode(with_cue[len(without):]) == "<|im_start|>assistant\n"


def test_tools_and_tool_choice_change_the_count_as_in_chat(fake_url):
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    plain = tokenize(fake_url, {"messages": messages}).json()["count"]
    assert tokenize(fake_url, {"messages": messages, "tools": TOOLS}).json()["count"] > plain
    assert tokenize(fake_url, {"messages": messages, "tools": TOOLS, "tool_choice": "none"}).json()["count"] == plain


def test_a_prompt_longer_than_the_context_is_counted_not_refused(fake_url, fake_engine):
    got = tokenize(fake_url, {"prompt": "word " * (fake_engine.max_model_len + 10)}).json()
    assert got["count"] > got["max_model_len"] == fake_engine.max_model_len


@pytest.mark.parametrize("body, status, param", [
    ({}, 400, "prompt"),
    ({"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, 400, "messages"),
    ({"messages": []}, 400, "messages"),
    ({"prompt": 5}, 400, "prompt"),
    ({"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
    ({"prompt": "a", "model": "gpt-4o"}, 404, "model"),
])
def test_bad_bodies_get_openai_errors_naming_the_field(fake_url, body, status, param):
    r = tokenize(fake_url, body)
    assert r.status_code == status
    err = r.json()["error"]
    assert err["param"] == param and err["message"]
    if status == 404:
        assert err["code"] == "model_not_found"


def test_served_model_name_is_accepted(fake_url):
    assert tokenize(fake_url, {"model": MODEL, "prompt": "a"}).status_code == 200


def test_api_key_protects_tokenize(fake_engine):
    app = build_app(fake_engine, ServeConfig(model_names=(MODEL,), api_key="s3cret"))
    with serve_in_thread(app) as url:
        missing = tokenize(url, {"prompt": "a"})
        assert missing.status_code == 401 and missing.json()["error"]["code"] == "invalid_api_key"
        assert tokenize(url, {"prompt": "a"}, headers={"Authorization": "Bearer wrong"}).status_code == 401
        ok = tokenize(url, {"prompt": "a"}, headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200 and ok.json()["count"] == 1
