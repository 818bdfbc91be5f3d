"""Server-sent events: framing helpers and a streaming response that always closes its source."""
from __future__ import annotations

import json

import anyio
from starlette.responses import StreamingResponse

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
KEEPALIVE = ": keep-alive\n\n"
DONE = "data: [DONE]\n\n"


def _json(obj) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def sse_data(obj) -> str:
    """An unnamed event (the OpenAI chat and completions grammar)."""
    return f"data: {_json(obj)}\n\n"


def sse_event(event: str, obj) -> str:
    """A named event (the Responses and Anthropic grammars)."""
    return f"event: {event}\ndata: {_json(obj)}\n\n"


class SSEResponse(StreamingResponse):
    """``text/event-stream`` whose body generator is closed however the stream ends.

    A client that disconnects cancels the send loop; closing the generator then runs
    its cleanup at once, which aborts the engine request and frees its KV blocks.
    """

    media_type = "text/event-stream"

    def __init__(self, content, status_code: int = 200, headers: dict[str, str] | None = None,
                 release=None) -> None:
        super().__init__(content, status_code, {**SSE_HEADERS, **(headers or {})})
        self._release = release          # called once the response has ended, however it ended

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if self._release is not None:
                self._release()

    async def stream_response(self, send) -> None:
        try:
            await super().stream_response(send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                with anyio.CancelScope(shield=True):
                    await aclose()
