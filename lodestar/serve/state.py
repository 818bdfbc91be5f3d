"""What every route needs: the engine, the server settings and the metrics."""
from __future__ import annotations

import asyncio
import threading
import time
from contextlib import aclosing
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import Request

from lodestar.agent.store import AgentStore, StoreError, default_db_path
from lodestar.engine.async_engine import EngineDeadError
from lodestar.serve.errors import APIError, context_fix
from lodestar.serve.metrics import Metrics
from lodestar.serve.reasoning import THINK_END, THINK_START
from lodestar.serve.tool_parsers import MARKUP_TOKENS

STATIC_DIR = Path(__file__).parent / "static"


@dataclass
class ServeConfig:
    model_names: tuple[str, ...] = ("lodestar",)   # the first is the model's id; the rest are aliases
    api_key: str | None = None
    cors_origins: tuple[str, ...] = ()
    keepalive_s: float = 2.0                       # SSE comment interval while no token arrives
    max_body_bytes: int = 8 * 1024 * 1024
    max_request_rows: int = 128                    # engine requests (prompts x n) one HTTP request may queue
    sampling_defaults: dict = field(default_factory=dict)  # temperature/top_p/top_k for requests that omit them
    static_dir: Path | None = STATIC_DIR
    db_path: Path | None = None                    # conversations and agent sessions; None: default_db_path()
    projects: tuple[Path, ...] = ()                # folders the web app's agent may work in; none: agent routes 403
    created: int = field(default_factory=lambda: int(time.time()))


@dataclass
class ServeState:
    engine: object                                 # AsyncLLMEngine, or a double with the same interface
    config: ServeConfig
    metrics: Metrics = field(default_factory=Metrics)
    _store: AgentStore | None = field(default=None, init=False, repr=False)
    _store_lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    def store(self) -> AgentStore:
        """The SQLite store at ``config.db_path``, opened on first use, so a server whose
        ``/api/`` routes are never called creates no file. A file it cannot use is a 500 whose
        message says what to do."""
        with self._store_lock:
            if self._store is None:
                try:
                    self._store = AgentStore(self.config.db_path or default_db_path())
                except StoreError as e:
                    raise APIError(500, str(e), code="store_unavailable") from None
            return self._store

    def close_store(self) -> None:
        with self._store_lock:
            if self._store is not None:
                self._store.close()
                self._store = None

    def __post_init__(self) -> None:
        # Facts of the served tokenizer, kept until a model switch brings another one.
        self._tokenizer_facts: dict = {}

    def _of_tokenizer(self, key: str, compute):
        tok = self.engine.tokenizer
        facts = self._tokenizer_facts
        if facts.get("tokenizer") is not tok:
            facts.clear()
            facts["tokenizer"] = tok
        if key not in facts:
            facts[key] = compute(tok)
        return facts[key]

    @property
    def markup_ids(self) -> dict[int, str]:
        """Special tokens the detokenizer drops but the tool and reasoning parsers must see."""
        def compute(tok) -> dict[int, str]:
            ids = {}
            for piece in MARKUP_TOKENS | {THINK_START, THINK_END}:
                tid = tok.piece_to_id(piece)
                if tid is not None and tok.is_special(tid):
                    ids[tid] = piece
            return ids
        return self._of_tokenizer("markup_ids", compute)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def model_id(self) -> str:
        return self.config.model_names[0]

    @property
    def trained_context(self) -> int | None:
        """The context the model file declares (``--ctx`` can go up to it), when the engine knows it."""
        value = getattr(self.engine, "trained_context", None)
        if value is None:
            loaded = getattr(getattr(self.engine, "engine", None), "loaded", None)
            value = getattr(getattr(loaded, "config", None), "context_length", None)
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    @property
    def max_token_bytes(self) -> int:
        """The most bytes of text one token can stand for: a prompt longer than this many
        bytes per context token cannot fit, and is refused before it is tokenized."""
        return self._of_tokenizer("max_token_bytes", lambda tok: max(1, max(
            max(len(tok.token_bytes(i)), len(tok.id_to_piece(i).encode())) for i in range(tok.vocab_size))))

    def check_prompt_text(self, text: str, field_name: str) -> None:
        """Refuse text that cannot fit the context however it tokenizes, without tokenizing it."""
        size = len(text.encode("utf-8", "surrogatepass"))
        least = -(-size // self.max_token_bytes)
        context = self.engine.max_model_len
        if least >= context:
            raise APIError(400, f"The prompt is {size:,} bytes of text, at least {least:,} tokens, and this model's "
                                f"maximum context length is {context:,} tokens. "
                                f"{context_fix(least, self.trained_context)}",
                           param=field_name, code="context_length_exceeded")

    def check_rows(self, rows: int, field_name: str) -> None:
        """One HTTP request may queue at most ``max_request_rows`` engine requests (prompts x n)."""
        limit = min(self.config.max_request_rows, getattr(self.engine, "max_queued", None) or 1 << 30)
        if rows > limit:
            raise APIError(400, f"This request asks for {rows} generations (prompts x n); at most {limit} are "
                                "allowed in one request. Split it into several requests.", param=field_name)

    def check_model(self, name: str | None, field_name: str = "model") -> str:
        """The served name the request asked for; 404 for any other."""
        if name in self.config.model_names:
            return name
        served = ", ".join(self.config.model_names)
        raise APIError(404, f"The model {name!r} does not exist. This server serves: {served} "
                            f"(add aliases with --served-model-name).", param=field_name, code="model_not_found")


def get_state(request: Request) -> ServeState:
    return request.app.state.serve


class ClientDisconnected(Exception):
    """The client went away before its non-streaming answer was ready."""


async def until_disconnect(request: Request, work):
    """Await ``work`` unless the client disconnects first; then cancel it (aborting its engine requests)."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
    if task in done:
        return task.result()
    raise ClientDisconnected()


# -- the served engine, replaceable ----------------------------------------------------------
def no_model_error() -> APIError:
    return APIError(503, 'No model is loaded. Load one with POST /api/models/load {"model": NAME} '
                         "(GET /api/models lists them).", code="no_model_loaded")


# (slot id, epoch) of the engine whose tokenizer the current request last read: a request that
# rendered its prompt for one model must not run on the next one.
_SEEN_EPOCH: ContextVar[tuple[int, int] | None] = ContextVar("lodestar_engine_epoch", default=None)
_END = object()
_IDLE_ENGINE_STATS = {"waiting": 0, "running": 0, "kv_blocks_used": 0, "kv_blocks_total": 0}


class EngineSlot:
    """The served engine, replaceable while the server runs (``POST /api/models/load``).

    Put in ``ServeState.engine``, it passes every attribute through to the current engine, so
    routes keep reading ``state.engine``; with no model loaded those reads are a 503 saying how
    to load one. While a switch is under way ``generate`` and ``compile_grammar`` wait for it.
    Each generation is pumped by its own task into a queue, so a switch can end the ones still
    running after its drain timeout with an error (aborting an engine request from outside
    would leave its stream waiting). Event loops of other threads (the in-process
    ``LocalServer``) use the same slot, so its own state is guarded by a thread lock and waiters
    are woken with ``call_soon_threadsafe``.
    """

    def __init__(self, engine: object | None = None) -> None:
        self._served: tuple[object | None, int] = (engine, 0)     # (engine, epoch), replaced together
        self._lock = threading.Lock()
        self._switching = False
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []
        self._active: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Task, asyncio.Queue]] = {}
        self._next_key = 0

    def __getattr__(self, name: str):
        # Reached only for names the slot lacks: they belong to the served engine.
        if name.startswith("__"):
            raise AttributeError(name)
        engine = self.__dict__["_served"][0]
        if engine is None:
            raise no_model_error()
        return getattr(engine, name)

    @property
    def current(self) -> object | None:
        """The served engine; None while no model is loaded (or during a switch's load)."""
        return self._served[0]

    @property
    def switching(self) -> bool:
        return self._switching

    @property
    def active(self) -> int:
        """Generations running through the slot."""
        return len(self._active)

    @property
    def tokenizer(self):
        engine, epoch = self._served
        if engine is None:
            raise no_model_error()
        _SEEN_EPOCH.set((id(self), epoch))
        return engine.tokenizer

    def stats(self) -> dict:
        engine = self._served[0]
        return engine.stats() if engine is not None else dict(_IDLE_ENGINE_STATS)

    # -- requests -------------------------------------------------------------------------
    async def wait_ready(self) -> None:
        """Return once no switch is under way (at once when none is)."""
        while True:
            with self._lock:
                if not self._switching:
                    return
                loop = asyncio.get_running_loop()
                waiter = loop.create_future()
                self._waiters.append((loop, waiter))
            await waiter

    async def compile_grammar(self, spec) -> None:
        await self.wait_ready()
        engine = self._served[0]
        if engine is None:
            raise no_model_error()
        await engine.compile_grammar(spec)

    async def generate(self, prompt_ids: list[int], params=None):
        """The current engine's ``generate``, counted so a switch can wait for it or end it."""
        while True:
            await self.wait_ready()
            started = self._start(prompt_ids, params)
            if started is not None:
                break
        key, pump, queue = started
        try:
            while True:
                item = await queue.get()
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            with self._lock:
                self._active.pop(key, None)
            if not pump.done():
                pump.cancel()               # the engine stream's own cleanup aborts the request

    def _start(self, prompt_ids, params):
        """Register and start one generation unless a switch began meanwhile (then None)."""
        with self._lock:
            if self._switching:
                return None
            engine, epoch = self._served
            if engine is None:
                raise no_model_error()
            seen = _SEEN_EPOCH.get()
            if seen is not None and seen[0] == id(self) and seen[1] != epoch:
                raise APIError(503, "The served model changed while this request was being prepared; send it "
                                    "again.", code="model_switched", headers={"Retry-After": "1"})
            loop = asyncio.get_running_loop()
            queue: asyncio.Queue = asyncio.Queue()
            pump = loop.create_task(_pump(engine.generate(prompt_ids, params), queue))
            self._next_key += 1
            self._active[self._next_key] = (loop, pump, queue)
            return self._next_key, pump, queue

    # -- switching ------------------------------------------------------------------------
    def begin_switch(self) -> bool:
        """Hold new generations back; False when another switch is already under way."""
        with self._lock:
            if self._switching:
                return False
            self._switching = True
            return True

    async def drain(self, timeout_s: float, reason: str) -> int:
        """Wait until no generation runs; those still running after ``timeout_s`` end with
        ``EngineDeadError(reason)``. Returns how many had to be ended."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self._active and loop.time() < deadline:
            await asyncio.sleep(0.02)
        with self._lock:
            running = list(self._active.items())
        for key, (owner, pump, queue) in running:
            try:
                owner.call_soon_threadsafe(_end_stream, pump, queue, EngineDeadError(reason))
            except RuntimeError:            # that event loop is closed: nothing reads the stream
                with self._lock:
                    self._active.pop(key, None)
        deadline = loop.time() + 5.0
        while self._active and loop.time() < deadline:
            await asyncio.sleep(0.02)
        with self._lock:
            self._active.clear()            # a stream whose loop no longer runs cannot finish
        return len(running)

    def install(self, engine: object | None) -> object | None:
        """Serve ``engine`` (None: no model) from now on; returns the engine served before."""
        with self._lock:
            old, epoch = self._served
            self._served = (engine, epoch + 1)
            return old

    def end_switch(self) -> None:
        """Let the requests held back run (on the engine installed now)."""
        with self._lock:
            self._switching = False
            waiters, self._waiters = self._waiters, []
        for loop, waiter in waiters:
            try:
                loop.call_soon_threadsafe(_wake, waiter)
            except RuntimeError:
                pass


async def _pump(stream, queue: asyncio.Queue) -> None:
    try:
        async with aclosing(stream):
            async for out in stream:
                queue.put_nowait(out)
        queue.put_nowait(_END)
    except asyncio.CancelledError:
        raise
    except BaseException as e:   # the engine's own errors (context length, queue full) reach the caller
        queue.put_nowait(e)
        if not isinstance(e, Exception):
            raise


def _end_stream(pump: asyncio.Task, queue: asyncio.Queue, error: BaseException) -> None:
    if not pump.done():
        queue.put_nowait(error)
        pump.cancel()


def _wake(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)
