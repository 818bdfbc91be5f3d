"""``GET /api/stats``: the dashboard's live numbers move with the requests the server answers."""
from __future__ import annotations

import time

import httpx
import pytest
from serve_helpers import MODEL

from lodestar.engine.spec import SpecStats
from lodestar.serve import ServeConfig, build_app
from lodestar.serve.metrics import RECENT_REQUESTS, Metrics, TokenRate
from lodestar.serve.web.stats_api import stats_document


def stats(url: str) -> dict:
    r = httpx.get(url + "/api/stats", timeout=10)
    assert r.status_code == 200
    return r.json()


def chat(url: str, **body) -> dict:
    r = httpx.post(url + "/v1/chat/completions", timeout=10,
                   json={"model": MODEL, "messages": [{"role": "user", "content": "Say hello."}], **body})
    assert r.status_code == 200, r.text
    return r


def test_counters_and_the_request_table_move_after_a_chat_completion(fake_url, script):
    script.cached_tokens = 3
    before = stats(fake_url)
    t0 = time.time()
    usage = chat(fake_url).json()["usage"]
    after = stats(fake_url)

    moved = {k: after["counters"][k] - before["counters"][k] for k in after["counters"]}
    assert moved["requests"] == 1
    assert moved["prompt_tokens"] == usage["prompt_tokens"] > 0
    assert moved["generation_tokens"] == usage["completion_tokens"] == 4
    assert moved["cached_tokens"] == 3
    assert after["prefix_cache_hit_rate"] > 0

    row = after["requests"][0]                       # newest first
    assert row["id"] > (before["requests"][0]["id"] if before["requests"] else 0)
    assert row["route"] == "/v1/chat/completions" and row["model"] == MODEL
    assert row["prompt_tokens"] == usage["prompt_tokens"] and row["completion_tokens"] == 4
    assert row["cached_tokens"] == 3 and row["finish_reason"] == "stop"
    assert isinstance(row["ttft_ms"], float) and 0 <= row["ttft_ms"] < 10_000
    assert t0 - 1 <= row["started"] <= time.time()
    assert row["spec_acceptance"] is None
    assert len(after["requests"]) == len(before["requests"]) + 1


def test_a_streamed_request_records_its_decode_speed_and_the_live_rate(fake_url, script):
    script.step_delay = 0.01
    with httpx.stream("POST", fake_url + "/v1/chat/completions", timeout=10,
                      json={"model": MODEL, "stream": True,
                            "messages": [{"role": "user", "content": "Say hello."}]}) as r:
        assert r.status_code == 200
        assert "[DONE]" in "".join(r.iter_text())
    after = stats(fake_url)
    row = after["requests"][0]
    assert row["route"] == "/v1/chat/completions" and row["completion_tokens"] == 4
    assert row["decode_tok_s"] > 0
    # The four tokens just streamed fall inside the 5-second window.
    assert isinstance(after["rates"]["decode_tok_s"], float) and after["rates"]["decode_tok_s"] > 0
    assert isinstance(after["rates"]["ttft_ms_p50"], float) and after["rates"]["ttft_ms_p50"] >= 0


def test_each_api_route_is_named_in_the_request_table(fake_url, script):
    r = httpx.post(fake_url + "/v1/messages", timeout=10,
                   json={"model": MODEL, "max_tokens": 16, "messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 200, r.text
    assert stats(fake_url)["requests"][0]["route"] == "/v1/messages"


def test_engine_load_is_reported(fake_url):
    engine = stats(fake_url)["engine"]
    assert engine == {"waiting": 0, "running": 0, "kv_blocks_used": 0, "kv_blocks_total": 64}


def test_a_fresh_server_reports_numbers_not_nulls(fake_engine):
    doc = stats_document(Metrics(), fake_engine.stats(), now=1000.0)
    assert doc["time"] == 1000.0
    assert doc["rates"] == {"decode_tok_s": 0.0, "ttft_ms_p50": 0.0}
    assert doc["prefix_cache_hit_rate"] == 0.0 and doc["spec_acceptance"] is None
    assert doc["requests"] == [] and set(doc["counters"].values()) == {0}


def test_the_request_table_keeps_the_newest_hundred_and_speculation():
    m = Metrics()
    for i in range(RECENT_REQUESTS + 5):
        m.record_generation(10, 5, 0, "stop", 0.001 * (i + 1), 50.0, route="/v1/completions", model="m",
                            speculation=SpecStats(drafted=8, accepted=6) if i % 2 else None)
    doc = stats_document(m, {})
    rows = doc["requests"]
    assert len(rows) == RECENT_REQUESTS
    assert rows[0]["id"] == RECENT_REQUESTS + 5 and rows[-1]["id"] == 6     # the five oldest dropped
    assert rows[0]["spec_acceptance"] is None and rows[1]["spec_acceptance"] == pytest.approx(0.75)
    assert doc["counters"]["requests"] == RECENT_REQUESTS + 5
    assert doc["spec_acceptance"] == pytest.approx(0.75)
    # The median time to first token covers the last 50 requests only (56 ms .. 105 ms).
    assert doc["rates"]["ttft_ms_p50"] == pytest.approx(80.5)


def test_the_decode_rate_forgets_tokens_older_than_its_window():
    rate = TokenRate(window_s=5.0)
    rate.add(100, now=10.0)
    rate.add(50, now=13.0)
    assert rate.rate(now=14.0) == pytest.approx(30.0)
    assert rate.rate(now=16.0) == pytest.approx(10.0)       # the first 100 fell out
    assert rate.rate(now=30.0) == 0.0


def test_stats_need_the_api_key_when_one_is_set(fake_engine):
    from fastapi.testclient import TestClient

    client = TestClient(build_app(fake_engine, ServeConfig(model_names=(MODEL,), api_key="k")))
    assert client.get("/api/stats").status_code == 401
    assert client.get("/api/stats", headers={"Authorization": "Bearer k"}).status_code == 200
    assert client.get("/report").status_code == 401             # the report page holds data too
    assert client.get("/report", headers={"Authorization": "Bearer k"}).status_code in (200, 404)
    assert client.get("/").status_code == 200                   # the page itself asks for the key
