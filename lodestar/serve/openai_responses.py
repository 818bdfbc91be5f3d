"""OpenAI ``POST /v1/responses``: input items -> prompt -> engine -> a ``response`` (or its event chain).

The server keeps no state: ``previous_response_id`` is refused, so clients send the whole
conversation (messages, ``function_call`` and ``function_call_output`` items) each time.
"""
from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from lodestar.serve.chat_prompt import render_chat
from lodestar.serve.errors import APIError, as_api_error
from lodestar.serve.generation import Generation, GenerationSpec, Result, build_params, resolve_max_tokens
from lodestar.serve.openai_chat import EFFORT_THINKING, logprob_entries, new_call_id, select_tools
from lodestar.serve.protocol import ResponsesRequest
from lodestar.serve.sse import KEEPALIVE, SSEResponse, sse_event
from lodestar.serve.state import ClientDisconnected, ServeState, get_state, until_disconnect

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


def input_messages(body: ResponsesRequest) -> list[dict]:
    messages: list[dict] = []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        return messages + [{"role": "user", "content": body.input}]
    reasoning: list[str] = []
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
            call = {"id": str(item.get("call_id") or new_call_id()), "type": "function",
                    "function": {"name": name, "arguments": args}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            elif last is not None and last["role"] == "assistant" and not last.get("tool_calls"):
                last["tool_calls"] = [call]
            else:
                msg = {"role": "assistant", "content": None, "tool_calls": [call]}
                if reasoning:
                    msg["reasoning_content"], reasoning = "\n".join(reasoning), []
                messages.append(msg)
        elif kind == "function_call_output":
            output = item.get("output", "")
            messages.append({"role": "tool", "tool_call_id": str(item.get("call_id", "")),
                             "content": _text(output, f"{where}.output")})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            reasoning.append(_text(parts, f"{where}.content"))
        else:
            raise APIError(400, f"{where}: input items of type {kind!r} are not supported (this server stores "
                                "nothing; send messages, function_call and function_call_output items)",
                           param=f"{where}.type")
    if not messages:
        raise APIError(400, "input must contain at least one message", param="input")
    return messages


def function_tools(body: ResponsesRequest) -> list[dict] | None:
    if not body.tools:
        return None
    tools = []
    for i, t in enumerate(body.tools):
        if t.get("type") != "function" or not isinstance(t.get("name"), str) or not t["name"]:
            raise APIError(400, f"tools[{i}]: only function tools with a name are supported, got type "
                                f"{t.get('type')!r}", param=f"tools[{i}]")
        params = t.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise APIError(400, f"tools[{i}].parameters must be a JSON schema object", param=f"tools[{i}].parameters")
        fn = {"name": t["name"], "description": t.get("description") or "", "parameters": params or {}}
        tools.append({"type": "function", "function": fn})
    return tools


def _tool_choice(choice):
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise APIError(400, "tool_choice must be none, auto, required or {type: function, name}",
                           param="tool_choice")
        return {"name": choice["name"]}
    return choice


# -- engine results -> wire ----------------------------------------------------------------
def _usage(state: ServeState, r: Result) -> dict:
    reasoning = len(state.tokenizer.encode(r.reasoning, add_special_tokens=False)) if r.reasoning else 0
    return {"input_tokens": r.prompt_tokens,
            "input_tokens_details": {"cached_tokens": r.cached_tokens, "cache_write_tokens": 0},
            "output_tokens": r.completion_tokens, "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": r.prompt_tokens + r.completion_tokens}


def _reasoning_item(item_id: str, text: str, status: str = "completed") -> dict:
    return {"id": item_id, "type": "reasoning", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": status}


def _text_part(text: str, logprobs: list | None = None) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def _message_item(item_id: str, text: str | None, status: str, logprobs: list | None = None) -> dict:
    content = [] if text is None else [_text_part(text, logprobs)]
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": content}


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


class _Envelope:
    """The ``response`` object fields that do not depend on the output."""

    def __init__(self, body: ResponsesRequest, model: str) -> None:
        self.id, self.created = _id("resp"), int(time.time())
        self.base = {"object": "response", "model": model, "error": None, "incomplete_details": None,
                     "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
                     "parallel_tool_calls": body.parallel_tool_calls if body.parallel_tool_calls is not None else True,
                     "previous_response_id": None,
                     "reasoning": {"effort": body.reasoning.effort if body.reasoning else None, "summary": None},
                     "store": False, "temperature": body.temperature if body.temperature is not None else 1.0,
                     "text": {"format": {"type": "text"}}, "tool_choice": body.tool_choice or "auto",
                     "tools": body.tools or [], "top_p": body.top_p if body.top_p is not None else 1.0,
                     "truncation": "disabled", "user": body.user, "metadata": body.metadata or {}}

    def response(self, status: str, output: list, usage: dict | None = None, reason: str | None = None) -> dict:
        out = {"id": self.id, "created_at": self.created, **self.base, "status": status, "output": output,
               "usage": usage}
        if reason:
            out["incomplete_details"] = {"reason": reason}
        return out


def _status(r: Result) -> tuple[str, str | None]:
    return ("incomplete", "max_output_tokens") if r.finish_reason == "length" else ("completed", None)


def response_object(state: ServeState, env: _Envelope, r: Result, want_logprobs: bool) -> dict:
    output = []
    if r.reasoning:
        output.append(_reasoning_item(_id("rs"), r.reasoning))
    status, reason = _status(r)
    content = r.content.strip() if r.tool_calls else r.content
    if content or not r.tool_calls:
        lp = logprob_entries(r.logprobs) if want_logprobs else None
        output.append(_message_item(_id("msg"), r.content, status, lp))
    for c in r.tool_calls:
        output.append(_call_item(_id("fc"), new_call_id(), c.name, c.arguments, "completed"))
    return env.response(status, output, _usage(state, r), reason)


class _EventWriter:
    """Builds the Responses event chain: items open and close as the kind of output changes."""

    def __init__(self, state: ServeState, env: _Envelope, want_logprobs: bool) -> None:
        self.state, self.env, self.want_logprobs = state, env, want_logprobs
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
            item = _call_item(self.item_id, c["call_id"], c["name"], c["arguments"], "completed")
            out.append(self.event("response.function_call_arguments.done", item_id=self.item_id,
                                  output_index=index, name=c["name"], arguments=c["arguments"]))
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
            self.call = {"call_id": new_call_id(), "name": d.name, "arguments": ""}
            out.append(self.event("response.output_item.added", output_index=index,
                                  item=_call_item(self.item_id, self.call["call_id"], d.name, "", "in_progress")))
            return out
        if d.kind == "tool_args" and self.kind == "call":
            self.call["arguments"] += d.text
            return [self.event("response.function_call_arguments.delta", item_id=self.item_id,
                               output_index=index, delta=d.text)]
        if d.kind == "tool_end":
            return self.close()
        return []


def prepare(state: ServeState, body: ResponsesRequest) -> GenerationSpec:
    state.check_model(body.model)
    if body.previous_response_id:
        raise APIError(400, "previous_response_id is not supported: this server stores no responses; send the "
                            "whole conversation in input", param="previous_response_id")
    fmt = (body.text or {}).get("format") or {}
    if isinstance(fmt, dict) and fmt.get("type", "text") != "text":
        raise APIError(400, f"text.format {fmt.get('type')!r} is not supported yet (no constrained decoding)",
                       param="text.format")
    tools, names = select_tools(function_tools(body), _tool_choice(body.tool_choice))
    effort = body.reasoning.effort if body.reasoning else None
    prompt = render_chat(state.tokenizer, input_messages(body), tools,
                         enable_thinking=EFFORT_THINKING.get(effort) if effort else None,
                         check_text=lambda text: state.check_prompt_text(text, "input"))
    try:
        max_tokens = resolve_max_tokens(state, len(prompt.ids), body.max_output_tokens)
    except Exception as e:
        raise as_api_error(e, "max_output_tokens") from None
    params = build_params({"max_tokens": "max_output_tokens", "logprobs": "top_logprobs"},
                          temperature=body.temperature, top_p=body.top_p, max_tokens=max_tokens,
                          stop=prompt.stop or None, logprobs=body.top_logprobs)
    return GenerationSpec(prompt.ids, params, names, prompt.in_reasoning)


async def _stream(state: ServeState, env: _Envelope, gen: Generation, want_logprobs: bool):
    w = _EventWriter(state, env, want_logprobs)
    yield w.event("response.created", response=env.response("in_progress", []))
    yield w.event("response.in_progress", response=env.response("in_progress", []))
    try:
        async for d in gen.events():
            if d.kind == "keepalive":
                yield KEEPALIVE
                continue
            for chunk in w.delta(d):
                yield chunk
    except Exception as e:
        err = as_api_error(e, "max_output_tokens")
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
    spec = await run_in_threadpool(prepare, state, body)   # tokenizing can take seconds
    env = _Envelope(body, body.model)
    want_logprobs = body.top_logprobs is not None
    if body.stream:
        gen = Generation(state, spec, stream=True, keepalive_s=state.config.keepalive_s)
        return SSEResponse(_stream(state, env, gen, want_logprobs))
    gen = Generation(state, spec, stream=False)
    try:
        result = await until_disconnect(request, gen.run())
    except ClientDisconnected:
        raise
    except Exception as e:
        raise as_api_error(e, "max_output_tokens") from None
    return JSONResponse(response_object(state, env, result, want_logprobs))

