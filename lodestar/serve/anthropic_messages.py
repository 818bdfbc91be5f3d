"""Anthropic ``POST /v1/messages`` and ``/v1/messages/count_tokens``.

Content blocks map onto the neutral chat shape: ``text`` -> content, ``tool_use`` ->
tool calls, ``tool_result`` -> tool messages, ``thinking`` -> reasoning. ``system`` (and
``developer``) messages inside ``messages``, which Claude Code sends, join the system
prompt in order. What the server cannot run (server tools such as web search, the blocks
their results come back in) is left out with a warning instead of a 400; images and
documents are still refused. A final assistant message is continued (prefill), as the
hosted API does. Usage follows
Anthropic's accounting: ``input_tokens`` excludes the prompt tokens read from the
prefix cache, which are reported as ``cache_read_input_tokens``.
"""
from __future__ import annotations

import json
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from lodestar.serve.chat_prompt import RenderedPrompt, render_chat
from lodestar.serve.errors import APIError, as_api_error, sse_error_payload
from lodestar.serve.generation import (Generation, GenerationSpec, RequestWarnings, Result, build_params,
                                       resolve_max_tokens, with_speculation)
from lodestar.serve.openai_chat import select_tools
from lodestar.serve.protocol import AnthropicMessage, MessagesCountRequest, MessagesRequest
from lodestar.serve.sse import SSEResponse, sse_event
from lodestar.serve.state import ClientDisconnected, ServeState, get_state, until_disconnect
from lodestar.serve.structured import OutputGrammar, compile_grammar, output_config_spec, output_grammar

router = APIRouter(tags=["Anthropic"])

ANTHROPIC_FIELDS = {"stop": "stop_sequences", "max_tokens": "max_tokens"}
SYSTEM_ROLES = ("system", "developer")
UNREADABLE_BLOCKS = ("image", "document")     # content the model would need to see: refused, not dropped


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


# -- request -> neutral shape --------------------------------------------------------------
def _block_text(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if not isinstance(content, list):
        raise APIError(400, f"{where} must be a string or a list of text blocks", param=where)
    texts = []
    for j, block in enumerate(content):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise APIError(400, f"{where}[{j}]: blocks of type {kind!r} are not supported here; "
                                "this server reads text only", param=f"{where}[{j}]")
        texts.append(block["text"])
    return "\n".join(texts)


def _message(m: AnthropicMessage, i: int, warnings: RequestWarnings) -> list[dict]:
    where = f"messages[{i}].content"
    if isinstance(m.content, str):
        return [{"role": m.role, "content": m.content}]
    out: list[dict] = []
    texts: list[str] = []
    thinking: list[str] = []
    calls: list[dict] = []

    def flush_user_text() -> None:
        if texts:
            out.append({"role": "user", "content": "\n".join(texts)})
            texts.clear()

    for j, block in enumerate(m.content):
        kind = block.get("type")
        at = f"{where}[{j}]"
        if not isinstance(kind, str):
            raise APIError(400, f"{at}.type is required (a content block type such as 'text')", param=f"{at}.type")
        if kind == "text":
            if not isinstance(block.get("text"), str):
                raise APIError(400, f"{at}.text must be a string", param=f"{at}.text")
            texts.append(block["text"])
        elif kind == "tool_result" and m.role == "user":
            flush_user_text()
            text = _block_text(block.get("content"), f"{at}.content")
            if block.get("is_error"):
                text = f"Error: {text}"
            out.append({"role": "tool", "tool_call_id": str(block.get("tool_use_id", "")), "content": text})
        elif kind == "tool_use" and m.role == "assistant":
            if not isinstance(block.get("name"), str) or not isinstance(block.get("input", {}), dict):
                raise APIError(400, f"{at}: tool_use needs a string name and an object input", param=at)
            calls.append({"id": str(block.get("id") or _id("toolu")), "type": "function",
                          "function": {"name": block["name"],
                                       "arguments": json.dumps(block.get("input", {}), ensure_ascii=False)}})
        elif kind == "thinking" and m.role == "assistant" and isinstance(block.get("thinking"), str):
            thinking.append(block["thinking"])
        elif kind == "redacted_thinking" and m.role == "assistant":
            continue
        elif kind in UNREADABLE_BLOCKS or kind in ("tool_result", "tool_use", "thinking"):
            raise APIError(400, f"{at}: content blocks of type {kind!r} are not supported in {m.role} messages",
                           param=at)
        else:                             # server tool use and results, search results, ...: nothing to run
            warnings.add(f"{at} of type {kind!r} left out: this server runs no server tools")
    if m.role == "user":
        flush_user_text()
        return out
    msg: dict = {"role": "assistant", "content": "\n".join(texts) if texts else ("" if not calls else None)}
    if calls:
        msg["tool_calls"] = calls
    if thinking:
        msg["reasoning_content"] = "\n".join(thinking)
    return [msg]


def messages_of(body: MessagesCountRequest, warnings: RequestWarnings) -> list[dict]:
    """The neutral chat messages: one system message (``system`` then any system-role messages, in
    order), then the conversation."""
    system = [_block_text(body.system, "system")] if body.system else []
    messages: list[dict] = []
    for i, m in enumerate(body.messages):
        if m.role in SYSTEM_ROLES:
            text = _block_text(m.content, f"messages[{i}].content")
            if text:
                system.append(text)
        else:
            messages += _message(m, i, warnings)
    if not messages:
        raise APIError(400, "messages must contain at least one user or assistant message", param="messages")
    if system:
        messages.insert(0, {"role": "system", "content": "\n\n".join(system)})
    return messages


def tools_of(body: MessagesCountRequest, warnings: RequestWarnings
             ) -> tuple[list[dict] | None, frozenset[str] | None, object]:
    """(tools for the prompt, names to parse, tool_choice in select_tools' terms)."""
    if not body.tools:
        return None, None, None
    tools, dropped = [], set()
    for i, t in enumerate(body.tools):
        if t.type not in (None, "custom"):
            # Server tools (web search, code execution ...) and Anthropic-defined client tools
            # (bash, text editor, computer) have no schema the model could follow here.
            warnings.add(f"tools[{i}] ({t.name!r}, type {t.type!r}) dropped: this server runs no server tools "
                         "and offers client tools declared with name, description and input_schema")
            dropped.add(t.name)
            continue
        tools.append({"type": "function", "function": {"name": t.name, "description": t.description or "",
                                                        "parameters": t.input_schema or {"type": "object"}}})
    choice = body.tool_choice or {}
    kind = choice.get("type", "auto")
    if kind == "tool":
        mapped = {"name": choice.get("name")}
        if choice.get("name") in dropped:
            warnings.add(f"tool_choice names the dropped tool {choice.get('name')!r}; using auto")
            mapped = "auto"
    elif kind in ("auto", "any", "none"):
        mapped = {"auto": "auto", "any": "required", "none": "none"}[kind]
    else:
        raise APIError(400, f"tool_choice.type must be auto, any, tool or none, got {kind!r}", param="tool_choice")
    return (*select_tools(tools, mapped), mapped)


def _thinking(body: MessagesCountRequest) -> bool | None:
    kind = (body.thinking or {}).get("type")
    if kind in ("enabled", "adaptive"):
        return True
    if kind == "disabled":
        return False
    if kind is not None:
        raise APIError(400, f"thinking.type must be enabled, adaptive or disabled, got {kind!r}",
                       param="thinking.type")
    return None


def render(state: ServeState, body: MessagesCountRequest, warnings: RequestWarnings
           ) -> tuple[RenderedPrompt, frozenset[str] | None, OutputGrammar | None]:
    """(the prompt, tool names to parse, the grammar its output follows)."""
    state.check_model(body.model)
    content = output_config_spec(getattr(body, "output_config", None))
    tools, names, choice = tools_of(body, warnings)
    prompt = render_chat(state.tokenizer, messages_of(body, warnings), tools, enable_thinking=_thinking(body),
                         continue_final=True, check_text=lambda text: state.check_prompt_text(text, "messages"))
    single = isinstance(body.tool_choice, dict) and body.tool_choice.get("disable_parallel_tool_use") is True
    grammar = output_grammar(state.tokenizer, content, tools, tool_choice=choice, parallel=not single,
                             in_reasoning=prompt.in_reasoning, warnings=warnings)
    return prompt, names, grammar


# -- engine results -> wire ----------------------------------------------------------------
def _stop_reason(r: Result, user_stops: list[str]) -> tuple[str, str | None]:
    if r.finish_reason == "tool_calls":
        return "tool_use", None
    if r.finish_reason == "length":
        return "max_tokens", None
    if r.stop_sequence is not None and r.stop_sequence in user_stops:
        return "stop_sequence", r.stop_sequence
    return "end_turn", None


def _usage(r: Result) -> dict:
    return with_speculation({"input_tokens": r.prompt_tokens - r.cached_tokens, "output_tokens": r.completion_tokens,
                             "cache_creation_input_tokens": 0, "cache_read_input_tokens": r.cached_tokens}, [r])


def message_object(model: str, r: Result, user_stops: list[str]) -> dict:
    content: list[dict] = []
    if r.reasoning:
        content.append({"type": "thinking", "thinking": r.reasoning, "signature": ""})
    text = r.content.strip() if r.tool_calls else r.content
    if text or not r.tool_calls:
        content.append({"type": "text", "text": r.content})
    for c in r.tool_calls:
        content.append({"type": "tool_use", "id": _id("toolu"), "name": c.name, "input": json.loads(c.arguments)})
    reason, seq = _stop_reason(r, user_stops)
    return {"id": _id("msg"), "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": reason, "stop_sequence": seq, "usage": _usage(r)}


class _BlockWriter:
    def __init__(self) -> None:
        self.index = -1
        self.kind: str | None = None     # thinking | text | tool_use
        self.after_tool = False

    def _open(self, kind: str, block: dict) -> list[str]:
        out = self.close()
        self.index += 1
        self.kind = kind
        out.append(sse_event("content_block_start", {"type": "content_block_start", "index": self.index,
                                                     "content_block": block}))
        return out

    def close(self) -> list[str]:
        if self.kind is None:
            return []
        self.after_tool = self.kind == "tool_use"
        self.kind = None
        return [sse_event("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def _delta(self, delta: dict) -> str:
        return sse_event("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})

    def delta(self, d) -> list[str]:
        if d.kind == "reasoning":
            out = [] if self.kind == "thinking" else self._open("thinking", {"type": "thinking", "thinking": "",
                                                                              "signature": ""})
            return out + [self._delta({"type": "thinking_delta", "thinking": d.text})]
        if d.kind == "content":
            if self.kind is None and self.after_tool and not d.text.strip():
                return []                 # blank text between tool calls is not a block
            out = [] if self.kind == "text" else self._open("text", {"type": "text", "text": ""})
            return out + [self._delta({"type": "text_delta", "text": d.text})]
        if d.kind == "tool_start":
            return self._open("tool_use", {"type": "tool_use", "id": _id("toolu"), "name": d.name, "input": {}})
        if d.kind == "tool_args" and self.kind == "tool_use":
            return [self._delta({"type": "input_json_delta", "partial_json": d.text})]
        if d.kind == "tool_end":
            return self.close()
        return []


async def _stream(path: str, model: str, gen: Generation, user_stops: list[str]):
    r = gen.result
    start = {"id": _id("msg"), "type": "message", "role": "assistant", "model": model, "content": [],
             "stop_reason": None, "stop_sequence": None,
             "usage": {"input_tokens": r.prompt_tokens, "output_tokens": 0, "cache_creation_input_tokens": 0,
                       "cache_read_input_tokens": 0}}
    yield sse_event("message_start", {"type": "message_start", "message": start})
    yield sse_event("ping", {"type": "ping"})
    w = _BlockWriter()
    try:
        async for d in gen.events():
            if d.kind == "keepalive":      # the API's own ping event: a client's idle timer may count events only
                yield sse_event("ping", {"type": "ping"})
                continue
            for chunk in w.delta(d):
                yield chunk
    except Exception as e:
        yield f"event: error\ndata: {sse_error_payload(path, as_api_error(e, anthropic=True))}\n\n"
        return
    for chunk in w.close():
        yield chunk
    if w.index < 0:                       # an empty answer still has one (empty) text block
        yield sse_event("content_block_start", {"type": "content_block_start", "index": 0,
                                                "content_block": {"type": "text", "text": ""}})
        yield sse_event("content_block_stop", {"type": "content_block_stop", "index": 0})
    reason, seq = _stop_reason(r, user_stops)
    yield sse_event("message_delta", {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": seq},
                                      "usage": _usage(r)})
    yield sse_event("message_stop", {"type": "message_stop"})


@router.post("/v1/messages", summary="Create a message (Anthropic)")
async def create_message(body: MessagesRequest, request: Request):
    state = get_state(request)
    warnings = RequestWarnings()
    prompt, names, grammar = await run_in_threadpool(render, state, body, warnings)   # tokenizing can take seconds
    await compile_grammar(state, grammar)                                      # a 400 before any stream
    user_stops = list(body.stop_sequences or [])
    try:
        max_tokens = resolve_max_tokens(state, len(prompt.ids), body.max_tokens, warnings=warnings,
                                        anthropic=True)
    except Exception as e:
        raise as_api_error(e, anthropic=True) from None
    params = build_params(ANTHROPIC_FIELDS, state.config.sampling_defaults, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                          max_tokens=max_tokens, stop=user_stops + prompt.stop or None,
                          grammar=grammar.spec if grammar else None, speculate=body.speculate)
    spec = GenerationSpec(prompt.ids, params, names, grammar.in_reasoning if grammar else prompt.in_reasoning,
                          grammar=grammar)
    if body.stream:
        gen = Generation(state, spec, stream=True, keepalive_s=state.config.keepalive_s)
        return SSEResponse(_stream(request.url.path, body.model, gen, user_stops), headers=warnings.headers())
    gen = Generation(state, spec, stream=False)
    try:
        result = await until_disconnect(request, gen.run())
    except ClientDisconnected:
        raise
    except Exception as e:
        raise as_api_error(e, anthropic=True) from None
    return JSONResponse(message_object(body.model, result, user_stops), headers=warnings.headers())


@router.post("/v1/messages/count_tokens", summary="Count the input tokens of a message (Anthropic)")
async def count_tokens(body: MessagesCountRequest, request: Request):
    warnings = RequestWarnings()
    prompt, _, _ = await run_in_threadpool(render, get_state(request), body, warnings)
    return JSONResponse({"input_tokens": len(prompt.ids)}, headers=warnings.headers())
