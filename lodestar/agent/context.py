"""What the model sees: the system prompt, the stored transcript as chat messages, and
compaction when the conversation outgrows the context.

Compaction keeps the newest messages verbatim (the tail) and replaces everything before
them with a model-written summary stored as a durable marker (``AgentStore.add_marker``),
so a rebuild is always marker + tail + later messages, after a restart too. Two
thresholds, as fractions of the context: past ``soft`` the agent compacts before its next
call; ``hard`` must hold for every call, so what still does not fit after compaction is
cut (longest tool outputs first) in the rendered messages only: the store keeps every
byte.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from lodestar.agent.store import StoredMessage

SYSTEM_PROMPT = """You are a coding agent working inside one project folder: {root}.
You act through the tools you are given; paths are relative to the project root, and
nothing outside it can be read or written. Before changing a file, read the part you change.
Prefer `edit` (exact-string replacement) over rewriting whole files. Run the project's tests
or the program with `shell` when that checks your work. Keep the user informed in a few
words, and when the task is done, say what you changed.
Some actions need the user's approval; when one is denied, do not retry it the same way:
choose another approach or ask the user."""

SUMMARY_PROMPT = """You compress the history of a coding session so the work can continue in a
fresh context. Write a summary of at most {words} words covering: the user's requests and
constraints, what was done (files read, created or changed, commands run and their
outcomes), decisions and their reasons, and what remains open. Keep exact file paths,
names and error messages. Do not invent anything."""

SUMMARY_HEADER = "[Summary of the earlier part of this session, written when it was compacted]\n"
CUT_NOTE = "\n[... {n} characters cut to fit the context; the full text is in the session store]"


@dataclass
class ContextLimits:
    context: int                 # the model's context in tokens
    reply: int                   # tokens kept free for the next reply
    soft: float = 0.75
    hard: float = 0.92
    tail: float = 0.3            # share of the context the verbatim tail may take

    @property
    def soft_tokens(self) -> int:
        return int(self.context * self.soft) - self.reply

    @property
    def hard_tokens(self) -> int:
        return int(self.context * self.hard) - self.reply


def system_message(root: Path, instructions: str = "", skills: str = "") -> dict:
    parts = [SYSTEM_PROMPT.format(root=root)]
    parts += [p for p in (instructions, skills) if p]
    return {"role": "system", "content": "\n\n".join(parts)}


def to_chat(messages: list[StoredMessage]) -> list[dict]:
    """Stored messages -> OpenAI chat messages (a marker becomes a user message carrying the
    summary). Tool results whose call is not in the list are dropped, as are calls left
    without results, so the list is always one a server accepts."""
    out: list[dict] = []
    answered = {m.tool_call_id for m in messages if m.role == "tool"}
    called: set[str] = set()
    for m in messages:
        if m.role == "marker":
            out.append({"role": "user", "content": SUMMARY_HEADER + m.content})
        elif m.role == "assistant":
            msg: dict = {"role": "assistant", "content": m.content or ""}
            calls = [c for c in (m.tool_calls or []) if c.get("id") in answered]
            if calls:
                msg["tool_calls"] = calls
                called.update(c["id"] for c in calls)
                if not m.content:
                    msg["content"] = None
            if msg["content"] or calls:
                out.append(msg)
        elif m.role == "tool":
            if m.tool_call_id in called:
                out.append({"role": "tool", "tool_call_id": m.tool_call_id, "content": m.content})
        elif m.role in ("user", "system"):
            out.append({"role": m.role, "content": m.content})
    return out


def estimate_tokens(messages: list[dict], tools: list[dict] | None = None) -> int:
    """A rough count (about 3.5 characters a token, plus per-message overhead), for servers
    that cannot count exactly."""
    chars = len(json.dumps(tools)) if tools else 0
    for m in messages:
        chars += len(m.get("content") or "") + 16
        for c in m.get("tool_calls") or []:
            chars += len(c["function"]["name"]) + len(c["function"]["arguments"]) + 16
    return int(chars / 3.5) + 8


def split_tail(messages: list[StoredMessage], budget_tokens: int) -> int:
    """Index where the verbatim tail starts: as many of the newest messages as fit
    ``budget_tokens`` (estimated), starting at a user or assistant message so no tool
    result is parted from its call. 0 means nothing can be compacted."""
    used, start = 0, len(messages)
    for i in range(len(messages) - 1, -1, -1):
        used += estimate_tokens(to_chat([messages[i]]) or [{"content": messages[i].content}])
        if used > budget_tokens:
            break
        start = i
    while start < len(messages) and messages[start].role == "tool":
        start += 1
    if start >= len(messages):          # the newest message alone is over budget: keep just it
        start = len(messages) - 1
        while start > 0 and messages[start].role == "tool":
            start -= 1
    return start


def transcript_text(messages: list[StoredMessage], max_chars: int) -> str:
    """The messages to summarize as plain text, newest kept when it is too long (the first
    user request is kept too: it states the task)."""
    lines = []
    for m in messages:
        if m.role == "marker":
            lines.append(f"Earlier summary:\n{m.content}")
        elif m.role == "tool":
            body = m.content if len(m.content) <= 2000 else m.content[:1000] + "\n[...]\n" + m.content[-800:]
            lines.append(f"Tool result ({m.name or 'tool'}):\n{body}")
        else:
            text = m.content or ""
            for c in m.tool_calls or []:
                text += f"\n-> {c['function']['name']}({c['function']['arguments'][:600]})"
            lines.append(f"{m.role.capitalize()}: {text}")
    text = "\n\n".join(lines)
    if len(text) <= max_chars:
        return text
    first = next((l for l in lines if l.startswith("User: ")), "")[:max_chars // 4]
    keep = max_chars - len(first) - 40
    return first + "\n\n[... middle of the session omitted ...]\n\n" + text[-keep:]


def cut_to_fit(messages: list[dict], over_chars: int) -> list[dict]:
    """Shorten the longest tool results (then assistant texts) of the rendered messages by about
    ``over_chars`` in all; the system message and the last message stay whole."""
    out = [dict(m) for m in messages]
    candidates = sorted(range(1, len(out) - 1), key=lambda i: (out[i]["role"] != "tool",
                                                               -len(out[i].get("content") or "")))
    for i in candidates:
        if over_chars <= 0:
            break
        text = out[i].get("content") or ""
        if len(text) < 400:
            continue
        keep = max(200, len(text) - over_chars - 100)
        cut = len(text) - keep
        out[i]["content"] = text[:keep] + CUT_NOTE.format(n=cut)
        over_chars -= cut
    return out
