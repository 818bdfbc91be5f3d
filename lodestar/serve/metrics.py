"""Prometheus text exposition of the server's counters, engine gauges and latency histograms,
plus the recent finished requests and the live decode rate the web dashboard reads (``/api/stats``).

Written by hand (the format is a few lines of text) so the server needs no client
library. Everything is updated from the event loop, so no locks.
"""
from __future__ import annotations

import bisect
import time
from collections import Counter, deque
from contextvars import ContextVar
from dataclasses import dataclass, field

from lodestar.engine.spec import SpecStats

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
DECODE_BUCKETS = (1, 2.5, 5, 10, 25, 50, 100, 250, 500, 1000, 2500)
RECENT_REQUESTS = 100         # finished requests kept for the dashboard's table
RATE_WINDOW_S = 5.0           # the live decode rate counts tokens streamed in this many seconds

# The ASGI scope of the HTTP request being served (set by the app's MetricsMiddleware): a
# finished generation names its route from it, so API modules need not pass the route along.
# A ContextVar, not shared state: each request's task sees only its own scope.
REQUEST_SCOPE: ContextVar[dict | None] = ContextVar("lodestar_request_scope", default=None)


def request_route() -> str:
    """The route template ("/v1/chat/completions") of the request being served, or "" outside one."""
    scope = REQUEST_SCOPE.get()
    if scope is None:
        return ""
    return getattr(scope.get("route"), "path", None) or scope.get("path", "")


@dataclass
class Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.buckets)

    def observe(self, value: float) -> None:
        i = bisect.bisect_left(self.buckets, value)
        if i < len(self.counts):
            self.counts[i] += 1
        self.total += value
        self.count += 1

    def lines(self, name: str, labels: str) -> list[str]:
        out, running = [], 0
        sep = "," if labels else ""
        for bound, n in zip(self.buckets, self.counts):
            running += n
            out.append(f'{name}_bucket{{{labels}{sep}le="{bound:g}"}} {running}')
        out.append(f'{name}_bucket{{{labels}{sep}le="+Inf"}} {self.count}')
        out.append(f"{name}_sum{{{labels}}} {self.total:.6f}")
        out.append(f"{name}_count{{{labels}}} {self.count}")
        return out


@dataclass
class FinishedRequest:
    """One finished engine request, as the dashboard's request table shows it."""

    id: int                          # order of finishing since the server started
    route: str                       # "" when it did not come over HTTP
    model: str
    started: float                   # Unix time of submission
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    ttft_ms: float | None            # None: no token came
    decode_tok_s: float | None       # None: fewer than two tokens
    finish_reason: str
    spec_acceptance: float | None    # accepted / drafted; None: no draft was scored


@dataclass
class TokenRate:
    """Tokens per second over the last ``window_s`` seconds, fed as tokens stream out (not when
    requests finish, so a long generation shows up while it runs)."""

    window_s: float = RATE_WINDOW_S
    events: deque = field(default_factory=deque)    # (monotonic time, tokens)
    total: int = 0                                  # tokens in ``events``

    def add(self, tokens: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self.events.append((now, tokens))
        self.total += tokens
        self._drop_before(now - self.window_s)

    def rate(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        self._drop_before(now - self.window_s)
        return self.total / self.window_s

    def _drop_before(self, cutoff: float) -> None:
        while self.events and self.events[0][0] < cutoff:
            self.total -= self.events.popleft()[1]


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


@dataclass
class Metrics:
    requests: Counter = field(default_factory=Counter)          # (route, status) -> count
    finished: Counter = field(default_factory=Counter)          # finish reason -> count
    prompt_tokens: int = 0
    generation_tokens: int = 0
    cached_tokens: int = 0
    forced_tokens: int = 0
    constrained: Counter = field(default_factory=Counter)       # grammar kind -> finished requests
    spec_drafted: int = 0
    spec_accepted: int = 0
    spec_verify_steps: int = 0
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    decode_speed: Histogram = field(default_factory=lambda: Histogram(DECODE_BUCKETS))
    recent: deque = field(default_factory=lambda: deque(maxlen=RECENT_REQUESTS))   # FinishedRequest, oldest first
    decode_rate: TokenRate = field(default_factory=TokenRate)
    finished_count: int = 0

    def record_request(self, route: str, status: int) -> None:
        self.requests[(route, str(status))] += 1

    def record_generation(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int,
                          finish_reason: str, ttft_s: float | None, decode_tok_s: float | None,
                          forced_tokens: int = 0, grammar_kind: str | None = None,
                          speculation: SpecStats | None = None, *, route: str = "", model: str = "",
                          started: float | None = None) -> None:
        """One finished engine request; ``speculation`` is its ``engine.spec.SpecStats`` (None: it did not
        speculate); ``started`` is its Unix submission time (None: now)."""
        self.prompt_tokens += prompt_tokens
        self.forced_tokens += forced_tokens
        if speculation is not None:
            self.spec_drafted += speculation.drafted
            self.spec_accepted += speculation.accepted
            self.spec_verify_steps += speculation.verify_steps
        if grammar_kind is not None:
            self.constrained[grammar_kind] += 1
        self.generation_tokens += completion_tokens
        self.cached_tokens += cached_tokens
        self.finished[finish_reason] += 1
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
        if decode_tok_s is not None:
            self.decode_speed.observe(decode_tok_s)
        self.finished_count += 1
        acceptance = speculation.accepted / speculation.drafted if speculation is not None and speculation.drafted \
            else None
        self.recent.append(FinishedRequest(
            self.finished_count, route, model, time.time() if started is None else started, prompt_tokens,
            cached_tokens, completion_tokens, None if ttft_s is None else ttft_s * 1000.0, decode_tok_s,
            finish_reason, acceptance))

    def record_tokens(self, tokens: int) -> None:
        """Output tokens that just streamed out (the live decode rate)."""
        if tokens:
            self.decode_rate.add(tokens)

    def render(self, engine_stats: dict, model: str) -> str:
        m = f'model="{_escape(model)}"'
        lines: list[str] = []

        def metric(name: str, kind: str, help_: str, samples: list[str]) -> None:
            lines.append(f"# HELP {name} {help_}")
            lines.append(f"# TYPE {name} {kind}")
            lines.extend(samples)

        metric("lodestar_requests_total", "counter", "HTTP requests by route and status.",
               [f'lodestar_requests_total{{route="{_escape(r)}",status="{s}"}} {n}'
                for (r, s), n in sorted(self.requests.items())])
        metric("lodestar_requests_finished_total", "counter", "Engine requests by finish reason.",
               [f'lodestar_requests_finished_total{{{m},reason="{_escape(r)}"}} {n}'
                for r, n in sorted(self.finished.items())])
        metric("lodestar_prompt_tokens_total", "counter", "Prompt tokens processed.",
               [f"lodestar_prompt_tokens_total{{{m}}} {self.prompt_tokens}"])
        metric("lodestar_generation_tokens_total", "counter", "Tokens generated.",
               [f"lodestar_generation_tokens_total{{{m}}} {self.generation_tokens}"])
        metric("lodestar_cached_prompt_tokens_total", "counter", "Prompt tokens whose KV came from the prefix cache.",
               [f"lodestar_cached_prompt_tokens_total{{{m}}} {self.cached_tokens}"])
        rate = self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
        metric("lodestar_prefix_cache_hit_rate", "gauge", "Cached prompt tokens / prompt tokens since start.",
               [f"lodestar_prefix_cache_hit_rate{{{m}}} {rate:.6f}"])
        metric("lodestar_constrained_requests_total", "counter",
               "Engine requests whose output followed a grammar, by kind (json_schema, regex, choice, grammar, "
               "tool_call).",
               [f'lodestar_constrained_requests_total{{{m},kind="{_escape(k)}"}} {n}'
                for k, n in sorted(self.constrained.items())])
        metric("lodestar_forced_tokens_total", "counter",
               "Output tokens a grammar forced (appended by jump-forward without sampling).",
               [f"lodestar_forced_tokens_total{{{m}}} {self.forced_tokens}"])
        metric("lodestar_spec_drafted_tokens_total", "counter",
               "Draft tokens the model scored in speculative verify steps (finished requests).",
               [f"lodestar_spec_drafted_tokens_total{{{m}}} {self.spec_drafted}"])
        metric("lodestar_spec_accepted_tokens_total", "counter",
               "Draft tokens that entered the output; accepted / drafted is the acceptance rate.",
               [f"lodestar_spec_accepted_tokens_total{{{m}}} {self.spec_accepted}"])
        metric("lodestar_spec_verify_steps_total", "counter",
               "Model steps that scored at least one draft token (finished requests).",
               [f"lodestar_spec_verify_steps_total{{{m}}} {self.spec_verify_steps}"])
        metric("lodestar_grammar_mask_seconds_total", "counter", "Time the engine spent filling grammar token masks.",
               [f"lodestar_grammar_mask_seconds_total{{{m}}} {engine_stats.get('grammar_mask_ns', 0) / 1e9:.6f}"])
        metric("lodestar_grammar_mask_rows_total", "counter", "Grammar token masks filled (one per constrained row "
               "per step).", [f"lodestar_grammar_mask_rows_total{{{m}}} {engine_stats.get('grammar_mask_rows', 0)}"])
        for key, name, help_ in (("waiting", "lodestar_queue_depth", "Requests waiting to start."),
                                 ("running", "lodestar_running_sequences", "Sequences being decoded."),
                                 ("kv_blocks_used", "lodestar_kv_blocks_used", "KV cache blocks in use."),
                                 ("kv_blocks_total", "lodestar_kv_blocks_total", "KV cache blocks in the pool.")):
            metric(name, "gauge", help_, [f"{name}{{{m}}} {engine_stats.get(key, 0)}"])
        metric("lodestar_time_to_first_token_seconds", "histogram", "Time from submission to the first token.",
               self.ttft.lines("lodestar_time_to_first_token_seconds", m))
        metric("lodestar_decode_tokens_per_second", "histogram", "Per-request decode speed after the first token.",
               self.decode_speed.lines("lodestar_decode_tokens_per_second", m))
        return "\n".join(lines) + "\n"


def grammar_stats(engine) -> dict:
    """The engine's grammar-mask counters (an AsyncLLMEngine's LLMEngine keeps them in ``stats``).

    Read from the event loop while the engine thread adds to them: two dict lookups, no iteration."""
    stats = getattr(getattr(engine, "engine", None), "stats", None)
    if not hasattr(stats, "get"):
        return {}
    return {key: stats.get(key, 0) for key in ("grammar_mask_ns", "grammar_mask_rows")}
