"""``lodestar bench cache``: what the prefix cache and the disk tier save.

1. Second turn of a ~1500-token conversation (the first turn's KV is reused) vs the same
   prompt cold (prefix cache off): time to first token.
2. First request after a restart with the disk tier (a fresh engine on a warm checkpoint
   folder) vs the same request cold: time to first token.
Each is the median [min–max] of ``--runs`` after one warm-up, measured in one run.
"""
from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch

from lodestar.bench.common import Stat, device_info, git_commit
from lodestar.bench.decode import FILLER


def ttft(engine, ids: list[int]) -> tuple[float, list[int]]:
    from lodestar.engine.sampling import SamplingParams
    t = time.perf_counter()
    toks = []
    for out in engine.stream(ids, SamplingParams(temperature=0.0, max_tokens=1)):
        toks += out.token_ids
    return time.perf_counter() - t, toks


def conversation(tokenizer, target: int) -> tuple[list[dict], list[dict]]:
    """A first turn of about ``target`` tokens, and the same conversation one turn later."""
    doc = ""
    while len(tokenizer.encode(doc)) < target:
        doc += FILLER
    turn1 = [{"role": "user", "content": "Read this and wait for my question.\n" + doc}]
    turn2 = turn1 + [{"role": "assistant", "content": "I have read it."},
                     {"role": "user", "content": "Which animal jumps over the dog?"}]
    return turn1, turn2


def render(tokenizer, messages: list[dict]) -> list[int]:
    if tokenizer.has_chat_template:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return tokenizer.encode("".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:")


def main(a: argparse.Namespace) -> int:
    from lodestar.engine.llm_engine import EngineConfig, LLMEngine
    from lodestar.engine.loader import load_model
    if a.threads:
        torch.set_num_threads(a.threads)
    loaded = load_model(a.model, mode=a.dtype, progress=False, device=a.device)
    tok = loaded.tokenizer
    turn1, turn2 = conversation(tok, a.context)
    ids1, ids2 = render(tok, turn1), render(tok, turn2)
    res = {k: Stat() for k in ("cold_ms", "second_turn_ms", "restart_disk_ms")}
    cold = LLMEngine(loaded, EngineConfig(enable_prefix_cache=False))
    ttft(cold, ids2)  # warm-up
    for _ in range(a.runs):
        res["cold_ms"].add(1000 * ttft(cold, ids2)[0])
    for _ in range(a.runs):
        warm = LLMEngine(loaded, EngineConfig())
        ttft(warm, ids1)                                  # turn 1 fills the cache
        res["second_turn_ms"].add(1000 * ttft(warm, ids2)[0])
    kv_dir = Path(tempfile.mkdtemp(prefix="lodestar-kv-"))
    try:
        writer = LLMEngine(loaded, EngineConfig(kv_dir=str(kv_dir)))
        ttft(writer, ids2)
        writer.close()
        for _ in range(a.runs):
            restarted = LLMEngine(loaded, EngineConfig(kv_dir=str(kv_dir)))  # empty memory cache
            res["restart_disk_ms"].add(1000 * ttft(restarted, ids2)[0])
    finally:
        shutil.rmtree(kv_dir, ignore_errors=True)
    c = res["cold_ms"].median
    print(f"\n{loaded.path.name} ({a.dtype}), conversation of {len(ids2)} tokens, {torch.get_num_threads()} threads, "
          f"median [min–max] of {a.runs}")
    print(f"{'time to first token':<34}{'ms':>26}{'speed-up vs cold':>18}")
    print(f"{'cold (no cache)':<34}{res['cold_ms'].fmt(0):>26}{'1.00x':>18}")
    print(f"{'second turn (prefix cache)':<34}{res['second_turn_ms'].fmt(0):>26}"
          f"{c / res['second_turn_ms'].median:>17.2f}x")
    print(f"{'after restart (disk tier)':<34}{res['restart_disk_ms'].fmt(0):>26}"
          f"{c / res['restart_disk_ms'].median:>17.2f}x")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({"bench": "cache", "model": loaded.path.name, "dtype": a.dtype,
                                      "prompt_tokens": len(ids2), "commit": git_commit(), "device": device_info(),
                                      "results": {k: s.as_dict() for k, s in res.items()}}, indent=1) + "\n")
    return 0
