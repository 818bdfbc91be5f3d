"""Speculative decoding over HTTP: the ``speculate`` field, ``usage.speculation`` and the metrics.

One server runs the real default model with n-gram speculation on. A greedy answer that
repeats its prompt gets drafts from the prompt itself; every API must report them in its
usage (streamed too) and give the same text as the same request with ``"speculate": false``,
which reports none.
"""
from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from serve_helpers import MODEL, serve_in_thread

from lodestar.engine.async_engine import AsyncLLMEngine
from lodestar.engine.llm_engine import EngineConfig, LLMEngine
from lodestar.engine.spec import SpecConfig, SpecStats
from lodestar.serve import ServeConfig, build_app
from lodestar.serve.generation import Result, speculation_usage

LIST = "1. red apple\n2. green pear\n3. yellow lemon\n4. purple plum\n5. orange peach"
REPEAT = f"Repeat this list exactly, nothing else:\n{LIST}"
RAW = "red apple, green pear, yellow lemon, purple plum; " * 3 + "red apple,"
MAX_TOKENS = 16
APIS = ["chat", "completions", "responses", "messages"]
SPEC_KEYS = {"drafted_tokens", "accepted_tokens", "acceptance_rate", "verify_steps", "mean_tokens_per_step"}


@pytest.fixture(scope="module")
def url(smollm_path):
    from lodestar.engine.loader import load_model

    def build() -> LLMEngine:
        return LLMEngine(load_model(str(smollm_path), progress=False),
                         EngineConfig(max_num_seqs=4, kv_tokens=4096, max_model_len=1024, spec=SpecConfig("ngram")))

    aeng = AsyncLLMEngine(build, max_queued=16)
    try:
        with serve_in_thread(build_app(aeng, ServeConfig(model_names=(MODEL,), keepalive_s=5))) as base:
            yield base
    finally:
        aeng.shutdown()


def request(api: str, extra: dict) -> tuple[str, dict]:
    """(route, body) of a greedy request that repeats its prompt, on ``api``."""
    greedy = {"model": MODEL, "temperature": 0, **extra}
    if api == "chat":
        return "/v1/chat/completions", {**greedy, "max_tokens": MAX_TOKENS,
                                        "messages": [{"role": "user", "content": REPEAT}]}
    if api == "completions":
        return "/v1/completions", {**greedy, "max_tokens": MAX_TOKENS, "prompt": RAW}
    if api == "responses":
        return "/v1/responses", {**greedy, "max_output_tokens": MAX_TOKENS, "input": REPEAT}
    return "/v1/messages", {**greedy, "max_tokens": MAX_TOKENS, "messages": [{"role": "user", "content": REPEAT}]}


def answer(api: str, body: dict) -> tuple[str, dict]:
    """(text, usage) of a non-streamed answer."""
    if api == "chat":
        return body["choices"][0]["message"]["content"], body["usage"]
    if api == "completions":
        return body["choices"][0]["text"], body["usage"]
    if api == "responses":
        text = "".join(p["text"] for item in body["output"] if item["type"] == "message" for p in item["content"])
        return text, body["usage"]
    return "".join(b["text"] for b in body["content"] if b["type"] == "text"), body["usage"]


def post(url: str, api: str, **extra) -> tuple[str, dict]:
    route, body = request(api, extra)
    r = httpx.post(url + route, json=body, timeout=120)
    assert r.status_code == 200, r.text
    return answer(api, r.json())


def stream(url: str, api: str, **extra) -> tuple[str, list[dict]]:
    """(text, the usage objects of the stream's events, in order) of a streamed answer."""
    stream_extra = {"stream_options": {"include_usage": True}} if api in ("chat", "completions") else {}
    route, body = request(api, {"stream": True, **stream_extra, **extra})
    text, usages = "", []
    with httpx.stream("POST", url + route, json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            assert event.get("type") != "error" and "error" not in event, event
            if api == "chat":
                text += "".join(c["delta"].get("content") or "" for c in event["choices"])
            elif api == "completions":
                text += "".join(c["text"] for c in event["choices"])
            elif event["type"] in ("response.output_text.delta", "content_block_delta"):
                text += event["delta"] if api == "responses" else event["delta"].get("text", "")
            usage = event.get("usage") or (event.get("response") or {}).get("usage")
            if usage:
                usages.append(usage)
    return text, usages


_plain: dict[tuple[str, str], tuple[str, dict]] = {}


def plain(url: str, api: str) -> tuple[str, dict]:
    """The answer with ``"speculate": false`` (asked once per API)."""
    if (url, api) not in _plain:
        _plain[(url, api)] = post(url, api, speculate=False)
    return _plain[(url, api)]


def check_speculation(spec: dict) -> None:
    assert set(spec) == SPEC_KEYS, spec
    assert spec["drafted_tokens"] > 0 and spec["verify_steps"] > 0, spec
    assert 0 <= spec["accepted_tokens"] <= spec["drafted_tokens"]
    assert spec["acceptance_rate"] == pytest.approx(spec["accepted_tokens"] / spec["drafted_tokens"], abs=1e-4)
    assert spec["mean_tokens_per_step"] >= 1.0


@pytest.mark.parametrize("api", APIS)
def test_usage_reports_speculation_and_the_text_is_the_same(url, api):
    with ThreadPoolExecutor(2) as pool:           # decoded in one batch: a speculating row beside a plain one
        speculated, unspeculated = pool.submit(post, url, api), pool.submit(plain, url, api)
        (text, usage), (plain_text, plain_usage) = speculated.result(), unspeculated.result()
    check_speculation(usage["speculation"])
    assert "speculation" not in plain_usage
    assert text == plain_text and text.strip()


@pytest.mark.parametrize("api", ["completions", "responses", "messages"])     # chat: through the SDK below
def test_streamed_usage_reports_speculation(url, api):
    text, usages = stream(url, api)
    check_speculation(usages[-1]["speculation"])      # the final usage chunk / response.completed / message_delta
    assert text == plain(url, api)[0]


def test_openai_sdk_sends_speculate_and_reads_the_streamed_usage(url):
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": REPEAT}], max_tokens=MAX_TOKENS, temperature=0,
        stream=True, stream_options={"include_usage": True}, extra_body={"speculate": True}))
    check_speculation(chunks[-1].usage.speculation)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain(url, "chat")[0]


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("value", ["yes", 1, {"on": True}])
def test_speculate_must_be_a_boolean(url, api, value):
    route, body = request(api, {"speculate": value})
    r = httpx.post(url + route, json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    if api == "messages":
        assert r.json()["type"] == "error" and error["message"].startswith("Invalid request: speculate:")
    else:
        assert error["param"] == "speculate" and "speculate" in error["message"]


def test_metrics_count_drafts_after_a_speculated_request(url):
    post(url, "completions")
    text = httpx.get(url + "/metrics").text
    for name in ("lodestar_spec_drafted_tokens_total", "lodestar_spec_accepted_tokens_total",
                 "lodestar_spec_verify_steps_total"):
        assert f"# HELP {name} " in text and f"# TYPE {name} counter" in text
    counts = {name: int(re.search(rf"^lodestar_spec_{name}_total\{{.*\}} (\d+)$", text, re.M).group(1))
              for name in ("drafted_tokens", "accepted_tokens", "verify_steps")}
    assert counts["drafted_tokens"] > 0 and counts["verify_steps"] > 0, counts
    assert 0 < counts["accepted_tokens"] <= counts["drafted_tokens"], counts


def test_speculation_of_several_choices_is_summed():
    a, b = Result(speculation=SpecStats(10, 8, 4, 12)), Result(speculation=SpecStats(6, 2, 3, 5))
    assert speculation_usage([a, b, Result()]) == {"drafted_tokens": 16, "accepted_tokens": 10,
                                                   "acceptance_rate": 0.625, "verify_steps": 7,
                                                   "mean_tokens_per_step": round(17 / 7, 4)}
    assert speculation_usage([Result(), Result()]) is None
