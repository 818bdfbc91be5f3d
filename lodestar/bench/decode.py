"""``lodestar bench decode``: load time, prefill and decode speed, against llama.cpp.

Both engines get the same GGUF file, the same prompt token ids, greedy sampling and the
same thread count, in the same process run. Each figure is the median of ``--runs``
measurements after one warm-up, printed with its [min–max] spread.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from lodestar.bench.common import Stat, device_info, git_commit, ids_hash, timed

FILLER = ("The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. "
          "How vexingly quick daft zebras jump! Sphinx of black quartz, judge my vow. ")


def make_prompt(tokenizer, n: int) -> list[int]:
    """Exactly ``n`` token ids of plain English text."""
    ids: list[int] = []
    while len(ids) < n:
        ids += tokenizer.encode(FILLER * 8, add_special_tokens=False)
    return ids[:n]


class LodestarRunner:
    name = "lodestar"

    def __init__(self, model: str, dtype: str, max_len: int, device: str = "cpu") -> None:
        from lodestar.engine.llm_engine import EngineConfig, LLMEngine
        from lodestar.engine.loader import load_model
        self._load = lambda: LLMEngine(load_model(model, mode=dtype, progress=False, device=device),
                                       EngineConfig(max_num_batched_tokens=max_len, kv_tokens=max_len + 64,
                                                                    enable_prefix_cache=False))
        self.engine = None

    def load(self) -> float:
        self.engine = None
        dt, self.engine = timed(self._load)
        return dt

    def prefill(self, ids: list[int]) -> float:
        from lodestar.engine.sampling import SamplingParams
        dt, _ = timed(lambda: self.engine.generate([ids], SamplingParams(temperature=0.0, max_tokens=1)))
        return dt

    def decode(self, ids: list[int], n: int) -> tuple[float, int]:
        """Seconds from the first generated token to the last, and the tokens counted."""
        from lodestar.engine.sampling import SamplingParams
        t_first, count = None, 0
        for out in self.engine.stream(ids, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)):
            count += len(out.token_ids)
            if t_first is None:
                t_first = time.perf_counter()
        return time.perf_counter() - t_first, count - 1


class LlamaCppRunner:
    name = "llama.cpp"

    def __init__(self, path: str, max_len: int, threads: int) -> None:
        import llama_cpp
        self._mk = lambda: llama_cpp.Llama(model_path=path, n_ctx=max_len + 64, n_batch=512, n_threads=threads,
                                           n_threads_batch=threads, verbose=False)
        self.llm = None

    def load(self) -> float:
        self.llm = None
        dt, self.llm = timed(self._mk)
        return dt

    def prefill(self, ids: list[int]) -> float:
        self.llm.reset()
        dt, _ = timed(lambda: self.llm.eval(ids))
        return dt

    def decode(self, ids: list[int], n: int) -> tuple[float, int]:
        self.llm.reset()
        t_first, count = None, 0
        for _ in self.llm.generate(ids, temp=0.0, top_k=1, reset=True):
            count += 1
            if t_first is None:
                t_first = time.perf_counter()
            if count >= n:
                break
        return time.perf_counter() - t_first, count - 1


def measure(runners: list, prompts: dict[int, list[int]], decode_prompt: list[int], gen: int, runs: int) -> dict:
    """Every metric for every runner, their runs interleaved (A B, then B A, ...), so that the
    machine's drift over the minutes a run takes falls on both alike."""
    res = {r.name: {} for r in runners}

    def rounds(metric: str, one) -> None:
        for r in runners:
            res[r.name][metric] = Stat()
        for i in range(runs):
            for r in (runners if i % 2 == 0 else runners[::-1]):
                res[r.name][metric].add(one(r))

    rounds("load_s", lambda r: r.load())
    for n, ids in prompts.items():
        for r in runners:
            r.prefill(ids)  # warm-up
        rounds(f"prefill_{n}_tok_s", lambda r: len(ids) / r.prefill(ids))
    for r in runners:
        r.decode(decode_prompt, 16)  # warm-up

    def decode_rate(r) -> float:
        dt, count = r.decode(decode_prompt, gen)
        return count / dt
    rounds(f"decode_{gen}_tok_s", decode_rate)
    return res


def paired_ratios(ours: Stat, theirs: Stat, metric: str) -> Stat:
    """Run i of one engine against run i of the other (measured side by side)."""
    out = Stat()
    for a, b in zip(ours.values, theirs.values):
        out.add(b / a if metric == "load_s" else a / b)
    return out


def main(a: argparse.Namespace) -> int:
    from lodestar.engine.loader import load_model
    from lodestar.formats.catalog import file_sha256, resolve_model_path
    if a.threads:
        torch.set_num_threads(a.threads)
    threads = torch.get_num_threads()
    path = resolve_model_path(a.model)
    tok = load_model(a.model, mode=a.dtype, progress=False).tokenizer
    prompts = {n: make_prompt(tok, n) for n in a.prompt_lens}
    decode_prompt = make_prompt(tok, 16)
    max_len = max(a.prompt_lens + [16 + a.gen_tokens])

    runners = [LodestarRunner(a.model, a.dtype, max_len, a.device)]
    peer_note = None
    if a.peer != "none":
        try:
            runners.append(LlamaCppRunner(str(path), max_len, threads))
        except ImportError:
            peer_note = "llama-cpp-python not installed (pip install '.[peers]'): no peer column"
            if a.peer == "llama.cpp":
                print(f"lodestar: error: {peer_note}", file=sys.stderr)
                return 2
    print(f"measuring {' and '.join(r.name for r in runners)}, runs interleaved ...", file=sys.stderr)
    results = measure(runners, prompts, decode_prompt, a.gen_tokens, a.runs)
    for r in runners:
        r.engine = r.llm = None

    metrics = list(results["lodestar"])
    peer = results.get("llama.cpp")
    from lodestar.engine.loader import resolve_device
    where = resolve_device(a.device)
    print(f"\nmodel {path.name} ({a.dtype}) on {where} (llama.cpp on the CPU), {threads} threads, "
          f"median [min–max] of {a.runs} runs")
    print(f"{'metric':<22}{'lodestar':>26}{'llama.cpp':>26}{'ratio, run by run':>26}")
    ratios = {}
    for m in metrics:
        ours = results["lodestar"][m]
        theirs = peer[m] if peer else None
        digits = 2 if m == "load_s" else 1
        ratio = "-"
        if theirs:
            ratios[m] = paired_ratios(ours, theirs, m)
            ratio = ratios[m].fmt(2) + "x"
        print(f"{m:<22}{ours.fmt(digits):>26}{(theirs.fmt(digits) if theirs else '-'):>26}{ratio:>26}")
    print("(ratio > 1 means lodestar is faster; for load_s it is llama.cpp time / lodestar time; each run of one "
          "engine is paired with the other's run beside it)")
    if peer_note:
        print(peer_note)
    if a.json:
        doc = {"bench": "decode", "model": path.name, "model_sha256": file_sha256(path), "dtype": a.dtype,
               "threads": threads, "runs": a.runs, "gen_tokens": a.gen_tokens,
               "prompt_ids_sha": {n: ids_hash(ids) for n, ids in prompts.items()},
               "decode_prompt_ids": decode_prompt, "sampler": "greedy", "commit": git_commit(),
               "device": device_info(), "lodestar_device": where,
               "results": {k: {m: s.as_dict() for m, s in v.items()} for k, v in results.items()},
               "paired_ratio": {m: s.as_dict() for m, s in ratios.items()}}
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(doc, indent=1) + "\n")
    return 0
