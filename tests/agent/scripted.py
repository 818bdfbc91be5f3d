"""A scripted model for agent tests: each ``complete`` call takes the next scripted reply."""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field

from lodestar.agent.client import Completion, ToolCallRequest


def call(name: str, id: str = "c1", **args) -> ToolCallRequest:
    return ToolCallRequest(id, name, json.dumps(args))


def reply(content: str = "", *calls: ToolCallRequest, prompt_tokens: int = 100, cached: int = 0) -> Completion:
    return Completion(content=content, tool_calls=list(calls), finish_reason="tool_calls" if calls else "stop",
                      usage={"prompt_tokens": prompt_tokens, "completion_tokens": 5,
                             "prompt_tokens_details": {"cached_tokens": cached}}, ttft_s=0.01)


@dataclass
class Hang:
    """A reply that streams ``text`` and then never finishes (until cancelled)."""
    text: str = "partial answer"


@dataclass
class ScriptedClient:
    script: list = field(default_factory=list)      # Completion | Hang | callable(messages) -> Completion
    context: int = 8192
    requests: list[dict] = field(default_factory=list)
    cancelled: int = 0
    model: str = "scripted"
    summary: str | None = None      # when set, calls without tools (compaction) get it as the reply

    async def resolve_model(self) -> str:
        return self.model

    async def count_tokens(self, messages, tools=None):
        return None                                  # the agent estimates, as against a foreign server

    async def context_length(self):
        return self.context

    async def aclose(self) -> None:
        pass

    async def complete(self, messages, tools=None, *, tool_choice=None, parallel_tool_calls=None, response_format=None, max_tokens=None,
                       temperature=None, on_delta=None) -> Completion:
        self.requests.append({"messages": json.loads(json.dumps(messages)), "tools": tools,
                              "response_format": response_format, "max_tokens": max_tokens,
                              "tool_choice": tool_choice})
        if self.summary is not None and not tools and response_format is None:
            return reply(self.summary)
        if not self.script:
            raise AssertionError("the scripted model ran out of replies")
        item = self.script.pop(0)
        if callable(item) and not isinstance(item, (Completion, Hang)):
            item = item(messages)
        if isinstance(item, Hang):
            if on_delta:
                on_delta("content", item.text)
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
        if on_delta and item.content:
            on_delta("content", item.content)
        await asyncio.sleep(0)
        return item
