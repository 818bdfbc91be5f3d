"""The terminal front ends: an interactive session (prompt_toolkit) and a plain one for
non-interactive runs (``lodestar agent -p``, loop runs, pipes).

prompt_toolkit is the line editor of the Python terminal tools people already use
(IPython, ptpython, aider): history, editing, and a prompt that stays usable while output
streams above it (``patch_stdout``), which is what lets a prompt typed during a run be
queued, and Ctrl+C stop the run without killing the program.
"""
from __future__ import annotations

import asyncio
import sys
from typing import TextIO

from lodestar.agent.client import Completion, ToolCallRequest
from lodestar.agent.loop import Agent, Frontend, TurnStats
from lodestar.agent.policy import Assessment, Decision
from lodestar.agent.tools import ToolResult

MAX_DISPLAY_LINES = 40


def _args_line(call: ToolCallRequest, width: int = 100) -> str:
    text = call.arguments.replace("\n", "\\n")
    return text if len(text) <= width else text[:width - 3] + "..."


def _head(text: str, lines: int = 6) -> str:
    rows = text.splitlines()
    more = f"\n    ... {len(rows) - lines} more lines" if len(rows) > lines else ""
    return "\n".join("    " + r for r in rows[:lines]) + more


def turn_line(stats: TurnStats) -> str:
    parts = [f"{stats.calls} model call{'s' * (stats.calls != 1)}", f"{stats.tools} tool{'s' * (stats.tools != 1)}",
             f"{stats.output_tokens} tokens out"]
    if stats.prompt_tokens:
        parts.append(f"context {stats.prompt_tokens} ({stats.cached_tokens} cached)")
    if stats.first_ttft_s is not None:
        parts.append(f"first token {stats.first_ttft_s * 1000:.0f} ms")
    parts.append(f"{stats.seconds:.1f} s")
    if stats.compactions:
        parts.append(f"compacted {stats.compactions}x")
    return ("stopped · " if stats.stopped else "") + " · ".join(parts)


class PlainFrontend(Frontend):
    """Streams the reply to ``out`` and notes tool calls on ``err``; approvals follow the
    rules only (non-interactive runs deny what they do not allow)."""

    def __init__(self, out: TextIO | None = None, err: TextIO | None = None, verbose: bool = True) -> None:
        self.out, self.err, self.verbose = out or sys.stdout, err or sys.stderr, verbose
        self._open = False

    def delta(self, kind: str, text: str) -> None:
        if kind == "content":
            self.out.write(text)
            self.out.flush()
            self._open = not text.endswith("\n")

    def _newline(self) -> None:
        if self._open:
            self.out.write("\n")
            self.out.flush()
            self._open = False

    def assistant_done(self, completion: Completion) -> None:
        self._newline()

    def tool_start(self, call, assessment, decision) -> None:
        if self.verbose:
            self.err.write(f"-> {call.name} {_args_line(call)}\n")

    def tool_end(self, call, result: ToolResult, decision) -> None:
        if self.verbose:
            mark = "ok" if result.ok else "error"
            self.err.write(f"   {mark}: {result.content.splitlines()[0][:160] if result.content else ''}\n")
            self.err.flush()

    def status(self, message: str) -> None:
        self._newline()
        self.err.write(f"[{message}]\n")
        self.err.flush()


class TerminalFrontend(Frontend):
    """The interactive session's output and approval questions (see ``interactive``)."""

    def __init__(self) -> None:
        from prompt_toolkit import print_formatted_text
        from prompt_toolkit.formatted_text import FormattedText
        self._print, self._ft = print_formatted_text, FormattedText
        self._line = ""                           # streamed text not yet printed (printing is by line)
        self.pending: asyncio.Future | None = None
        self.invalidate = lambda: None

    def say(self, text: str, style: str = "") -> None:
        self._print(self._ft([(style, text)]))

    def delta(self, kind: str, text: str) -> None:
        if kind == "tool":
            return
        style = "#888888 italic" if kind == "reasoning" else ""
        self._line += text
        while "\n" in self._line:
            line, self._line = self._line.split("\n", 1)
            self.say(line, style)

    def end_line(self) -> None:
        """Print the streamed text still waiting for its newline (a reply done, or cut by Stop:
        kept back, it would be glued onto the next reply)."""
        if self._line:
            self.say(self._line)
            self._line = ""

    def assistant_done(self, completion: Completion) -> None:
        self.end_line()

    def tool_start(self, call, assessment: Assessment | None, decision: Decision | None) -> None:
        self.end_line()
        self.say(f"▸ {call.name} {_args_line(call)}", "bold ansicyan")

    def tool_end(self, call, result: ToolResult, decision: Decision | None) -> None:
        if not result.ok:
            self.say(f"  ✗ {result.content.splitlines()[0][:200] if result.content else 'failed'}", "ansired")
            return
        shown = result.display or result.content
        rows = shown.splitlines()
        for r in rows[:MAX_DISPLAY_LINES if result.display else 4]:
            style = "ansigreen" if r.startswith("+") else "ansired" if r.startswith("-") else "#999999"
            self.say("  " + r, style if result.display else "#999999")
        limit = MAX_DISPLAY_LINES if result.display else 4
        if len(rows) > limit:
            self.say(f"  ... {len(rows) - limit} more lines", "#999999")

    async def approve(self, call, assessment: Assessment, decision: Decision) -> tuple[bool, str]:
        risks = ", ".join(sorted(assessment.risks)) or assessment.kind
        self.say(f"? approve {assessment.summary or call.name}  [{risks}]: {decision.reason}", "bold ansiyellow")
        self.say("  y = allow once, n = deny (add a reason after n to tell the model why)", "ansiyellow")
        self.pending = asyncio.get_running_loop().create_future()
        self.invalidate()
        try:
            answer: str = await self.pending
        finally:
            self.pending = None
            self.invalidate()
        a = answer.strip()
        if a.lower() in ("y", "yes"):
            return True, "allowed once by the user"
        reason = a[1:].strip() if a[:1].lower() == "n" else a
        return False, f"denied by the user{': ' + reason if reason else ''}"

    def status(self, message: str) -> None:
        self.say(f"· {message}", "#999999")


async def interactive(agent: Agent, banner: str, history_file: str | None = None) -> int:
    """The session of an agent built with a ``TerminalFrontend``: type a prompt, watch the work,
    answer approvals; Ctrl+C stops a run (twice at an empty prompt quits), Ctrl+D quits. Lines
    typed during a run are queued."""
    from prompt_toolkit import PromptSession
    from prompt_toolkit.history import FileHistory, InMemoryHistory
    from prompt_toolkit.patch_stdout import patch_stdout

    frontend = agent.frontend
    if not isinstance(frontend, TerminalFrontend):
        raise TypeError("interactive() needs an agent built with a TerminalFrontend")
    session = PromptSession(history=FileHistory(history_file) if history_file else InMemoryHistory())
    frontend.invalidate = lambda: session.app.invalidate() if session.app.is_running else None
    run: asyncio.Task | None = None

    def message() -> str:
        if frontend.pending is not None:
            return "allow? [y/n] "
        return "… " if run is not None and not run.done() else "› "

    def finished(task: asyncio.Task) -> None:
        frontend.end_line()
        if task.cancelled():
            return
        if task.exception() is not None:
            frontend.say(f"error: {task.exception()}", "ansired")
        else:
            frontend.say(turn_line(task.result()), "#999999")

    frontend.say(banner, "bold")
    interrupts = 0
    with patch_stdout(raw=True):
        while True:
            try:
                text = await session.prompt_async(message)
            except KeyboardInterrupt:
                if frontend.pending is not None:
                    frontend.pending.set_result("n stopped")
                if run is not None and not run.done():
                    agent.stop()
                    frontend.status("stopping ...")
                    interrupts = 0
                    continue
                interrupts += 1
                if interrupts >= 2:
                    break
                frontend.status("Ctrl+C again (or Ctrl+D) to quit")
                continue
            except EOFError:
                break
            interrupts = 0
            if frontend.pending is not None and not frontend.pending.done():
                frontend.pending.set_result(text)
                continue
            text = text.strip()
            if not text:
                continue
            if text in ("/quit", "/exit"):
                break
            if text == "/compact":
                if run is None or run.done():
                    done = await agent.compact()
                    frontend.status("compacted" if done else "nothing to compact yet")
                continue
            if run is not None and not run.done():
                agent.queue(text)
                frontend.status("queued: the agent reads it after the current step")
                continue
            run = asyncio.ensure_future(agent.run(text))
            run.add_done_callback(finished)
        if run is not None and not run.done():
            agent.stop()
            await asyncio.gather(run, return_exceptions=True)
    return 0
