"""Pieces every GPU benchmark stage uses (``lodestar.bench.gpu``): the results file, synthetic
engines, and the decode / prefill / batch / context cells.

A cell is one measurement: min / median / max of ``RUNS`` runs after a warm-up run. Models are
synthetic (``formats.synthetic``: random weights of real geometries built in GPU memory, the
same tensor types and kernels as a GGUF file of that type); EOS is ignored and sampling is
greedy. Engines read the kernel policy in force (``kernels.policy.active``): a stage that
compares policies builds each engine and runs it inside ``using(policy)``.
"""
from __future__ import annotations

import dataclasses
import gc
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

from lodestar.kernels.policy import KernelPolicy, using

RUNS = 3
SEED = 1234


class Results:
    """One JSON file shared by all stages; rewritten (atomically) after every cell."""

    def __init__(self, path: Path, stage: str, deadline: float) -> None:
        self.path, self.stage, self.deadline = path, stage, deadline
        self.doc = json.loads(path.read_text()) if path.is_file() else {}
        self.section = self.doc.setdefault("stages", {}).setdefault(stage, {"cells": {}, "errors": []})
        self.section["started"] = time.strftime("%Y-%m-%dT%H:%M:%S")
        self.save()

    def left(self) -> float:
        return self.deadline - time.time()

    def put(self, key: str, value) -> None:
        self.section["cells"][key] = value
        self.save()

    def error(self, key: str, exc: BaseException) -> None:
        self.section["errors"].append({"cell": key, "error": f"{type(exc).__name__}: {exc}",
                                       "traceback": traceback.format_exc()[-3000:]})
        self.save()

    def cell(self, key: str, fn, need_s: float = 10.0) -> None:
        """Run ``fn() -> dict`` unless too little time is left; record result or error."""
        if self.left() < need_s:
            self.put(key, {"skipped": f"out of time ({self.left():.0f}s left, needs ~{need_s:.0f}s)"})
            return
        torch.cuda.reset_peak_memory_stats()
        try:
            out = fn()
            out["peak_gpu_mem_gb"] = round(torch.cuda.max_memory_allocated() / 1e9, 3)
            out["peak_gpu_reserved_gb"] = round(torch.cuda.max_memory_reserved() / 1e9, 3)
            self.put(key, out)
        except Exception as e:   # one failing cell must not stop the others
            self.error(key, e)
            print(f"[{self.stage}] {key} failed: {e}", file=sys.stderr)

    def save(self) -> None:
        self.section["updated"] = time.strftime("%Y-%m-%dT%H:%M:%S")
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.doc, indent=1, default=str))
        os.replace(tmp, self.path)


def stat(values: list[float], digits: int = 2) -> dict:
    return {"median": round(statistics.median(values), digits), "min": round(min(values), digits),
            "max": round(max(values), digits), "runs": [round(v, digits) for v in values]}


def release() -> None:
    """Return the memory of models and engines no longer referenced."""
    gc.collect()
    torch.cuda.empty_cache()


def bandwidth_from(results: Results) -> float | None:
    """The device-copy bandwidth the ``env`` stage measured into the same results file."""
    env = results.doc.get("stages", {}).get("env", {}).get("cells", {}).get("copy_bandwidth", {})
    bw = env.get("bytes_per_s")
    return float(bw) if bw else None


def env_policy(**switches: str) -> KernelPolicy:
    """The policy of the environment's ``SWITCHES`` with ``switches`` (env name -> value) set
    on top, e.g. ``env_policy(LODESTAR_FUSE="0")``."""
    return KernelPolicy.from_env({**os.environ, **switches})


def parse_cells(text: str) -> list[tuple[str, str]]:
    """``"geometry/type geometry/type ..."`` -> [(geometry, type), ...]."""
    cells = []
    for item in text.split():
        geometry, sep, qtype = item.partition("/")
        if not sep or not geometry or not qtype or "/" in qtype:
            raise ValueError(f"cell {item!r}: give geometry/type, e.g. llama-3.1-8b/Q4_0")
        cells.append((geometry, qtype))
    return cells


# ----------------------------------------------------------------------------- engines

def synthetic_engine(geometry: str, qtype: str, mode: str = "packed", max_len: int = 8192,
                     max_seqs: int = 64, kv_tokens: int | None = None, context: int | None = None,
                     policy: KernelPolicy | None = None):
    """(engine, load seconds, checkpoint bytes) for a synthetic model on the GPU, built under
    ``policy`` when given (its runs must be inside ``using(policy)`` too)."""
    if policy is not None:
        with using(policy):
            return synthetic_engine(geometry, qtype, mode, max_len, max_seqs, kv_tokens, context)
    from lodestar.engine.llm_engine import EngineConfig, LLMEngine
    from lodestar.engine.loader import LoadedModel
    from lodestar.formats.synthetic import SyntheticCheckpoint, tokenizer_metadata_or_synthetic
    from lodestar.models import build_model
    from lodestar.tokenizer import Tokenizer
    release()
    t0 = time.perf_counter()
    ck = SyntheticCheckpoint(geometry, qtype, device="cuda", seed=SEED)
    if context:
        ck.config = dataclasses.replace(ck.config, context_length=context)
    model = build_model(ck.config, ck, mode, device="cuda")
    meta, _ = tokenizer_metadata_or_synthetic(ck.config.vocab_size)
    torch.cuda.synchronize()
    load_s = time.perf_counter() - t0
    # the checkpoint stands in for the file (its tensors make their bytes on access; none is held)
    loaded = LoadedModel(Path(f"synthetic-{geometry}-{qtype}"), ck, ck.config, model, Tokenizer.from_metadata(meta),
                         mode, load_s, "cuda")
    cfg = EngineConfig(max_num_seqs=max_seqs, max_num_batched_tokens=max(8192, max_len), block_size=16,
                       max_model_len=max_len, kv_tokens=kv_tokens or max_len, enable_prefix_cache=False,
                       device="cuda")
    return LLMEngine(loaded, cfg), load_s, ck.weight_bytes


def read_bytes_per_token(model) -> int:
    """Bytes of every weight a decode step reads in full (linear layers and the head)."""
    from lodestar.layers.cuda_linear import CudaDenseLinear, CudaQuantLinear
    seen, total = set(), 0
    for m in model.modules():
        if isinstance(m, CudaQuantLinear):
            key = id(m.weight.codes)
        elif isinstance(m, CudaDenseLinear):
            key = id(m.weight)
        else:
            continue
        if key not in seen:
            seen.add(key)
            total += m.nbytes
    return total


def file_weight_bytes(loaded) -> int:
    """Bytes of every tensor of the model's file as stored (GGUF blocks, safetensors arrays),
    the token embedding included: the weight bytes of the roofline as the CUDA issue's targets
    define it (its llama.cpp fractions and the 8B F16 file's 14.77 GB are of these bytes)."""
    return sum(int(t.n_bytes) for t in loaded.file.tensors.values())


def kv_bytes_per_token(engine) -> int:
    """KV bytes per cached token (all layers, K and V)."""
    return sum(2 * l.k_cache[0].numel() * l.k_cache.element_size() for l in engine.loaded.model.attention_layers)


def prompts(n: int, length: int, vocab: int, seed: int = SEED) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    # ids past the control tokens, so no prompt holds a special token by chance
    return torch.randint(10, vocab, (n, length), generator=g).tolist()


# ------------------------------------------------------------------------------- cells

def timed_generate(engine, batch: list[list[int]], new: int) -> dict:
    """Run ``batch`` to ``new`` tokens each; time to first token (all rows) and decode time."""
    from lodestar.engine.sampling import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    ids = [engine.add_request(p, params) for p in batch]
    counts = dict.fromkeys(ids, 0)
    first = None
    while engine.has_unfinished():
        for out in engine.step():
            counts[out.request_id] += len(out.token_ids)
        if first is None and all(counts[i] >= 1 for i in ids):
            first = time.perf_counter()
    end = time.perf_counter()
    tokens = sum(counts.values())
    return {"ttft_s": first - t0, "decode_s": end - first, "tokens": tokens,
            "decode_tok_s": (tokens - len(ids)) / max(end - first, 1e-9)}


def decode_cell(engine, weight_read: int, bandwidth: float | None, prompt_len: int = 128, new: int = 256) -> dict:
    """Single-stream decode tok/s, with its fractions of the roofline (weights read + KV) and
    of the file's roofline (``file_weight_bytes``) where the copy bandwidth is known."""
    vocab = engine.loaded.config.vocab_size
    p = prompts(1, prompt_len, vocab)
    timed_generate(engine, p, 16)                               # warm-up: kernels, graph capture
    runs = [timed_generate(engine, p, new)["decode_tok_s"] for _ in range(RUNS)]
    stored = file_weight_bytes(engine.loaded)
    out = {"prompt_tokens": prompt_len, "new_tokens": new, "decode_tok_s": stat(runs),
           "weight_bytes_read_per_token": weight_read, "file_weight_bytes": stored,
           "cuda_graph_replays": engine.runner.graph_replays}
    if bandwidth:
        kv = kv_bytes_per_token(engine) * (prompt_len + new // 2)
        roof = bandwidth / (weight_read + kv)
        out.update(roofline_tok_s=round(roof, 1), fraction_of_roofline=round(statistics.median(runs) / roof, 3),
                   fraction_of_file_roofline=round(statistics.median(runs) * stored / bandwidth, 3))
    return out


def prefill_cell(engine, length: int) -> dict:
    vocab = engine.loaded.config.vocab_size
    p = prompts(1, length, vocab, seed=SEED + length)
    timed_generate(engine, p, 1)
    runs = []
    for _ in range(RUNS):
        r = timed_generate(engine, p, 1)
        runs.append(length / r["ttft_s"])
    return {"prompt_tokens": length, "prefill_tok_s": stat(runs, 1)}


def batch_cell(engine, size: int, prompt_len: int = 128, new: int = 256) -> dict:
    vocab = engine.loaded.config.vocab_size
    p = prompts(size, prompt_len, vocab, seed=SEED + size)
    timed_generate(engine, p, 8)
    runs = [timed_generate(engine, p, new)["decode_tok_s"] for _ in range(RUNS)]
    return {"batch": size, "prompt_tokens": prompt_len, "new_tokens": new, "aggregate_decode_tok_s": stat(runs, 1),
            "per_stream_tok_s": round(statistics.median(runs) / size, 1)}


def context_decode(engine, ctx: int, new: int) -> float:
    """Decode tok/s of one sequence whose cache already holds ``ctx - 1`` (zero) entries,
    stepped as the engine's overlapped decode does (each step queued before the previous
    one's token is read; step by step where the engine does not overlap)."""
    from lodestar.engine.sequence import Sequence
    runner, pool = engine.runner, engine.pool
    seq = Sequence(10**6 + ctx, prompts(1, ctx, engine.loaded.config.vocab_size)[0], None)
    runner.ensure_blocks(seq, ctx)
    seq.num_computed = ctx - 1
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    if engine.overlap:
        pending = runner.launch([seq])
        for _ in range(new - 1):
            runner.ensure_blocks(seq, seq.num_computed + 1)
            nxt = runner.launch([seq], pending)
            seq.output_ids.append(pending.tokens()[0][0])
            pending = nxt
        seq.output_ids.append(pending.tokens()[0][0])
    else:
        for _ in range(new):
            logits = runner.run([seq], [1])
            seq.output_ids.append(int(logits[0].argmax()))
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    pool.free(seq.block_table)
    return new / dt


def context_cell(engine, ctx: int, new: int, read: int, bw: float | None) -> dict:
    """Decode at context ``ctx``: warm-up, then ``RUNS`` timed runs of ``new`` tokens."""
    context_decode(engine, ctx, min(new, 8))
    runs = [context_decode(engine, ctx, new) for _ in range(RUNS)]
    out = {"context": ctx, "new_tokens": new, "decode_tok_s": stat(runs),
           "ms_per_token": round(1e3 / statistics.median(runs), 3)}
    if bw:
        roof = bw / (read + kv_bytes_per_token(engine) * (ctx + new // 2))
        out.update(roofline_tok_s=round(roof, 1), fraction_of_roofline=round(statistics.median(runs) / roof, 3))
    return out
