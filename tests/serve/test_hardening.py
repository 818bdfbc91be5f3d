"""Hostile and careless input over HTTP: every case here once broke the server.

A long stop string, a lone surrogate, hundreds of prompts in one request, an unhandled
error's missing CORS headers, and a huge prompt that froze every other client while it
was tokenized. Each runs against the real HTTP stack (uvicorn on loopback) with the
scripted engine double, so nothing depends on the model's speed.
"""
from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from lodestar.engine.sampling import MAX_STOP_CHARS
from lodestar.serve import ServeConfig, build_app

from serve_helpers import MODEL, ScriptedEngine, serve_in_thread

CHAT = "/v1/chat/completions"
LONE = "\ud800"


def _bodies(text: str, stream: bool = False) -> dict[str, dict]:
    """A minimal request per POST route, with ``text`` in its main text field."""
    return {
        CHAT: {"model": MODEL, "stream": stream, "messages": [{"role": "user", "content": text}]},
        "/v1/completions": {"model": MODEL, "stream": stream, "prompt": text},
        "/v1/responses": {"model": MODEL, "stream": stream, "input": text},
        "/v1/messages": {"model": MODEL, "stream": stream, "max_tokens": 4,
                         "messages": [{"role": "user", "content": text}]},
        "/v1/messages/count_tokens": {"model": MODEL, "messages": [{"role": "user", "content": text}]},
    }


def _error_text(r: httpx.Response) -> str:
    body = r.json()
    return body["error"]["message"]


# -- stop strings -----------------------------------------------------------------------------
@pytest.mark.parametrize("length", [MAX_STOP_CHARS + 1, 40_000])
def test_a_stop_string_over_the_limit_is_a_400_naming_it(fake_url, length):
    t0 = time.monotonic()
    r = httpx.post(fake_url + CHAT, json={"model": MODEL, "stop": ["x" * length],
                                          "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and str(MAX_STOP_CHARS) in _error_text(r)
    r = httpx.post(fake_url + "/v1/messages", json={"model": MODEL, "max_tokens": 4, "stop_sequences": ["y" * length],
                                                    "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and str(MAX_STOP_CHARS) in _error_text(r)
    assert time.monotonic() - t0 < 10


def test_too_many_stop_strings_is_a_400(fake_url):
    r = httpx.post(fake_url + CHAT, json={"model": MODEL, "stop": [f"s{i}" for i in range(17)],
                                          "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and "16" in _error_text(r)


def test_sixteen_stop_strings_at_the_limit_work(fake_url, script):
    script.pieces = ("ab", "cd", "STOP", "ef")
    stops = ["x" * (MAX_STOP_CHARS - 1) + str(i % 10) for i in range(15)] + ["STOP"]
    r = httpx.post(fake_url + CHAT, json={"model": MODEL, "stop": stops,
                                          "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200, r.text


# -- lone surrogates --------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_a_lone_surrogate_is_a_400_on_every_route(fake_url, stream):
    for path, body in _bodies(f"hello {LONE} world", stream).items():
        raw = json.dumps(body).encode()          # the escape "\\ud800", as a JavaScript client sends it
        assert b"\\ud800" in raw
        r = httpx.post(fake_url + path, content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400, (path, r.status_code, r.text)
        assert "surrogate" in _error_text(r)
        if path.startswith("/v1/messages"):
            assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
        else:
            assert r.json()["error"]["param"] in ("messages[0].content", "prompt", "input")


def test_a_body_that_is_not_utf8_is_a_400_on_every_route(fake_url):
    for path, body in _bodies("hello world").items():
        raw = json.dumps(body).encode().replace(b"hello", b"he\xff\xfello")
        r = httpx.post(fake_url + path, content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400 and "UTF-8" in _error_text(r), (path, r.status_code, r.text)


def test_a_surrogate_pair_escape_is_ordinary_text(fake_url, script):
    raw = (b'{"model": "%s", "messages": [{"role": "user", "content": "smile \\ud83d\\ude00"}]}' % MODEL.encode())
    r = httpx.post(fake_url + CHAT, content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text


# -- unhandled errors and CORS ----------------------------------------------------------------
class _BrokenStats(ScriptedEngine):
    def stats(self) -> dict:
        raise RuntimeError("stats are broken")


def test_an_unhandled_error_is_a_500_with_cors_headers(tokenizer):
    origin = "http://localhost:3000"
    app = build_app(_BrokenStats(tokenizer), ServeConfig(model_names=(MODEL,), cors_origins=(origin,)))
    with serve_in_thread(app) as url:
        r = httpx.get(url + "/health", headers={"Origin": origin})
        assert r.status_code == 500
        assert r.json()["error"]["type"] == "server_error" and "stats are broken" in r.json()["error"]["message"]
        assert r.headers["access-control-allow-origin"] == origin
        ok = httpx.get(url + "/v1/models", headers={"Origin": origin})
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == origin


# -- one request taking the whole queue -------------------------------------------------------
def test_hundreds_of_prompts_is_a_client_error_not_busy(fake_url, fake_engine):
    before = len(fake_engine.requests)
    r = httpx.post(fake_url + "/v1/completions", json={"model": MODEL, "max_tokens": 2,
                                                       "prompt": [f"prompt {i}" for i in range(300)]})
    assert r.status_code == 400 and "retry-after" not in r.headers
    assert "300" in _error_text(r) and "128" in _error_text(r)
    assert len(fake_engine.requests) == before          # nothing was queued
    r = httpx.post(fake_url + "/v1/completions", json={"model": MODEL, "max_tokens": 2, "n": 8,
                                                       "prompt": [f"prompt {i}" for i in range(17)]})
    assert r.status_code == 400 and "136" in _error_text(r)


def test_many_prompts_within_the_limit_are_served(fake_url, script):
    script.pieces = ("ok",)
    r = httpx.post(fake_url + "/v1/completions", json={"model": MODEL, "max_tokens": 2,
                                                       "prompt": [f"prompt {i}" for i in range(40)]})
    assert r.status_code == 200 and len(r.json()["choices"]) == 40


# -- huge prompts ------------------------------------------------------------------------------
def test_a_prompt_that_cannot_fit_is_refused_before_tokenizing(fake_url):
    text = "word " * 1_500_000                              # 7.5 MB
    for path, body in _bodies(text).items():
        t0 = time.monotonic()
        r = httpx.post(fake_url + path, json=body, timeout=60)
        seconds = time.monotonic() - t0
        assert r.status_code == 400, (path, r.text[:200])
        assert "context length" in _error_text(r) and "4,096" in _error_text(r)
        assert seconds < 5, (path, seconds)                  # tokenizing it takes ~10 s


def test_health_answers_while_a_big_prompt_is_tokenized(tokenizer):
    # A context large enough that the prompt must really be tokenized (seconds of work).
    engine = ScriptedEngine(tokenizer, max_model_len=10_000_000)
    app = build_app(engine, ServeConfig(model_names=(MODEL,)))
    text = "The quick brown fox jumps over the lazy dog. " * 45_000     # 2 MB, ~3 s to tokenize
    with serve_in_thread(app) as url:
        done = threading.Event()
        result = {}

        def big() -> None:
            result["r"] = httpx.post(url + "/v1/messages/count_tokens", timeout=120, json={
                "model": MODEL, "messages": [{"role": "user", "content": text}]})
            done.set()

        threading.Thread(target=big, daemon=True).start()
        worst, polls = 0.0, 0
        with httpx.Client() as client:
            while not done.is_set():
                t0 = time.monotonic()
                assert client.get(url + "/health", timeout=30).status_code == 200
                worst = max(worst, time.monotonic() - t0)
                polls += 1
                time.sleep(0.05)
        assert result["r"].status_code == 200 and result["r"].json()["input_tokens"] > 400_000
        assert polls >= 5, (polls, worst)                     # it ran a while
        assert worst < 1.0, f"/health took {worst:.2f} s while the prompt was tokenized"
