"""What every route needs: the engine, the server settings and the metrics."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from fastapi import Request

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
    created: int = field(default_factory=lambda: int(time.time()))


@dataclass
class ServeState:
    engine: object                                 # AsyncLLMEngine, or a double with the same interface
    config: ServeConfig
    metrics: Metrics = field(default_factory=Metrics)

    def __post_init__(self) -> None:
        tok = self.engine.tokenizer
        # Special tokens the detokenizer drops but the tool and reasoning parsers must see.
        self.markup_ids: dict[int, str] = {}
        for piece in MARKUP_TOKENS | {THINK_START, THINK_END}:
            tid = tok.piece_to_id(piece)
            if tid is not None and tok.is_special(tid):
                self.markup_ids[tid] = piece

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

    @cached_property
    def max_token_bytes(self) -> int:
        """The most bytes of text one token can stand for: a prompt longer than this many
        bytes per context token cannot fit, and is refused before it is tokenized."""
        tok = self.engine.tokenizer
        return max(1, max(max(len(tok.token_bytes(i)), len(tok.id_to_piece(i).encode()))
                          for i in range(tok.vocab_size)))

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
