"""OpenAI ``POST /v1/responses``: input items -> prompt -> engine -> a ``response`` (or its event chain).

The server keeps no state: ``previous_response_id`` is refused, so clients send the whole
conversation (messages, ``function_call`` and ``function_call_output`` items) each time.
Function tools, freeform ``custom`` tools (called with one ``input`` string) and the tools
of ``namespace`` groups (their calls carry the namespace back) reach the model as function
tools; hosted tools and input items the server cannot use are left out with a warning.
"""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from lodestar.serve.chat_prompt import render_chat
from lodestar.serve.errors import APIError, as_api_error
from lodestar.serve.generation import (Generation, GenerationSpec, RequestWarnings, Result, build_params,
                                       resolve_max_tokens, with_speculation)
from lodestar.serve.openai_chat import EFFORT_THINKING, logprob_entries, new_call_id, select_tools
from lodestar.serve.protocol import ResponsesRequest
from lodestar.serve.sse import SSEResponse, sse_event
from lodestar.serve.state import ClientDisconnected, ServeState, get_state, until_disconnect
from lodestar.serve.structured import compile_grammar, output_grammar, text_format_spec

router = APIRouter(tags=["OpenAI"])

_TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# -- request -> neutral shape --------------------------------------------------------------
def _text(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where} must be a string or a list of content parts", param=where)
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS + ("refusal",):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise APIError(400, f"{where}[{j}]: content of type {kind!r} is not supported; "
                                "this server reads text only", param=f"{where}[{j}]")
        value = part.get("text", part.get("refusal"))
        if not isinstance(value, str):
            raise APIError(400, f"{where}[{j}].text must be a string", param=f"{where}[{j}].text")
        texts.append(value)
    return "\n".join(texts)


@dataclass(frozen=True)
class ToolOrigin:
    """The client's tool behind a name in the prompt."""

    name: str
    namespace: str | None = None       # a tool of a ``namespace`` group: its calls carry the namespace
    custom: bool = False               # a freeform tool: its calls carry one string, ``input``


@dataclass
class ResponseTools:
    """The request's tools as function tools for the prompt, and where each came from."""

    tools: list[dict] = field(default_factory=list)
    origins: dict[str, ToolOrigin] = field(default_factory=dict)   # prompt name -> the client's tool

    def prompt_name(self, name: str, namespace: str | None = None) -> str:
        """The prompt's name for the client's tool ``name`` (in ``namespace``)."""
        for prompt, origin in self.origins.items():
            if origin.name == name and origin.namespace == namespace:
                return prompt
        return name

    def origin(self, prompt_name: str) -> ToolOrigin:
        return self.origins.get(prompt_name) or ToolOrigin(prompt_name)


CUSTOM_INPUT_SCHEMA = {"type": "object", "required": ["input"], "properties": {
    "input": {"type": "string", "description": "The tool's whole input as plain text (not JSON)."}}}


def _add_tool(out: ResponseTools, t: dict, where: str, warnings: RequestWarnings, namespace: str | None = None,
              custom: bool = False) -> None:
    name = t.get("name")
    if not isinstance(name, str) or not name:
        raise APIError(400, f"{where}.name is required (a non-empty string)", param=f"{where}.name")
    description = t.get("description") or ""
    if custom:
        fmt = t.get("format")
        if isinstance(fmt, dict) and fmt.get("type") == "grammar" and isinstance(fmt.get("definition"), str):
            description += f"\n\nThe input follows this {fmt.get('syntax') or ''} grammar:\n{fmt['definition']}"
        params = CUSTOM_INPUT_SCHEMA
    else:
        params = t.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise APIError(400, f"{where}.parameters must be a JSON schema object", param=f"{where}.parameters")
    prompt = name
    if prompt in out.origins and namespace:
        prompt = f"{namespace}.{name}"        # the same name in two namespaces
    if prompt in out.origins:
        warnings.add(f"{where} ({name!r}) dropped: an earlier tool has the same name")
        return
    out.origins[prompt] = ToolOrigin(name, namespace, custom)
    function = {"name": prompt, "description": description, "parameters": params or {}}
    if not custom and t.get("strict") is True:     # only an explicit true: constrain calls under auto too
        function["strict"] = True
    out.tools.append({"type": "function", "function": function})


def response_tools(body: ResponsesRequest, warnings: RequestWarnings) -> ResponseTools:
    """Function and custom tools, and those of ``namespace`` groups, become prompt tools; hosted tools
    (web search, file search, code interpreter, computer use, MCP ...) cannot run here and are
    dropped with a warning, so a client that declares them still works."""
    out = ResponseTools()
    for i, t in enumerate(body.tools or ()):
        kind, where = t.get("type"), f"tools[{i}]"
        if kind in ("function", "custom"):
            _add_tool(out, t, where, warnings, custom=kind == "custom")
        elif kind == "namespace":
            namespace, members = t.get("name"), t.get("tools")
            if not isinstance(namespace, str) or not namespace or not isinstance(members, list):
                raise APIError(400, f"{where}: a namespace tool needs a name and a list of tools", param=where)
            for j, member in enumerate(members):
                at = f"{where}.tools[{j}]"
                member_kind = member.get("type", "function") if isinstance(member, dict) else None
                if member_kind in ("function", "custom"):
                    _add_tool(out, member, at, warnings, namespace, custom=member_kind == "custom")
                elif isinstance(member, dict) and isinstance(member_kind, str):
                    warnings.add(f"{at} of type {member_kind!r} dropped: this server runs function tools only")
                else:
                    raise APIError(400, f"{at} must be a function or custom tool", param=at)
        elif isinstance(kind, str) and kind:
            warnings.add(f"{where} of type {kind!r} dropped: hosted tools do not run on this server")
        else:
            raise APIError(400, f"{where}.type is required (function, custom, namespace or a hosted tool type)",
                           param=f"{where}.type")
    return out


def _tool_choice(choice, tools: ResponseTools, warnings: RequestWarnings) -> tuple[list[dict], object]:
    """(the prompt tools it allows, the choice in select_tools' terms)."""
    if not isinstance(choice, dict):
        return tools.tools, choice
    kind = choice.get("type")
    if kind in ("function", "custom"):
        if not isinstance(choice.get("name"), str):
            raise APIError(400, f"tool_choice of type {kind} needs a name", param="tool_choice.name")
        return tools.tools, {"name": tools.prompt_name(choice["name"], choice.get("namespace"))}
    if kind == "allowed_tools":
        allowed, mode = choice.get("tools"), choice.get("mode", "auto")
        if not isinstance(allowed, list) or mode not in ("auto", "required"):
            raise APIError(400, "tool_choice allowed_tools needs a list of tools and mode auto or required",
                           param="tool_choice")
        names = {tools.prompt_name(a["name"], a.get("namespace")) for a in allowed
                 if isinstance(a, dict) and isinstance(a.get("name"), str)}
        return [t for t in tools.tools if t["function"]["name"] in names], mode
    if isinstance(kind, str) and kind:
        warnings.add(f"tool_choice of type {kind!r} ignored (its tool does not run on this server); using auto")
        return tools.tools, "auto"
    raise APIError(400, "tool_choice must be none, auto, required or an object with a type", param="tool_choice")


def input_messages(body: ResponsesRequest, tools: ResponseTools, warnings: RequestWarnings) -> list[dict]:
    messages: list[dict] = []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        return messages + [{"role": "user", "content": body.input}]
    reasoning: list[str] = []

    def add_call(call_id, name: str, arguments: str) -> None:
        nonlocal reasoning
        call = {"id": str(call_id or new_call_id()), "type": "function",
                "function": {"name": name, "arguments": arguments}}
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant":
            last.setdefault("tool_calls", []).append(call)
            return
        msg = {"role": "assistant", "content": None, "tool_calls": [call]}
        if reasoning:
            msg["reasoning_content"], reasoning = "\n".join(reasoning), []
        messages.append(msg)

    for i, item in enumerate(body.input):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise APIError(400, f"{where}.role must be user, assistant, system or developer, got {role!r}",
                               param=f"{where}.role")
            msg = {"role": role, "content": _text(item.get("content", ""), f"{where}.content")}
            if role == "assistant" and reasoning:
                msg["reasoning_content"], reasoning = "\n".join(reasoning), []
            messages.append(msg)
        elif kind == "function_call":
            name, args = item.get("name"), item.get("arguments", "{}")
            if not isinstance(name, str) or not isinstance(args, str):
                raise APIError(400, f"{where}: a function_call needs a string name and string arguments",
                               param=where)
            add_call(item.get("call_id"), tools.prompt_name(name, item.get("namespace")), args)
        elif kind == "custom_tool_call":
            name, text = item.get("name"), item.get("input", "")
            if not isinstance(name, str) or not isinstance(text, str):
                raise APIError(400, f"{where}: a custom_tool_call needs a string name and string input", param=where)
            add_call(item.get("call_id"), tools.prompt_name(name, item.get("namespace")),
                     json.dumps({"input": text}, ensure_ascii=False))
        elif kind in ("function_call_output", "custom_tool_call_output"):
            messages.append({"role": "tool", "tool_call_id": str(item.get("call_id", "")),
                             "content": _text(item.get("output", ""), f"{where}.output")})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            text = _text(parts, f"{where}.content")
            if text:                       # encrypted_content alone: nothing this server can read
                reasoning.append(text)
        elif kind == "item_reference":
            raise APIError(400, f"{where}: item_reference is not supported: this server stores no items; send "
                                "the items themselves", param=f"{where}.type")
        elif isinstance(kind, str):
            # web_search_call, local_shell_call, compaction ...: output of tools that do not run here
            warnings.add(f"{where} of type {kind!r} left out of the prompt: this server cannot read it")
        else:
            raise APIError(400, f"{where}.type must be a string", param=f"{where}.type")
    if not messages:
        raise APIError(400, "input must contain at least one message", param="input")
    return messages


# -- engine results -> wire ----------------------------------------------------------------
def _usage(state: ServeState, r: Result) -> dict:
    reasoning = len(state.tokenizer.encode(r.reasoning, add_special_tokens=False)) if r.reasoning else 0
    return with_speculation({"input_tokens": r.prompt_tokens,
                             "input_tokens_details": {"cached_tokens": r.cached_tokens, "cache_write_tokens": 0},
                             "output_tokens": r.completion_tokens,
                             "output_tokens_details": {"reasoning_tokens": reasoning,
                                                       "forced_tokens": r.forced_tokens},
                             "total_tokens": r.prompt_tokens + r.completion_tokens}, [r])


def _reasoning_item(item_id: str, text: str, status: str = "completed") -> dict:
    return {"id": item_id, "type": "reasoning", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": status}


def _text_part(text: str, logprobs: list | None = None) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def _message_item(item_id: str, text: str | None, status: str, logprobs: list | None = None) -> dict:
    content = [] if text is None else [_text_part(text, logprobs)]
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": content}


def _custom_input(arguments: str) -> str:
    """A freeform tool's input from the function-call arguments the model wrote (``{"input": ...}``)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    if isinstance(value, dict):
        if isinstance(value.get("input"), str):
            return value["input"]
        texts = [v for v in value.values() if isinstance(v, str)]
        if len(value) == 1 and texts:
            return texts[0]
    return arguments


def _call_item(item_id: str, call_id: str, origin: ToolOrigin, arguments: str, status: str) -> dict:
    if origin.custom:
        item = {"id": item_id, "type": "custom_tool_call", "call_id": call_id, "name": origin.name,
                "input": _custom_input(arguments) if arguments else "", "status": status}
    else:
        item = {"id": item_id, "type": "function_call", "call_id": call_id, "name": origin.name,
                "arguments": arguments, "status": status}
    if origin.namespace:
        item["namespace"] = origin.namespace
    return item


class _Envelope:
    """The ``response`` object fields that do not depend on the output."""

    def __init__(self, body: ResponsesRequest, model: str, defaults: dict | None = None) -> None:
        defaults = defaults or {}
        self.id, self.created = _id("resp"), int(time.time())
        self.base = {"object": "response", "model": model, "error": None, "incomplete_details": None,
                     "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
                     "parallel_tool_calls": body.parallel_tool_calls if body.parallel_tool_calls is not None else True,
                     "previous_response_id": None,
                     "reasoning": {"effort": body.reasoning.effort if body.reasoning else None, "summary": None},
                     "store": False,
                     "temperature": body.temperature if body.temperature is not None else defaults.get("temperature", 1.0),
                     "text": {"format": {"type": "text"}, **(body.text or {})},
                     "tool_choice": body.tool_choice or "auto",
                     "tools": body.tools or [], "top_p": body.top_p if body.top_p is not None else defaults.get("top_p", 1.0),
                     "truncation": "disabled", "user": body.user, "metadata": body.metadata or {}}

    def response(self, status: str, output: list, usage: dict | None = None, reason: str | None = None) -> dict:
        out = {"id": self.id, "created_at": self.created, **self.base, "status": status, "output": output,
               "usage": usage}
        if reason:
            out["incomplete_details"] = {"reason": reason}
        return out


def _status(r: Result) -> tuple[str, str | None]:
    return ("incomplete", "max_output_tokens") if r.finish_reason == "length" else ("completed", None)


def response_object(state: ServeState, env: _Envelope, r: Result, want_logprobs: bool, tools: ResponseTools
                    ) -> dict:
    output = []
    if r.reasoning:
        output.append(_reasoning_item(_id("rs"), r.reasoning))
    status, reason = _status(r)
    content = r.content.strip() if r.tool_calls else r.content
    if content or not r.tool_calls:
        lp = logprob_entries(r.logprobs) if want_logprobs else None
        output.append(_message_item(_id("msg"), r.content, status, lp))
    for c in r.tool_calls:
        origin = tools.origin(c.name)
        output.append(_call_item(_id("ctc" if origin.custom else "fc"), new_call_id(), origin, c.arguments,
                                 "completed"))
    return env.response(status, output, _usage(state, r), reason)


class _EventWriter:
    """Builds the Responses event chain: items open and close as the kind of output changes."""

    def __init__(self, state: ServeState, env: _Envelope, want_logprobs: bool, tools: ResponseTools) -> None:
        self.state, self.env, self.want_logprobs, self.tools = state, env, want_logprobs, tools
        self.seq = 0
        self.output: list[dict] = []
        self.kind: str | None = None     # reasoning | message | call
        self.item_id = ""
        self.text = ""
        self.logprobs: list = []
        self.call: dict = {}

    def event(self, kind: str, **fields) -> str:
        payload = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return sse_event(kind, payload)

    def _open(self, kind: str) -> list[str]:
        out = self.close()
        self.kind, self.item_id, self.text, self.logprobs = kind, _id({"reasoning": "rs", "message": "msg",
                                                                       "call": "fc"}[kind]), "", []
        index = len(self.output)
        if kind == "reasoning":
            item = _reasoning_item(self.item_id, "", "in_progress")
            item["content"] = []
            out.append(self.event("response.output_item.added", output_index=index, item=item))
            out.append(self.event("response.content_part.added", item_id=self.item_id, output_index=index,
                                  content_index=0, part={"type": "reasoning_text", "text": ""}))
        elif kind == "message":
            out.append(self.event("response.output_item.added", output_index=index,
                                  item=_message_item(self.item_id, None, "in_progress")))
            out.append(self.event("response.content_part.added", item_id=self.item_id, output_index=index,
                                  content_index=0, part=_text_part("")))
        return out

    def close(self, status: str = "completed") -> list[str]:
        out, index = [], len(self.output)
        if self.kind == "reasoning":
            item = _reasoning_item(self.item_id, self.text)
            out.append(self.event("response.reasoning_text.done", item_id=self.item_id, output_index=index,
                                  content_index=0, text=self.text))
            out.append(self.event("response.content_part.done", item_id=self.item_id, output_index=index,
                                  content_index=0, part={"type": "reasoning_text", "text": self.text}))
            out.append(self.event("response.output_item.done", output_index=index, item=item))
            self.output.append(item)
        elif self.kind == "message":
            item = _message_item(self.item_id, self.text, status, self.logprobs)
            out.append(self.event("response.output_text.done", item_id=self.item_id, output_index=index,
                                  content_index=0, text=self.text, logprobs=self.logprobs))
            out.append(self.event("response.content_part.done", item_id=self.item_id, output_index=index,
                                  content_index=0, part=_text_part(self.text, self.logprobs)))
            out.append(self.event("response.output_item.done", output_index=index, item=item))
            self.output.append(item)
        elif self.kind == "call":
            c = self.call
            origin: ToolOrigin = c["origin"]
            item = _call_item(self.item_id, c["call_id"], origin, c["arguments"], "completed")
            if origin.custom:             # the input is known once the arguments close
                if item["input"]:
                    out.append(self.event("response.custom_tool_call_input.delta", item_id=self.item_id,
                                          output_index=index, delta=item["input"]))
                out.append(self.event("response.custom_tool_call_input.done", item_id=self.item_id,
                                      output_index=index, input=item["input"]))
            else:
                out.append(self.event("response.function_call_arguments.done", item_id=self.item_id,
                                      output_index=index, name=origin.name, arguments=c["arguments"]))
            out.append(self.event("response.output_item.done", output_index=index, item=item))
            self.output.append(item)
        self.kind = None
        return out

    def delta(self, d) -> list[str]:
        index = len(self.output)
        if d.kind == "reasoning":
            out = [] if self.kind == "reasoning" else self._open("reasoning")
            index = len(self.output)
            self.text += d.text
            out.append(self.event("response.reasoning_text.delta", item_id=self.item_id, output_index=index,
                                  content_index=0, delta=d.text))
            return out
        if d.kind == "content":
            if self.kind == "call" or (self.kind is None and not d.text.strip() and self.output
                                       and self.output[-1]["type"] == "function_call"):
                return []                  # blank text between calls is not a message
            out = [] if self.kind == "message" else self._open("message")
            index = len(self.output)
            lp = logprob_entries(d.logprobs) if self.want_logprobs else []
            self.text += d.text
            self.logprobs += lp
            out.append(self.event("response.output_text.delta", item_id=self.item_id, output_index=index,
                                  content_index=0, delta=d.text, logprobs=lp))
            return out
        if d.kind == "tool_start":
            out = self._open("call")
            index = len(self.output)
            origin = self.tools.origin(d.name)
            if origin.custom:
                self.item_id = _id("ctc")
            self.call = {"call_id": new_call_id(), "origin": origin, "arguments": ""}
            out.append(self.event("response.output_item.added", output_index=index,
                                  item=_call_item(self.item_id, self.call["call_id"], origin, "", "in_progress")))
            return out
        if d.kind == "tool_args" and self.kind == "call":
            self.call["arguments"] += d.text
            if self.call["origin"].custom:
                return []
            return [self.event("response.function_call_arguments.delta", item_id=self.item_id,
                               output_index=index, delta=d.text)]
        if d.kind == "tool_end":
            return self.close()
        return []


def prepare(state: ServeState, body: ResponsesRequest, warnings: RequestWarnings
            ) -> tuple[GenerationSpec, ResponseTools]:
    state.check_model(body.model)
    if body.previous_response_id:
        raise APIError(400, "previous_response_id is not supported: this server stores no responses; send the "
                            "whole conversation in input", param="previous_response_id")
    if body.conversation:
        raise APIError(400, "conversation is not supported: this server stores no conversations; send the "
                            "whole conversation in input", param="conversation")
    content = text_format_spec(body.text)
    tools = response_tools(body, warnings)
    allowed, choice = _tool_choice(body.tool_choice, tools, warnings)
    prompt_tools, names = select_tools(allowed, choice)
    effort = body.reasoning.effort if body.reasoning else None
    prompt = render_chat(state.tokenizer, input_messages(body, tools, warnings), prompt_tools,
                         enable_thinking=EFFORT_THINKING.get(effort) if effort else None,
                         check_text=lambda text: state.check_prompt_text(text, "input"))
    grammar = output_grammar(state.tokenizer, content, prompt_tools, tool_choice=choice,
                             parallel=body.parallel_tool_calls, in_reasoning=prompt.in_reasoning,
                             warnings=warnings)
    try:
        max_tokens = resolve_max_tokens(state, len(prompt.ids), body.max_output_tokens, warnings=warnings,
                                        max_field="max_output_tokens", prompt_field="input")
    except Exception as e:
        raise as_api_error(e, "input") from None
    params = build_params({"max_tokens": "max_output_tokens", "logprobs": "top_logprobs"}, state.config.sampling_defaults,
                          temperature=body.temperature, top_p=body.top_p, max_tokens=max_tokens,
                          stop=prompt.stop or None, logprobs=body.top_logprobs,
                          grammar=grammar.spec if grammar else None, speculate=body.speculate)
    in_reasoning = grammar.in_reasoning if grammar else prompt.in_reasoning
    return GenerationSpec(prompt.ids, params, names, in_reasoning, grammar=grammar), tools


async def _stream(state: ServeState, env: _Envelope, gen: Generation, want_logprobs: bool, tools: ResponseTools):
    w = _EventWriter(state, env, want_logprobs, tools)
    yield w.event("response.created", response=env.response("in_progress", []))
    yield w.event("response.in_progress", response=env.response("in_progress", []))
    try:
        async for d in gen.events():
            if d.kind == "keepalive":      # an event, not an SSE comment: Codex's idle timer counts events only
                yield w.event("keepalive")
                continue
            for chunk in w.delta(d):
                yield chunk
    except Exception as e:
        err = as_api_error(e, "input")
        code = err.code or ("server_error" if err.status >= 500 else "invalid_request")
        yield w.event("error", code=code, message=err.message, param=err.param)
        failed = env.response("failed", w.output)
        failed["error"] = {"code": code, "message": err.message}
        yield w.event("response.failed", response=failed)
        return
    r = gen.result
    status, reason = _status(r)
    for chunk in w.close(status):
        yield chunk
    yield w.event(f"response.{status}", response=env.response(status, w.output, _usage(state, r), reason))


@router.post("/v1/responses", summary="Create a model response (OpenAI Responses)")
async def create_response(body: ResponsesRequest, request: Request):
    state = get_state(request)
    warnings = RequestWarnings()
    spec, tools = await run_in_threadpool(prepare, state, body, warnings)   # tokenizing can take seconds
    await compile_grammar(state, spec.grammar)                              # a 400 before any stream
    env = _Envelope(body, body.model, state.config.sampling_defaults)
    want_logprobs = body.top_logprobs is not None
    if body.stream:
        gen = Generation(state, spec, stream=True, keepalive_s=state.config.keepalive_s)
        return SSEResponse(_stream(state, env, gen, want_logprobs, tools), headers=warnings.headers())
    gen = Generation(state, spec, stream=False)
    try:
        result = await until_disconnect(request, gen.run())
    except ClientDisconnected:
        raise
    except Exception as e:
        raise as_api_error(e, "input") from None
    return JSONResponse(response_object(state, env, result, want_logprobs, tools), headers=warnings.headers())
