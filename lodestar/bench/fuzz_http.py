"""Fuzz a running server over HTTP: malformed, hostile, oversized and cancelled requests.

``lodestar bench fuzz`` starts ``lodestar serve`` on a loopback port in a child process,
warms it up, records its resident memory and the latency of one fixed request, sends
``--count`` requests from ``--workers`` client threads, waits for the engine to go idle
and measures again. It reports the requests tried by kind and status, every 5xx (a 503
with ``Retry-After`` from a full queue is the one allowed), every request that took
longer than ``--timeout`` (a hang), connections the server dropped, the KV blocks still
held at the end and the change in memory and latency. Loopback only; bounded by count
and by ``--max-seconds``.

The request mix (seeded, reproducible): valid requests on every route with random
sampling settings (a few tokens each); valid requests with one to three values anywhere
in the body replaced by hostile ones (wrong types, huge or negative numbers, NaN, deep
nesting, long strings, lone surrogates, markup tokens); raw bodies that are not the JSON
they claim (random bytes, truncated, wrong top-level type, invalid UTF-8); wrong methods,
unknown and traversal paths; and streams the client abandons after a few events.
"""
from __future__ import annotations

import argparse
import copy
import json
import random
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages", "/v1/messages/count_tokens")
MAX_TOKEN_KEYS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
KINDS = {"valid": 0.22, "mutated": 0.43, "raw": 0.13, "http": 0.10, "cancel": 0.12}


def _nasty_values(rng: random.Random) -> list:
    deep: list = []
    for _ in range(rng.choice([50, 400])):
        deep = [deep]
    return [None, True, False, 0, -1, 1, 2 ** 31, 2 ** 64, -(2 ** 63), 1e308, -1e308, 0.5, -0.0,
            float("nan"), float("inf"), "", " ", "x" * rng.choice([1000, 100_000]), "\u0000\u0001",
            "<|im_start|>system\n", "<|im_end|>", "\ud83d\ude00", "\ud800", "\\u0000", "{{ raise_exception('x') }}",
            "{% for x in range(10**9) %}{% endfor %}", "../../etc/passwd", [], [None], [{}], [[[]]], {}, {"": ""},
            {"type": "text"}, {"type": "image_url"}, {"role": "tool"}, deep, ["a"] * 300,
            {str(i): i for i in range(300)}, "NaN", "Infinity", "-1", "1e309"]


def _valid_body(route: str, model: str, rng: random.Random) -> dict:
    """A request the server must answer 200, a few tokens long."""
    text = rng.choice(["Hi", "Say one word.", "2+2=", "Write a haiku about rust.", "¿Qué tal? 😀",
                       "def f(x):", "List three colors."])
    n_tokens = rng.randint(1, 6)
    sampling = {}
    if rng.random() < 0.5:
        sampling["temperature"] = rng.choice([0.0, 0.3, 0.8, 1.5])
    if rng.random() < 0.3:
        sampling["top_p"] = rng.choice([0.1, 0.5, 0.95])
    stream = rng.random() < 0.5
    if route == "/v1/chat/completions":
        body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": n_tokens,
                "stream": stream, **sampling}
        if rng.random() < 0.2:
            body["messages"].insert(0, {"role": "system", "content": "Be brief."})
        if rng.random() < 0.15:
            body["n"] = 2
        if rng.random() < 0.15:
            body["logprobs"], body["top_logprobs"] = True, rng.randint(0, 5)
        if rng.random() < 0.15:
            body["stop"] = ["\n", "x" * rng.randint(1, 1024)]
        if rng.random() < 0.15:
            body["tools"] = [{"type": "function", "function": {"name": "get_time", "parameters": {
                "type": "object", "properties": {"tz": {"type": "string"}}}}}]
        return body
    if route == "/v1/completions":
        body = {"model": model, "prompt": text, "max_tokens": n_tokens, "stream": stream, **sampling}
        if rng.random() < 0.2:
            body["prompt"] = [text, "Once upon a time"]
        if rng.random() < 0.1:
            body["echo"], body["logprobs"] = True, 2
        return body
    if route == "/v1/responses":
        return {"model": model, "input": text, "max_output_tokens": n_tokens, "stream": stream, **sampling}
    if route == "/v1/messages":
        body = {"model": model, "max_tokens": n_tokens, "messages": [{"role": "user", "content": text}],
                "stream": stream}
        if rng.random() < 0.2:
            body["system"] = "Be brief."
        if rng.random() < 0.15:
            body["stop_sequences"] = ["\n\n"]
        return body
    return {"model": model, "messages": [{"role": "user", "content": text}]}


def _paths(value, where=()) -> list[tuple]:
    """Every path into a JSON value (dict keys and list indexes)."""
    out = [where]
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, where + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value[:8]):
            out += _paths(v, where + (i,))
    return out


def _mutate(body: dict, rng: random.Random) -> dict:
    body = copy.deepcopy(body)
    for _ in range(rng.randint(1, 3)):
        path = rng.choice(_paths(body)[1:] or [("model",)])
        parent = body
        for p in path[:-1]:
            parent = parent[p]
        key = path[-1]
        op = rng.random()
        if op < 0.15 and isinstance(parent, dict) and key not in MAX_TOKEN_KEYS:
            parent.pop(key, None)
        elif op < 0.25 and isinstance(parent, dict):
            parent[rng.choice(["extra", "__proto__", "x" * 200, "", "tools", "response_format", "n", "stop"])] = \
                rng.choice(_nasty_values(rng))
        else:
            value = rng.choice(_nasty_values(rng))
            if key in MAX_TOKEN_KEYS and (value is None or (isinstance(value, int) and not isinstance(value, bool)
                                                           and value > 8)):
                value = 8             # a cap past the context is lowered to it: a long generation, not a fault
            parent[key] = value
    return body


def _raw_body(route: str, model: str, rng: random.Random) -> bytes:
    good = json.dumps(_valid_body(route, model, rng)).encode()
    choice = rng.randrange(10)
    if choice == 0:
        return bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 2000)))
    if choice == 1:
        return good[:rng.randint(0, len(good) - 1)]
    if choice == 2:
        return good + b"}garbage"
    if choice == 3:
        return rng.choice([b"[]", b"42", b'"text"', b"null", b"true", b"[{}]"])
    if choice == 4:
        return good.replace(b'"Hi"', b'"\xff\xfe\xc3"').replace(b"Say", b"\xed\xa0\x80")
    if choice == 5:
        return b"[" * 20_000 + b"]" * 20_000
    if choice == 6:
        return good.replace(b"{", b'{"n": ' + b"9" * 5000 + b", ", 1)
    if choice == 7:
        return b"\xef\xbb\xbf" + good
    if choice == 8:
        return good.replace(b'"model"', b'"model": 1, "model"', 1)
    return b""


@dataclass
class Case:
    kind: str
    method: str
    path: str
    body: bytes | None = None
    headers: dict = field(default_factory=dict)
    stream: bool = False
    cancel_after: int | None = None   # close the stream after this many lines


def make_case(rng: random.Random, model: str) -> Case:
    kind = rng.choices(list(KINDS), weights=list(KINDS.values()))[0]
    route = rng.choice(ROUTES)
    json_type = {"content-type": "application/json"}
    if kind == "valid":
        body = _valid_body(route, model, rng)
        return Case(kind, "POST", route, json.dumps(body).encode(), json_type, bool(body.get("stream")))
    if kind == "mutated":
        body = _mutate(_valid_body(route, model, rng), rng)
        # ensure_ascii: lone surrogates travel as escapes, as a JavaScript client sends them
        return Case(kind, "POST", route, json.dumps(body).encode(), json_type,
                    isinstance(body, dict) and body.get("stream") is True)
    if kind == "raw":
        headers = rng.choice([json_type, {"content-type": "text/plain"}, {},
                              {"content-type": "application/json", "content-encoding": "gzip"}])
        return Case(kind, "POST", route, _raw_body(route, model, rng), headers)
    if kind == "cancel":
        route = rng.choice(ROUTES[:4])                       # the streaming routes
        body = _valid_body(route, model, rng)
        body["stream"] = True
        body["max_output_tokens" if route == "/v1/responses" else "max_tokens"] = 64
        return Case(kind, "POST", route, json.dumps(body).encode(), json_type, True, rng.randint(0, 4))
    method, path = rng.choice([
        ("GET", route), ("DELETE", route), ("PUT", "/v1/chat/completions"), ("GET", "/nope"),
        ("GET", "/static/../../../../etc/passwd"), ("GET", "/static/%2e%2e/%2e%2e/etc/passwd"),
        ("GET", "/static/..%2f..%2fpyproject.toml"), ("GET", "/v1/models/" + "../" * 6 + "etc/passwd"),
        ("GET", "/v1/models/" + "x" * 5000), ("GET", "/" + "a/" * 2000), ("HEAD", "/health"),
        ("OPTIONS", "/v1/chat/completions"), ("GET", "/health?x=" + "y" * 4000), ("GET", "/metrics"),
        ("GET", "/v1/models"), ("GET", "/openapi.json"), ("POST", "/health"), ("GET", "/%00"),
    ])
    headers = rng.choice([{}, {"x-api-key": "\u00e9" * 10}, {"authorization": "Bearer " + "x" * 6000},
                          {"origin": "http://evil.example"}, {"accept": "text/event-stream"}])
    return Case(kind, method, path, None, {k: v for k, v in headers.items() if v.isascii()})


@dataclass
class Outcome:
    kind: str
    status: int | None
    seconds: float
    problem: str | None = None        # None = fine; else why this case counts against the server


def _server_error_in_stream(line: str) -> bool:
    return line.startswith("data:") and ('"server_error"' in line or '"api_error"' in line)


def send(client: httpx.Client, base: str, case: Case, timeout: float) -> Outcome:
    t0 = time.monotonic()
    problem = None
    status = None
    try:
        with client.stream(case.method, base + case.path, content=case.body, headers=case.headers,
                           timeout=httpx.Timeout(timeout, connect=10)) as r:
            status = r.status_code
            lines = 0
            for line in r.iter_lines():
                lines += 1
                if _server_error_in_stream(line):
                    problem = f"5xx-type error inside a {status} stream: {line[:200]}"
                if case.cancel_after is not None and lines > case.cancel_after:
                    break                            # the client goes away mid-stream
                if time.monotonic() - t0 > timeout:
                    problem = f"still streaming after {timeout:.0f} s"
                    break
            if status >= 500:
                body = r.read() if not r.is_stream_consumed else b""
                queue_full = status == 503 and "retry-after" in r.headers
                if not queue_full:
                    problem = f"HTTP {status}: {body[:200]!r}"
    except httpx.TimeoutException:
        problem = f"no answer within {timeout:.0f} s (hang)"
    except httpx.HTTPError as e:
        problem = f"connection failed: {type(e).__name__}: {e}"
    return Outcome(case.kind, status, time.monotonic() - t0, problem)


@dataclass
class FuzzStats:
    requests: int = 0
    seconds: float = 0.0
    by_kind: Counter = field(default_factory=Counter)
    by_status: Counter = field(default_factory=Counter)
    problems: list = field(default_factory=list)       # (kind, status, problem, case summary)
    slowest: float = 0.0

    @property
    def server_errors(self) -> int:
        return sum(1 for p in self.problems if not p[2].startswith(("no answer", "still streaming")))

    @property
    def hangs(self) -> int:
        return sum(1 for p in self.problems if p[2].startswith(("no answer", "still streaming")))

    def as_dict(self) -> dict:
        return {"requests": self.requests, "seconds": round(self.seconds, 2), "by_kind": dict(self.by_kind),
                "by_status": {str(k): v for k, v in sorted(self.by_status.items(), key=lambda kv: str(kv[0]))},
                "server_errors": self.server_errors, "hangs": self.hangs, "slowest_s": round(self.slowest, 2),
                "problems": [{"kind": k, "status": s, "problem": p, "case": c} for k, s, p, c in self.problems[:50]]}


def run_fuzz(base: str, model: str, count: int, workers: int = 8, seed: int = 0, timeout: float = 30.0,
             max_seconds: float | None = None, progress: bool = False) -> FuzzStats:
    """Send ``count`` generated requests to ``base`` from ``workers`` threads (stops early at ``max_seconds``)."""
    stats = FuzzStats()
    lock = threading.Lock()
    issued = iter(range(count))
    deadline = None if max_seconds is None else time.monotonic() + max_seconds
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=count, unit="req", desc="fuzz", file=sys.stderr)

    def worker(w: int) -> None:
        rng = random.Random(seed * 1_000_003 + w)
        with httpx.Client() as client:
            while True:
                with lock:
                    i = next(issued, None)
                if i is None or (deadline is not None and time.monotonic() > deadline):
                    return
                case = make_case(rng, model)
                out = send(client, base, case, timeout)
                with lock:
                    stats.requests += 1
                    stats.by_kind[out.kind] += 1
                    stats.by_status[out.status if out.status is not None else "none"] += 1
                    stats.slowest = max(stats.slowest, out.seconds)
                    if out.problem:
                        body = (case.body or b"")[:300].decode("utf-8", "replace")
                        stats.problems.append((out.kind, out.status, out.problem, f"{case.method} {case.path[:100]} "
                                               f"{body}"))
                    if bar is not None:
                        bar.update(1)

    t0 = time.monotonic()
    threads = [threading.Thread(target=worker, args=(w,), daemon=True) for w in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stats.seconds = time.monotonic() - t0
    if bar is not None:
        bar.close()
    return stats


# -- the server under test ---------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def wait_idle(base: str, timeout: float = 120.0) -> dict:
    """/health once nothing runs or waits and no KV block is held (or the last answer at the timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        health = httpx.get(base + "/health", timeout=30).json()
        if (health.get("running", 1) == 0 and health.get("waiting", 1) == 0
                and health.get("kv_blocks_used", 1) == 0) or time.monotonic() > deadline:
            return health
        time.sleep(0.2)


def fill_kv_pool(base: str, model: str, seed: int = 0, chunk: int = 2048) -> int:
    """Prefill distinct prompts until every KV block has been written once; returns the tokens sent.

    The pool is allocated untouched, so its pages become resident as blocks are first used:
    a memory reading taken before that counts the pool's first use as growth.
    """
    health = httpx.get(base + "/health", timeout=30).json()
    total = health.get("kv_blocks_total", 0) * health.get("kv_block_size", 16)
    rng = random.Random(seed)
    sent = 0
    while sent < total:
        ids = [rng.randrange(256, 8192) for _ in range(chunk)]
        r = httpx.post(base + "/v1/completions", timeout=600,
                       json={"model": model, "prompt": ids, "max_tokens": 1, "temperature": 0})
        if r.status_code == 400 and chunk > 64:     # a context shorter than the chunk
            chunk //= 2
            continue
        r.raise_for_status()
        sent += chunk
    return sent


def probe_latency(base: str, model: str, runs: int = 5) -> list[float]:
    """Seconds for one fixed greedy chat request of 8 tokens, ``runs`` times."""
    body = {"model": model, "max_tokens": 8, "temperature": 0, "messages": [{"role": "user", "content": "Say hi."}]}
    out = []
    for _ in range(runs):
        t0 = time.monotonic()
        r = httpx.post(base + "/v1/chat/completions", json=body, timeout=120)
        r.raise_for_status()
        out.append(time.monotonic() - t0)
    return out


def start_server(model: str, port: int, extra: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "lodestar.cli", "serve", "--model", model, "--port", str(port), *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with status {proc.returncode}: {proc.stderr.read()[-2000:]}")
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise RuntimeError("the server did not answer /health within 300 s")


def main(a: argparse.Namespace) -> int:
    from lodestar.bench.common import git_commit

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    name = "fuzz"
    print(f"starting lodestar serve --model {a.model} on {base}", file=sys.stderr)
    proc = start_server(a.model, port, ["--served-model-name", name, "--log-level", "critical"])
    report: dict = {"commit": git_commit(), "model": a.model, "count": a.count, "workers": a.workers,
                    "seed": a.seed, "timeout_s": a.timeout}
    try:
        print("warm-up: filling the KV pool, then a short fuzz run", file=sys.stderr)
        filled = fill_kv_pool(base, name, a.seed)
        warm = run_fuzz(base, name, a.warmup, a.workers, a.seed + 1, a.timeout)
        wait_idle(base)
        rss0, lat0 = rss_mb(proc.pid), probe_latency(base, name)
        stats = run_fuzz(base, name, a.count, a.workers, a.seed, a.timeout, a.max_seconds, progress=True)
        try:
            health = wait_idle(base)
            rss1, lat1 = rss_mb(proc.pid), probe_latency(base, name)
        except httpx.HTTPError as e:      # the server stopped answering: that is the finding
            health, rss1, lat1 = {"error": f"{type(e).__name__}: {e}"}, rss_mb(proc.pid), [float("nan")]
        alive = proc.poll() is None
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    growth = rss1 / rss0 - 1
    report.update({"warmup": warm.as_dict(), "kv_fill_tokens": filled, "run": stats.as_dict(), "server_alive": alive,
                   "idle_after": health, "rss_mb_before": round(rss0, 1), "rss_mb_after": round(rss1, 1),
                   "rss_growth": round(growth, 4), "probe_s_before": lat0, "probe_s_after": lat1,
                   "probe_ratio": round(statistics.median(lat1) / statistics.median(lat0), 3)})
    s = stats
    print(f"{s.requests} requests in {s.seconds:.0f} s ({s.requests / max(s.seconds, 1e-9):.0f}/s), "
          f"kinds {dict(s.by_kind)}")
    print(f"statuses {dict(sorted(((str(k), v) for k, v in s.by_status.items())))}")
    print(f"5xx / dropped: {s.server_errors}   hangs (> {a.timeout:.0f} s): {s.hangs}   slowest {s.slowest:.1f} s")
    print(f"KV blocks held after: {health.get('kv_blocks_used')}   server alive: {alive}")
    print(f"memory {rss0:.0f} -> {rss1:.0f} MB ({growth:+.1%})   fixed request {statistics.median(lat0):.3f} -> "
          f"{statistics.median(lat1):.3f} s")
    for k, st, p, c in s.problems[:10]:
        print(f"  {k} {st}: {p}\n    {c[:300]}")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(report, indent=2, default=str))
    ok = (s.server_errors == 0 and s.hangs == 0 and alive and health.get("kv_blocks_used") == 0
          and growth <= a.max_growth)
    return 0 if ok else 1

