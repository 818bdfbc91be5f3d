"""The coding agent over HTTP: ``/api/projects`` and ``/api/agent/sessions...``.

The agent works only in the folders the server was started with (``--projects DIR...``,
``ServeConfig.projects``); without any, every route here is a 403 saying so. A project path
in a request, and the project of every session a route touches, must resolve (symlinks and
``..`` followed) to one of those folders or a folder inside one.

Each session has at most one live ``Agent``, kept in an ``AgentWorkspace`` on ``app.state``
and run as an asyncio task on the server's loop. Its ``HTTPFrontend`` turns the agent's
callbacks into SSE events for every attached ``GET .../events`` listener (events from the
moment it attaches; the page reloads history with ``GET .../sessions/{id}``):

- ``prompt`` {text, queued}: a prompt was taken (started a run, or queued into the running one)
- ``delta`` {kind, text}: streamed reply ("content", "reasoning", or "tool": a call's name)
- ``tool_start`` {id, name, arguments, summary, risks, decision}
- ``tool_end`` {id, name, ok, content (at most 2 KB), truncated, display (a diff for write/edit)}
- ``approval`` {request_id, tool, arguments, summary, risks, reason}: answered by ``POST .../approve``
- ``status`` {message}; ``error`` {message}
- ``turn_end`` {stats}: the run ended (``TurnStats`` fields; null after an error); always the last of a run

The agent's model client speaks OpenAI chat completions to this same app served in-process
on a private Unix socket (``LocalServer``, started on the first run, stopped at shutdown),
so its replies go through the same chat templates, tool-call parsing and grammar as
``/v1/chat/completions``. Tests replace it with ``app.state.agent_client_factory``
(``SessionInfo -> client``).
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import secrets
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from fastapi import APIRouter, FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, StrictBool
from starlette.concurrency import run_in_threadpool

from lodestar.agent.client import ChatClient, ModelError, ToolCallRequest
from lodestar.agent.instructions import (
    find_skills,
    load_instructions,
    render_instructions,
    render_skills,
)
from lodestar.agent.loop import Agent, AgentConfig, Frontend, TurnStats
from lodestar.agent.policy import Assessment, Decision, Mode
from lodestar.agent.store import AgentStore, SessionInfo, StoredMessage, StoreError
from lodestar.agent.tools import ToolResult
from lodestar.serve.errors import APIError
from lodestar.serve.local import LocalServer
from lodestar.serve.sse import KEEPALIVE, SSEResponse, sse_event
from lodestar.serve.state import ServeState, get_state

log = logging.getLogger("lodestar.serve")

KIND = "agent"
TOOL_CONTENT_BYTES = 2048          # a tool_end event carries at most this much of the result
LISTENER_BACKLOG = 10_000          # events a listener may fall behind before it is dropped
STOP_WAIT_S = 10.0                 # at shutdown: how long runs get to stop before they are cancelled
TEMPERATURE = 0.2                  # as `lodestar agent`: tool calls want little noise
MAX_LIST = 500

_END = object()                    # a listener's stream ends (session deleted, server shutting down)
_OVERFLOW = object()               # a listener fell too far behind


# -- the frontend ------------------------------------------------------------------------------
@dataclass
class PendingApproval:
    request_id: str
    tool: str
    arguments: str
    summary: str
    risks: list[str]
    reason: str                    # why the policy asks
    answer: asyncio.Future         # (allowed, reason)

    def public(self) -> dict:
        return {"request_id": self.request_id, "tool": self.tool, "arguments": self.arguments,
                "summary": self.summary, "risks": self.risks, "reason": self.reason}


def _cut_utf8(text: str, limit: int) -> tuple[str, bool]:
    data = text.encode("utf-8", "surrogatepass")
    if len(data) <= limit:
        return text, False
    return data[:limit].decode("utf-8", "ignore"), True


class HTTPFrontend(Frontend):
    """Agent callbacks as SSE events for every attached listener; an approval waits for
    ``answer`` (``POST .../approve``). All calls happen on the server's event loop."""

    def __init__(self) -> None:
        self._listeners: set[asyncio.Queue] = set()
        self.pending: dict[str, PendingApproval] = {}

    # -- listeners ------------------------------------------------------------------------
    def attach(self) -> asyncio.Queue:
        q: asyncio.Queue = asyncio.Queue()
        self._listeners.add(q)
        return q

    def detach(self, q: asyncio.Queue) -> None:
        self._listeners.discard(q)

    @property
    def listeners(self) -> int:
        return len(self._listeners)

    def emit(self, event: str, data: dict) -> None:
        frame = sse_event(event, data)
        for q in list(self._listeners):
            if q.qsize() >= LISTENER_BACKLOG:
                # a stalled reader must not hold the whole run's output in memory
                self.detach(q)
                q.put_nowait(_OVERFLOW)
            else:
                q.put_nowait(frame)

    def close(self) -> None:
        for q in list(self._listeners):
            self.detach(q)
            q.put_nowait(_END)

    # -- approvals ------------------------------------------------------------------------
    def answer(self, request_id: str, allowed: bool, reason: str = "") -> bool:
        """Answer a pending approval; False when there is none with that id."""
        p = self.pending.get(request_id)
        if p is None or p.answer.done():
            return False
        if allowed:
            p.answer.set_result((True, "allowed once by the user"))
        else:
            p.answer.set_result((False, f"denied by the user{': ' + reason if reason else ''}"))
        return True

    def deny_all(self, reason: str) -> None:
        for p in list(self.pending.values()):
            if not p.answer.done():
                p.answer.set_result((False, reason))

    def first_pending(self) -> dict | None:
        return next((p.public() for p in self.pending.values() if not p.answer.done()), None)

    # -- Frontend -------------------------------------------------------------------------
    def delta(self, kind: str, text: str) -> None:
        self.emit("delta", {"kind": kind, "text": text})

    def tool_start(self, call: ToolCallRequest, assessment: Assessment | None, decision: Decision | None) -> None:
        self.emit("tool_start", {"id": call.id, "name": call.name, "arguments": call.arguments,
                                 "summary": assessment.summary if assessment else "",
                                 "risks": sorted(assessment.risks) if assessment else [],
                                 "decision": decision.action if decision else None})

    def tool_end(self, call: ToolCallRequest, result: ToolResult, decision: Decision | None) -> None:
        content, truncated = _cut_utf8(result.content, TOOL_CONTENT_BYTES)
        self.emit("tool_end", {"id": call.id, "name": call.name, "ok": result.ok, "content": content,
                               "truncated": truncated, "display": result.display})

    async def approve(self, call: ToolCallRequest, assessment: Assessment, decision: Decision) -> tuple[bool, str]:
        p = PendingApproval(secrets.token_hex(8), call.name, call.arguments, assessment.summary or call.name,
                            sorted(assessment.risks), decision.reason, asyncio.get_running_loop().create_future())
        self.pending[p.request_id] = p
        self.emit("approval", p.public())
        try:
            return await p.answer
        finally:
            self.pending.pop(p.request_id, None)

    def status(self, message: str) -> None:
        self.emit("status", {"message": message})


# -- the registry of live agents ---------------------------------------------------------------
class SessionRun:
    """One session's live state: its frontend (listeners, approvals), its agent once a prompt
    came, and the task of the run in progress."""

    def __init__(self, session_id: str) -> None:
        self.session_id = session_id
        self.frontend = HTTPFrontend()
        self.agent: Agent | None = None
        self.task: asyncio.Task | None = None
        self.backlog: list[str] = []     # prompts queued while the agent was still being built
        self.started = False             # Agent.run has begun (Stop goes through the agent from then on)

    @property
    def busy(self) -> bool:
        return self.task is not None and not self.task.done()

    def stop(self) -> None:
        if self.agent is not None and self.started:
            self.agent.stop()
        elif self.busy:
            self.task.cancel()           # still building the agent: nothing to save yet
        self.frontend.deny_all("stopped by the user")


class _RequestsOnly:
    """The app without its lifespan, for the in-process socket server: the main server ran the
    startup, and its shutdown is what stops this one."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "lifespan":
            await self.app(scope, receive, send)
            return
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return


class AgentWorkspace:
    """The app's live agents, one per session id, and the model client they share."""

    def __init__(self, app) -> None:
        self.app = app
        self.runs: dict[str, SessionRun] = {}
        self.closed = False
        self.local_server: LocalServer | None = None   # the agent's way to the model, once started
        self._client: ChatClient | None = None
        self._client_lock = asyncio.Lock()

    def run_for(self, session_id: str) -> SessionRun:
        run = self.runs.get(session_id)
        if run is None:
            run = self.runs[session_id] = SessionRun(session_id)
        return run

    def peek(self, session_id: str) -> SessionRun | None:
        return self.runs.get(session_id)

    def forget(self, session_id: str) -> None:
        run = self.runs.pop(session_id, None)
        if run is not None:
            run.frontend.close()
            if run.agent is not None:
                run.agent.ctx.jobs.kill_all()

    # -- the model --------------------------------------------------------------------------
    async def client_for(self, state: ServeState, session: SessionInfo):
        factory = getattr(self.app.state, "agent_client_factory", None)
        if factory is not None:
            return factory(session)
        async with self._client_lock:
            if self._client is None:
                server = LocalServer(_RequestsOnly(self.app))
                try:
                    await asyncio.to_thread(server.start)
                except RuntimeError as e:
                    raise ModelError(f"the agent cannot reach the model: {e}") from None
                self.local_server = server
                self._client = ChatClient(server.base_url, state.model_id, api_key=state.config.api_key,
                                          transport=server.client_transport())
        return self._client

    async def build_agent(self, state: ServeState, store: AgentStore, session: SessionInfo,
                          frontend: HTTPFrontend) -> Agent:
        root = Path(session.project)
        # AGENTS.md files and skills, as `lodestar agent` reads them (file reads: off the loop)
        instructions, skills = await asyncio.to_thread(
            lambda: (render_instructions(load_instructions(root)), render_skills(find_skills(root), root)))
        client = await self.client_for(state, session)
        config = AgentConfig(mode=Mode(session.mode), interactive=True, temperature=TEMPERATURE)
        return Agent(client, store, session, root, config, frontend, instructions=instructions, skills=skills)

    # -- runs -------------------------------------------------------------------------------
    def prompt(self, state: ServeState, store: AgentStore, session: SessionInfo, text: str) -> bool:
        """Start a run with ``text``, or queue it into the running one; True when queued."""
        if self.closed:
            raise APIError(503, "The server is shutting down; start it again to run the agent.",
                           code="shutting_down")
        run = self.run_for(session.id)
        if run.busy:
            if run.agent is not None:
                run.agent.queue(text)
            else:
                run.backlog.append(text)
            run.frontend.emit("prompt", {"text": text, "queued": True})
            return True
        run.frontend.emit("prompt", {"text": text, "queued": False})
        run.task = asyncio.create_task(self._turn(state, store, session, run, text),
                                       name=f"agent-session-{session.id}")
        return False

    async def _turn(self, state: ServeState, store: AgentStore, session: SessionInfo, run: SessionRun,
                    text: str) -> None:
        stats: TurnStats | None = None
        try:
            if run.agent is None:
                run.agent = await self.build_agent(state, store, session, run.frontend)
            for queued in run.backlog:
                run.agent.queue(queued)
            run.backlog.clear()
            if run.agent.client is self._client:
                # POST /api/models/load may have put another model, with other names, behind this app
                self._client.model = state.model_id
            if session.model != state.model_id:
                store.update_session(session.id, model=state.model_id)
                session.model = state.model_id
            run.started = True
            stats = await run.agent.run(text)
        except asyncio.CancelledError:
            stats = TurnStats(stopped=True)
            raise
        except Exception as e:           # the run ends; the server and other sessions go on
            if not isinstance(e, (ModelError, StoreError)):
                log.exception("agent session %s failed", session.id)
            run.frontend.emit("error", {"message": _describe(e)})
        finally:
            run.started = False
            run.backlog.clear()
            run.frontend.deny_all("the run ended")
            run.frontend.emit("turn_end", {"stats": None if stats is None else dataclasses.asdict(stats)})

    async def close(self) -> None:
        """Stop every run (tools, background jobs), end every listener's stream, stop the socket server."""
        self.closed = True
        runs = list(self.runs.values())
        for run in runs:
            run.stop()
        tasks = [run.task for run in runs if run.busy]
        if tasks:
            _, late = await asyncio.wait(tasks, timeout=STOP_WAIT_S)
            for task in late:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        for session_id in list(self.runs):
            self.forget(session_id)
        if self._client is not None:
            await self._client.aclose()
        if self.local_server is not None:
            await asyncio.to_thread(self.local_server.stop)


def _describe(e: Exception) -> str:
    if isinstance(e, (ModelError, StoreError)):
        return str(e)
    return f"{type(e).__name__}: {e}"


@asynccontextmanager
async def _lifespan(app: FastAPI):
    try:
        yield
    finally:
        workspace = getattr(app.state, "agent_workspace", None)
        if workspace is not None:
            await workspace.close()


router = APIRouter(prefix="/api", tags=["Agent"], lifespan=_lifespan)


def _workspace(request: Request) -> AgentWorkspace:
    app_state = request.app.state
    if getattr(app_state, "agent_workspace", None) is None:
        app_state.agent_workspace = AgentWorkspace(request.app)
    return app_state.agent_workspace


# -- the project boundary ----------------------------------------------------------------------
def allowed_projects(state: ServeState) -> list[Path]:
    """The real paths of ``--projects``; a 403 saying how to enable the agent when there are none."""
    if not state.config.projects:
        raise APIError(403, "The agent has no project folders here: start the server with --projects DIR "
                            "[DIR...] (the folders the agent may work in).", code="no_projects")
    roots: list[Path] = []
    for p in state.config.projects:
        real = Path(os.path.realpath(p))
        if real not in roots:
            roots.append(real)
    return roots


def _inside(path: Path, roots: list[Path]) -> bool:
    return any(path == root or root in path.parents for root in roots)


def check_project(state: ServeState, text: str, param: str = "project") -> Path:
    """The real path of a requested project folder: one of ``--projects`` or inside one (403 otherwise)."""
    roots = allowed_projects(state)
    if not os.path.isabs(text) or "\0" in text:
        raise APIError(400, f"{param} {text!r} must be an absolute folder path; GET /api/projects lists "
                            "the folders the agent may work in.", param=param)
    real = Path(os.path.realpath(text))
    if not _inside(real, roots):
        allowed = ", ".join(str(r) for r in roots)
        raise APIError(403, f"{text} is outside the folders the agent may work in ({allowed}); pick one of "
                            "GET /api/projects, or restart the server with that folder in --projects.",
                       param=param, code="project_not_allowed")
    if not real.is_dir():
        raise APIError(400, f"{param} {text} is not a folder; create it first or pick another.", param=param)
    return real


async def _db(fn, *args, **kwargs):
    """A store call on a worker thread (SQLite blocks); a store failure is a 500 saying what to do."""
    try:
        return await run_in_threadpool(fn, *args, **kwargs)
    except StoreError as e:
        raise APIError(500, str(e), code="store_error") from None


async def _agent_session(request: Request, session_id: str) -> tuple[ServeState, AgentStore, SessionInfo]:
    state = get_state(request)
    roots = allowed_projects(state)
    store = await run_in_threadpool(state.store)
    info = await _db(store.find_session, session_id)
    if info is None or info.kind != KIND:
        raise APIError(404, f"No agent session {session_id!r}; GET /api/agent/sessions?project=PATH lists them.",
                       param="id", code="session_not_found")
    if not _inside(Path(info.project), roots):
        raise APIError(403, f"Session {session_id} works in {info.project}, which is not among this server's "
                            "--projects; restart the server with that folder in --projects to use it.",
                       code="project_not_allowed")
    return state, store, info


def session_json(info: SessionInfo) -> dict:
    return dataclasses.asdict(info)


def message_json(m: StoredMessage) -> dict:
    return dataclasses.asdict(m)


# -- bodies ------------------------------------------------------------------------------------
class NewSession(BaseModel):
    model_config = ConfigDict(extra="forbid")
    project: str = Field(..., min_length=1, description="an absolute folder path: one of --projects or inside one")
    mode: Literal["read-only", "ask", "auto"] = "ask"


class PromptBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    text: str


class ApproveBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    request_id: str
    allow: StrictBool
    reason: str = Field("", max_length=2000, description="with allow false: told to the model")



# -- routes ------------------------------------------------------------------------------------
@router.get("/projects", summary="The folders the agent may work in (--projects)")
async def list_projects(request: Request):
    roots = allowed_projects(get_state(request))
    return {"data": [{"path": str(r), "name": r.name or str(r)} for r in roots]}


@router.get("/agent/sessions", summary="Agent sessions, most recently used first")
async def list_sessions(request: Request, project: str | None = Query(None, max_length=4096),
                        limit: int = Query(50, ge=1, le=MAX_LIST)):
    state = get_state(request)
    roots = allowed_projects(state)
    store = await run_in_threadpool(state.store)
    if project is not None:
        real = check_project(state, project)
        found = await _db(store.sessions, str(real), limit, kind=KIND)
    else:
        found = await _db(store.sessions, None, MAX_LIST, kind=KIND)
        found = [s for s in found if _inside(Path(s.project), roots)][:limit]
    return {"data": [session_json(s) for s in found]}


@router.post("/agent/sessions", summary="Start an agent session in a project", status_code=201)
async def create_session(body: NewSession, request: Request):
    state = get_state(request)
    real = check_project(state, body.project)
    store = await run_in_threadpool(state.store)
    info = await _db(store.create_session, str(real), state.model_id, body.mode, kind=KIND)
    return JSONResponse(session_json(info), status_code=201)


@router.get("/agent/sessions/{session_id}", summary="A session, its stored transcript, and whether it runs now")
async def get_session(session_id: str, request: Request):
    _, store, info = await _agent_session(request, session_id)
    history = await _db(store.messages, session_id)
    run = _workspace(request).peek(session_id)
    return {"session": session_json(info), "messages": [message_json(m) for m in history],
            "busy": run is not None and run.busy,
            "pending_approval": None if run is None else run.frontend.first_pending()}


@router.delete("/agent/sessions/{session_id}", summary="Delete a session and its messages", status_code=204)
async def delete_session(session_id: str, request: Request):
    _, store, _ = await _agent_session(request, session_id)
    workspace = _workspace(request)
    run = workspace.peek(session_id)
    if run is not None and run.busy:
        raise APIError(409, f"Session {session_id} is running; POST /api/agent/sessions/{session_id}/stop "
                            "and delete it once it has stopped.", code="session_busy")
    workspace.forget(session_id)
    await _db(store.delete_session, session_id)
    return Response(status_code=204)


@router.post("/agent/sessions/{session_id}/prompt", summary="Start a run, or queue the text into the running one",
             status_code=202)
async def prompt(session_id: str, body: PromptBody, request: Request):
    state, store, info = await _agent_session(request, session_id)
    if not body.text.strip():
        raise APIError(400, "text is required and must not be blank: the prompt for the agent", param="text")
    queued = _workspace(request).prompt(state, store, info, body.text)
    return JSONResponse({"queued": queued}, status_code=202)


@router.get("/agent/sessions/{session_id}/events", summary="Live events of the session (SSE) from now on")
async def events(session_id: str, request: Request):
    state, _, info = await _agent_session(request, session_id)
    workspace = _workspace(request)
    if workspace.closed:
        raise APIError(503, "The server is shutting down.", code="shutting_down")
    run = workspace.run_for(info.id)
    q = run.frontend.attach()           # attached now: the client sees every event after this answer starts
    return SSEResponse(_event_stream(q, state.config.keepalive_s), release=lambda: run.frontend.detach(q))


@router.post("/agent/sessions/{session_id}/approve", summary="Answer a pending approval")
async def approve(session_id: str, body: ApproveBody, request: Request):
    await _agent_session(request, session_id)
    run = _workspace(request).peek(session_id)
    if run is None or not run.frontend.answer(body.request_id, body.allow, body.reason.strip()):
        raise APIError(404, f"No pending approval {body.request_id!r} in session {session_id}; it may have been "
                            f"answered or its run stopped (GET /api/agent/sessions/{session_id} shows "
                            "pending_approval).", param="request_id", code="approval_not_found")
    return {"request_id": body.request_id, "allow": body.allow}


@router.post("/agent/sessions/{session_id}/stop", summary="Stop the running model call, tool and jobs")
async def stop(session_id: str, request: Request):
    await _agent_session(request, session_id)
    run = _workspace(request).peek(session_id)
    busy = run is not None and run.busy
    if run is not None:
        run.stop()
    return {"stopping": busy}


# -- the event stream --------------------------------------------------------------------------
async def _event_stream(q: asyncio.Queue, keepalive_s: float):
    while True:
        try:
            item = await asyncio.wait_for(q.get(), timeout=keepalive_s)
        except TimeoutError:
            yield KEEPALIVE              # also finds a client that left
            continue
        if item is _END:
            return
        if item is _OVERFLOW:
            yield sse_event("error", {"message": "this listener fell too far behind and was dropped; "
                                                 "reload the session (GET) and attach again"})
            return
        yield item
