"""OpenAI ``POST /v1/chat/completions``: request -> prompt -> engine -> ``chat.completion`` (or chunks)."""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import replace

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from lodestar.serve.chat_prompt import RenderedPrompt, render_chat
from lodestar.serve.errors import APIError, as_api_error, sse_error_payload
from lodestar.serve.generation import (Generation, GenerationSpec, RequestWarnings, Result, TokenLogprob,
                                       build_params, check_logit_bias, resolve_max_tokens, run_all, stream_all,
                                       with_speculation)
from lodestar.serve.protocol import ChatCompletionRequest, ContentPart, NamedToolChoice
from lodestar.serve.sse import DONE, KEEPALIVE, SSEResponse, sse_data
from lodestar.serve.state import ClientDisconnected, ServeState, get_state, until_disconnect
from lodestar.serve.structured import compile_grammar, openai_content_spec, output_grammar

router = APIRouter(tags=["OpenAI"])

EFFORT_THINKING = {"none": False, "minimal": False, "low": True, "medium": True, "high": True, "xhigh": True}


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


# -- request -> neutral shape --------------------------------------------------------------
def content_text(content: str | list[ContentPart] | None, where: str) -> str | None:
    """Text of a message's content; only text parts are supported."""
    if content is None or isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        if part.type not in ("text", "input_text", "output_text") or part.text is None:
            raise APIError(400, f"{where}[{j}]: content parts of type {part.type!r} are not supported; "
                                "this server reads text parts only", param=f"{where}[{j}]")
        texts.append(part.text)
    return "\n".join(texts)


def chat_messages(body: ChatCompletionRequest) -> list[dict]:
    out = []
    for i, m in enumerate(body.messages):
        msg: dict = {"role": m.role, "content": content_text(m.content, f"messages[{i}].content")}
        if m.name:
            msg["name"] = m.name
        if m.tool_calls:
            msg["tool_calls"] = [
                {"id": c.id or f"call_{i}_{j}", "type": "function",
                 "function": {"name": c.function.name,
                              "arguments": c.function.arguments if isinstance(c.function.arguments, str)
                              else json.dumps(c.function.arguments, ensure_ascii=False)}}
                for j, c in enumerate(m.tool_calls)]
        if m.tool_call_id:
            msg["tool_call_id"] = m.tool_call_id
        if m.reasoning_content:
            msg["reasoning_content"] = m.reasoning_content
        out.append(msg)
    return out


def chat_tools(body: ChatCompletionRequest, warnings: RequestWarnings) -> list[dict] | None:
    """The request's function tools; other types (``custom``, hosted tools) cannot be run here and are
    dropped with a warning rather than refused, so a client that declares them still works."""
    if not body.tools:
        return None
    tools = []
    for i, t in enumerate(body.tools):
        if t.type != "function":
            warnings.add(f"tools[{i}] of type {t.type!r} dropped: this server offers function tools only")
            continue
        if t.function is None:
            raise APIError(400, f"tools[{i}].function is required for a function tool", param=f"tools[{i}].function")
        tools.append({"type": "function", "function": t.function.model_dump(exclude_none=True)})
    return tools


def select_tools(tools: list[dict] | None, tool_choice, field: str = "tool_choice"
                 ) -> tuple[list[dict] | None, frozenset[str] | None]:
    """(tools for the prompt, names to parse) in OpenAI function-tool shape; tool_choice "none" drops them.

    A named choice keeps only that tool; "required" and a named choice are enforced by a grammar
    (``structured.output_grammar``).
    """
    if not tools or tool_choice == "none":
        return None, None
    if isinstance(tool_choice, str) or tool_choice is None:
        chosen = None
    else:
        chosen = tool_choice.function.name if isinstance(tool_choice, NamedToolChoice) else tool_choice.get("name")
    if chosen is not None:
        tools = [t for t in tools if t["function"]["name"] == chosen]
        if not tools:
            raise APIError(400, f"{field} names the tool {chosen!r}, which is not among the request's tools",
                           param=field)
    return tools, frozenset(t["function"]["name"] for t in tools)


def thinking_flag(effort: str | None, template_kwargs: dict | None) -> bool | None:
    if template_kwargs and "enable_thinking" in template_kwargs:
        return None  # the explicit template argument wins
    return EFFORT_THINKING.get(effort) if effort else None


CHAT_FIELDS = {"logprobs": "top_logprobs", "repetition_penalty": "repetition_penalty"}


def render_request(state: ServeState, body, warnings: RequestWarnings, *, tokenizer=None,
                   check_context: bool = True) -> tuple[RenderedPrompt, list[dict] | None, frozenset[str] | None]:
    """(the prompt, the tools it declares, the tool names to parse) of a chat request.

    ``body`` is a ``ChatCompletionRequest`` or any object with its ``messages``, ``tools``,
    ``tool_choice``, ``reasoning_effort`` and ``chat_template_kwargs`` (``/tokenize`` renders
    through here, so its count is the chat route's ``prompt_tokens``). ``tokenizer`` replaces
    the engine's for the template call; ``check_context`` refuses text that cannot fit the context.
    """
    tools, names = select_tools(chat_tools(body, warnings), body.tool_choice)
    check = (lambda text: state.check_prompt_text(text, "messages")) if check_context else None
    prompt = render_chat(tokenizer or state.tokenizer, chat_messages(body), tools,
                         enable_thinking=thinking_flag(body.reasoning_effort, body.chat_template_kwargs),
                         template_kwargs=body.chat_template_kwargs, check_text=check)
    return prompt, tools, names


def prepare(state: ServeState, body: ChatCompletionRequest, warnings: RequestWarnings) -> list[GenerationSpec]:
    """Validate and render a chat request into one engine spec per choice."""
    state.check_model(body.model)
    state.check_rows(body.n, "n")
    content = openai_content_spec(body)
    prompt, tools, names = render_request(state, body, warnings)
    grammar = output_grammar(state.tokenizer, content, tools, tool_choice=body.tool_choice,
                             parallel=body.parallel_tool_calls, in_reasoning=prompt.in_reasoning, warnings=warnings)
    max_field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    try:
        max_tokens = resolve_max_tokens(state, len(prompt.ids), requested, body.n, warnings=warnings,
                                        max_field=max_field)
    except Exception as e:
        raise as_api_error(e) from None
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    params = build_params(
        {**CHAT_FIELDS, "max_tokens": max_field}, state.config.sampling_defaults,
        temperature=body.temperature, top_p=body.top_p, top_k=max(body.top_k, 0) if body.top_k is not None else None,
        min_p=body.min_p, repetition_penalty=body.repetition_penalty, presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        logit_bias=check_logit_bias(body.logit_bias, state.tokenizer.vocab_size), seed=body.seed,
        max_tokens=max_tokens, stop=stop + prompt.stop or None, ignore_eos=body.ignore_eos or None,
        logprobs=(body.top_logprobs or 0) if body.logprobs else None, grammar=grammar.spec if grammar else None,
        speculate=body.speculate)
    in_reasoning = grammar.in_reasoning if grammar else prompt.in_reasoning
    specs = [GenerationSpec(prompt.ids, params if body.seed is None else replace(params, seed=body.seed + i),
                            names, in_reasoning, grammar=grammar) for i in range(body.n)]
    return specs


# -- engine results -> wire ----------------------------------------------------------------
def logprob_entries(entries: list[TokenLogprob]) -> list[dict]:
    return [{"token": e.token, "logprob": e.logprob, "bytes": e.bytes,
             "top_logprobs": [{"token": t.token, "logprob": t.logprob, "bytes": t.bytes} for t in e.top]}
            for e in entries]


def usage(state: ServeState, results: list[Result]) -> dict:
    prompt = results[0].prompt_tokens if results else 0
    completion = sum(r.completion_tokens for r in results)
    reasoning = sum(len(state.tokenizer.encode(r.reasoning, add_special_tokens=False)) for r in results
                    if r.reasoning)
    return with_speculation(
        {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
         "prompt_tokens_details": {"cached_tokens": results[0].cached_tokens if results else 0},
         "completion_tokens_details": {"reasoning_tokens": reasoning,
                                       "forced_tokens": sum(r.forced_tokens for r in results)}}, results)


def chat_response(state: ServeState, model: str, results: list[Result], want_logprobs: bool) -> dict:
    choices = []
    for i, r in enumerate(results):
        message: dict = {"role": "assistant", "content": r.content}
        if r.reasoning:
            message["reasoning_content"] = r.reasoning
        if r.tool_calls:
            message["tool_calls"] = [{"id": new_call_id(), "type": "function",
                                      "function": {"name": c.name, "arguments": c.arguments}} for c in r.tool_calls]
            if not r.content.strip():
                message["content"] = None
        choices.append({"index": i, "message": message, "finish_reason": r.finish_reason,
                        "logprobs": {"content": logprob_entries(r.logprobs), "refusal": None}
                        if want_logprobs else None})
    return {"id": "chatcmpl-" + uuid.uuid4().hex, "object": "chat.completion", "created": int(time.time()),
            "model": model, "system_fingerprint": None, "choices": choices, "usage": usage(state, results)}


async def stream_chat(state: ServeState, path: str, model: str, gens: list[Generation], want_logprobs: bool,
                      include_usage: bool):
    cid, created = "chatcmpl-" + uuid.uuid4().hex, int(time.time())

    def chunk(i: int, delta: dict, finish: str | None = None, lp: list[TokenLogprob] | None = None) -> str:
        choice = {"index": i, "delta": delta, "logprobs": None, "finish_reason": finish}
        if want_logprobs and lp:
            choice["logprobs"] = {"content": logprob_entries(lp), "refusal": None}
        body = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                "system_fingerprint": None, "choices": [choice]}
        if include_usage:
            body["usage"] = None
        return sse_data(body)

    for i in range(len(gens)):
        yield chunk(i, {"role": "assistant", "content": ""})
    call_ids: dict[tuple[int, int], str] = {}
    try:
        async for i, d in stream_all(gens):
            if d.kind == "keepalive":
                yield KEEPALIVE
            elif d.kind == "content":
                yield chunk(i, {"content": d.text}, lp=d.logprobs)
            elif d.kind == "reasoning":
                yield chunk(i, {"reasoning_content": d.text})
            elif d.kind == "tool_start":
                call_ids[(i, d.index)] = new_call_id()
                yield chunk(i, {"tool_calls": [{"index": d.index, "id": call_ids[(i, d.index)], "type": "function",
                                                "function": {"name": d.name, "arguments": ""}}]})
            elif d.kind == "tool_args":
                yield chunk(i, {"tool_calls": [{"index": d.index, "function": {"arguments": d.text}}]})
            elif d.kind == "end":
                r = gens[i].result
                yield chunk(i, {}, r.finish_reason, r.logprobs)
    except Exception as e:  # the status line is sent: report in the stream, as OpenAI does
        yield f"data: {sse_error_payload(path, as_api_error(e))}\n\n"
        yield DONE
        return
    if include_usage:
        yield sse_data({"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                        "system_fingerprint": None, "choices": [],
                        "usage": usage(state, [g.result for g in gens])})
    yield DONE


@router.post("/v1/chat/completions", summary="Create a chat completion (OpenAI)")
async def create_chat_completion(body: ChatCompletionRequest, request: Request):
    state = get_state(request)
    warnings = RequestWarnings()
    specs = await run_in_threadpool(prepare, state, body, warnings)   # tokenizing can take seconds
    await compile_grammar(state, specs[0].grammar)                    # a bad schema is a 400 before any stream
    if body.stream:
        gens = [Generation(state, s, stream=True, keepalive_s=state.config.keepalive_s) for s in specs]
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return SSEResponse(stream_chat(state, request.url.path, body.model, gens, body.logprobs, include_usage),
                           headers=warnings.headers())
    gens = [Generation(state, s, stream=False) for s in specs]
    try:
        results = await until_disconnect(request, run_all(gens))
    except ClientDisconnected:
        raise
    except Exception as e:
        raise as_api_error(e) from None
    return JSONResponse(chat_response(state, body.model, results, body.logprobs), headers=warnings.headers())

