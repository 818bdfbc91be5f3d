"""``lodestar bench http``: what the HTTP server costs on top of the engine it serves.

One process, one ``AsyncLLMEngine``: the server runs on a free loopback port (uvicorn in a
background thread) over that engine. For each N in ``--streams``, N clients stream
``POST /v1/completions`` (httpx) with token-id prompts, and ``serve_load.run_levels`` drives
the same engine directly with the same prompt ids: greedy, ``--gen-tokens`` new tokens
each, EOS ignored (every HTTP completion's token count is checked). Direct and HTTP
alternate level by level within each run, so both see the same machine state.

Reported per level: aggregate generated tok/s of both and their ratio (target: HTTP at
least 0.9x direct), and the time to first token the HTTP layer adds (HTTP TTFT p50 minus
direct TTFT p50; target at 1 stream: at most 15 ms). HTTP TTFT runs from sending the
request to reading the first chunk that carries text. Median [min–max] of ``--runs``.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import threading
import time
from contextlib import contextmanager

import torch

from lodestar.bench.common import Stat, device_info, git_commit, ids_hash
from lodestar.bench.decode import make_prompt
from lodestar.bench.serve_load import make_async_engine, percentile, run_levels

MIN_RATIO = 0.9          # HTTP aggregate tok/s / direct
MAX_TTFT_OVERHEAD_MS = 15.0
ENDPOINT = "/v1/completions"


class BenchError(RuntimeError):
    """The server answered something other than the expected stream."""


@contextmanager
def serve_in_thread(app):
    """Run ``app`` with uvicorn on a free loopback port; yields the base URL."""
    import uvicorn
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(256)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="bench-http", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise BenchError("the HTTP server did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


async def _stream_completion(client, body: dict) -> tuple[float | None, int | None]:
    """(seconds to the first text chunk, completion tokens from the usage chunk) of one streamed request."""
    t0 = time.perf_counter()
    ttft, completion = None, None
    async with client.stream("POST", ENDPOINT, json=body) as r:
        if r.status_code != 200:
            raise BenchError(f"{ENDPOINT} answered {r.status_code}: {(await r.aread()).decode(errors='replace')}")
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue                      # blank separators and keep-alive comments
            data = line[6:]
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise BenchError(f"{ENDPOINT} stream failed: {chunk['error'].get('message')}")
            if ttft is None and chunk["choices"] and chunk["choices"][0]["text"]:
                ttft = time.perf_counter() - t0
            if chunk.get("usage"):
                completion = chunk["usage"]["completion_tokens"]
    return ttft, completion


async def _http_level(url: str, model: str, prompts: list[list[int]], gen: int) -> tuple[float, list[float]]:
    """Aggregate tok/s and per-stream TTFTs of len(prompts) concurrent streams over HTTP."""
    import httpx
    n = len(prompts)
    common = {"model": model, "temperature": 0, "ignore_eos": True, "stream": True,
              "stream_options": {"include_usage": True}}
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600.0), limits=limits) as client:
        # open the N connections first, as a client with a warm pool would have them
        await asyncio.gather(*(_stream_completion(client, {**common, "prompt": p[:1], "max_tokens": 1})
                               for p in prompts))
        t = time.perf_counter()
        outs = await asyncio.gather(*(_stream_completion(client, {**common, "prompt": p, "max_tokens": gen})
                                      for p in prompts))
        wall = time.perf_counter() - t
    counts = [c for _, c in outs]
    if counts != [gen] * n:
        raise BenchError(f"completion token counts differ from --gen-tokens {gen}: {counts} "
                         "(ignore_eos should make every stream generate exactly that many)")
    ttfts = [t for t, _ in outs]
    if None in ttfts:
        raise BenchError("a stream ended without any text chunk")
    return sum(counts) / wall, ttfts


def run(aeng, url: str, model: str, levels: list[int], prompt_len: int, gen: int, runs: int) -> dict:
    """{level: {"direct": {...}, "http": {...}, "ratio": Stat, "ttft_overhead_ms": Stat}}."""
    tok = aeng.tokenizer
    base = make_prompt(tok, prompt_len + max(levels))   # the windows run_levels uses too
    results = {n: {"direct": {k: Stat() for k in ("tok_s", "ttft_p50_ms", "ttft_p95_ms")},
                   "http": {k: Stat() for k in ("tok_s", "ttft_p50_ms", "ttft_p95_ms")},
                   "ratio": Stat(), "ttft_overhead_ms": Stat()} for n in levels}
    asyncio.run(_http_level(url, model, [base[:prompt_len]], 8))   # warm-up of the HTTP path
    for _ in range(runs):
        for n in levels:
            r = results[n]
            direct = run_levels(aeng, tok, [n], prompt_len, gen, 1)[n]
            for k, stat in direct.items():
                if k in r["direct"]:
                    r["direct"][k].add(stat.values[0])
            tok_s, ttfts = asyncio.run(_http_level(url, model, [base[i:i + prompt_len] for i in range(n)], gen))
            r["http"]["tok_s"].add(tok_s)
            r["http"]["ttft_p50_ms"].add(1000 * statistics.median(ttfts))
            r["http"]["ttft_p95_ms"].add(1000 * percentile(ttfts, 0.95))
            r["ratio"].add(tok_s / r["direct"]["tok_s"].values[-1])
            r["ttft_overhead_ms"].add(r["http"]["ttft_p50_ms"].values[-1] - r["direct"]["ttft_p50_ms"].values[-1])
    return results


def print_results(results: dict, title: str) -> None:
    print(title)
    heads = ("direct tok/s", "HTTP tok/s", "HTTP/direct", "direct TTFT p50 ms", "HTTP TTFT p50 ms", "HTTP adds ms")
    print(f"{'streams':>7}" + "".join(f"  {h:>24}" for h in heads))
    for n, r in results.items():
        cells = (r["direct"]["tok_s"].fmt(), r["http"]["tok_s"].fmt(), r["ratio"].fmt(2),
                 r["direct"]["ttft_p50_ms"].fmt(), r["http"]["ttft_p50_ms"].fmt(), r["ttft_overhead_ms"].fmt())
        print(f"{n:>7}" + "".join(f"  {c:>24}" for c in cells))
    worst = min(results, key=lambda n: results[n]["ratio"].median)
    ratio = results[worst]["ratio"].median
    one = min(results)
    overhead = results[one]["ttft_overhead_ms"].median
    print(f"lowest HTTP/direct tok/s ratio: {ratio:.2f}x at {worst} streams "
          f"({'meets' if ratio >= MIN_RATIO else 'MISSES'} the target of >= {MIN_RATIO:.2f}x)")
    verdict = "meets" if overhead <= MAX_TTFT_OVERHEAD_MS else "MISSES"
    print(f"TTFT the HTTP layer adds at {one} stream{'s' if one > 1 else ''}: {overhead:.1f} ms "
          f"({verdict} the target of <= {MAX_TTFT_OVERHEAD_MS:.0f} ms)")


def main(a: argparse.Namespace) -> int:
    from lodestar.serve import ServeConfig, build_app
    if a.threads:
        torch.set_num_threads(a.threads)
    levels = sorted(set(a.streams))
    aeng = make_async_engine(a.model, a.dtype, max(levels), a.device)   # the model loads on the engine thread
    try:
        loaded = aeng.engine.loaded
        model = loaded.path.stem
        app = build_app(aeng, ServeConfig(model_names=(model,)))
        with serve_in_thread(app) as url:
            results = run(aeng, url, model, levels, a.prompt_len, a.gen_tokens, a.runs)
    finally:
        aeng.shutdown()
    print_results(results, f"\nHTTP ({ENDPOINT}, streamed) vs engine-direct, one engine, {loaded.path.name} "
                           f"({a.dtype}), prompt {a.prompt_len} tokens, {a.gen_tokens} new tokens (greedy, EOS "
                           f"ignored), {torch.get_num_threads()} threads, median [min–max] of {a.runs}")
    if a.json:
        from lodestar.formats.catalog import file_sha256
        base = make_prompt(aeng.tokenizer, a.prompt_len + max(levels))
        doc = {"bench": "http", "endpoint": ENDPOINT, "model": loaded.path.name,
               "model_sha256": file_sha256(loaded.path), "dtype": a.dtype, "threads": torch.get_num_threads(),
               "prompt_len": a.prompt_len, "gen_tokens": a.gen_tokens, "runs": a.runs, "sampler": "greedy",
               "ignore_eos": True, "prompt_base_ids_sha": ids_hash(base),
               "prompts": "stream i of a level gets prompt_base_ids[i:i + prompt_len]",
               "targets": {"min_ratio": MIN_RATIO, "max_ttft_overhead_ms": MAX_TTFT_OVERHEAD_MS},
               "commit": git_commit(), "device": device_info(),
               "results": {n: {"direct": {k: s.as_dict() for k, s in r["direct"].items()},
                               "http": {k: s.as_dict() for k, s in r["http"].items()},
                               "ratio": r["ratio"].as_dict(), "ttft_overhead_ms": r["ttft_overhead_ms"].as_dict()}
                           for n, r in results.items()}}
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(doc, indent=1) + "\n")
    return 0
