"""The web app's chats: ``/api/conversations``, kept in the agent's SQLite store as sessions of
kind ``chat``, and a reply streamed as SSE.

A reply is what ``POST /v1/chat/completions`` answers for the same messages and settings: the
conversation becomes a ``ChatCompletionRequest`` that goes through the chat route's own
``prepare`` (chat template, reasoning split, ``response_format`` grammar) and ``Generation``.
The user's message is stored before generation starts, the answer when it ends; a client that
closes the stream (Stop) aborts the engine request, and what it was shown is stored with
``stopped: true``. One reply at a time per conversation (a second is a 409).
"""
from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from typing import Literal

import anyio
from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError
from starlette.concurrency import run_in_threadpool

from lodestar.agent.store import AgentStore, SessionInfo, StoredMessage, StoreError
from lodestar.engine.grammar import GrammarError
from lodestar.serve.errors import APIError, as_api_error
from lodestar.serve.generation import Generation, RequestWarnings
from lodestar.serve.openai_chat import prepare
from lodestar.serve.protocol import ChatCompletionRequest, ResponseFormat
from lodestar.serve.sse import KEEPALIVE, SSEResponse, sse_event
from lodestar.serve.state import ServeState, get_state
from lodestar.serve.structured import compile_grammar, grammar_error, response_format_spec

log = logging.getLogger("lodestar.serve")

router = APIRouter(prefix="/api/conversations", tags=["Web app"])

KIND = "chat"
CHAT_MODE = "read-only"          # the store wants a permission mode; a chat runs no tools
MAX_TITLE_CHARS = 200
MAX_LIST = 500


# -- bodies ------------------------------------------------------------------------------------
class Settings(BaseModel):
    """How a conversation's replies are generated (the chat route's fields of the same names).
    Unknown keys are refused: a misspelt setting would otherwise be stored and silently ignored."""

    model_config = ConfigDict(extra="forbid")
    system: str | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    max_tokens: int | None = Field(None, ge=1)
    reasoning_effort: Literal["none", "low", "medium", "high"] | None = None
    response_format: ResponseFormat | None = None


class ConversationBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    title: str | None = Field(None, max_length=MAX_TITLE_CHARS)
    settings: Settings | None = Field(None, description="replaces the stored settings as a whole")


class SendBody(BaseModel):
    """``{"content"}`` (a new user message), ``{"regenerate": true}`` (answer the last user
    message again) or ``{"edit_seq", "content"}`` (replace that user message and all after it)."""

    model_config = ConfigDict(extra="forbid")
    content: str | None = None
    regenerate: StrictBool = False
    edit_seq: int | None = Field(None, ge=1)


# -- wire shapes -------------------------------------------------------------------------------
def conversation_json(info: SessionInfo) -> dict:
    return {"id": info.id, "title": info.title, "created": info.created, "last_used": info.last_used,
            "message_count": info.message_count, "settings": info.settings or {}}


def message_json(m: StoredMessage) -> dict:
    meta = m.meta or {}
    stats = None
    if m.role == "assistant":
        stats = {"prompt_tokens": m.tokens_in, "completion_tokens": m.tokens_out, "cached_tokens": m.tokens_cached,
                 "ttft_ms": meta.get("ttft_ms"), "tokens_per_s": meta.get("tokens_per_s"),
                 "finish_reason": meta.get("finish_reason")}
    return {"seq": m.seq, "role": m.role, "content": m.content, "reasoning": meta.get("reasoning", ""),
            "stats": stats, "stopped": bool(meta.get("stopped", False)), "created": m.created}


# -- store access ------------------------------------------------------------------------------
async def _db(fn, *args, **kwargs):
    """A store call on a worker thread (SQLite blocks); a store failure is a 500 saying what to do."""
    try:
        return await run_in_threadpool(fn, *args, **kwargs)
    except StoreError as e:
        raise APIError(500, str(e), code="store_error") from None


async def _store(request: Request) -> tuple[ServeState, AgentStore]:
    state = get_state(request)
    return state, await run_in_threadpool(state.store)


async def _find(store: AgentStore, conversation_id: str) -> SessionInfo:
    info = await _db(store.find_session, conversation_id)
    if info is None or info.kind != KIND:
        raise APIError(404, f"No conversation {conversation_id!r}; GET /api/conversations lists them.",
                       param="id", code="conversation_not_found")
    return info


def _replying(request: Request) -> set[str]:
    """Ids of this app's conversations with a reply streaming now."""
    app_state = request.app.state
    if not hasattr(app_state, "conversations_replying"):
        app_state.conversations_replying = set()
    return app_state.conversations_replying


async def _checked_settings(state: ServeState, settings: Settings | None) -> dict | None:
    """The settings as stored; a response_format the engine cannot compile is a 400 now, not at send time."""
    if settings is None:
        return None
    stored = settings.model_dump(exclude_none=True)
    if settings.response_format is not None:
        field = "settings.response_format"
        spec = response_format_spec(settings.response_format.model_dump(exclude_none=True), field)
        compile_spec = getattr(state.engine, "compile_grammar", None)
        if spec is not None and compile_spec is not None:
            try:
                await compile_spec(spec)
            except GrammarError as e:
                raise grammar_error(e) from None
    return stored


# -- CRUD --------------------------------------------------------------------------------------
@router.get("", summary="List conversations, newest first; q searches titles and message text")
async def list_conversations(request: Request, q: str | None = Query(None, max_length=500),
                             limit: int = Query(50, ge=1, le=MAX_LIST)):
    _, store = await _store(request)
    found = await _db(store.sessions, kind=KIND, query=q or None, limit=limit)
    return {"data": [conversation_json(info) for info in found]}


@router.post("", summary="Start a conversation", status_code=201)
async def create_conversation(request: Request, body: ConversationBody | None = None):
    body = body or ConversationBody()
    state, store = await _store(request)
    settings = await _checked_settings(state, body.settings)
    info = await _db(store.create_session, "", state.model_id, CHAT_MODE, kind=KIND, settings=settings,
                     title=body.title or "")
    return JSONResponse(conversation_json(info), status_code=201)


@router.get("/{conversation_id}", summary="A conversation with its messages")
async def get_conversation(conversation_id: str, request: Request):
    _, store = await _store(request)
    info = await _find(store, conversation_id)
    history = await _db(store.messages, conversation_id)
    return {**conversation_json(info), "messages": [message_json(m) for m in history]}


@router.patch("/{conversation_id}", summary="Rename a conversation or replace its settings")
async def update_conversation(conversation_id: str, body: ConversationBody, request: Request):
    state, store = await _store(request)
    await _find(store, conversation_id)
    settings = await _checked_settings(state, body.settings)
    await _db(store.update_session, conversation_id, title=body.title, settings=settings)
    return conversation_json(await _find(store, conversation_id))


@router.delete("/{conversation_id}", summary="Delete a conversation and its messages", status_code=204)
async def delete_conversation(conversation_id: str, request: Request):
    _, store = await _store(request)
    await _find(store, conversation_id)
    if conversation_id in _replying(request):
        raise APIError(409, f"Conversation {conversation_id} is generating a reply; stop it (close its stream) "
                            "and delete it then.", code="conversation_busy")
    await _db(store.delete_session, conversation_id)
    return Response(status_code=204)


# -- sending -----------------------------------------------------------------------------------
def _plan(body: SendBody, history: list[StoredMessage]) -> tuple[int | None, str | None, list[StoredMessage]]:
    """(drop messages from this seq, the new user message, the history the reply answers)."""
    if body.regenerate:
        if body.content is not None or body.edit_seq is not None:
            raise APIError(400, "regenerate takes no content or edit_seq; send {\"regenerate\": true} alone",
                           param="regenerate")
        drop = None
        if history and history[-1].role == "assistant":
            drop, history = history[-1].seq, history[:-1]
        if not history or history[-1].role != "user":
            raise APIError(400, "Nothing to regenerate: the conversation does not end with a user message; "
                                "send {\"content\": ...} instead.", param="regenerate")
        return drop, None, history
    if body.content is None or not body.content.strip():
        raise APIError(400, "content is required and must not be blank: the user message to send",
                       param="content")
    if body.edit_seq is None:
        return None, body.content, history
    target = next((m for m in history if m.seq == body.edit_seq), None)
    if target is None or target.role != "user":
        users = [m.seq for m in history if m.role == "user"]
        raise APIError(400, f"edit_seq {body.edit_seq} is not a user message of this conversation; "
                            f"its user messages have seq {users}", param="edit_seq")
    return body.edit_seq, body.content, [m for m in history if m.seq < body.edit_seq]


def chat_request(state: ServeState, settings: dict, history: list[StoredMessage],
                 new_user: str | None) -> ChatCompletionRequest:
    """The ``/v1/chat/completions`` request this conversation's next reply answers."""
    messages = [{"role": "system", "content": settings["system"]}] if settings.get("system") else []
    messages += [{"role": m.role, "content": m.content} for m in history if m.role in ("user", "assistant")]
    if new_user is not None:
        messages.append({"role": "user", "content": new_user})
    fields = {k: settings[k] for k in ("temperature", "top_p", "max_tokens", "reasoning_effort", "response_format")
              if settings.get(k) is not None}
    return ChatCompletionRequest.model_validate({"model": state.model_id, "messages": messages, "stream": True,
                                                 **fields})


@router.post("/{conversation_id}/messages", summary="Send a message (or regenerate, or edit) and stream the reply")
async def send_message(conversation_id: str, body: SendBody, request: Request):
    state, store = await _store(request)
    info = await _find(store, conversation_id)
    replying = _replying(request)
    if conversation_id in replying:
        raise APIError(409, f"Conversation {conversation_id} is already generating a reply; wait for it or stop "
                            "it (close its stream).", code="conversation_busy")
    replying.add(conversation_id)
    try:
        history = await _db(store.messages, conversation_id)
        drop, new_user, history = _plan(body, history)
        try:
            settings = Settings.model_validate(info.settings or {}).model_dump(exclude_none=True)
            chat = chat_request(state, settings, history, new_user)
        except ValidationError as e:
            raise APIError(400, f"The conversation's stored settings are invalid ({e.errors()[0]['msg']}); "
                                f"PATCH /api/conversations/{conversation_id} with new settings.",
                           param="settings") from None
        warnings = RequestWarnings()
        spec = (await run_in_threadpool(prepare, state, chat, warnings))[0]
        await compile_grammar(state, spec.grammar)
        # Checked and rendered: only now change what is stored.
        if drop is not None:
            await _db(store.delete_messages_from, conversation_id, drop)
        if new_user is not None:
            await _db(store.add_message, conversation_id, "user", new_user)
        gen = Generation(state, spec, stream=True, keepalive_s=state.config.keepalive_s)
    except BaseException:
        replying.discard(conversation_id)
        raise
    return SSEResponse(_reply_events(store, conversation_id, gen),
                       release=lambda: replying.discard(conversation_id), headers=warnings.headers())


async def _reply_events(store: AgentStore, conversation_id: str, gen: Generation) -> AsyncIterator[str]:
    """``delta`` events, then ``done`` with the stored answer, or ``error``. Closed early (Stop), it
    aborts the engine request and stores what was sent, marked stopped."""
    content: list[str] = []
    reasoning: list[str] = []
    t0 = time.perf_counter()
    t_first: float | None = None
    events = gen.events()
    ended, error = False, None

    def save(stopped: bool) -> StoredMessage:
        res, t_end = gen.result, time.perf_counter()
        tokens_per_s = None
        if t_first is not None and res.completion_tokens > 1 and t_end > t_first:
            tokens_per_s = round((res.completion_tokens - 1) / (t_end - t_first), 2)
        meta = {"reasoning": "".join(reasoning),
                "ttft_ms": None if t_first is None else round((t_first - t0) * 1000, 1),
                "tokens_per_s": tokens_per_s,
                "finish_reason": "abort" if stopped else res.finish_reason,
                "stopped": stopped}
        return store.add_message(conversation_id, "assistant", "".join(content), tokens_in=res.prompt_tokens,
                                 tokens_cached=res.cached_tokens, tokens_out=res.completion_tokens,
                                 duration_ms=round((t_end - t0) * 1000), meta=meta)

    try:
        try:
            async for d in events:
                if d.kind == "keepalive":
                    yield KEEPALIVE
                elif d.kind in ("content", "reasoning") and d.text:
                    if t_first is None:
                        t_first = time.perf_counter()
                    (content if d.kind == "content" else reasoning).append(d.text)
                    yield sse_event("delta", {"kind": d.kind, "text": d.text})
        except Exception as e:  # noqa: BLE001 - the status line is sent: any failure is reported in the stream
            error = as_api_error(e).message
        ended = True
    finally:
        if not ended:
            # Stop: the client closed the stream. Shielded, as the task may be cancelled already.
            with anyio.CancelScope(shield=True):
                await events.aclose()           # aborts the engine request and frees its KV blocks
                try:
                    await run_in_threadpool(save, True)
                except StoreError as e:
                    log.warning("conversation %s: the stopped answer was not stored: %s", conversation_id, e)
    try:
        if error is None or content or reasoning:
            saved = await run_in_threadpool(save, False)
    except StoreError as e:
        yield sse_event("error", {"message": f"The answer could not be stored: {e}"})
        return
    if error is not None:
        yield sse_event("error", {"message": error})
    else:
        yield sse_event("done", {"message": message_json(saved)})
