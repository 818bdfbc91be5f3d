"""Shared pieces of the serve tests: a uvicorn server thread and a scripted engine double."""
from __future__ import annotations

import asyncio
import socket
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

import uvicorn

from lodestar.engine.async_engine import EngineDeadError, QueueFullError
from lodestar.engine.llm_engine import RequestOutput

MODEL = "smollm2-135m"


@contextmanager
def serve_in_thread(app):
    """Run ``app`` with uvicorn on a free loopback port; yields the base URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("test server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def wait_idle(aeng, timeout: float = 15.0) -> dict:
    """Engine stats once no sequence runs and no KV block is held (or the last stats at the timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = aeng.stats()
        if (stats["running"] == 0 and stats["waiting"] == 0 and stats["kv_blocks_used"] == 0) \
                or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


# -- the engine double -----------------------------------------------------------------------
@dataclass
class Script:
    pieces: tuple[str, ...] = ("Hello", ",", " world", "!")
    finish_reason: str = "stop"       # when the script ends before max_tokens
    first_delay: float = 0.0          # a long prefill
    step_delay: float = 0.0
    cached_tokens: int = 0
    fail_after: int | None = None     # the engine dies after this many pieces


class ScriptedEngine:
    """Same interface as AsyncLLMEngine; replays ``script`` as one text piece per step."""

    def __init__(self, tokenizer, max_model_len: int = 4096, max_queued: int = 256) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.max_queued = max_queued
        self.script = Script()
        self.requests: list[tuple[list[int], object]] = []
        self.running = 0
        self.error = None
        self.grammars = None

    def stats(self) -> dict:
        return {"waiting": 0, "running": self.running, "kv_blocks_used": self.running, "kv_blocks_total": 64}

    async def compile_grammar(self, spec) -> None:
        """Compiled as the real engine does (the double ignores the grammar when it replays its script)."""
        from lodestar.engine.grammar import GrammarCompiler

        if self.grammars is None:
            self.grammars = GrammarCompiler(self.tokenizer)
        await asyncio.to_thread(self.grammars.compile, spec)

    def prompt_text(self, i: int = -1) -> str:
        return self.tokenizer.decode(self.requests[i][0])

    async def generate(self, prompt_ids, params):
        if self.max_queued <= 0:
            raise QueueFullError(0, self.max_queued)
        script = self.script
        self.requests.append((list(prompt_ids), params))
        self.running += 1
        try:
            await asyncio.sleep(script.first_delay)
            pieces = script.pieces[:params.max_tokens]
            for i, piece in enumerate(pieces):
                if script.fail_after is not None and i >= script.fail_after:
                    raise EngineDeadError("engine stopped: simulated failure")
                last = i == len(pieces) - 1
                reason = None
                if last:
                    reason = "length" if len(script.pieces) > params.max_tokens else script.finish_reason
                ids = self.tokenizer.encode(piece, add_special_tokens=False)[:1] or [0]
                lp = None
                if params.logprobs is not None:
                    lp = [(-0.25, [(ids[0], -0.25)] * params.logprobs)]
                yield RequestOutput(0, ids, piece, last, reason, lp, len(prompt_ids), i + 1, script.cached_tokens)
                if script.step_delay:
                    await asyncio.sleep(script.step_delay)
        finally:
            self.running -= 1

    def shutdown(self) -> None:
        pass
