"""The coding agent over HTTP (``/api/projects``, ``/api/agent/sessions...``): the project
boundary, runs with live SSE events, approvals, Stop, queued prompts and the stored transcript,
against a scripted model (``app.state.agent_client_factory``) and real tools in a temp folder."""
from __future__ import annotations

import asyncio
import json
import os
import queue
import threading
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
import pytest
from serve_helpers import MODEL, ScriptedEngine, serve_in_thread

from lodestar.agent.store import AgentStore
from lodestar.formats.synthetic import synthetic_tokenizer_metadata
from lodestar.serve import ServeConfig, build_app
from lodestar.tokenizer import Tokenizer
from tests.agent.scripted import Hang, ScriptedClient, call, reply

WAIT_S = 5.0


class _Tokenizer:
    """Just what the app asks of a tokenizer at start; the agent's model here is scripted."""

    def piece_to_id(self, piece):
        return None

    def is_special(self, token_id):
        return False


class _Engine:
    tokenizer = _Tokenizer()
    max_model_len = 4096
    error = None

    def stats(self) -> dict:
        return {"waiting": 0, "running": 0, "kv_blocks_used": 0, "kv_blocks_total": 64}


class GatedClient(ScriptedClient):
    """The scripted model, whose first reply waits until the test opens ``gate``."""

    def __init__(self, script) -> None:
        super().__init__(script)
        self.gate = threading.Event()

    async def complete(self, messages, tools=None, **kwargs):
        if not self.requests:
            await asyncio.to_thread(self.gate.wait, WAIT_S)
        return await super().complete(messages, tools, **kwargs)


@dataclass
class Server:
    api: httpx.Client
    url: str
    app: object


@pytest.fixture()
def folders(tmp_path):
    root = tmp_path / "work"
    (root / "proj" / "sub").mkdir(parents=True)
    (root / "other").mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("keep out\n")
    return root, outside


@contextmanager
def serving(tmp_path, projects=(), client=None, engine=None, api_key=None):
    config = ServeConfig(model_names=(MODEL,), keepalive_s=0.05, db_path=tmp_path / "db" / "agent.db",
                         projects=tuple(projects), api_key=api_key)
    app = build_app(engine or _Engine(), config)
    if client is not None:
        app.state.agent_client_factory = lambda session: client
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with serve_in_thread(app) as url, httpx.Client(base_url=url + "/api", timeout=WAIT_S, headers=headers) as api:
        yield Server(api, url, app)


class Events:
    """One ``GET .../events`` listener, read on a thread; ``next(name)`` waits for that event."""

    def __init__(self, server: Server, session_id: str, headers: dict | None = None) -> None:
        self._q: queue.Queue = queue.Queue()
        self._closed = threading.Event()
        self.seen: list[tuple[str, dict]] = []
        attached = threading.Event()
        self.status = None

        def read() -> None:
            with httpx.Client(base_url=server.url + "/api", timeout=WAIT_S, headers=headers or {}) as c, \
                    c.stream("GET", f"/agent/sessions/{session_id}/events") as r:
                self.status, self.content_type = r.status_code, r.headers.get("content-type", "")
                attached.set()
                name = None
                for line in r.iter_lines():      # keep-alives every 50 ms let a closed listener leave
                    if self._closed.is_set():
                        return
                    if line.startswith("event: "):
                        name = line[7:]
                    elif line.startswith("data: "):
                        self._q.put((name, json.loads(line[6:])))

        self._thread = threading.Thread(target=read, daemon=True)
        self._thread.start()
        assert attached.wait(WAIT_S), "the events stream did not open"

    def next(self, name: str) -> dict:
        while True:
            try:
                got = self._q.get(timeout=WAIT_S)
            except queue.Empty:
                raise AssertionError(f"no {name!r} event; saw {self.seen}") from None
            self.seen.append(got)
            if got[0] == name:
                return got[1]

    def names(self) -> list[str]:
        return [n for n, _ in self.seen]

    def close(self) -> None:
        self._closed.set()
        self._thread.join(WAIT_S)


@contextmanager
def listening(server: Server, session_id: str, headers: dict | None = None):
    ev = Events(server, session_id, headers)
    try:
        yield ev
    finally:
        ev.close()


def new_session(api: httpx.Client, project, mode: str = "ask") -> dict:
    r = api.post("/agent/sessions", json={"project": str(project), "mode": mode})
    assert r.status_code == 201, r.text
    return r.json()


def prompt(api: httpx.Client, sid: str, text: str) -> dict:
    r = api.post(f"/agent/sessions/{sid}/prompt", json={"text": text})
    assert r.status_code == 202, r.text
    return r.json()


def error_of(r: httpx.Response) -> str:
    return r.json()["error"]["message"]


# -- projects and the boundary ----------------------------------------------------------------
def test_without_projects_every_agent_route_is_403_saying_how_to_enable_it(tmp_path):
    with serving(tmp_path) as s:
        calls = [("GET", "/projects", None), ("GET", "/agent/sessions", None),
                 ("POST", "/agent/sessions", {"project": str(tmp_path)}), ("GET", "/agent/sessions/abc", None),
                 ("DELETE", "/agent/sessions/abc", None), ("POST", "/agent/sessions/abc/prompt", {"text": "hi"}),
                 ("GET", "/agent/sessions/abc/events", None),
                 ("POST", "/agent/sessions/abc/approve", {"request_id": "x", "allow": True}),
                 ("POST", "/agent/sessions/abc/stop", None)]
        for method, path, body in calls:
            r = s.api.request(method, path, json=body)
            assert r.status_code == 403, (method, path, r.text)
            assert "--projects" in error_of(r)


def test_projects_are_listed_and_sessions_created_in_them_or_below(tmp_path, folders):
    root, _ = folders
    with serving(tmp_path, projects=[root]) as s:
        assert s.api.get("/projects").json() == {"data": [{"path": str(root.resolve()), "name": "work"}]}
        top = new_session(s.api, root, mode="auto")
        sub = new_session(s.api, root / "proj" / "sub")
        assert (top["project"], top["mode"], top["kind"]) == (str(root.resolve()), "auto", "agent")
        assert sub["mode"] == "ask" and sub["project"] == str((root / "proj" / "sub").resolve())
        listed = s.api.get("/agent/sessions", params={"project": str(root / "proj" / "sub")}).json()["data"]
        assert [x["id"] for x in listed] == [sub["id"]]
        everything = s.api.get("/agent/sessions").json()["data"]
        assert {x["id"] for x in everything} == {top["id"], sub["id"]}
        assert s.api.get(f"/agent/sessions/{sub['id']}").json()["session"]["id"] == sub["id"]


def test_paths_outside_the_projects_are_403_and_create_nothing(tmp_path, folders):
    root, outside = folders
    (root / "proj" / "escape").symlink_to(outside)
    with serving(tmp_path, projects=[root / "proj"]) as s:
        for bad in (outside, root / "other", root / "proj" / ".." / "other", root / "proj" / "escape",
                    root / "proj" / "escape" / "deeper", "/"):
            r = s.api.post("/agent/sessions", json={"project": str(bad)})
            assert r.status_code == 403, (bad, r.text)
            assert "outside the folders" in error_of(r) and "GET /api/projects" in error_of(r)
            assert s.api.get("/agent/sessions", params={"project": str(bad)}).status_code == 403
        r = s.api.post("/agent/sessions", json={"project": "proj"})            # relative: ambiguous
        assert r.status_code == 400 and "absolute" in error_of(r)
        r = s.api.post("/agent/sessions", json={"project": str(root / "proj" / "missing")})
        assert r.status_code == 400 and "not a folder" in error_of(r)
        r = s.api.post("/agent/sessions", json={"project": str(root / "proj"), "mode": "yolo"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "mode"
        assert s.api.get("/agent/sessions").json()["data"] == []

        # a stored session of a folder this server does not allow cannot be driven from here
        with AgentStore(tmp_path / "db" / "agent.db") as store:
            foreign = store.create_session(str(outside), "m", "auto")
        for method, path in (("GET", ""), ("POST", "/stop"), ("GET", "/events"), ("DELETE", "")):
            r = s.api.request(method, f"/agent/sessions/{foreign.id}{path}")
            assert r.status_code == 403 and "--projects" in error_of(r), (method, path)
        r = s.api.post(f"/agent/sessions/{foreign.id}/prompt", json={"text": "cat secret.txt"})
        assert r.status_code == 403
        assert s.api.get("/agent/sessions").json()["data"] == []
        assert s.api.get("/agent/sessions/nope").status_code == 404


# -- runs ---------------------------------------------------------------------------------------
def test_approved_write_runs_and_streams_every_step(tmp_path, folders):
    root, _ = folders
    client = ScriptedClient([reply("Writing it.", call("write", path="hello.txt", content="hi there\n")),
                             reply("Done: hello.txt holds the greeting.")])
    with serving(tmp_path, projects=[root], client=client) as s:
        sid = new_session(s.api, root / "proj")["id"]
        with listening(s, sid) as ev:
            assert ev.status == 200 and ev.content_type.startswith("text/event-stream")
            assert prompt(s.api, sid, "create hello.txt") == {"queued": False}
            assert ev.next("prompt") == {"text": "create hello.txt", "queued": False}
            assert ev.next("delta") == {"kind": "content", "text": "Writing it."}
            asked = ev.next("approval")
            assert asked["tool"] == "write" and "hello.txt" in asked["summary"] and asked["reason"]
            assert not (root / "proj" / "hello.txt").exists()       # nothing runs before the answer

            state = s.api.get(f"/agent/sessions/{sid}").json()
            assert state["busy"] is True and state["pending_approval"]["request_id"] == asked["request_id"]

            r = s.api.post(f"/agent/sessions/{sid}/approve", json={"request_id": asked["request_id"], "allow": True})
            assert r.status_code == 200
            started = ev.next("tool_start")
            assert (started["name"], started["decision"]) == ("write", "allow")
            assert json.loads(started["arguments"]) == {"path": "hello.txt", "content": "hi there\n"}
            ended = ev.next("tool_end")
            assert ended["ok"] is True and ended["id"] == started["id"] and "+hi there" in ended["display"]
            assert ev.next("delta")["text"] == "Done: hello.txt holds the greeting."
            stats = ev.next("turn_end")["stats"]
            assert (stats["calls"], stats["tools"], stats["stopped"]) == (2, 1, False)
        assert (root / "proj" / "hello.txt").read_text() == "hi there\n"

        # a second approval of the same request is refused: it was answered
        again = s.api.post(f"/agent/sessions/{sid}/approve", json={"request_id": asked["request_id"], "allow": True})
        assert again.status_code == 404 and "pending_approval" in error_of(again)

        got = s.api.get(f"/agent/sessions/{sid}").json()
        assert (got["busy"], got["pending_approval"]) == (False, None)
        msgs = got["messages"]
        assert [m["role"] for m in msgs] == ["user", "assistant", "tool", "assistant"]
        assert msgs[0]["content"] == "create hello.txt"
        assert msgs[1]["tool_calls"][0]["function"]["name"] == "write"
        assert msgs[2]["meta"]["ok"] is True and "+hi there" in msgs[2]["meta"]["data"]["diff"]
        assert msgs[2]["approval"] == {"action": "allow", "reason": "allowed once by the user", "by": "user"}
        assert msgs[3]["content"] == "Done: hello.txt holds the greeting."
        assert got["session"]["title"] == "create hello.txt"


def test_denied_call_does_not_run_and_the_model_hears_why(tmp_path, folders):
    root, _ = folders
    client = ScriptedClient([reply("", call("shell", command="touch made.txt")), reply("Understood.")])
    with serving(tmp_path, projects=[root], client=client) as s:
        sid = new_session(s.api, root / "proj")["id"]
        with listening(s, sid) as ev:
            prompt(s.api, sid, "make a file")
            asked = ev.next("approval")
            assert asked["tool"] == "shell" and "touch made.txt" in asked["summary"]
            r = s.api.post(f"/agent/sessions/{sid}/approve",
                           json={"request_id": asked["request_id"], "allow": False, "reason": "use write instead"})
            assert r.status_code == 200
            assert ev.next("tool_start")["decision"] == "deny"
            ended = ev.next("tool_end")
            assert ended["ok"] is False and "denied by the user: use write instead" in ended["content"]
            assert ev.next("turn_end")["stats"]["tools"] == 0
        assert not (root / "proj" / "made.txt").exists()
        told = client.requests[1]["messages"][-1]
        assert told["role"] == "tool" and "use write instead" in told["content"]


def test_stop_during_a_reply_ends_the_turn_and_keeps_what_streamed(tmp_path, folders):
    root, _ = folders
    client = ScriptedClient([Hang("half an ans")])
    with serving(tmp_path, projects=[root], client=client) as s:
        sid = new_session(s.api, root / "proj")["id"]
        with listening(s, sid) as ev:
            prompt(s.api, sid, "explain everything")
            assert ev.next("delta")["text"] == "half an ans"
            r = s.api.delete(f"/agent/sessions/{sid}")
            assert r.status_code == 409 and "/stop" in error_of(r)               # not while it runs
            assert s.api.post(f"/agent/sessions/{sid}/stop").json() == {"stopping": True}
            assert ev.next("turn_end")["stats"]["stopped"] is True
        assert client.cancelled == 1                     # the model's stream was closed
        got = s.api.get(f"/agent/sessions/{sid}").json()
        assert got["busy"] is False
        last = got["messages"][-1]
        assert (last["role"], last["content"], last["meta"]["stopped"]) == ("assistant", "half an ans", True)
        assert s.api.delete(f"/agent/sessions/{sid}").status_code == 204
        assert s.api.get(f"/agent/sessions/{sid}").status_code == 404


def test_stop_while_an_approval_waits_denies_it(tmp_path, folders):
    root, _ = folders
    client = ScriptedClient([reply("", call("write", path="x.txt", content="x"))])
    with serving(tmp_path, projects=[root], client=client) as s:
        sid = new_session(s.api, root / "proj")["id"]
        with listening(s, sid) as ev:
            prompt(s.api, sid, "write x")
            asked = ev.next("approval")
            s.api.post(f"/agent/sessions/{sid}/stop")
            assert ev.next("tool_end")["ok"] is False
            assert ev.next("turn_end")["stats"]["stopped"] is True
        assert not (root / "proj" / "x.txt").exists()
        late = s.api.post(f"/agent/sessions/{sid}/approve", json={"request_id": asked["request_id"], "allow": True})
        assert late.status_code == 404
        assert len(client.requests) == 1                 # no further model call after Stop


def test_a_prompt_sent_while_busy_is_queued_into_the_running_turn(tmp_path, folders):
    root, _ = folders
    client = GatedClient([reply("First answer."), reply("Second answer.")])
    with serving(tmp_path, projects=[root], client=client) as s:
        sid = new_session(s.api, root / "proj")["id"]
        with listening(s, sid) as ev:
            assert prompt(s.api, sid, "first question") == {"queued": False}
            assert prompt(s.api, sid, "also this") == {"queued": True}
            assert ev.next("prompt")["queued"] is False and ev.next("prompt") == {"text": "also this", "queued": True}
            client.gate.set()
            assert "also this" in ev.next("status")["message"]
            assert ev.next("turn_end")["stats"]["calls"] == 2
            assert ev.names().count("turn_end") == 1     # one run took both prompts
        assert client.requests[1]["messages"][-1] == {"role": "user", "content": "also this"}
        msgs = s.api.get(f"/agent/sessions/{sid}").json()["messages"]
        assert [(m["role"], m["content"]) for m in msgs] == [
            ("user", "first question"), ("assistant", "First answer."), ("user", "also this"),
            ("assistant", "Second answer.")]


def test_two_listeners_both_see_the_run(tmp_path, folders):
    root, _ = folders
    client = ScriptedClient([reply("", call("read", path="notes.md")), reply("It says hello.")])
    (root / "proj" / "notes.md").write_text("hello\n")
    with serving(tmp_path, projects=[root], client=client) as s:
        sid = new_session(s.api, root / "proj")["id"]
        with listening(s, sid) as one, listening(s, sid) as two:
            prompt(s.api, sid, "read notes.md")
            for ev in (one, two):
                ended = ev.next("tool_end")
                assert ended["name"] == "read" and ended["ok"] and "hello" in ended["content"]
                assert ev.next("delta")["text"] == "It says hello."
                ev.next("turn_end")
                assert "approval" not in ev.names()          # reads never ask
            assert one.seen == two.seen


def test_model_errors_end_the_turn_with_an_error_event(tmp_path, folders):
    root, _ = folders
    client = ScriptedClient([])                              # runs out of replies at once
    with serving(tmp_path, projects=[root], client=client) as s:
        sid = new_session(s.api, root / "proj")["id"]
        with listening(s, sid) as ev:
            prompt(s.api, sid, "hello")
            assert "ran out of replies" in ev.next("error")["message"]
            assert ev.next("turn_end") == {"stats": None}
        assert s.api.get(f"/agent/sessions/{sid}").json()["busy"] is False
        r = s.api.post(f"/agent/sessions/{sid}/prompt", json={"text": "   "})
        assert r.status_code == 400 and r.json()["error"]["param"] == "text"


def test_the_api_key_guards_every_agent_route(tmp_path, folders):
    root, _ = folders
    with serving(tmp_path, projects=[root], api_key="sekret") as s:
        sid = new_session(s.api, root)["id"]                 # the fixture's client sends the key
        bare = httpx.Client(base_url=s.url + "/api", timeout=WAIT_S)
        wrong = httpx.Client(base_url=s.url + "/api", timeout=WAIT_S, headers={"Authorization": "Bearer nope"})
        for c in (bare, wrong):
            assert c.get("/projects").status_code == 401
            assert c.post("/agent/sessions", json={"project": str(root)}).status_code == 401
            assert c.get(f"/agent/sessions/{sid}").status_code == 401
            assert c.get(f"/agent/sessions/{sid}/events").status_code == 401
            assert c.post(f"/agent/sessions/{sid}/prompt", json={"text": "hi"}).status_code == 401
        assert s.api.get("/projects").status_code == 200
        assert [x["id"] for x in s.api.get("/agent/sessions").json()["data"]] == [sid]


# -- the real path to the model ------------------------------------------------------------------
def test_without_a_client_hook_the_agent_talks_to_this_app_over_a_private_socket(tmp_path, folders):
    root, _ = folders
    # a small byte-level vocabulary with a chat template: the server renders and counts for real
    engine = ScriptedEngine(Tokenizer.from_metadata(synthetic_tokenizer_metadata(1024)), max_model_len=32768)
    with serving(tmp_path, projects=[root], engine=engine, api_key="sekret") as s:
        sid = new_session(s.api, root / "proj")["id"]
        with listening(s, sid, headers={"Authorization": "Bearer sekret"}) as ev:
            prompt(s.api, sid, "say hello")
            text = ""
            while not text.endswith("!"):
                text += ev.next("delta")["text"]
            assert text == "Hello, world!"
            stats = ev.next("turn_end")["stats"]
            assert stats["calls"] == 1 and stats["prompt_tokens"] > 0       # counted by this server
        socket_path = s.app.state.agent_workspace.local_server.socket_path
        assert socket_path.exists() and oct(socket_path.stat().st_mode & 0o777) == "0o600"
        assert "say hello" in engine.prompt_text()                           # the engine saw the prompt
        msgs = s.api.get(f"/agent/sessions/{sid}").json()["messages"]
        assert [(m["role"], m["content"]) for m in msgs] == [("user", "say hello"), ("assistant", "Hello, world!")]

        # another model loaded behind the app (new served name): the next turn asks for that one
        s.app.state.serve.config.model_names = ("another-model",)
        with listening(s, sid, headers={"Authorization": "Bearer sekret"}) as ev:
            prompt(s.api, sid, "again")
            assert ev.next("turn_end")["stats"]["calls"] == 1 and "error" not in ev.names()
        assert s.api.get(f"/agent/sessions/{sid}").json()["session"]["model"] == "another-model"
    assert not socket_path.exists()                      # stopped with the app
    assert not os.path.exists(socket_path.parent)
