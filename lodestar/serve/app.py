"""The HTTP application: routes of every API, errors in each API's shape, limits, auth, CORS, metrics.

``build_app(engine, config)`` takes a running ``AsyncLLMEngine`` (or any object with the
same ``generate`` / ``stats`` / ``tokenizer`` / ``max_model_len`` interface) so tests can
serve a scripted engine double.
"""
from __future__ import annotations

import datetime
import json
import logging
import re
import sys
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

from lodestar.serve import anthropic_messages, openai_chat, openai_completions, openai_responses, tokenize, web
from lodestar.serve.auth import APIKeyMiddleware
from lodestar.serve.errors import APIError, as_api_error, error_response
from lodestar.serve.generation import WARNING_HEADER
from lodestar.serve.metrics import REQUEST_SCOPE, grammar_stats
from lodestar.serve.state import ClientDisconnected, ServeConfig, ServeState, get_state

PLACEHOLDER_PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>lodestar</title></head>
<body><h1>lodestar</h1><p>Serving <code>{model}</code>. OpenAI-compatible API at <code>/v1</code>,
Anthropic Messages at <code>/v1/messages</code>, API reference at <a href="/docs">/docs</a>.</p></body></html>
"""


log = logging.getLogger("lodestar.serve")

# A JSON escape of a UTF-16 surrogate; most are halves of a valid pair, so a body that has
# one is parsed and searched for surrogates left alone (not valid Unicode: no tokenizer,
# template or encoder can take them).
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def _lone_surrogate_at(value) -> str | None:
    """The field path of the first string (or key) in ``value`` holding a lone surrogate."""
    stack = [("", value)]
    while stack:                       # iterative: a deeply nested body must not overflow the stack
        where, v = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return where or "body"
        elif isinstance(v, dict):
            for k, item in reversed(list(v.items())):
                at = f"{where}.{k}" if where else str(k)
                stack += [(at, item), (at, k)]
        elif isinstance(v, list):
            stack += [(f"{where}[{i}]", item) for i, item in reversed(list(enumerate(v)))]
    return None


class BodyLimitMiddleware:
    """Reads request bodies up front, refusing those over ``limit`` bytes with 413, and bodies
    that are not UTF-8 or whose JSON strings hold a lone UTF-16 surrogate with 400."""

    def __init__(self, app, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope.get("method") in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        too_big = APIError(413, f"The request body is larger than {self.limit} bytes.", code="request_too_large")
        for name, value in scope.get("headers", []):
            if name == b"content-length" and value.isdigit() and int(value) > self.limit:
                await error_response(path, too_big)(scope, receive, send)
                return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limit:
                await error_response(path, too_big)(scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False
        try:
            body.decode("utf-8")
        except UnicodeDecodeError as e:    # JSON is UTF-8; the JSON parser would fail with a 500
            bad = APIError(400, f"The request body is not valid UTF-8 (byte {e.start}: {e.reason}).", param="body")
            await error_response(path, bad)(scope, receive, send)
            return
        if _SURROGATE_ESCAPE.search(body):
            try:
                where = _lone_surrogate_at(json.loads(body))
            except (ValueError, RecursionError):
                where = None               # not JSON: the route's own parser says so
            if where is not None:
                bad = APIError(400, f"Invalid request: {where}: the text holds a lone UTF-16 surrogate "
                                    "(an unpaired \\ud800-\\udfff escape), which is not valid Unicode",
                               param=where)
                await error_response(path, bad)(scope, receive, send)
                return

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()      # after the body: wait for the disconnect

        await self.app(scope, replay, send)


class ErrorMiddleware:
    """Turns an exception no route handled into a 500 in the API's error shape.

    It sits inside the CORS middleware, so such answers carry the same CORS headers as
    every other (Starlette's own catch-all handler runs outside all middleware).
    """

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_tracked(message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, send_tracked)
        except Exception as exc:
            if started:
                raise                      # the status line is out: the connection just ends
            log.exception("unhandled error on %s %s", scope.get("method"), scope.get("path"))
            await error_response(scope.get("path", ""), as_api_error(exc))(scope, receive, send)


class MetricsMiddleware:
    """Counts responses by route template and status."""

    def __init__(self, app, state: ServeState) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def send_status(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        token = REQUEST_SCOPE.set(scope)     # finished generations name their route from it
        try:
            await self.app(scope, receive, send_status)
        finally:
            REQUEST_SCOPE.reset(token)
            route = scope.get("route")
            self.state.metrics.record_request(getattr(route, "path", None) or "other", status)


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "dict", "list", "none", "json-or-python"})


def _is_type_tag(part) -> bool:
    """pydantic names a union's branch in an error's location ('constrained-str', 'list[str]')."""
    return isinstance(part, str) and (part in _TYPE_TAGS or "[" in part or "-" in part or part[:1].isupper())


def _field(loc) -> str:
    parts = [p for p in loc if p != "body" and not _is_type_tag(p)]
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or "body"


def _log_to_stderr() -> None:
    """Server and engine log lines (request warnings, long prefills) reach stderr even when nothing
    configured logging: uvicorn sets up only its own loggers. A program that configured logging keeps its setup."""
    root = logging.getLogger("lodestar")
    if root.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("lodestar: %(levelname)s: %(message)s"))
    root.addHandler(handler)
    if root.level == logging.NOTSET:
        root.setLevel(logging.INFO)


def build_app(engine, config: ServeConfig | None = None) -> FastAPI:
    config = config or ServeConfig()
    _log_to_stderr()
    state = ServeState(engine, config)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        try:
            yield
        finally:
            state.close_store()

    app = FastAPI(title="lodestar", version="0.1.0", lifespan=lifespan,
                  description="Local LLM server speaking the OpenAI and Anthropic APIs.")
    app.state.serve = state
    for module in (openai_chat, openai_completions, openai_responses, anthropic_messages, tokenize, web):
        app.include_router(module.router)

    @app.get("/health", tags=["Server"], summary="Liveness and engine load")
    async def health(request: Request):
        s = get_state(request)
        if getattr(s.engine, "error", None) is not None:
            return JSONResponse({"status": "error", "error": str(s.engine.error)}, status_code=503)
        return {"status": "ok", "model": s.model_id, **s.engine.stats()}

    def model_card(s: ServeState, name: str) -> dict:
        # One object readable by both SDKs: OpenAI's model fields plus Anthropic's ModelInfo fields.
        created_at = datetime.datetime.fromtimestamp(s.config.created, datetime.timezone.utc)
        return {"id": name, "object": "model", "created": s.config.created, "owned_by": "lodestar",
                "type": "model", "display_name": name, "created_at": created_at.isoformat().replace("+00:00", "Z"),
                "max_model_len": s.engine.max_model_len}

    @app.get("/v1/models", tags=["Models"], summary="List the served models")
    async def list_models(request: Request):
        s = get_state(request)
        names = s.config.model_names
        return {"object": "list", "data": [model_card(s, n) for n in names], "has_more": False,
                "first_id": names[0], "last_id": names[-1]}

    @app.get("/v1/models/{model_id:path}", tags=["Models"], summary="Describe one served model")
    async def get_model(model_id: str, request: Request):
        s = get_state(request)
        return model_card(s, s.check_model(model_id, "model_id"))

    @app.get("/metrics", tags=["Server"], summary="Prometheus metrics", response_class=PlainTextResponse)
    async def metrics(request: Request):
        s = get_state(request)
        return PlainTextResponse(s.metrics.render({**s.engine.stats(), **grammar_stats(s.engine)}, s.model_id),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    static = config.static_dir

    @app.get("/", include_in_schema=False)
    async def index(request: Request):
        page = static / "index.html" if static is not None else None
        if page is not None and page.is_file():
            return HTMLResponse(page.read_text(encoding="utf-8"))
        return HTMLResponse(PLACEHOLDER_PAGE.format(model=get_state(request).model_id))

    if static is not None and static.is_dir():
        app.mount("/static", StaticFiles(directory=static), name="static")

    # -- errors in each API's own shape ----------------------------------------------------
    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError):
        return error_response(request.url.path, exc)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        # Of a union's failed branches, the one that got deepest into the value, and did not
        # just have the wrong type, says most ("stop[0]: at most 1024 characters" rather than
        # "stop: should be a string").
        first = max(errors, key=lambda e: (len(_field(e.get("loc", ())).replace("[", ".").split(".")),
                                           not str(e.get("type", "")).endswith("_type")),
                    default={"loc": ("body",), "msg": "invalid request"})
        if first.get("type") == "json_invalid":
            err = APIError(400, f"The request body is not valid JSON: {first.get('ctx', {}).get('error', '')}".strip(),
                           param="body")
        else:
            where = _field(first.get("loc", ()))
            more = f" (and {len(errors) - 1} more errors)" if len(errors) > 1 else ""
            err = APIError(400, f"Invalid request: {where}: {first.get('msg')}{more}", param=where)
        return error_response(request.url.path, err)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException):
        message = exc.detail if isinstance(exc.detail, str) else "HTTP error"
        if exc.status_code == 404:
            message = f"No route {request.method} {request.url.path}."
        elif exc.status_code == 405:
            message = f"Method {request.method} is not allowed on {request.url.path}."
        return error_response(request.url.path, APIError(exc.status_code, message))

    @app.exception_handler(ClientDisconnected)
    async def on_disconnect(request: Request, exc: ClientDisconnected):
        return Response(status_code=499)

    # Outermost last: CORS wraps everything, so even 401 and 413 answers carry its headers.
    if config.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=config.api_key)
    app.add_middleware(BodyLimitMiddleware, limit=config.max_body_bytes)
    app.add_middleware(MetricsMiddleware, state=state)
    app.add_middleware(ErrorMiddleware)
    if config.cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(config.cors_origins), allow_methods=["*"],
                           allow_headers=["*"], expose_headers=["Retry-After", WARNING_HEADER])
    return app
