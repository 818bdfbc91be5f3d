"""The tool loop: a prompt goes to the model; its tool calls are validated, assessed,
approved (or not) and run; their results go back; until the model answers without a call.

Everything the loop does is stored as it happens (``AgentStore``), so a crash, a Stop or a
restart leaves a transcript that resumes: every tool call in it has a result, a reply
cut by Stop is kept with what had streamed.

Stop (``Agent.stop``, Ctrl+C in the terminal) is cooperative at every stage: it cancels
the model's stream (the server aborts the request), tells the running tool to give up
(``ToolContext.cancel``: the shell kills its process group) and kills background jobs;
calls that had not started get a "not run" result. A prompt typed while the agent works
(``Agent.queue``) is added between tool rounds, so the model sees it on its next call.
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from lodestar.agent import context as ctxmod
from lodestar.agent.client import ChatClient, Completion, ModelError, ToolCallRequest
from lodestar.agent.policy import AllowRule, Assessment, Decision, Mode, decide
from lodestar.agent.store import AgentStore, SessionInfo
from lodestar.agent.tools import (
    TOOLS,
    ToolContext,
    ToolResult,
    new_context,
    tool_schemas,
    validate_call,
)

NOT_RUN = "not run: the user stopped the agent before this call"
REPEATED = ("not run: this exact call already ran in your previous step and succeeded; do not repeat it. "
            "Continue with the next step of the task, or finish.")

# With tool_choice "required" every reply must be a tool call (the server's grammar forces
# one), which lets small models act reliably; this tool is then how a turn ends.
FINISH_TOOL = {"type": "function", "function": {
    "name": "finish",
    "description": "End your turn: give the user your final answer or report. Call it once the task is "
                   "done or when you need the user's input.",
    "parameters": {"type": "object", "properties": {"message": {"type": "string", "description":
                   "what to tell the user"}}, "required": ["message"], "additionalProperties": False}}}


@dataclass
class AgentConfig:
    mode: Mode = Mode.ASK
    rules: tuple[AllowRule, ...] = ()
    interactive: bool = True          # False: what would ask is denied (only --allow rules allow)
    max_rounds: int = 40              # model calls per prompt
    max_tokens: int = 2048            # per reply
    temperature: float | None = None
    tool_choice: str = "auto"         # "required": every reply is one tool call; `finish` ends the turn
    tool_plan: tuple[str, ...] = ()   # a prompt's first replies are forced calls of these tools, in order
    context: int | None = None        # tokens; None: ask the server (8192 when it cannot say)
    soft: float = 0.75
    hard: float = 0.92
    tail: float = 0.3
    shell_timeout: float = 120.0


@dataclass
class TurnStats:
    calls: int = 0                    # model calls
    tools: int = 0
    prompt_tokens: int = 0            # of the last call
    cached_tokens: int = 0            # of the last call
    output_tokens: int = 0            # over the turn
    first_ttft_s: float | None = None # the turn's first model call
    seconds: float = 0.0
    stopped: bool = False
    compactions: int = 0


class Frontend:
    """What the loop tells the user and asks them; the terminal UI, the HTTP API and tests
    implement it. The defaults print nothing and deny approvals."""

    def delta(self, kind: str, text: str) -> None:
        """A streamed piece of the reply: kind "content", "reasoning" or "tool" (a call's name)."""

    def assistant_done(self, completion: Completion) -> None:
        """A model call finished."""

    def tool_start(self, call: ToolCallRequest, assessment: Assessment | None, decision: Decision | None) -> None:
        """A tool call is about to run (or was refused: see tool_end)."""

    def tool_end(self, call: ToolCallRequest, result: ToolResult, decision: Decision | None) -> None:
        """A tool call's result (also for refused, denied and invalid calls)."""

    async def approve(self, call: ToolCallRequest, assessment: Assessment, decision: Decision) -> tuple[bool, str]:
        """Ask the user about a risky call: (allowed, reason)."""
        return False, "no one to ask"

    def status(self, message: str) -> None:
        """A one-line notice (compaction, a rebuilt context, a queued prompt taken)."""


class Agent:
    def __init__(self, client: ChatClient, store: AgentStore, session: SessionInfo, root: Path,
                 config: AgentConfig | None = None, frontend: Frontend | None = None, *,
                 instructions: str = "", skills: str = "", spill_dir: Path | None = None,
                 tools: list[str] | None = None) -> None:
        self.client, self.store, self.session = client, store, session
        self.root = Path(root).resolve()
        self.config = config or AgentConfig()
        self.frontend = frontend or Frontend()
        self.system = ctxmod.system_message(self.root, instructions, skills)
        self.tool_names = list(tools or TOOLS)
        if self.config.tool_choice not in ("auto", "required"):
            raise ValueError(f"tool_choice {self.config.tool_choice!r}: auto or required")
        self.tools = tool_schemas(self.tool_names)
        if self.config.tool_choice == "required":
            self.tools.append(FINISH_TOOL)
        known = {t["function"]["name"] for t in self.tools}
        if any(name not in known for name in self.config.tool_plan):
            raise ValueError(f"tool_plan {list(self.config.tool_plan)}: every name must be one of {sorted(known)}")
        spill = spill_dir or (Path(store.path).parent / "agent-spill" / session.id)
        self.ctx: ToolContext = new_context(self.root, spill)
        self.ctx.shell_timeout = self.config.shell_timeout
        self._queued: list[str] = []
        self._task: asyncio.Task | None = None
        self._stopping = False
        self._limits: ctxmod.ContextLimits | None = None
        self._last_count: int | None = None
        self._last_call: tuple[str, str] | None = None     # the previous tool call, to catch repeats

    # -- control from the UI ---------------------------------------------------------
    def queue(self, text: str) -> None:
        """A prompt typed while the agent works: the model sees it after the current round."""
        self._queued.append(text)

    def stop(self) -> None:
        """Stop whatever runs now (model stream, tool, background jobs); the turn returns."""
        self._stopping = True
        self.ctx.cancel.set()
        self.ctx.jobs.kill_all()
        if self._task is not None and not self._task.done():
            self._task.cancel()

    @property
    def busy(self) -> bool:
        return self._task is not None and not self._task.done()

    # -- one prompt ------------------------------------------------------------------
    async def run(self, prompt: str) -> TurnStats:
        """Run the tool loop for one user prompt until the model answers without tool calls,
        the round limit, an error or Stop."""
        self._stopping = False
        self.ctx.cancel.clear()
        stats = TurnStats()
        t0 = time.monotonic()
        self.store.add_message(self.session.id, "user", prompt)
        try:
            for r in range(self.config.max_rounds):
                if self._stopping:
                    break
                planned = self.config.tool_plan[r] if r < len(self.config.tool_plan) else None
                completion = await self._call_model(stats, planned)
                if completion is None:          # stopped mid-reply
                    break
                finished = False
                for i, call in enumerate(completion.tool_calls):
                    if call.name == FINISH_TOOL["function"]["name"] and self.config.tool_choice == "required":
                        finished = self._finish(call) or finished
                        continue
                    if self._stopping:
                        for rest in completion.tool_calls[i:]:
                            self._record_tool(rest, ToolResult(ok=False, content=NOT_RUN), None, 0.0)
                        break
                    await self._tool(call, stats)
                if not self._take_queued() and (finished or not completion.tool_calls):
                    break
            else:
                self.frontend.status(f"stopped after {self.config.max_rounds} model calls (--max-rounds)")
        except asyncio.CancelledError:
            if not self._stopping:
                raise
        finally:
            stats.stopped = self._stopping
            stats.seconds = time.monotonic() - t0
            self.store.update_session(self.session.id)
        return stats

    def _finish(self, call: ToolCallRequest) -> bool:
        """The `finish` call of a required-tool turn: its message is the answer."""
        try:
            message = json.loads(call.arguments).get("message")
        except (json.JSONDecodeError, AttributeError):
            message = None
        if not isinstance(message, str):
            self._record_tool(call, ToolResult(ok=False, content='error: finish takes {"message": "..."}'),
                              None, 0.0)
            return False
        self.frontend.delta("content", message + "\n")
        self._record_tool(call, ToolResult(ok=True, content="turn finished"), None, 0.0)
        return True

    def _take_queued(self) -> bool:
        """Store the prompts typed meanwhile as user messages; True when there were any."""
        taken = bool(self._queued) and not self._stopping
        while self._queued and not self._stopping:
            text = self._queued.pop(0)
            self.frontend.status(f"queued prompt added: {text[:60]}")
            self.store.add_message(self.session.id, "user", text)
        return taken

    async def call(self, chat: list[dict], **kwargs) -> Completion:
        """One model call that Stop can cancel (raises CancelledError then)."""
        self._task = asyncio.ensure_future(self.client.complete(chat, **kwargs))
        try:
            return await self._task
        finally:
            self._task = None

    # -- the model -------------------------------------------------------------------
    async def messages(self, stats: TurnStats | None = None) -> list[dict]:
        """The next call's messages: system + marker + tail, compacted to fit."""
        limits = await self.limits()
        chat = self._render()
        n = await self._count(chat)
        if n > limits.soft_tokens:
            if await self.compact(limits):
                if stats is not None:
                    stats.compactions += 1
                chat = self._render()
                n = await self._count(chat)
        if n > limits.hard_tokens:
            for _ in range(6):          # cut long outputs in the rendered copy until it fits
                chat = ctxmod.cut_to_fit(chat, int((n - limits.hard_tokens) * 3.5) + 400)
                n = await self._count(chat)
                if n <= limits.hard_tokens:
                    break
            else:
                raise ModelError(f"the conversation needs {n} tokens even after compaction; the context "
                                 f"allows {limits.hard_tokens} before the reply: start a new session")
        self._last_count = n
        return chat

    def _render(self) -> list[dict]:
        return [self.system] + ctxmod.to_chat(self.store.context_messages(self.session.id))

    async def _count(self, chat: list[dict]) -> int:
        exact = await self.client.count_tokens(chat, self.tools)
        return exact if exact is not None else ctxmod.estimate_tokens(chat, self.tools)

    async def limits(self) -> ctxmod.ContextLimits:
        if self._limits is None:
            context = self.config.context or await self.client.context_length() or 8192
            reply = min(self.config.max_tokens, context // 4)
            self._limits = ctxmod.ContextLimits(context, reply, self.config.soft, self.config.hard,
                                                self.config.tail)
        return self._limits

    async def _call_model(self, stats: TurnStats, planned: str | None = None) -> Completion | None:
        chat = await self.messages(stats)
        limits = await self.limits()
        streamed: dict[str, str] = {"content": "", "reasoning": ""}

        def on_delta(kind: str, text: str) -> None:
            if kind in streamed:
                streamed[kind] += text
            self.frontend.delta(kind, text)

        max_tokens = max(16, min(self.config.max_tokens, limits.context - (self._last_count or 0) - 8))
        try:
            choice = {"type": "function", "function": {"name": planned}} if planned else \
                "required" if self.config.tool_choice == "required" else None
            completion = await self.call(chat, tools=self.tools, max_tokens=max_tokens,
                                         temperature=self.config.temperature, on_delta=on_delta,
                                         tool_choice=choice, parallel_tool_calls=False if choice else None)
        except asyncio.CancelledError:
            if not self._stopping:
                raise
            if streamed["content"] or streamed["reasoning"]:
                self.store.add_message(self.session.id, "assistant", streamed["content"],
                                       meta={"stopped": True, "reasoning": streamed["reasoning"] or None})
            return None
        stats.calls += 1
        stats.prompt_tokens, stats.cached_tokens = completion.prompt_tokens, completion.cached_tokens
        stats.output_tokens += completion.completion_tokens
        if stats.first_ttft_s is None:
            stats.first_ttft_s = completion.ttft_s
        calls = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                 for c in completion.tool_calls]
        self.store.add_message(
            self.session.id, "assistant", completion.content, tool_calls=calls or None,
            tokens_in=completion.prompt_tokens, tokens_cached=completion.cached_tokens,
            tokens_out=completion.completion_tokens, duration_ms=int(completion.duration_s * 1000),
            meta={"finish_reason": completion.finish_reason, "ttft_ms": _ms(completion.ttft_s),
                  "reasoning": completion.reasoning or None})
        self.frontend.assistant_done(completion)
        return completion

    # -- tools -----------------------------------------------------------------------
    async def _tool(self, call: ToolCallRequest, stats: TurnStats) -> None:
        t0 = time.monotonic()
        checked = validate_call(call.name, call.arguments)
        if isinstance(checked, ToolResult):            # unknown tool, bad JSON, schema violation
            self.frontend.tool_start(call, None, None)
            self._record_tool(call, checked, None, time.monotonic() - t0)
            return
        tool, args = checked
        key = (tool.name, json.dumps(args, sort_keys=True))
        if key == self._last_call and tool.kind == "write":
            # small models repeat a write they just made; running it again changes nothing
            self.frontend.tool_start(call, None, None)
            self._record_tool(call, ToolResult(ok=False, content=REPEATED), None, time.monotonic() - t0)
            return
        assessment = tool.assess(args, self.ctx)
        decision = decide(self.config.mode, tool.name, args, assessment, self.config.rules,
                          interactive=self.config.interactive)
        approval = {"action": decision.action, "reason": decision.reason, "by": "policy"}
        if decision.action == "ask":
            allowed, reason = await self.frontend.approve(call, assessment, decision)
            approval = {"action": "allow" if allowed else "deny", "reason": reason, "by": "user"}
            decision = Decision("allow" if allowed else "deny", reason)
        self.frontend.tool_start(call, assessment, decision)
        if decision.action != "allow":
            why = assessment.refused or decision.reason
            result = ToolResult(ok=False, content=f"denied: {why}. Do not retry this call as is.")
        elif self._stopping:
            result = ToolResult(ok=False, content=NOT_RUN)
        else:
            stats.tools += 1
            # the tool runs in a worker thread; Stop reaches it through ctx.cancel, and the
            # loop waits for it to return so its result (partial output) is recorded
            work = asyncio.ensure_future(asyncio.to_thread(tool.run, args, self.ctx))
            try:
                result = await asyncio.shield(work)
            except asyncio.CancelledError:
                self.ctx.cancel.set()
                result = await work
        self._last_call = key if result.ok else None
        self._record_tool(call, result, approval, time.monotonic() - t0)

    def _record_tool(self, call: ToolCallRequest, result: ToolResult, approval: dict | None, seconds: float) -> None:
        meta = {"ok": result.ok}
        if result.data:
            meta["data"] = result.data
        self.store.add_message(self.session.id, "tool", result.content, tool_call_id=call.id, name=call.name,
                               duration_ms=int(seconds * 1000), approval=approval, meta=meta)
        self.frontend.tool_end(call, result, None if approval is None else
                               Decision(approval["action"], approval["reason"]))

    # -- compaction ------------------------------------------------------------------
    async def compact(self, limits: ctxmod.ContextLimits | None = None) -> bool:
        """Summarize everything before the verbatim tail into a marker. False when there is
        nothing before the tail to summarize."""
        limits = limits or await self.limits()
        msgs = self.store.context_messages(self.session.id)
        start = ctxmod.split_tail(msgs, int(limits.context * limits.tail))
        head = msgs[:start]
        if not head or (len(head) == 1 and head[0].role == "marker"):
            return False
        words = max(100, min(600, limits.context // 20))
        budget_chars = int((limits.context - words * 2 - 600) * 3.0)
        prompt = [{"role": "system", "content": ctxmod.SUMMARY_PROMPT.format(words=words)},
                  {"role": "user", "content": ctxmod.transcript_text(head, budget_chars)}]
        self.frontend.status(f"compacting: summarizing {len(head)} messages, keeping the last {len(msgs) - start}")
        try:
            summary = (await self.call(prompt, max_tokens=words * 2, temperature=0.0)).content.strip()
        except ModelError as e:
            summary = ""
            self.frontend.status(f"the model could not summarize ({e}); keeping a list of the requests instead")
        if not summary:
            asks = [m.content for m in head if m.role == "user"]
            summary = "(The model wrote no summary.) Requests so far:\n" + "\n".join(f"- {a[:300]}" for a in asks)
        self.store.add_marker(self.session.id, summary, upto_seq=head[-1].seq)
        return True


def _ms(seconds: float | None) -> int | None:
    return None if seconds is None else int(seconds * 1000)


# -- loop runs ----------------------------------------------------------------------
REPORT_SCHEMA = {
    "type": "object",
    "properties": {
        "status": {"type": "string", "enum": ["done", "blocked", "failed", "continue"]},
        "summary": {"type": "string"},
        "next_steps": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["status", "summary", "next_steps"],
    "additionalProperties": False,
}

REPORT_PROMPT = """This round is over. Report on it as JSON: "status" is "done" when the task is
complete, "blocked" when you need something you cannot get (say what), "failed" when it
cannot be done, "continue" when more rounds would finish it; "summary" says what this round
did; "next_steps" lists what the next round should do first."""


@dataclass
class RoundReport:
    round: int
    session_id: str
    status: str
    summary: str
    next_steps: list[str] = field(default_factory=list)
    stats: TurnStats | None = None


def round_prompt(task: str, previous: RoundReport | None, round_no: int, rounds: int) -> str:
    text = f"Task (round {round_no} of at most {rounds}; each round starts from a fresh context):\n{task}"
    if previous is not None:
        report = {"status": previous.status, "summary": previous.summary, "next_steps": previous.next_steps}
        text += ("\n\nThe previous round's report:\n" + json.dumps(report, indent=2, ensure_ascii=False) +
                 "\nThe project's files show its work; check them rather than trusting the report blindly.")
    return text


async def request_report(agent: Agent) -> tuple[dict | None, str]:
    """Ask for the round's report under the JSON schema (the server's structured output);
    validated here too, one retry. Returns (report, error)."""
    import jsonschema
    chat = await agent.messages() + [{"role": "user", "content": REPORT_PROMPT}]
    fmt = {"type": "json_schema", "json_schema": {"name": "round_report", "schema": REPORT_SCHEMA, "strict": True}}
    error = ""
    for _ in range(2):
        try:
            c = await agent.call(chat, response_format=fmt, max_tokens=512, temperature=0.0)
            report = json.loads(c.content)
            jsonschema.validate(report, REPORT_SCHEMA)
            return report, ""
        except (json.JSONDecodeError, jsonschema.ValidationError) as e:
            error = f"the report was not valid JSON for the schema: {str(e).splitlines()[0][:200]}"
        except ModelError as e:
            error = str(e)
    return None, error


async def loop_run(new_agent, task: str, rounds: int, on_report=None) -> list[RoundReport]:
    """Ralph loop: up to ``rounds`` rounds, each a fresh session (``new_agent(round)`` makes
    its Agent) given the task and the previous round's validated report; stops on done,
    blocked, failed, Stop or the limit."""
    reports: list[RoundReport] = []
    previous: RoundReport | None = None
    for r in range(1, rounds + 1):
        agent: Agent = new_agent(r)
        stats = await agent.run(round_prompt(task, previous, r, rounds))
        if stats.stopped:
            rep = RoundReport(r, agent.session.id, "stopped", "stopped by the user", [], stats)
        else:
            try:
                report, error = await request_report(agent)
            except asyncio.CancelledError:
                report, error = None, "stopped"
            if report is None:
                status = "stopped" if agent._stopping else "failed"
                rep = RoundReport(r, agent.session.id, status, f"no valid report: {error}", [], stats)
            else:
                rep = RoundReport(r, agent.session.id, report["status"], report["summary"],
                                  list(report["next_steps"]), stats)
        agent.store.add_message(agent.session.id, "assistant", json.dumps(
            {"status": rep.status, "summary": rep.summary, "next_steps": rep.next_steps}, ensure_ascii=False),
            meta={"report": True, "round": r})
        reports.append(rep)
        if on_report is not None:
            on_report(rep)
        if rep.status != "continue":
            break
        previous = rep
    return reports
