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


def _ctx_suggestion(prompt_tokens: int) -> int:
    """A ``--ctx`` that holds the prompt with room to answer: prompt + 1024, rounded up to 1024."""
    return -(-(prompt_tokens + 1024) // 1024) * 1024


def context_fix(prompt_tokens: int, trained: int | None) -> str:
    """What the user can do about a prompt that does not fit the server's context (the model's own is
    ``trained``, when known)."""
    shorten = ("or shorten the prompt (fewer tools, a shorter system prompt or history: the client's own "
               "settings)")
    if trained is not None and prompt_tokens + 1 > trained:
        return (f"Fix: this model supports at most {trained} tokens, so serve a model with a longer context, "
                f"{shorten}.")
    suggested = _ctx_suggestion(prompt_tokens)
    if trained is not None:
        suggested = min(suggested, trained)
        where = f"`lodestar serve --ctx {suggested}`; this model supports up to {trained}"
    else:
        where = f"`lodestar serve --ctx {suggested}`, if the model supports it"
    return f"Fix: restart the server with a longer context ({where}), serve a model with a longer context, {shorten}."


def prompt_too_long_error(prompt_tokens: int, context: int, trained: int | None, field_name: str,
                          anthropic: bool = False) -> APIError:
    """The prompt alone leaves no room for one output token: a 400 with the numbers and the fix.

    The Anthropic wording starts as the hosted API's does (``prompt is too long: N tokens >
    M maximum``), which Claude Code recognises and reports as such.
    """
    fix = context_fix(prompt_tokens, trained)
    if anthropic:
        message = (f"prompt is too long: {prompt_tokens} tokens > {context} maximum (this server's context "
                   f"for the model, which must also hold at least one output token). {fix}")
    else:
        # plain numbers, as the hosted API writes them: clients parse this message
        message = (f"This model's maximum context length is {context} tokens, but the prompt has "
                   f"{prompt_tokens} tokens (the prompt and at least one output token must fit). {fix}")
    return APIError(400, message, param=field_name, code="context_length_exceeded")


def context_error(e: ContextLengthError, field_name: str = "messages", anthropic: bool = False) -> APIError:
    """The engine refused a prompt that does not fit (the server checks first, so this is a backstop)."""
    return prompt_too_long_error(e.prompt_tokens, e.context, None, field_name, anthropic)


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


def as_api_error(e: BaseException, prompt_field: str = "messages", anthropic: bool = False) -> APIError:
    """Map an exception raised while serving a request to the error its client sees."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, ContextLengthError):
        return context_error(e, prompt_field, anthropic)
    if isinstance(e, QueueFullError):
        return queue_full_error(e)
    if isinstance(e, EngineDeadError):
        return APIError(503, f"The engine is not running: {e}", code="engine_dead")
    if isinstance(e, ValueError):
        return APIError(400, str(e))
    return APIError(500, f"Internal error: {type(e).__name__}: {e}")


def sse_error_payload(path: str, err: APIError) -> str:
    return json.dumps(error_body(path, err), ensure_ascii=False)
