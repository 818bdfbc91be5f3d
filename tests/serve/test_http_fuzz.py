"""A bounded run of the HTTP fuzzer against the real default model: no 5xx, no hang, no leak.

The long run (10,000 requests, memory and latency before and after) is
``lodestar bench fuzz``; this one keeps CI under a minute or two.
"""
from __future__ import annotations

import random

import httpx

from lodestar.bench.fuzz_http import KINDS, make_case, run_fuzz

from serve_helpers import MODEL, wait_idle


def test_generated_cases_cover_every_kind_and_route():
    rng = random.Random(0)
    cases = [make_case(rng, MODEL) for _ in range(2000)]
    assert {c.kind for c in cases} == set(KINDS)
    assert {c.path for c in cases if c.kind in ("valid", "mutated")} >= {
        "/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages", "/v1/messages/count_tokens"}
    assert any(b"\\ud800" in (c.body or b"") for c in cases)          # lone surrogates travel
    assert all(c.cancel_after is not None and c.stream for c in cases if c.kind == "cancel")
    # the same seed gives the same cases
    again = [make_case(random.Random(0), MODEL) for _ in range(1)]
    assert again[0] == cases[0]


def test_fuzzing_the_real_server_finds_no_server_error(real_url, real_engine):
    stats = run_fuzz(real_url, MODEL, count=160, workers=4, seed=7, timeout=60, max_seconds=120)
    assert stats.requests >= 60, stats.as_dict()
    assert stats.server_errors == 0 and stats.hangs == 0, stats.as_dict()["problems"]
    assert stats.by_status[200] >= 15 and stats.by_status[400] >= 15, stats.as_dict()
    # every request, finished or abandoned, gave its KV blocks back
    idle = wait_idle(real_engine, timeout=60)
    assert idle["running"] == 0 and idle["waiting"] == 0 and idle["kv_blocks_used"] == 0, idle
    assert httpx.get(real_url + "/health").json()["status"] == "ok"
