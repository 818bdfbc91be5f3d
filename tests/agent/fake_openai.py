"""A scripted OpenAI-compatible chat server for agent tests that need a real TCP endpoint
(the agent running as its own process, e.g. under tmux).

Each ``POST /v1/chat/completions`` (``stream: true``) replays the next scripted ``Turn`` as
server-sent events the way OpenAI streams them: content deltas or ``delta.tool_calls``
chunks, a finish_reason chunk, a usage chunk, ``data: [DONE]``. Every request body is
recorded, and a stream the client closed early is counted, so tests can assert what the
model saw and that Stop really hung up. There is no ``/tokenize`` (the agent then estimates).

FastAPI and uvicorn are the server stack the project already serves with.

    with serve([tool("write", path="a.txt", content="hi\\n"), text("done")]) as (url, rec):
        ...  # point `lodestar agent --base-url URL` at it; rec.requests holds the bodies

Standalone: ``python tests/agent/fake_openai.py SCRIPT.json PORT`` where SCRIPT.json is a list
of turns like ``{"text": "hi"}``, ``{"calls": [{"name": "read", "arguments": {"path": "."}}]}``
or ``{"slow": true}``.
"""
from __future__ import annotations

import asyncio
import json
import socket
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

MODEL = "scripted"
CONTEXT = 8192
SLOW_INTERVAL_S = 0.2
SLOW_DURATION_S = 30.0


@dataclass
class Call:
    name: str
    arguments: dict
    id: str = ""


@dataclass
class Turn:
    """One assistant reply: text, tool calls, or a slow text stream (to test Stop)."""
    text: str = ""
    calls: list[Call] = field(default_factory=list)
    slow: bool = False

    @classmethod
    def from_json(cls, d: dict) -> Turn:
        calls = [Call(c["name"], c.get("arguments", {}), c.get("id", "")) for c in d.get("calls", [])]
        return cls(text=d.get("text", ""), calls=calls, slow=bool(d.get("slow", False)))


def text(content: str) -> Turn:
    return Turn(text=content)


def tool(name: str, id: str = "", **arguments) -> Turn:
    return Turn(calls=[Call(name, arguments, id)])


def slow(content: str = "still working") -> Turn:
    """Streams ``content`` as a line, then a "." every 0.2 s for 30 s (a line still open when
    Stop comes): long enough that only Stop ends it."""
    return Turn(text=content, slow=True)


@dataclass
class Recorder:
    requests: list[dict] = field(default_factory=list)   # every chat-completions body, in order
    streamed: dict[int, str] = field(default_factory=dict)  # request index -> content sent so far
    closed_early: int = 0                                # streams the client hung up on
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record(self, body: dict) -> int:
        with self._lock:
            self.requests.append(body)
            return len(self.requests) - 1

    def sent(self, n: int, content: str) -> None:
        with self._lock:
            self.streamed[n] = self.streamed.get(n, "") + content

    def hung_up(self) -> None:
        with self._lock:
            self.closed_early += 1


def _chunk(n: int, delta: dict | None = None, finish: str | None = None, usage: dict | None = None) -> str:
    body: dict = {"id": f"chatcmpl-{n}", "object": "chat.completion.chunk", "created": int(time.time()),
                  "model": MODEL,
                  "choices": [] if usage else [{"index": 0, "delta": delta or {}, "finish_reason": finish}]}
    if usage:
        body["usage"] = usage
    return f"data: {json.dumps(body)}\n\n"


def _pieces(s: str, n: int = 3) -> list[str]:
    """``s`` cut into about ``n`` pieces, as a model streams it."""
    step = max(1, -(-len(s) // n))
    return [s[i:i + step] for i in range(0, len(s), step)] or [""]


def create_app(script: Iterable[Turn], recorder: Recorder, delay: float = 0.02) -> FastAPI:
    turns = list(script)
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "tests"}]}

    @app.get("/v1/models/{name}")
    async def model(name: str) -> dict:
        return {"id": name, "object": "model", "owned_by": "tests", "max_model_len": CONTEXT}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        n = recorder.record(body)
        if not body.get("stream"):
            return JSONResponse({"error": {"message": "this scripted server only streams: send stream=true"}}, 400)
        if n >= len(turns):
            return JSONResponse({"error": {"message": f"the script has {len(turns)} turns; request {n + 1} "
                                                      "has none: add a turn"}}, 500)
        turn = turns[n]
        prompt_tokens = len(json.dumps(body.get("messages", []))) // 4

        async def events():
            tokens = 0
            finished = False
            try:
                yield _chunk(n, {"role": "assistant", "content": ""})
                pieces = ([turn.text + "\n"] + ["."] * int(SLOW_DURATION_S / SLOW_INTERVAL_S) if turn.slow
                          else _pieces(turn.text) if turn.text else [])
                for piece in pieces:
                    yield _chunk(n, {"content": piece})
                    recorder.sent(n, piece)
                    tokens += 1
                    await asyncio.sleep(SLOW_INTERVAL_S if turn.slow else delay)
                for i, c in enumerate(turn.calls):
                    head = {"index": i, "id": c.id or f"call_{n}_{i}", "type": "function",
                            "function": {"name": c.name, "arguments": ""}}
                    yield _chunk(n, {"tool_calls": [head]})
                    for piece in _pieces(json.dumps(c.arguments)):
                        yield _chunk(n, {"tool_calls": [{"index": i, "function": {"arguments": piece}}]})
                        tokens += 1
                        await asyncio.sleep(delay)
                yield _chunk(n, finish="tool_calls" if turn.calls else "stop")
                yield _chunk(n, usage={"prompt_tokens": prompt_tokens, "completion_tokens": tokens,
                                       "total_tokens": prompt_tokens + tokens,
                                       "prompt_tokens_details": {"cached_tokens": 0}})
                yield "data: [DONE]\n\n"
                finished = True
            finally:
                # a client that hangs up mid-stream cancels this generator before it finishes
                if not finished:
                    recorder.hung_up()

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


@contextmanager
def serve(script: Iterable[Turn], delay: float = 0.02) -> Iterator[tuple[str, Recorder]]:
    """Serve the script on 127.0.0.1 (a free port) from a background thread; yields
    (base URL ending in /v1, recorder)."""
    recorder = Recorder()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(create_app(script, recorder, delay), log_level="warning", lifespan="off",
                            timeout_graceful_shutdown=1)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            sock.close()
            raise RuntimeError("the scripted OpenAI server did not start (see uvicorn's log above)")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}/v1", recorder
    finally:
        server.should_exit = True
        thread.join(5)
        sock.close()


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python tests/agent/fake_openai.py SCRIPT.json PORT", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        script = [Turn.from_json(d) for d in json.load(f)]
    recorder = Recorder()
    uvicorn.run(create_app(script, recorder), host="127.0.0.1", port=int(argv[1]), log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
