"""`lodestar agent`: options, sessions, and the three ways to run (interactive, one prompt
with ``-p``, loop runs). The model connection is made by the caller (``lodestar.cli``):
the local engine in this process, or ``--base-url``.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from lodestar.agent.args import add_agent_args  # noqa: F401  (the CLI's options, re-exported)
from lodestar.agent.client import ChatClient, ModelError
from lodestar.agent.instructions import (
    find_skills,
    load_instructions,
    render_instructions,
    render_skills,
)
from lodestar.agent.loop import Agent, AgentConfig, Frontend, RoundReport, loop_run
from lodestar.agent.policy import AllowRule, Mode
from lodestar.agent.store import AgentStore, SessionInfo, StoreError, default_db_path
from lodestar.agent.tui import PlainFrontend, TerminalFrontend, interactive, turn_line


class AgentUsageError(Exception):
    """Bad options or a session that cannot be used: one line for the user (exit 2)."""


@dataclass
class Connection:
    client: ChatClient
    label: str                      # the model as sessions record it
    kv_identity: str | None         # the local engine's KV checkpoint identity (None for --base-url)
    context: int | None = None


def parse_rules(texts: list[str]) -> tuple[AllowRule, ...]:
    try:
        return tuple(AllowRule.parse(t) for t in texts)
    except ValueError as e:
        raise AgentUsageError(f"--allow: {e}") from None


def project_root(text: str) -> Path:
    root = Path(text).expanduser()
    if not root.is_dir():
        raise AgentUsageError(f"--project {text}: not a folder")
    return root.resolve()


def open_store(a: argparse.Namespace) -> AgentStore:
    try:
        return AgentStore(a.db or default_db_path())
    except StoreError as e:
        raise AgentUsageError(str(e)) from None


def list_sessions(a: argparse.Namespace, out=None) -> int:
    out = out or sys.stdout
    store = open_store(a)
    try:
        project = None if a.all else str(project_root(a.project))
        rows = store.sessions(project, limit=a.limit)
    finally:
        store.close()
    if not rows:
        out.write("no sessions" + ("" if project is None else f" for {project} (--all lists every project)") + "\n")
        return 0
    for s in rows:
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(s.last_used))
        where = "" if project is not None else f"  {s.project}"
        out.write(f"{s.id}  {when}  {s.message_count:4d} msgs  {s.mode:9s}  {s.title}{where}\n")
    return 0


def _session(store: AgentStore, a: argparse.Namespace, root: Path, conn: Connection, mode: Mode,
             notice) -> SessionInfo:
    resume = getattr(a, "resume", None)
    if resume is None:
        return store.create_session(str(root), conn.label, mode.value)
    try:
        s = store.session(resume) if resume != "last" else store.latest(str(root))
    except StoreError as e:
        raise AgentUsageError(str(e)) from None
    if s is None:
        raise AgentUsageError(f"no session to resume in {root}; `lodestar agent sessions` lists them")
    if Path(s.project) != root:
        raise AgentUsageError(f"session {s.id} belongs to {s.project}, not {root}: run it there "
                              f"(--project {s.project})")
    if s.kv_identity and conn.kv_identity and s.kv_identity != conn.kv_identity:
        notice("the KV checkpoint of this session was made with another model or engine settings; "
               "the context is rebuilt from the transcript (one full prefill)")
    if s.model != conn.label:
        notice(f"this session ran on {s.model}; it continues on {conn.label}")
    store.update_session(s.id, mode=mode.value, model=conn.label)
    return s


def build_agent(a: argparse.Namespace, store: AgentStore, conn: Connection, frontend: Frontend,
                session: SessionInfo | None = None, interactive_run: bool = True, notice=None) -> Agent:
    root = project_root(a.project)
    mode = Mode(a.mode or "ask")
    rules = parse_rules(a.allow)
    if session is None:
        session = _session(store, a, root, conn, mode, notice or frontend.status)
    if conn.kv_identity:
        store.update_session(session.id, kv_identity=conn.kv_identity)
    instructions = render_instructions(load_instructions(root, Path.cwd() if _inside(Path.cwd(), root) else None))
    skills = render_skills(find_skills(root), root)
    config = AgentConfig(mode=mode, rules=rules, interactive=interactive_run, max_rounds=a.max_rounds,
                         max_tokens=a.max_tokens, temperature=a.temperature, tool_choice=a.tool_choice,
                         tool_plan=tuple(t.strip() for t in (a.tool_plan or "").split(",") if t.strip()),
                         context=a.context or conn.context,
                         shell_timeout=a.shell_timeout)
    try:
        return Agent(conn.client, store, session, root, config, frontend, instructions=instructions,
                     skills=skills, tools=tool_list(a.tools))
    except ValueError as e:
        raise AgentUsageError(f"--tool-plan: {e}") from None


def _all_tools():
    from lodestar.agent.tools import TOOLS
    return TOOLS


def tool_list(text: str | None) -> list[str] | None:
    TOOLS = _all_tools()
    if text is None:
        return None
    names = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [n for n in names if n not in TOOLS]
    if unknown or not names:
        raise AgentUsageError(f"--tools {text}: unknown {', '.join(unknown) or 'empty list'}; "
                              f"known: {', '.join(TOOLS)}")
    return names


def _inside(path: Path, root: Path) -> bool:
    try:
        path.resolve().relative_to(root)
        return True
    except ValueError:
        return False


def _check(a: argparse.Namespace) -> None:
    for flag, value in (("--max-rounds", a.max_rounds), ("--max-tokens", a.max_tokens)):
        if value < 1:
            raise AgentUsageError(f"{flag} {value}: must be at least 1")
    if a.context is not None and a.context < 512:
        raise AgentUsageError(f"--context {a.context}: must be at least 512")
    if not 0.0 <= a.temperature <= 2.0:
        raise AgentUsageError(f"--temperature {a.temperature}: must be in [0, 2]")
    if a.shell_timeout <= 0:
        raise AgentUsageError(f"--shell-timeout {a.shell_timeout}: must be positive")
    project_root(a.project)
    parse_rules(a.allow)
    names = tool_list(a.tools) or list(_all_tools())
    if a.tool_choice == "required":
        names.append("finish")
    for t in (a.tool_plan or "").split(","):
        if t.strip() and t.strip() not in names:
            raise AgentUsageError(f"--tool-plan {a.tool_plan}: {t.strip()} is not among the tools "
                                  f"({', '.join(names)}; finish comes with --tool-choice required)")


def check_args(a: argparse.Namespace) -> None:
    """Everything that can be checked before a model loads."""
    _check(a)
    if getattr(a, "rounds", 1) < 1:
        raise AgentUsageError(f"--rounds {a.rounds}: must be at least 1")


async def _with_client(conn: Connection, coro):
    try:
        return await coro
    finally:
        await conn.client.aclose()


def run_agent(a: argparse.Namespace, conn: Connection) -> int:
    """`lodestar agent [-p PROMPT]`: interactive on a terminal, one prompt otherwise."""
    store = open_store(a)
    try:
        if a.prompt is not None or not sys.stdin.isatty():
            prompt = sys.stdin.read() if a.prompt in (None, "-") else a.prompt
            if not prompt.strip():
                raise AgentUsageError("no prompt: pass -p TEXT or pipe one in")
            frontend = PlainFrontend()
            agent = build_agent(a, store, conn, frontend, interactive_run=False)
            stats = asyncio.run(_with_client(conn, _one(agent, prompt)))
            sys.stderr.write(f"[session {agent.session.id} · {turn_line(stats)}]\n")
            return 130 if stats.stopped else 0
        frontend = TerminalFrontend()
        agent = build_agent(a, store, conn, frontend)
        history = store.path.parent / "agent-history"
        banner = (f"lodestar agent · {conn.label} · {agent.root} · mode {agent.config.mode.value} · "
                  f"session {agent.session.id}\nCtrl+C stops a run, Ctrl+D quits, /compact compacts.")
        for m in store.messages(agent.session.id)[-6:]:
            if m.role in ("user", "assistant") and m.content:
                frontend.say(f"{'you' if m.role == 'user' else 'agent'}: {m.content[:300]}", "#999999")
        return asyncio.run(_with_client(conn, interactive(agent, banner, str(history))))
    except (ModelError, StoreError) as e:
        raise AgentUsageError(str(e)) from None
    finally:
        store.close()


async def _one(agent: Agent, prompt: str):
    import signal
    loop = asyncio.get_running_loop()
    try:
        loop.add_signal_handler(signal.SIGINT, agent.stop)
    except (NotImplementedError, RuntimeError):
        pass
    return await agent.run(prompt)


def run_loop(a: argparse.Namespace, conn: Connection) -> int:
    """`lodestar agent loop --rounds N TASK`."""
    store = open_store(a)
    frontend = PlainFrontend()
    root = project_root(a.project)
    mode = Mode(a.mode or "ask")
    agents: list[Agent] = []

    def new_agent(r: int) -> Agent:
        s = store.create_session(str(root), conn.label, mode.value)
        store.update_session(s.id, title=f"loop r{r}: {a.task}"[:60])
        frontend.status(f"round {r}/{a.rounds} · session {s.id}")
        agent = build_agent(a, store, conn, frontend, session=s, interactive_run=False)
        agents.append(agent)
        return agent

    def on_report(rep: RoundReport) -> None:
        frontend.status(f"round {rep.round}: {rep.status} · {rep.summary[:200]}")

    async def main():
        import signal
        loop = asyncio.get_running_loop()
        try:
            loop.add_signal_handler(signal.SIGINT, lambda: agents and agents[-1].stop())
        except (NotImplementedError, RuntimeError):
            pass
        return await loop_run(new_agent, a.task, a.rounds, on_report)

    try:
        reports = asyncio.run(_with_client(conn, main()))
    except (ModelError, StoreError) as e:
        raise AgentUsageError(str(e)) from None
    finally:
        store.close()
    final = reports[-1] if reports else None
    summary = {"rounds": [{"round": r.round, "session": r.session_id, "status": r.status, "summary": r.summary,
                           "next_steps": r.next_steps} for r in reports],
               "status": final.status if final else "none"}
    if a.json:
        Path(a.json).write_text(json.dumps(summary, indent=2, ensure_ascii=False) + "\n")
    print(json.dumps(summary["rounds"][-1] if reports else summary, ensure_ascii=False))
    return {"done": 0, "continue": 0}.get(summary["status"], 3 if summary["status"] != "stopped" else 130)


def env_api_key(a: argparse.Namespace) -> str | None:
    return a.api_key or os.environ.get("LODESTAR_API_KEY") or None
