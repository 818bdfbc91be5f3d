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


def measure(runner, prompts: dict[int, list[int]], decode_prompt: list[int], gen: int, runs: int) -> dict:
    res = {"load_s": Stat()}
    for _ in range(runs):
        res["load_s"].add(runner.load())
    for n, ids in prompts.items():
        runner.prefill(ids)  # warm-up
        st = res[f"prefill_{n}_tok_s"] = Stat()
        for _ in range(runs):
            st.add(len(ids) / runner.prefill(ids))
    runner.decode(decode_prompt, 16)  # warm-up
    st = res[f"decode_{gen}_tok_s"] = Stat()
    for _ in range(runs):
        dt, count = runner.decode(decode_prompt, gen)
        st.add(count / dt)
    return res


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
    results = {}
    for r in runners:
        print(f"measuring {r.name} ...", file=sys.stderr)
        results[r.name] = measure(r, prompts, decode_prompt, a.gen_tokens, a.runs)
        r.engine = r.llm = None

    metrics = list(results["lodestar"])
    peer = results.get("llama.cpp")
    from lodestar.engine.loader import resolve_device
    where = resolve_device(a.device)
    print(f"\nmodel {path.name} ({a.dtype}) on {where} (llama.cpp on the CPU), {threads} threads, "
          f"median [min–max] of {a.runs} runs")
    print(f"{'metric':<22}{'lodestar':>26}{'llama.cpp':>26}{'ratio':>8}")
    for m in metrics:
        ours = results["lodestar"][m]
        theirs = peer[m] if peer else None
        digits = 2 if m == "load_s" else 1
        ratio = "-"
        if theirs:
            r = theirs.median / ours.median if m == "load_s" else ours.median / theirs.median
            ratio = f"{r:.2f}x"
        print(f"{m:<22}{ours.fmt(digits):>26}{(theirs.fmt(digits) if theirs else '-'):>26}{ratio:>8}")
    print("(ratio > 1 means lodestar is faster; for load_s it is llama.cpp time / lodestar time)")
    if peer_note:
        print(peer_note)
    if a.json:
        doc = {"bench": "decode", "model": path.name, "model_sha256": file_sha256(path), "dtype": a.dtype,
               "threads": threads, "runs": a.runs, "gen_tokens": a.gen_tokens,
               "prompt_ids_sha": {n: ids_hash(ids) for n, ids in prompts.items()},
               "decode_prompt_ids": decode_prompt, "sampler": "greedy", "commit": git_commit(),
               "device": device_info(), "lodestar_device": where,
               "results": {k: {m: s.as_dict() for m, s in v.items()} for k, v in results.items()}}
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(doc, indent=1) + "\n")
    return 0
