"""The web app's conversations (``/api/conversations``): stored chats, and replies streamed as SSE
that match ``/v1/chat/completions`` for the same messages and settings."""
from __future__ import annotations

import json
import time
from contextlib import contextmanager

import httpx
import pytest
from serve_helpers import MODEL, serve_in_thread

from lodestar.serve import ServeConfig, build_app


@contextmanager
def serving(engine, db, **config):
    app = build_app(engine, ServeConfig(model_names=(MODEL,), keepalive_s=0.1, db_path=db, **config))
    with serve_in_thread(app) as url:
        yield url


@pytest.fixture()
def db(tmp_path):
    return tmp_path / "data" / "agent.db"


@pytest.fixture()
def api(fake_engine, db):
    with serving(fake_engine, db) as url:
        yield httpx.Client(base_url=url + "/api", timeout=10)


def events_of(lines) -> list[tuple[str, dict]]:
    """(event name, data) of an SSE stream's lines; comments (keep-alives) are skipped."""
    out, name = [], None
    for line in lines:
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            out.append((name, json.loads(line[6:])))
            name = None
    return out


def send(api: httpx.Client, cid: str, body: dict) -> list[tuple[str, dict]]:
    with api.stream("POST", f"/conversations/{cid}/messages", json=body) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        return events_of(r.iter_lines())


def create(api: httpx.Client, **body) -> dict:
    r = api.post("/conversations", json=body)
    assert r.status_code == 201, r.text
    return r.json()


def messages(api: httpx.Client, cid: str) -> list[dict]:
    r = api.get(f"/conversations/{cid}")
    assert r.status_code == 200, r.text
    return r.json()["messages"]


# -- CRUD ------------------------------------------------------------------------------------
def test_create_list_get_rename_and_delete(api):
    first = create(api)
    assert (first["title"], first["settings"], first["message_count"]) == ("", {}, 0)
    second = create(api, title="Recipes", settings={"system": "Be brief.", "temperature": 0.2})
    assert second["settings"] == {"system": "Be brief.", "temperature": 0.2}
    listed = api.get("/conversations").json()["data"]
    assert [c["id"] for c in listed] == [second["id"], first["id"]]          # newest first
    assert set(listed[0]) == {"id", "title", "created", "last_used", "message_count", "settings"}
    assert [c["id"] for c in api.get("/conversations", params={"limit": 1}).json()["data"]] == [second["id"]]
    got = api.get(f"/conversations/{second['id']}").json()
    assert (got["title"], got["settings"], got["messages"]) == ("Recipes", second["settings"], [])

    renamed = api.patch(f"/conversations/{second['id']}", json={"title": "Soups"}).json()
    assert (renamed["title"], renamed["settings"]) == ("Soups", second["settings"])   # settings stay
    patched = api.patch(f"/conversations/{second['id']}", json={"settings": {"top_p": 0.5}}).json()
    assert (patched["title"], patched["settings"]) == ("Soups", {"top_p": 0.5})       # replaced whole

    assert api.delete(f"/conversations/{second['id']}").status_code == 204
    missing = api.get(f"/conversations/{second['id']}")
    assert missing.status_code == 404 and "GET /api/conversations" in missing.json()["error"]["message"]
    assert api.delete(f"/conversations/{second['id']}").status_code == 404
    assert api.patch(f"/conversations/{second['id']}", json={"title": "x"}).status_code == 404
    assert [c["id"] for c in api.get("/conversations").json()["data"]] == [first["id"]]


def test_agent_sessions_are_not_conversations(api, db):
    from lodestar.agent.store import AgentStore

    with AgentStore(db) as store:
        agent = store.create_session(str(db.parent), "m", "ask")
    assert api.get("/conversations").json()["data"] == []
    assert api.get(f"/conversations/{agent.id}").status_code == 404
    assert api.delete(f"/conversations/{agent.id}").status_code == 404


@pytest.mark.parametrize("settings, field", [
    ({"temperature": 3}, "settings.temperature"),
    ({"top_p": 0}, "settings.top_p"),
    ({"max_tokens": 0}, "settings.max_tokens"),
    ({"max_tokens": "many"}, "settings.max_tokens"),
    ({"reasoning_effort": "extreme"}, "settings.reasoning_effort"),
    ({"system": 5}, "settings.system"),
    ({"temprature": 0.5}, "settings.temprature"),                 # a misspelt setting is not kept silently
    ({"response_format": {"type": "yaml"}}, "settings.response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "settings.response_format.json_schema.schema"),
])
def test_bad_settings_are_400_naming_the_field_and_change_nothing(api, settings, field):
    r = api.post("/conversations", json={"settings": settings})
    assert r.status_code == 400 and r.json()["error"]["param"] == field and field in r.json()["error"]["message"]
    kept = create(api, settings={"temperature": 0.7})
    r = api.patch(f"/conversations/{kept['id']}", json={"settings": settings})
    assert r.status_code == 400 and r.json()["error"]["param"] == field
    assert api.get(f"/conversations/{kept['id']}").json()["settings"] == {"temperature": 0.7}
    assert len(api.get("/conversations").json()["data"]) == 1          # the refused create stored nothing


def test_search_matches_titles_and_message_text_with_wildcards_taken_literally(api, script):
    lisbon = create(api, title="Trip to Lisbon")["id"]
    percent = create(api)["id"]
    send(api, percent, {"content": "what is 100% of x?"})
    snake = create(api, title="snake_case names")["id"]
    plain = create(api, title="snakeXcase names")["id"]

    def found(q):
        return {c["id"] for c in api.get("/conversations", params={"q": q}).json()["data"]}

    assert found("LISBON") == {lisbon}
    assert found("100%") == {percent}
    assert found("%") == {percent}
    assert found("e_c") == {snake}
    assert found("hello, world") == {percent}      # the stored answer's text is searched too
    assert found("") == {lisbon, percent, snake, plain}
    assert api.get("/conversations", params={"limit": 0}).status_code == 400


# -- replies ---------------------------------------------------------------------------------
def test_send_streams_deltas_then_done_with_stats_and_stores_both_messages(api, fake_engine, script):
    script.step_delay = 0.01
    script.cached_tokens = 3
    conv = create(api, settings={"system": "You answer in French.", "temperature": 0.3, "max_tokens": 50})
    events = send(api, conv["id"], {"content": "Say hello"})
    deltas = [d for e, d in events if e == "delta"]
    assert [d["kind"] for d in deltas] == ["content"] * 4
    assert "".join(d["text"] for d in deltas) == "Hello, world!"
    name, done = events[-1]
    assert name == "done" and [e for e, _ in events].count("done") == 1
    answer = done["message"]
    prompt_ids, params = fake_engine.requests[-1]
    assert (answer["role"], answer["content"], answer["seq"], answer["stopped"]) == \
        ("assistant", "Hello, world!", 2, False)
    stats = answer["stats"]
    assert stats["prompt_tokens"] == len(prompt_ids) and stats["completion_tokens"] == 4
    assert stats["cached_tokens"] == 3 and stats["finish_reason"] == "stop"
    assert stats["ttft_ms"] >= 0 and 0 < stats["tokens_per_s"] < 1000
    # The settings reached the engine through the chat template and the sampler.
    prompt = fake_engine.prompt_text()
    assert "You answer in French." in prompt and "Say hello" in prompt
    assert params.temperature == 0.3 and params.max_tokens == 50
    stored = messages(api, conv["id"])
    assert [(m["seq"], m["role"], m["content"]) for m in stored] == [(1, "user", "Say hello"),
                                                                    (2, "assistant", "Hello, world!")]
    assert stored[1] == answer and stored[0]["stats"] is None
    listed = api.get("/conversations").json()["data"][0]
    assert (listed["title"], listed["message_count"]) == ("Say hello", 2)


def test_reasoning_is_streamed_and_stored_apart_from_the_answer(api, script):
    script.pieces = ("<think>", "let me see", "</think>", "Forty-two.")
    conv = create(api)
    events = send(api, conv["id"], {"content": "meaning of life?"})
    kinds = {(d["kind"], d["text"]) for e, d in events if e == "delta"}
    assert ("reasoning", "let me see") in kinds and ("content", "Forty-two.") in kinds
    answer = messages(api, conv["id"])[1]
    assert (answer["reasoning"], answer["content"]) == ("let me see", "Forty-two.")


def test_response_format_setting_constrains_generation_with_a_grammar(api, fake_engine, script):
    conv = create(api, settings={"response_format": {"type": "json_object"}})
    send(api, conv["id"], {"content": "a person as JSON"})
    assert fake_engine.requests[-1][1].grammar is not None
    plain = create(api)
    send(api, plain["id"], {"content": "a person"})
    assert fake_engine.requests[-1][1].grammar is None


def test_regenerate_replaces_the_last_answer(api, fake_engine, script):
    conv = create(api)
    send(api, conv["id"], {"content": "first question"})
    script.pieces = ("Another", " answer")
    events = send(api, conv["id"], {"regenerate": True})
    assert events[-1][1]["message"]["content"] == "Another answer"
    assert [(m["seq"], m["role"], m["content"]) for m in messages(api, conv["id"])] == \
        [(1, "user", "first question"), (2, "assistant", "Another answer")]
    prompt = fake_engine.prompt_text()
    assert "first question" in prompt and "Hello, world!" not in prompt     # the old answer is gone
    empty = create(api)
    r = api.post(f"/conversations/{empty['id']}/messages", json={"regenerate": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "regenerate"


def test_edit_and_resend_drops_the_later_messages(api, fake_engine, script):
    conv = create(api)
    for text in ("question one", "question two", "question three"):
        send(api, conv["id"], {"content": text})
    assert len(messages(api, conv["id"])) == 6
    send(api, conv["id"], {"edit_seq": 3, "content": "question two, edited"})
    got = messages(api, conv["id"])
    assert [(m["seq"], m["role"], m["content"]) for m in got] == [
        (1, "user", "question one"), (2, "assistant", "Hello, world!"),
        (3, "user", "question two, edited"), (4, "assistant", "Hello, world!")]
    prompt = fake_engine.prompt_text()
    assert "question two, edited" in prompt and "question three" not in prompt
    for body, field in [({"edit_seq": 2, "content": "x"}, "edit_seq"),        # an assistant message
                        ({"edit_seq": 9, "content": "x"}, "edit_seq"),
                        ({"edit_seq": 1}, "content"),
                        ({"content": "  "}, "content"),
                        ({"regenerate": True, "content": "x"}, "regenerate")]:
        r = api.post(f"/conversations/{conv['id']}/messages", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, body
    assert len(messages(api, conv["id"])) == 4              # refused sends changed nothing


def test_a_prompt_too_long_is_a_400_that_stores_nothing(api, script):
    conv = create(api)
    r = api.post(f"/conversations/{conv['id']}/messages", json={"content": "word " * 5000})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert messages(api, conv["id"]) == []


def test_closing_the_stream_stores_the_partial_answer_as_stopped_and_frees_the_request(api, fake_engine, script):
    script.pieces = ("tick ",) * 400
    script.step_delay = 0.01
    conv = create(api)
    with api.stream("POST", f"/conversations/{conv['id']}/messages", json={"content": "count"}) as r:
        lines = r.iter_lines()          # kept referenced: dropping it would close the response early
        seen = 0
        for line in lines:
            seen += line.startswith("event: delta")
            if seen == 5:
                break
        assert fake_engine.running == 1
        # One reply at a time: a second send and a delete wait for this one.
        busy = api.post(f"/conversations/{conv['id']}/messages", json={"content": "again"})
        assert busy.status_code == 409 and "stop it" in busy.json()["error"]["message"]
        assert api.delete(f"/conversations/{conv['id']}").status_code == 409
    deadline = time.monotonic() + 5
    while (fake_engine.running or len(messages(api, conv["id"])) < 2) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert fake_engine.running == 0
    user, answer = messages(api, conv["id"])
    assert user["content"] == "count"
    ticks = answer["content"].count("tick ")
    assert 5 <= ticks < 400 and answer["content"] == "tick " * ticks
    assert answer["stopped"] is True and answer["stats"]["finish_reason"] == "abort"
    assert answer["stats"]["completion_tokens"] >= ticks
    script.pieces, script.step_delay = ("Done",), 0.0
    assert send(api, conv["id"], {"content": "next"})[-1][0] == "done"     # the conversation is free again


def test_an_engine_failure_mid_answer_is_an_error_event_and_keeps_the_partial_answer(api, script):
    script.fail_after = 2
    conv = create(api)
    events = send(api, conv["id"], {"content": "hi"})
    assert [e for e, _ in events] == ["delta", "delta", "error"]
    assert "engine" in events[-1][1]["message"]
    answer = messages(api, conv["id"])[1]
    assert (answer["content"], answer["stats"]["finish_reason"], answer["stopped"]) == ("Hello,", "error", False)


# -- the server around it --------------------------------------------------------------------
def test_conversations_survive_a_server_restart(fake_engine, db, script):
    with serving(fake_engine, db) as url:
        api = httpx.Client(base_url=url + "/api", timeout=10)
        conv = create(api, title="Keep me", settings={"temperature": 0.1})
        send(api, conv["id"], {"content": "remember this"})
    with serving(fake_engine, db) as url:
        got = httpx.get(f"{url}/api/conversations/{conv['id']}").json()
    assert (got["title"], got["settings"]) == ("Keep me", {"temperature": 0.1})
    assert [(m["role"], m["content"]) for m in got["messages"]] == [("user", "remember this"),
                                                                   ("assistant", "Hello, world!")]


def test_the_store_is_opened_only_when_the_api_is_used(fake_engine, db):
    with serving(fake_engine, db) as url:
        assert httpx.get(url + "/health").status_code == 200
        assert httpx.get(url + "/v1/models").status_code == 200
        assert not db.exists()
        assert httpx.get(url + "/api/conversations").status_code == 200
        assert db.exists()


def test_an_unusable_db_path_is_an_error_saying_what_to_do(fake_engine, tmp_path):
    (tmp_path / "file").write_text("not a folder")
    with serving(fake_engine, tmp_path / "file" / "agent.db") as url:
        r = httpx.get(url + "/api/conversations")
    assert r.status_code == 500 and "--db PATH" in r.json()["error"]["message"]


def test_api_key_protects_the_api(fake_engine, db):
    with serving(fake_engine, db, api_key="s3cret") as url:
        assert httpx.get(url + "/api/conversations").status_code == 401
        assert httpx.post(url + "/api/conversations", json={}).status_code == 401
        wrong = httpx.get(url + "/api/conversations", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
        assert not db.exists()             # refused requests never reached the store
        ok = httpx.get(url + "/api/conversations", headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200 and ok.json() == {"data": []}


# -- the real model --------------------------------------------------------------------------
def test_replies_match_chat_completions_at_temperature_zero(real_engine, db):
    settings = {"system": "You are a helpful assistant.", "temperature": 0, "max_tokens": 16}
    with serving(real_engine, db) as url:
        api = httpx.Client(base_url=url + "/api", timeout=60)

        def completion(history):
            body = {"model": MODEL, "messages": [{"role": "system", "content": settings["system"]}, *history],
                    "temperature": 0, "max_tokens": 16}
            r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            return r.json()

        conv = create(api, settings=settings)
        history = []
        for question in ("What is the capital of France?", "And of Italy?"):
            events = send(api, conv["id"], {"content": question})
            history.append({"role": "user", "content": question})
            answer = events[-1][1]["message"]
            expected = completion(history)
            assert answer["content"] == expected["choices"][0]["message"]["content"]
            assert "".join(d["text"] for e, d in events if e == "delta" and d["kind"] == "content") == \
                answer["content"]
            assert answer["stats"]["prompt_tokens"] == expected["usage"]["prompt_tokens"]
            assert answer["stats"]["completion_tokens"] == expected["usage"]["completion_tokens"]
            assert answer["stats"]["finish_reason"] == expected["choices"][0]["finish_reason"]
            history.append({"role": "assistant", "content": answer["content"]})
