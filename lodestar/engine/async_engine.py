"""Run an ``LLMEngine`` on one background thread and stream its outputs to asyncio.

The thread owns the model: it takes new requests and aborts from a queue between
steps, runs ``step()``, and hands each output to the caller's event loop. Callers never
touch tensors. Cancelling or closing a stream aborts its request, which frees its KV
blocks within one step.
"""
from __future__ import annotations

import asyncio
import queue
import threading
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from lodestar.engine.llm_engine import LLMEngine, RequestOutput
from lodestar.engine.sampling import SamplingParams


class QueueFullError(RuntimeError):
    """Too many requests are waiting; retry later (HTTP 503 + Retry-After)."""

    def __init__(self, waiting: int, limit: int) -> None:
        self.waiting, self.limit = waiting, limit
        super().__init__(f"request queue is full ({waiting} waiting, limit {limit}); retry later")


class EngineDeadError(RuntimeError):
    """The engine thread stopped after an error; no request can be served."""


@dataclass
class _Submit:
    prompt_ids: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue
    ready: "asyncio.Future[int]"


class AsyncLLMEngine:
    """``engine`` is an LLMEngine, or a zero-argument callable that builds one.

    Prefer the callable: the model is then loaded on the engine thread itself. With
    OpenMP, a second thread running parallel torch code beside a thread that already
    did (the loader) runs about half as fast on a small CPU; keeping all tensor work on
    one thread avoids that.
    """

    def __init__(self, engine: LLMEngine | Callable[[], LLMEngine], max_queued: int = 256) -> None:
        self.engine: LLMEngine | None = engine if isinstance(engine, LLMEngine) else None
        self._factory = None if isinstance(engine, LLMEngine) else engine
        self._ready = threading.Event()
        self.max_queued = max_queued
        self._inbox: queue.Queue = queue.Queue()
        self._streams: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._pending = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="lodestar-engine", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self.engine is None:
            raise self.error

    # -- caller side ------------------------------------------------------------
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        """Prompt + generated tokens one request may hold."""
        return self.engine.max_model_len

    async def generate(self, prompt_ids: list[int], params: SamplingParams | None = None
                       ) -> AsyncIterator[RequestOutput]:
        """Stream one request's outputs; raises ContextLengthError/QueueFullError/ValueError at start."""
        if self.error is not None:
            raise EngineDeadError(f"engine stopped: {self.error}")
        with self._lock:
            waiting = len(self.engine.waiting) + self._pending
            if waiting >= self.max_queued:
                raise QueueFullError(waiting, self.max_queued)
            self._pending += 1
        loop = asyncio.get_running_loop()
        out: asyncio.Queue = asyncio.Queue()
        ready = loop.create_future()
        self._inbox.put(_Submit(list(prompt_ids), params or SamplingParams(), loop, out, ready))
        try:
            rid = await asyncio.shield(ready)  # raises the engine's validation error, if any
        except asyncio.CancelledError:
            # cancelled before the engine thread took the request: abort it once it has an id
            ready.add_done_callback(lambda f: f.cancelled() or f.exception() or self.abort(f.result()))
            raise
        finished = False
        try:
            while True:
                item = await out.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(rid)

    async def compile_grammar(self, spec) -> None:
        """Compile a request's grammar on a worker thread (the engine thread keeps stepping);
        raises engine.grammar.GrammarError. ``generate`` then finds it compiled."""
        await asyncio.to_thread(self.engine.compile_grammar, spec)

    def abort(self, request_id: int) -> None:
        self._inbox.put(("abort", request_id))

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._inbox.put(None)
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self.engine.close()   # checkpoint running conversations to the disk tier

    def stats(self) -> dict:
        e = self.engine
        return {"waiting": len(e.waiting) + self._pending, "running": len(e.running),
                "kv_blocks_used": e.pool.num_blocks - e.pool.num_free, "kv_blocks_total": e.pool.num_blocks,
                "kv_block_size": e.config.block_size}

    # -- engine thread ----------------------------------------------------------
    def _take(self, item) -> None:
        if item is None:
            return
        if isinstance(item, tuple):
            rid = item[1]
            self.engine.abort(rid)
            self._streams.pop(rid, None)
            return
        with self._lock:
            self._pending -= 1
        try:
            rid = self.engine.add_request(item.prompt_ids, item.params)
        except Exception as e:  # validation errors go back to the caller
            item.loop.call_soon_threadsafe(_set_exception, item.ready, e)
            return
        self._streams[rid] = (item.loop, item.out)
        item.loop.call_soon_threadsafe(_set_result, item.ready, rid)

    def _loop(self) -> None:
        try:
            if self._factory is not None:
                self.engine = self._factory()
        except BaseException as e:
            self.error = e
            return
        finally:
            self._ready.set()
        try:
            while not self._stop.is_set():
                block = not self.engine.has_unfinished()
                try:
                    item = self._inbox.get(block=block, timeout=0.5 if block else None)
                    self._take(item)
                    while True:
                        self._take(self._inbox.get_nowait())
                except queue.Empty:
                    pass
                if not self.engine.has_unfinished():
                    continue
                # One wake-up per event loop per step, however many streams it serves: every
                # wake-up is the loop's thread taking the GIL from this one.
                batches: dict[asyncio.AbstractEventLoop, list] = {}
                for out in self.engine.step():
                    target = self._streams.get(out.request_id)
                    if target is None:
                        continue
                    loop, q = target
                    batches.setdefault(loop, []).append((q, out))
                    if out.finished:
                        self._streams.pop(out.request_id, None)
                for loop, items in batches.items():
                    loop.call_soon_threadsafe(_deliver, items)
        except BaseException as e:  # the model failed: fail every stream, loudly
            self.error = e
            for loop, q in self._streams.values():
                loop.call_soon_threadsafe(q.put_nowait, EngineDeadError(f"engine stopped: {e}"))
            self._streams.clear()
            raise


def _deliver(items: list) -> None:
    for q, out in items:
        q.put_nowait(out)


def _set_result(fut: asyncio.Future, value) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
