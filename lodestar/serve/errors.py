"""API errors: one exception type, rendered in the error shape of the API that was called.

OpenAI routes answer ``{"error": {"message", "type", "param", "code"}}``; Anthropic
routes (``/v1/messages...``) answer ``{"type": "error", "error": {"type", "message"}}``.
Engine exceptions map to statuses here, so API modules just raise.
"""
from __future__ import annotations

import json
import re

from starlette.responses import JSONResponse

from lodestar.engine.async_engine import EngineDeadError, QueueFullError
from lodestar.engine.llm_engine import ContextLengthError

RETRY_AFTER_S = 1

_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                    500: "api_error", 503: "overloaded_error", 529: "overloaded_error"}
_OPENAI_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                 404: "invalid_request_error", 405: "invalid_request_error", 413: "invalid_request_error",
                 429: "rate_limit_error", 500: "server_error", 503: "server_error"}


class APIError(Exception):
    """An error a client sees: HTTP status, message, and the request field at fault."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}


def is_anthropic_path(path: str) -> bool:
    return path.startswith("/v1/messages")


def openai_error_body(err: APIError) -> dict:
    return {"error": {"message": err.message, "type": _OPENAI_TYPES.get(err.status, "server_error"),
                      "param": err.param, "code": err.code}}


def anthropic_error_body(err: APIError) -> dict:
    return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(err.status, "api_error"),
                                       "message": err.message}}


def error_body(path: str, err: APIError) -> dict:
    return anthropic_error_body(err) if is_anthropic_path(path) else openai_error_body(err)


def error_response(path: str, err: APIError) -> JSONResponse:
    return JSONResponse(error_body(path, err), status_code=err.status, headers=err.headers)


def context_error(e: ContextLengthError, max_tokens_field: str = "max_tokens") -> APIError:
    total = e.prompt_tokens + (e.max_tokens or 0)
    return APIError(400, f"This model's maximum context length is {e.context} tokens. However, you requested "
                         f"{total} tokens ({e.prompt_tokens} in the prompt, {e.max_tokens} for the completion). "
                         f"Shorten the prompt or lower {max_tokens_field}.",
                    param=max_tokens_field, code="context_length_exceeded")


def queue_full_error(e: QueueFullError) -> APIError:
    return APIError(503, f"The server is busy: {e}.", code="queue_full",
                    headers={"Retry-After": str(RETRY_AFTER_S)})


_FIELD = re.compile(r"^SamplingParams\.(\w+)")


def sampling_error(e: ValueError, fields: dict[str, str]) -> APIError:
    """A SamplingParams validation error, naming the request's own field (``fields``: engine -> API name)."""
    message = str(e)
    m = _FIELD.match(message)
    param = None
    if m:
        param = fields.get(m.group(1), m.group(1))
        message = f"{param}{message[m.end():]}"
    return APIError(400, f"Invalid value: {message}", param=param)


def as_api_error(e: BaseException, max_tokens_field: str = "max_tokens") -> APIError:
    """Map an exception raised while serving a request to the error its client sees."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, ContextLengthError):
        return context_error(e, max_tokens_field)
    if isinstance(e, QueueFullError):
        return queue_full_error(e)
    if isinstance(e, EngineDeadError):
        return APIError(503, f"The engine is not running: {e}", code="engine_dead")
    if isinstance(e, ValueError):
        return APIError(400, str(e))
    return APIError(500, f"Internal error: {type(e).__name__}: {e}")


def sse_error_payload(path: str, err: APIError) -> str:
    return json.dumps(error_body(path, err), ensure_ascii=False)
