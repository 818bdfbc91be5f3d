"""The agent's model: an OpenAI-compatible chat-completions endpoint, streamed.

One code path for every model the agent can drive: the local engine served in this
process on a private Unix socket (``lodestar.serve.LocalServer``, wired by the CLI), a
``lodestar serve`` on a GPU box, or any other OpenAI-compatible server (``--base-url``).
Cancelling the task that awaits ``complete`` closes the stream, which makes a Lodestar
server abort the request and free its KV blocks at once.

httpx (already the HTTP client of the OpenAI and Anthropic SDKs) does the transport: it
streams, speaks Unix sockets and cancels cleanly under asyncio.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import httpx


class ModelError(Exception):
    """The model endpoint failed (unreachable, an HTTP error, a broken stream)."""


@dataclass
class ToolCallRequest:
    id: str
    name: str
    arguments: str                      # JSON text as the model wrote it


@dataclass
class Completion:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallRequest] = field(default_factory=list)
    finish_reason: str | None = None
    usage: dict = field(default_factory=dict)
    ttft_s: float | None = None         # request sent -> first streamed token
    duration_s: float = 0.0

    @property
    def prompt_tokens(self) -> int:
        return int(self.usage.get("prompt_tokens") or 0)

    @property
    def cached_tokens(self) -> int:
        return int((self.usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)

    @property
    def completion_tokens(self) -> int:
        return int(self.usage.get("completion_tokens") or 0)


# on_delta(kind, text): kind is "content", "reasoning" or "tool" (a tool call's name as it starts)
DeltaCallback = Callable[[str, str], None]


class ChatClient:
    def __init__(self, base_url: str, model: str | None = None, api_key: str | None = None,
                 transport: httpx.AsyncBaseTransport | None = None, timeout: float = 600.0) -> None:
        self.base_url = base_url.rstrip("/")
        # given with or without /v1 (OpenAI SDK style: ".../v1"); requests use full paths from the root
        root = self.base_url[:-3] if self.base_url.endswith("/v1") else self.base_url
        self.model = model
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.AsyncClient(base_url=root, transport=transport, headers=headers,
                                       timeout=httpx.Timeout(timeout, connect=10.0))
        self._context: int | None = None
        self._tokenize = True           # False once the server showed it has no /tokenize

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _get(self, path: str) -> Any:
        try:
            r = await self._http.get(path)
        except httpx.HTTPError as e:
            raise ModelError(f"cannot reach {self.base_url}: {e}") from None
        if r.status_code >= 400:
            raise ModelError(f"{path}: HTTP {r.status_code}: {_error_text(r.text)}")
        return r.json()

    async def resolve_model(self) -> str:
        """The model to ask for: the one given, else the server's first."""
        if self.model:
            return self.model
        data = await self._get("/v1/models")
        models = [m.get("id") for m in data.get("data", []) if isinstance(m, dict)]
        if not models:
            raise ModelError(f"{self.base_url} serves no models")
        self.model = models[0]
        return self.model

    async def count_tokens(self, messages: list[dict], tools: list[dict] | None = None) -> int | None:
        """Exact prompt tokens of this conversation (the server's ``/tokenize``), or None when the
        server cannot tell."""
        if not self._tokenize:
            return None
        body: dict = {"model": await self.resolve_model(), "messages": messages}
        if tools:
            body["tools"] = tools
        try:
            r = await self._http.post("/tokenize", json=body)
        except httpx.HTTPError as e:
            raise ModelError(f"cannot reach {self.base_url}: {e}") from None
        if r.status_code in (404, 405):
            self._tokenize = False
            return None
        if r.status_code >= 400:
            raise ModelError(f"/tokenize: HTTP {r.status_code}: {_error_text(r.text)}")
        data = r.json()
        if isinstance(data.get("max_model_len"), int):
            self._context = data["max_model_len"]
        return int(data["count"])

    async def context_length(self) -> int | None:
        """The model's context in tokens, when the server says (``/tokenize`` or model metadata)."""
        if self._context is None and self._tokenize:
            await self.count_tokens([{"role": "user", "content": "hi"}])
        if self._context is None:
            try:
                data = await self._get(f"/v1/models/{await self.resolve_model()}")
            except ModelError:
                return None
            for key in ("max_model_len", "context_length", "context_window"):
                if isinstance(data.get(key), int):
                    self._context = data[key]
        return self._context

    async def complete(self, messages: list[dict], tools: list[dict] | None = None, *,
                       tool_choice: str | dict | None = None, parallel_tool_calls: bool | None = None,
                       response_format: dict | None = None,
                       max_tokens: int | None = None, temperature: float | None = None,
                       on_delta: DeltaCallback | None = None) -> Completion:
        body: dict = {"model": await self.resolve_model(), "messages": messages, "stream": True,
                      "stream_options": {"include_usage": True}}
        if tools:
            body["tools"] = tools
            if tool_choice is not None:
                body["tool_choice"] = tool_choice
            if parallel_tool_calls is not None:
                body["parallel_tool_calls"] = parallel_tool_calls
        if response_format is not None:
            body["response_format"] = response_format
        if max_tokens is not None:
            body["max_tokens"] = max_tokens
        if temperature is not None:
            body["temperature"] = temperature
        out = Completion()
        calls: dict[int, dict] = {}
        t0 = time.monotonic()
        try:
            async with self._http.stream("POST", "/v1/chat/completions", json=body) as r:
                if r.status_code >= 400:
                    text = (await r.aread()).decode("utf-8", "replace")
                    raise ModelError(f"chat completion: HTTP {r.status_code}: {_error_text(text)}")
                async for line in r.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    try:
                        chunk = json.loads(data)
                    except json.JSONDecodeError:
                        raise ModelError(f"chat completion: unreadable stream chunk {data[:200]!r}") from None
                    if "error" in chunk:
                        raise ModelError(f"chat completion failed: {_error_text(json.dumps(chunk))}")
                    if chunk.get("usage"):
                        out.usage = chunk["usage"]
                    for choice in chunk.get("choices") or []:
                        _take_delta(out, calls, choice, on_delta, t0)
        except httpx.HTTPError as e:
            raise ModelError(f"chat completion: {type(e).__name__}: {e} ({self.base_url})") from None
        out.duration_s = time.monotonic() - t0
        out.tool_calls = [ToolCallRequest(c["id"] or f"call_{i}", c["name"], c["arguments"] or "{}")
                          for i, c in sorted(calls.items()) if c["name"]]
        return out


def _take_delta(out: Completion, calls: dict[int, dict], choice: dict, on_delta: DeltaCallback | None,
                t0: float) -> None:
    delta = choice.get("delta") or {}
    if choice.get("finish_reason"):
        out.finish_reason = choice["finish_reason"]
    got = False
    for key, kind in (("reasoning_content", "reasoning"), ("reasoning", "reasoning"), ("content", "content")):
        text = delta.get(key)
        if isinstance(text, str) and text:
            got = True
            if kind == "content":
                out.content += text
            else:
                out.reasoning += text
            if on_delta:
                on_delta(kind, text)
    for tc in delta.get("tool_calls") or []:
        got = True
        c = calls.setdefault(int(tc.get("index", 0)), {"id": "", "name": "", "arguments": ""})
        fn = tc.get("function") or {}
        if tc.get("id"):
            c["id"] = tc["id"]
        if fn.get("name"):
            c["name"] += fn["name"]
            if on_delta:
                on_delta("tool", fn["name"])
        if isinstance(fn.get("arguments"), str):
            c["arguments"] += fn["arguments"]
    if got and out.ttft_s is None:
        out.ttft_s = time.monotonic() - t0


def _error_text(text: str) -> str:
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return text.strip()[:500]
    err = data.get("error", data) if isinstance(data, dict) else data
    if isinstance(err, dict):
        return str(err.get("message") or err)[:500]
    return str(err)[:500]
