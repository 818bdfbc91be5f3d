"""OpenAI ``POST /v1/completions``: raw prompts (text or token ids) -> ``text_completion``."""
from __future__ import annotations

import time
import uuid
from dataclasses import replace

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from lodestar.serve.errors import APIError, as_api_error, sse_error_payload
from lodestar.serve.generation import (Generation, GenerationSpec, RequestWarnings, Result, TokenLogprob,
                                       build_params, check_logit_bias, check_prompt_ids, resolve_max_tokens, run_all,
                                       stream_all, with_speculation)
from lodestar.serve.protocol import CompletionRequest
from lodestar.serve.sse import DONE, KEEPALIVE, SSEResponse, sse_data
from lodestar.serve.state import ClientDisconnected, ServeState, get_state, until_disconnect
from lodestar.serve.structured import OutputGrammar, compile_grammar, openai_content_spec

router = APIRouter(tags=["OpenAI"])


def prompt_ids(state: ServeState, prompt, n: int = 1) -> list[list[int]]:
    """One token-id list per prompt (refusing more than the server takes at once, with ``n`` choices each)."""
    tok = state.tokenizer
    if isinstance(prompt, str):
        prompts = [prompt]
    elif prompt and all(isinstance(p, int) for p in prompt):
        prompts = [prompt]
    else:
        prompts = list(prompt)
    if not prompts:
        raise APIError(400, "prompt is empty", param="prompt")
    state.check_rows(len(prompts) * n, "prompt")
    out = []
    for i, p in enumerate(prompts):
        where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
        if isinstance(p, str):
            state.check_prompt_text(p, where)
        ids = tok.encode(p) if isinstance(p, str) else list(p)
        check_prompt_ids(ids, tok.vocab_size, where)
        out.append(ids)
    return out


def legacy_logprobs(entries: list[TokenLogprob], offset: int, prompt: list[str] | None = None) -> dict:
    tokens, token_lps, tops, offsets = [], [], [], []
    for text in prompt or ():
        tokens.append(text)
        token_lps.append(None)
        tops.append(None)
        offsets.append(offset)
        offset += len(text)
    for e in entries:
        tokens.append(e.token)
        token_lps.append(e.logprob)
        tops.append({t.token: t.logprob for t in e.top})
        offsets.append(offset)
        offset += len(e.token)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def completion_usage(prompts: list[list[int]], results: list[Result], n: int) -> dict:
    """Each prompt counts once, however many choices it has."""
    prompt = sum(len(p) for p in prompts)
    completion = sum(r.completion_tokens for r in results)
    cached = sum(r.cached_tokens for r in results[::n])
    return with_speculation(
        {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
         "prompt_tokens_details": {"cached_tokens": cached},
         "completion_tokens_details": {"forced_tokens": sum(r.forced_tokens for r in results)}}, results)


@router.post("/v1/completions", summary="Create a text completion (OpenAI)")
async def create_completion(body: CompletionRequest, request: Request):
    state = get_state(request)
    model = state.check_model(body.model)
    if body.suffix:
        raise APIError(400, "suffix (fill-in-the-middle) is not supported", param="suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise APIError(400, "best_of must equal n (no server-side ranking)", param="best_of")
    content = openai_content_spec(body)
    grammar = OutputGrammar(content, False) if content is not None else None
    await compile_grammar(state, grammar)                                      # a 400 before any stream
    prompts = await run_in_threadpool(prompt_ids, state, body.prompt, body.n)   # tokenizing can take seconds
    n = body.n
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    bias = check_logit_bias(body.logit_bias, state.tokenizer.vocab_size)
    specs = []
    warnings = RequestWarnings()
    try:
        for i, ids in enumerate(prompts):
            where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
            max_tokens = resolve_max_tokens(state, len(ids), body.max_tokens, n * len(prompts), warnings=warnings,
                                            prompt_field=where)
            params = build_params(
                {}, state.config.sampling_defaults, temperature=body.temperature, top_p=body.top_p,
                top_k=max(body.top_k, 0) if body.top_k is not None else None, min_p=body.min_p,
                repetition_penalty=body.repetition_penalty, presence_penalty=body.presence_penalty,
                frequency_penalty=body.frequency_penalty, logit_bias=bias, seed=body.seed, max_tokens=max_tokens,
                stop=stop or None, ignore_eos=body.ignore_eos or None, logprobs=body.logprobs,
                grammar=content, speculate=body.speculate)
            for j in range(n):
                p = params if body.seed is None else replace(params, seed=body.seed + j)
                specs.append(GenerationSpec(ids, p, parse_reasoning=False, grammar=grammar))
    except APIError:
        raise
    except Exception as e:
        raise as_api_error(e, "prompt") from None
    echoes = [state.tokenizer.decode(ids, skip_special_tokens=True) if body.echo else "" for ids in prompts]
    echo_pieces = [[state.tokenizer.decode([t]) for t in ids] for ids in prompts] if body.echo else None

    def prompt_of(choice: int) -> int:
        return choice // n

    if body.stream:
        gens = [Generation(state, s, stream=True, keepalive_s=state.config.keepalive_s) for s in specs]
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return SSEResponse(_stream(state, request.url.path, model, gens, prompts, echoes, echo_pieces,
                                   body.logprobs is not None, include_usage, prompt_of), headers=warnings.headers())
    gens = [Generation(state, s, stream=False) for s in specs]
    try:
        results = await until_disconnect(request, run_all(gens))
    except ClientDisconnected:
        raise
    except Exception as e:
        raise as_api_error(e, "prompt") from None
    choices = []
    for i, r in enumerate(results):
        p = prompt_of(i)
        lp = None
        if body.logprobs is not None:
            lp = legacy_logprobs(r.logprobs, 0, echo_pieces[p] if echo_pieces else None)
        choices.append({"index": i, "text": echoes[p] + r.content, "logprobs": lp, "finish_reason": r.finish_reason})
    return JSONResponse({"id": "cmpl-" + uuid.uuid4().hex, "object": "text_completion", "created": int(time.time()),
                         "model": model, "system_fingerprint": None, "choices": choices,
                         "usage": completion_usage(prompts, results, n)}, headers=warnings.headers())


async def _stream(state: ServeState, path: str, model: str, gens: list[Generation], prompts, echoes, echo_pieces,
                  want_logprobs: bool, include_usage: bool, prompt_of):
    cid, created = "cmpl-" + uuid.uuid4().hex, int(time.time())
    offsets = [0] * len(gens)

    def chunk(i: int, text: str, finish: str | None = None, lp: dict | None = None) -> str:
        body = {"id": cid, "object": "text_completion", "created": created, "model": model,
                "system_fingerprint": None,
                "choices": [{"index": i, "text": text, "logprobs": lp, "finish_reason": finish}]}
        if include_usage:
            body["usage"] = None
        return sse_data(body)

    for i in range(len(gens)):
        p = prompt_of(i)
        if echoes[p]:
            lp = legacy_logprobs([], 0, echo_pieces[p]) if want_logprobs else None
            offsets[i] = len(echoes[p])
            yield chunk(i, echoes[p], lp=lp)
    try:
        async for i, d in stream_all(gens):
            if d.kind == "keepalive":
                yield KEEPALIVE
            elif d.kind == "content":
                lp = legacy_logprobs(d.logprobs, offsets[i]) if want_logprobs else None
                offsets[i] += len(d.text)
                yield chunk(i, d.text, lp=lp)
            elif d.kind == "end":
                r = gens[i].result
                lp = legacy_logprobs(r.logprobs, offsets[i]) if want_logprobs and r.logprobs else None
                yield chunk(i, "", r.finish_reason, lp)
    except Exception as e:
        yield f"data: {sse_error_payload(path, as_api_error(e))}\n\n"
        yield DONE
        return
    if include_usage:
        yield sse_data({"id": cid, "object": "text_completion", "created": created, "model": model, "choices": [],
                        "usage": completion_usage(prompts, [g.result for g in gens], len(gens) // len(prompts))})
    yield DONE
