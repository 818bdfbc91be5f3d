"""``lodestar bench serve-load``: aggregate decode speed and TTFT under concurrent streams.

Drives the same ``AsyncLLMEngine`` the server uses, in-process: N clients start together,
each with its own prompt, greedy, ``--gen-tokens`` new tokens (EOS ignored). Per concurrency
level it reports, with the ratio to one stream measured in the same run:

- aggregate decode tok/s: tokens that arrive while every stream is decoding (after the
  last stream's first token, up to the first stream's last token) over that window's
  length, i.e. the steady-state rate of N concurrent decodes;
- end-to-end tok/s: all generated tokens over the wall time from the requests' start,
  prefill of all N prompts included;
- TTFT p50/p95.

Median [min–max] of ``--runs``.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import torch

from lodestar.bench.common import Stat, device_info, git_commit
from lodestar.bench.decode import make_prompt


def percentile(values: list[float], q: float) -> float:
    v = sorted(values)
    if not v:
        return float("nan")
    k = (len(v) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def decode_rate(arrivals: list[list[tuple[float, int]]]) -> float:
    """Tokens per second while all streams decode, from each stream's (time, n_tokens) list.

    The window opens at the last stream's first token and closes at the first stream's
    last token; tokens arriving inside it (first tokens excluded) are counted.
    """
    start = max(a[0][0] for a in arrivals)
    end = min(a[-1][0] for a in arrivals)
    if end <= start:
        return float("nan")
    n = sum(k for a in arrivals for t, k in a if start < t <= end)
    return n / (end - start)


async def _one_level(aeng, prompts: list[list[int]], gen: int) -> tuple[float, list[float], float]:
    """(end-to-end tok/s, TTFTs, aggregate decode tok/s) of one run of len(prompts) streams."""
    from lodestar.engine.sampling import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=gen, ignore_eos=True)
    ttfts: list[float] = []
    arrivals: list[list[tuple[float, int]]] = []

    async def client(ids):
        t0 = time.perf_counter()
        got: list[tuple[float, int]] = []
        arrivals.append(got)
        async for out in aeng.generate(ids, params):
            now = time.perf_counter()
            if not got:
                ttfts.append(now - t0)
            if out.token_ids:
                got.append((now, len(out.token_ids)))

    t = time.perf_counter()
    await asyncio.gather(*(client(p) for p in prompts))
    total = sum(k for a in arrivals for _, k in a)
    return total / (time.perf_counter() - t), ttfts, decode_rate(arrivals)


def run_levels(aeng, tokenizer, levels: list[int], prompt_len: int, gen: int, runs: int) -> dict:
    """{level: {"decode_tok_s", "tok_s" (end to end), "ttft_p50_ms", "ttft_p95_ms": Stat}}."""
    base = make_prompt(tokenizer, prompt_len + max(levels))
    results = {}
    asyncio.run(_one_level(aeng, [base[:prompt_len]], 8))  # warm-up
    for n in levels:
        results[n] = {"decode_tok_s": Stat(), "tok_s": Stat(), "ttft_p50_ms": Stat(), "ttft_p95_ms": Stat()}
    # The levels' runs interleave (1 8, then 8 1, ...), so the machine's drift falls on all alike.
    for i in range(runs):
        for n in (levels if i % 2 == 0 else levels[::-1]):
            # distinct prompts (shifted windows) so no request shares another's prefix
            prompts = [base[j:j + prompt_len] for j in range(n)]
            tok_s, ttfts, decode = asyncio.run(_one_level(aeng, prompts, gen))
            r = results[n]
            r["decode_tok_s"].add(decode)
            r["tok_s"].add(tok_s)
            r["ttft_p50_ms"].add(1000 * statistics.median(ttfts))
            r["ttft_p95_ms"].add(1000 * percentile(ttfts, 0.95))
    return results


def make_async_engine(model: str, dtype: str, max_seqs: int, device: str = "cpu"):
    from lodestar.engine.async_engine import AsyncLLMEngine
    from lodestar.engine.llm_engine import EngineConfig, LLMEngine
    from lodestar.engine.loader import load_model
    return AsyncLLMEngine(lambda: LLMEngine(load_model(model, mode=dtype, progress=False, device=device),
                                            EngineConfig(max_num_seqs=max_seqs, enable_prefix_cache=False)))


def print_levels(results: dict, title: str) -> None:
    one = results[min(results)]["decode_tok_s"].median
    one_e2e = results[min(results)]["tok_s"].median
    print(title)
    print(f"{'streams':>8}{'aggregate decode tok/s':>26}{'vs 1':>8}{'end-to-end tok/s':>26}{'vs 1':>8}"
          f"{'TTFT p50 ms':>22}{'TTFT p95 ms':>22}")
    for n, r in results.items():
        print(f"{n:>8}{r['decode_tok_s'].fmt():>26}{r['decode_tok_s'].median / one:>7.2f}x"
              f"{r['tok_s'].fmt():>26}{r['tok_s'].median / one_e2e:>7.2f}x"
              f"{r['ttft_p50_ms'].fmt(0):>22}{r['ttft_p95_ms'].fmt(0):>22}")


def main(a: argparse.Namespace) -> int:
    if a.threads:
        torch.set_num_threads(a.threads)
    aeng = make_async_engine(a.model, a.dtype, max(a.streams), a.device)
    try:
        results = run_levels(aeng, aeng.tokenizer, a.streams, a.prompt_len, a.gen_tokens, a.runs)
    finally:
        aeng.shutdown()
    print_levels(results, f"\nengine-direct, {aeng.engine.loaded.path.name} ({a.dtype}) on {aeng.engine.device}, "
                          f"prompt {a.prompt_len}, "
                          f"{a.gen_tokens} new tokens, {torch.get_num_threads()} threads, median [min–max] of {a.runs}")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({
            "bench": "serve-load", "model": aeng.engine.loaded.path.name, "dtype": a.dtype,
            "prompt_len": a.prompt_len, "gen_tokens": a.gen_tokens, "commit": git_commit(), "device": device_info(),
            "lodestar_device": str(aeng.engine.device),
            "results": {n: {k: s.as_dict() for k, s in r.items()} for n, r in results.items()}}, indent=1) + "\n")
    return 0
