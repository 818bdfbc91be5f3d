"""One engine request seen as API-neutral events: the part every API module shares.

``Generation.events()`` submits the prompt, reads the engine's outputs and turns them into
``Delta`` events -- reasoning text, content text, tool-call start / argument / end --
with keep-alive ticks while no token arrives. When it ends, ``Generation.result`` holds
the finish reason, usage and (for non-streaming requests) the whole parsed answer. API
modules only translate these into their own wire grammar.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any, AsyncIterator

from lodestar.engine.async_engine import QueueFullError
from lodestar.engine.sampling import SamplingParams
from lodestar.engine.spec import SpecStats
from lodestar.serve.errors import APIError, prompt_too_long_error, sampling_error
from lodestar.serve.metrics import request_route
from lodestar.serve.reasoning import ReasoningParser, split_reasoning
from lodestar.serve.state import ServeState
from lodestar.serve.structured import OutputGrammar, grammar_label
from lodestar.serve.tool_parsers import ToolCall, ToolCallParser, parse_tool_calls

log = logging.getLogger("lodestar.serve")

WARNING_HEADER = "x-lodestar-warning"


class RequestWarnings:
    """What the server changed or left out of a request instead of refusing it.

    Each warning goes to the server log at once and back to the client in one
    ``x-lodestar-warning`` header (the body keeps the API's own shape).
    """

    MAX_HEADER_CHARS = 2000

    def __init__(self) -> None:
        self.messages: list[str] = []

    def add(self, message: str) -> None:
        if message not in self.messages:
            self.messages.append(message)
            log.warning("request changed: %s", message)

    def headers(self) -> dict[str, str]:
        if not self.messages:
            return {}
        text = " | ".join(self.messages).replace("\r", " ").replace("\n", " ")
        text = text.encode("ascii", "replace").decode("ascii")     # header values are latin-1; keep ASCII
        if len(text) > self.MAX_HEADER_CHARS:
            text = text[:self.MAX_HEADER_CHARS - 3] + "..."
        return {WARNING_HEADER: text}


@dataclass
class TopLogprob:
    token: str
    bytes: list[int]
    logprob: float


@dataclass
class TokenLogprob:
    token: str
    bytes: list[int]
    logprob: float
    top: list[TopLogprob] = field(default_factory=list)


@dataclass
class Delta:
    """``reasoning`` / ``content`` (text), ``tool_start`` (index, name), ``tool_args`` (index, text),
    ``tool_end`` (index), or ``keepalive`` (nothing arrived for a while)."""

    kind: str
    text: str = ""
    index: int = 0
    name: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass
class Result:
    finish_reason: str = "abort"          # stop | length | tool_calls | abort | error
    stop_sequence: str | None = None      # the stop string that ended the output
    content: str = ""                     # non-streaming: the answer without reasoning and tool markup
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    text: str = ""                        # everything the model wrote (markup included)
    logprobs: list[TokenLogprob] = field(default_factory=list)   # streaming: those not sent with a delta
    token_ids: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    forced_tokens: int = 0                # output tokens the grammar forced (jump-forward, no sampling)
    speculation: SpecStats | None = None  # drafts scored and accepted (None: the request did not speculate)


@dataclass
class GenerationSpec:
    prompt_ids: list[int]
    params: SamplingParams
    tool_names: frozenset[str] | None = None   # parse tool calls of these tools
    in_reasoning: bool = False                 # the output starts inside a <think> span
    parse_reasoning: bool = True
    grammar: OutputGrammar | None = None       # what params.grammar came from; compile it before generating


def build_params(fields: dict[str, str], defaults: dict[str, Any] | None = None, **values: Any) -> SamplingParams:
    """SamplingParams from request values (None = the server's ``defaults``, else the engine's);
    ``fields`` maps engine to API field names."""
    kwargs = {k: v for k, v in values.items() if v is not None}
    for k, v in (defaults or {}).items():
        kwargs.setdefault(k, v)
    if kwargs.get("stop"):
        # The server strips the stop string itself, so it knows which one matched.
        kwargs["include_stop_str_in_output"] = True
    try:
        return SamplingParams(**kwargs)
    except ValueError as e:
        raise sampling_error(e, fields) from None


def speculation_usage(results: list[Result]) -> dict | None:
    """``usage.speculation`` of one or more choices (their counts summed), or None when none speculated."""
    specs = [r.speculation for r in results if r.speculation is not None]
    if not specs:
        return None
    return SpecStats(sum(s.drafted for s in specs), sum(s.accepted for s in specs),
                     sum(s.verify_steps for s in specs), sum(s.emitted for s in specs)).to_dict()


def with_speculation(usage: dict, results: list[Result]) -> dict:
    """``usage`` with ``speculation`` added when a result speculated."""
    spec = speculation_usage(results)
    if spec is not None:
        usage["speculation"] = spec
    return usage


def check_logit_bias(bias: dict | None, vocab_size: int, field_name: str = "logit_bias") -> dict[int, float]:
    out: dict[int, float] = {}
    for key, value in (bias or {}).items():
        try:
            tid = int(key)
        except (TypeError, ValueError):
            raise APIError(400, f"{field_name} keys must be token ids, got {key!r}", param=field_name) from None
        if not 0 <= tid < vocab_size:
            raise APIError(400, f"{field_name} names token {tid}, but the vocabulary has {vocab_size} tokens",
                           param=field_name)
        out[tid] = float(value)
    return out


def resolve_max_tokens(state: ServeState, prompt_len: int, requested: int | None, n: int = 1, *,
                       warnings: RequestWarnings | None = None, max_field: str = "max_tokens",
                       prompt_field: str = "messages", anthropic: bool = False) -> int:
    """The request's token budget; raises the 400/503 errors a stream could no longer report as a status.

    A prompt that leaves no room for one output token is a 400 naming both counts and the fix.
    Otherwise the output may use the rest of the context: an uncapped request gets all of it
    (or the server's ``--max-tokens``, when set),
    and a cap larger than that is lowered to it, with a warning, rather than refused (OpenAI
    refuses it, but coding tools send a fixed output cap with whatever prompt they have, and a
    400 there breaks the tool). Either way the output stops with finish reason ``length``.
    """
    context = state.engine.max_model_len
    if prompt_len + 1 > context:
        raise prompt_too_long_error(prompt_len, context, state.trained_context, prompt_field, anthropic)
    stats = state.engine.stats()
    limit = getattr(state.engine, "max_queued", None)
    if limit is not None and stats.get("waiting", 0) + n > limit:
        raise QueueFullError(stats.get("waiting", 0), limit)
    room = context - prompt_len
    if requested is None:           # the server's cap (serve --max-tokens), else the rest of the context
        cap = state.config.sampling_defaults.get("max_tokens")
        return room if cap is None else min(cap, room)
    if requested <= room:
        return requested
    if warnings is not None:
        warnings.add(f"{max_field}={requested} lowered to {room}: the prompt has {prompt_len} tokens and the "
                     f"context is {context}, so the output stops after {room} tokens (finish reason length); "
                     f"serve a longer context (--ctx) or lower the client's max output setting")
    return room


def check_prompt_ids(ids: list[int], vocab_size: int, field_name: str = "prompt") -> None:
    if not ids:
        raise APIError(400, f"{field_name} is empty", param=field_name)
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise APIError(400, f"{field_name} has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}",
                       param=field_name)


class Generation:
    def __init__(self, state: ServeState, spec: GenerationSpec, stream: bool, keepalive_s: float | None = None) -> None:
        self.state, self.spec, self.stream = state, spec, stream
        self.keepalive_s = keepalive_s if stream else None
        self.result = Result(prompt_tokens=len(spec.prompt_ids))
        tool_names = spec.tool_names
        self._reasoning = ReasoningParser(spec.in_reasoning) if spec.parse_reasoning else None
        self._tools = ToolCallParser(tool_names) if tool_names else None
        self._pending_lp: list[TokenLogprob] = []
        self._pieces: dict[int, tuple[str, list[int]]] = {}

    # -- logprobs -----------------------------------------------------------------
    def _piece(self, tid: int) -> tuple[str, list[int]]:
        if tid not in self._pieces:
            raw = self.state.tokenizer.token_bytes(tid)
            self._pieces[tid] = (raw.decode("utf-8", errors="replace"), list(raw))
        return self._pieces[tid]

    def _logprobs(self, out) -> list[TokenLogprob]:
        entries = []
        for tid, (chosen, top) in zip(out.token_ids, out.logprobs or ()):
            text, raw = self._piece(tid)
            entries.append(TokenLogprob(text, raw, chosen,
                                        [TopLogprob(*self._piece(t), lp) for t, lp in (top or ())]))
        return entries

    # -- the stream ---------------------------------------------------------------
    async def events(self) -> AsyncIterator[Delta]:
        """Deltas as they become final (streaming), or nothing (non-streaming); ``result`` is set at the end."""
        engine, spec, res = self.state.engine, self.spec, self.result
        agen = engine.generate(spec.prompt_ids, spec.params)
        t0, started = time.perf_counter(), time.time()
        t_first: float | None = None
        last_sent = t0                   # the last event the client got (keep-alives count)
        nxt: asyncio.Future | None = asyncio.ensure_future(agen.__anext__())
        try:
            while True:
                if self.keepalive_s:
                    timeout = max(0.0, last_sent + self.keepalive_s - time.perf_counter())
                    done, _ = await asyncio.wait({nxt}, timeout=timeout)
                    if not done:
                        last_sent = time.perf_counter()
                        yield Delta("keepalive")
                        continue
                try:
                    out = await nxt
                except StopAsyncIteration:
                    nxt = None
                    break
                nxt = None
                last_sent = time.perf_counter()
                if t_first is None:
                    t_first = last_sent
                self.state.metrics.record_tokens(len(out.token_ids))
                for delta in self._accept(out):
                    yield delta
                if out.finished:
                    res.finish_reason = out.finish_reason or "stop"
                    for delta in self._finish():
                        yield delta
                    break
                nxt = asyncio.ensure_future(agen.__anext__())
        except Exception:
            res.finish_reason = "error"
            raise
        finally:
            if nxt is not None and not nxt.done():
                nxt.cancel()                 # the engine stream's own cleanup aborts the request
            else:
                await agen.aclose()
            t_end = time.perf_counter()
            decode = None
            if t_first is not None and res.completion_tokens > 1 and t_end > t_first:
                decode = (res.completion_tokens - 1) / (t_end - t_first)
            self.state.metrics.record_generation(res.prompt_tokens, res.completion_tokens, res.cached_tokens,
                                                 res.finish_reason, None if t_first is None else t_first - t0,
                                                 decode, res.forced_tokens, grammar_label(spec.grammar),
                                                 res.speculation, route=request_route(),
                                                 model=self.state.model_id, started=started)

    async def run(self) -> Result:
        async for _ in self.events():
            pass
        return self.result

    def _accept(self, out) -> list[Delta]:
        res = self.result
        res.token_ids += out.token_ids
        res.completion_tokens = out.completion_tokens or len(res.token_ids)
        res.prompt_tokens = out.prompt_tokens or res.prompt_tokens
        res.cached_tokens = max(res.cached_tokens, getattr(out, "cached_tokens", 0) or 0)
        res.forced_tokens = max(res.forced_tokens, getattr(out, "forced_tokens", 0) or 0)   # cumulative
        if getattr(out, "speculation", None) is not None:
            res.speculation = replace(out.speculation)    # cumulative; a copy, as the engine thread adds to its own
        text = out.text
        for tid in out.token_ids:                    # markup special tokens the detokenizer dropped
            piece = self.state.markup_ids.get(tid)
            if piece is not None:
                text += piece
        if out.finished and out.finish_reason == "stop" and self.spec.params.stop:
            whole = res.text + text
            matched = [s for s in self.spec.params.stop if whole.endswith(s)]
            if matched:
                res.stop_sequence = max(matched, key=len)
                text = text[:max(0, len(text) - len(res.stop_sequence))]
        res.text += text
        if self.spec.params.logprobs is not None and out.logprobs:
            self._pending_lp += self._logprobs(out)
        if not self.stream:
            return []
        return self._parse(text)

    def _parse(self, text: str, final: bool = False) -> list[Delta]:
        if self._reasoning is not None:
            pieces = self._reasoning.feed(text) if text else []
            if final:
                pieces += self._reasoning.flush()
        else:
            pieces = [("content", text)] if text else []
        deltas: list[Delta] = []
        for kind, piece in pieces:
            if kind == "reasoning":
                deltas.append(Delta("reasoning", piece))
            elif self._tools is not None:
                for e in self._tools.feed(piece):
                    deltas.append(self._tool_delta(e))
            else:
                deltas.append(Delta("content", piece))
        if final and self._tools is not None:
            deltas += [self._tool_delta(e) for e in self._tools.finish()]
        for d in deltas:
            if d.kind == "content" and self._pending_lp:
                d.logprobs, self._pending_lp = self._pending_lp, []
        return deltas

    @staticmethod
    def _tool_delta(e) -> Delta:
        kind = "content" if e.kind == "content" else "tool_" + e.kind
        return Delta(kind, e.text, e.index, e.name)

    def _finish(self) -> list[Delta]:
        res = self.result
        if not self.stream:
            if self._reasoning is not None:
                res.reasoning, content = split_reasoning(res.text, self.spec.in_reasoning)
            else:
                content = res.text
            if self.spec.tool_names:
                content, res.tool_calls = parse_tool_calls(content, self.spec.tool_names)
            res.content = content
            res.logprobs, self._pending_lp = self._pending_lp, []
            if res.tool_calls and res.finish_reason == "stop":
                res.finish_reason = "tool_calls"
            return []
        deltas = self._parse("", final=True)
        res.logprobs, self._pending_lp = self._pending_lp, []
        if self._tools is not None and self._tools.calls:
            res.tool_calls = self._tools.calls
            if res.finish_reason == "stop":
                res.finish_reason = "tool_calls"
        return deltas


async def _until_end(gen: Generation) -> AsyncIterator[Delta]:
    async for delta in gen.events():
        yield delta
    yield Delta("end")


def stream_all(gens: list[Generation]) -> AsyncIterator[tuple[int, Delta]]:
    """Events of several generations as (choice index, delta); each ends with Delta("end")."""
    return merge_streams([_until_end(g) for g in gens])


async def run_all(gens: list[Generation]) -> list[Result]:
    """Run generations together; cancelling this cancels (and aborts) all of them."""
    return list(await asyncio.gather(*(g.run() for g in gens)))


async def merge_streams(streams: list[AsyncIterator]) -> AsyncIterator[tuple[int, Any]]:
    """Interleave several event streams as (stream index, event); an error in one ends all."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: AsyncIterator) -> None:
        try:
            async for item in stream:
                await queue.put((i, item))
            await queue.put((i, done))
        except Exception as e:  # handed to the consumer, which raises it
            await queue.put((i, e))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
