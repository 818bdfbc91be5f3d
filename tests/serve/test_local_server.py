"""LocalServer: the HTTP app served in-process on a Unix socket, as the coding agent uses it."""
from __future__ import annotations

import asyncio
import json
import signal
import stat
import time

import httpx
import pytest
from serve_helpers import MODEL, ScriptedEngine

from lodestar.serve import LocalServer, ServeConfig, build_app
from lodestar.tokenizer import Tokenizer


class RecordingEngine(ScriptedEngine):
    """The scripted double, also counting requests whose stream was closed before they finished."""

    def __init__(self, tokenizer) -> None:
        super().__init__(tokenizer)
        self.aborted = 0

    async def generate(self, prompt_ids, params):
        finished = False
        try:
            async for out in super().generate(prompt_ids, params):
                finished = out.finished
                yield out
        finally:
            if not finished:
                self.aborted += 1


@pytest.fixture(scope="module")
def tok(smollm_path):
    return Tokenizer.from_gguf(smollm_path)


@pytest.fixture()
def engine(tok):
    return RecordingEngine(tok)


def app_for(engine, name: str = MODEL):
    return build_app(engine, ServeConfig(model_names=(name,), keepalive_s=0.1))


def wait_for(condition, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


async def model_ids(server: LocalServer) -> list[str]:
    async with httpx.AsyncClient(transport=server.client_transport(), base_url=server.base_url) as client:
        r = await client.get("/v1/models")
        r.raise_for_status()
        return [m["id"] for m in r.json()["data"]]


def test_stream_arrives_in_chunks_and_closing_it_aborts_the_request(engine):
    engine.script.pieces = ("tick ",) * 400
    engine.script.step_delay = 0.01
    body = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "count"}]}

    async def read_some(server: LocalServer) -> list[str]:
        async with (httpx.AsyncClient(transport=server.client_transport(), base_url=server.base_url) as client,
                    client.stream("POST", "/v1/chat/completions", json=body, timeout=10) as r):
            assert r.status_code == 200
            got = []
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    got.append(line)
                if len(got) == 5:
                    break
            assert engine.running == 1          # the answer is still being written
            return got

    with LocalServer(app_for(engine)) as server:
        chunks = asyncio.run(read_some(server))
        text = "".join(json.loads(c[6:])["choices"][0]["delta"].get("content", "") for c in chunks)
        assert text == "tick " * 4
        assert wait_for(lambda: engine.aborted == 1 and engine.running == 0)
        assert len(engine.requests) == 1


def test_stop_removes_the_socket_and_its_directory(engine):
    server = LocalServer(app_for(engine)).start()
    path = server.socket_path
    assert stat.S_ISSOCK(path.stat().st_mode)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert asyncio.run(model_ids(server)) == [MODEL]
    server.stop()
    assert not path.exists() and not path.parent.exists()
    server.stop()                                   # a second stop is harmless
    with pytest.raises(httpx.ConnectError):
        asyncio.run(model_ids(server))
    with pytest.raises(RuntimeError, match="create a new one"):
        server.start()


def test_two_servers_at_once_do_not_clash(tok, tmp_path):
    first = LocalServer(app_for(RecordingEngine(tok), "first"))
    second = LocalServer(app_for(RecordingEngine(tok), "second"))
    with first, second:
        assert first.socket_path != second.socket_path
        assert asyncio.run(model_ids(first)) == ["first"] and asyncio.run(model_ids(second)) == ["second"]
    shared = [LocalServer(app_for(RecordingEngine(tok), name), socket_dir=tmp_path) for name in ("a", "b")]
    with shared[0], shared[1]:
        assert shared[0].socket_path != shared[1].socket_path
        assert asyncio.run(model_ids(shared[0])) == ["a"] and asyncio.run(model_ids(shared[1])) == ["b"]
        shared[0].stop()
        assert asyncio.run(model_ids(shared[1])) == ["b"]     # stopping one leaves the other serving
    assert tmp_path.is_dir() and list(tmp_path.iterdir()) == []   # a given directory stays, emptied


def test_ctrl_c_still_reaches_the_main_thread(engine):
    before = signal.getsignal(signal.SIGINT)
    assert before is signal.default_int_handler
    with LocalServer(app_for(engine)) as server:
        assert signal.getsignal(signal.SIGINT) is before
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
        assert asyncio.run(model_ids(server)) == [MODEL]


def test_a_failed_start_says_why_and_leaves_nothing_behind(tmp_path):
    async def refusing_app(scope, receive, send):
        if scope["type"] == "lifespan":
            await receive()
            await send({"type": "lifespan.startup.failed", "message": "model file missing"})

    server = LocalServer(refusing_app)
    with pytest.raises(RuntimeError, match="model file missing"):
        server.start(timeout=10)
    assert not server.socket_path.parent.exists()
    with pytest.raises(RuntimeError, match="shorter path"):
        LocalServer(refusing_app, socket_dir=tmp_path / ("d" * 120)).start()
