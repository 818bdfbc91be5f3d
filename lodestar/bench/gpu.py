"""GPU benchmark stages for ``scripts/device_bench.sh`` (one H200, no network).

Each stage runs in its own process (``python -m lodestar.bench.gpu STAGE --json FILE``)
and merges its results into one JSON file after every cell, so a stage that fails or
runs out of time still leaves what it measured (and its error). Models are synthetic
(``formats.synthetic``: random weights of real geometries built in GPU memory, the same
tensor types and kernels as a GGUF file of that type); EOS is ignored and sampling is
greedy. Every cell reports min / median / max of 3 runs after a warm-up run, and the
peak GPU memory.

Stages:
  env     device, versions, device-copy bandwidth (a 2 GiB torch copy, read + write bytes)
  small   SmolLM2-135M geometry, F16 and Q4_0: single-stream decode, prefill 512 / 4096
  8b-f16  Llama-3.1-8B geometry, F16 (bf16 weights): decode, prefill, aggregate decode at
          batch 1..64 (prompt 128, 256 new)
  8b-q4k  Llama-3.1-8B, Q4_K (Q6_K head): decode, prefill
  8b-q4km Llama-3.1-8B, Q4_K_M (llama.cpp's mix: attn_v and ffn_down in Q6_K on 16 of the
          32 layers, Q6_K head; the peer's Q4_K file): decode, prefill
  8b-q4_0 Llama-3.1-8B, Q4_0 (Q8_0 head): decode, prefill
  sweep   Llama-3.1-8B Q4_K decode at context 1k..32k (CSV + SVG); the context is filled
          with zeros rather than prefilled, which changes no byte read per token
  hf      Hugging Face transformers (eager generate, sdpa attention) against lodestar on
          the same synthetic safetensors folders (SmolLM2, Llama-3.2-1B)
  gemv    quantized matrix-vector kernel on 8B shapes: every type at its default tiling
          (M = 1, 8, 32), then a tiling sweep for Q4_0 / Q4_K at M = 1
  profile wall time per decode step (overlapped, and step by step) vs GPU time of its
          graph replay (host gap) and the per-kernel times of eager decode steps (SmolLM2
          F16, 8B F16, Q4_K and Q4_0)
  chain   the decode step's kernel chain from graph replays under torch.profiler: per
          kernel and its place in the layer, how far it moved the end of the chain, and the
          projections' weight streams (LODESTAR_CHAIN_CELLS)
  fuse    decode fusions off vs on (LODESTAR_FUSE=0/1): same tokens and log-probabilities,
          decode tok/s (SmolLM2 and 8B, F16 and Q4_0; LODESTAR_FUSE_CELLS="geometry/type ...")
  dense   bf16 matrix-vector at M = 1: cuBLAS vs the Triton kernel (tiling sweep)
  densegemv  decode with bf16 weights, the layers' Triton matrix-vector kernel off vs on
  prefill 8B F16 prefill 512 / 4096: wall vs CUDA-event time around the step, fusions off and on
  overlap overlapped decode off vs on, one engine, runs interleaved: same greedy tokens,
          decode tok/s at 1 and 8 streams (SmolLM2 F16, 8B F16, 8B Q4_0)
  tp      tensor parallelism (needs 2 GPUs): Llama-3.1-8B bf16 single-stream decode and
          batch 32 with --tensor-parallel 1 and 2 (symmetric-memory and NCCL all-reduce)
          in the same run
  tp70    a 70B-geometry bf16 model (138.5 GB of weights; with a 128k-token cache,
          181 GB: more than one H200 holds) with --tensor-parallel 2, decode at 1k / 32k /
          128k context; per-GPU
          memory from nvidia-smi

Roofline: decode tok/s <= copy bandwidth / (weight bytes + KV bytes read per token), with the
weight bytes those a decode step reads in this engine's layout (``read_bytes_per_token``:
every projection and the head, not the token embedding; ``fraction_of_roofline``). The CUDA
issue's targets take the file's weight bytes instead (``file_weight_bytes``: every tensor as
stored, the token embedding included, no KV; ``fraction_of_file_roofline``), as its llama.cpp
fractions do. The two differ by the embedding table (in the file, not read) and by packed
layouts larger than the file's blocks (Q4_K / Q5_K scales in pairs or split: 148 bytes a
block of 256 weights read against the file's 144).
"""
from __future__ import annotations

import argparse
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

RUNS = 3
SEED = 1234


# --------------------------------------------------------------------------- results

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


# ----------------------------------------------------------------------------- models

def synthetic_engine(geometry: str, qtype: str, mode: str = "packed", max_len: int = 8192,
                     max_seqs: int = 64, kv_tokens: int | None = None, context: int | None = None):
    """(engine, load seconds, checkpoint bytes) for a synthetic model on the GPU."""
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
        for i in range(new - 1):
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


def release() -> None:
    """Return the memory of models and engines no longer referenced."""
    gc.collect()
    torch.cuda.empty_cache()


def bandwidth_from(results: Results) -> float | None:
    env = results.doc.get("stages", {}).get("env", {}).get("cells", {}).get("copy_bandwidth", {})
    bw = env.get("bytes_per_s")
    return float(bw) if bw else None


# ----------------------------------------------------------------------------- stages

def stage_env(r: Results) -> None:
    def info():
        p = torch.cuda.get_device_properties(0)
        try:
            import triton
            tv = triton.__version__
        except ImportError:
            tv = None
        from lodestar.bench.common import git_commit
        return {"device": p.name, "sms": p.multi_processor_count, "memory_gb": round(p.total_memory / 1e9, 1),
                "torch": torch.__version__, "cuda": torch.version.cuda, "triton": tv, "python": sys.version.split()[0],
                "commit": git_commit()}

    def copy_bandwidth():
        from lodestar.bench.gemv_variants import copy_bandwidth as measure
        n = 2 << 30
        bw = measure("cuda", 14)["bytes_per_s"]      # median of 7 copies
        release()
        return {"bytes": n, "bytes_per_s": bw, "gb_per_s": round(bw / 1e9, 1),
                "note": "read + write bytes of a 2 GiB device copy, median of 7"}

    r.cell("device", info, 5)
    r.cell("copy_bandwidth", copy_bandwidth, 5)


def _model_cells(r: Results, geometry: str, qtype: str, prefill: tuple[int, ...] = (512, 4096),
                 batches: tuple[int, ...] = (), context: int | None = None) -> None:
    key = f"{geometry}-{qtype}"
    bw = bandwidth_from(r)
    max_len = 4096 + 64
    kv = max(max_len, max(batches, default=1) * (128 + 256 + 16))
    state = {}

    def load():
        engine, load_s, file_bytes = synthetic_engine(geometry, qtype, max_len=max_len, kv_tokens=kv, context=context)
        state["engine"] = engine
        state["read"] = read_bytes_per_token(engine.loaded.model)
        return {"load_s": round(load_s, 2), "checkpoint_bytes": file_bytes, "weight_bytes_read_per_token": state["read"],
                "kv_bytes_per_token": kv_bytes_per_token(engine)}

    r.cell(f"{key}/load", load, 20)
    if "engine" not in state:
        return
    engine = state["engine"]
    r.cell(f"{key}/decode", lambda: decode_cell(engine, state["read"], bw), 15)
    for n in prefill:
        r.cell(f"{key}/prefill_{n}", lambda n=n: prefill_cell(engine, n), 10)
    for b in batches:
        r.cell(f"{key}/batch_{b}", lambda b=b: batch_cell(engine, b), 12)
    state.clear()
    del engine
    release()


def stage_small(r: Results) -> None:
    _model_cells(r, "smollm2-135m", "F16")
    _model_cells(r, "smollm2-135m", "Q4_0")


def stage_8b_f16(r: Results) -> None:
    _model_cells(r, "llama-3.1-8b", "F16", batches=(1, 2, 4, 8, 16, 32, 64))


def stage_8b_q4k(r: Results) -> None:
    _model_cells(r, "llama-3.1-8b", "Q4_K")


def stage_8b_q4km(r: Results) -> None:
    _model_cells(r, "llama-3.1-8b", "Q4_K_M")


def stage_8b_q4_0(r: Results) -> None:
    _model_cells(r, "llama-3.1-8b", "Q4_0")


SWEEP_QTYPES = "Q4_K,F16"


def sweep_qtypes() -> list[str]:
    """The 8B files the context sweep decodes (env ``LODESTAR_SWEEP_QTYPES``, a comma list;
    unset: Q4_K then F16)."""
    return [q.strip() for q in os.environ.get("LODESTAR_SWEEP_QTYPES", SWEEP_QTYPES).split(",") if q.strip()]


def sweep_contexts() -> tuple[int, ...]:
    """The sweep's contexts: env ``LODESTAR_SWEEP_CONTEXTS`` (comma list of ascending positive
    integers), unset 1k to 32k in doublings."""
    env = os.environ.get("LODESTAR_SWEEP_CONTEXTS", "").strip()
    if not env:
        return (1024, 2048, 4096, 8192, 16384, 32768)
    try:
        values = tuple(int(v) for v in env.split(","))
    except ValueError:
        values = ()
    if not values or min(values) < 1 or list(values) != sorted(set(values)):
        raise ValueError(f"LODESTAR_SWEEP_CONTEXTS={env!r}; use ascending positive integers, comma-separated")
    return values


def stage_sweep(r: Results, csv_path: Path | None, svg_path: Path | None) -> None:
    """Decode speed against context, one 8B file per ``sweep_qtypes()``: CSV (a row per
    type and context) and SVG (a line per type, with its roofline). Env
    ``LODESTAR_SWEEP_CONTEXTS``: other contexts (comma list, ascending)."""
    contexts = sweep_contexts()
    new = 64
    max_len = contexts[-1] + new + 16
    rows = []
    for qtype in sweep_qtypes():
        state = {}

        def load(qtype=qtype):
            engine, load_s, _ = synthetic_engine("llama-3.1-8b", qtype, max_len=max_len, max_seqs=1,
                                                 kv_tokens=max_len, context=65536)
            state["engine"] = engine
            return {"load_s": round(load_s, 2)}

        r.cell(f"llama-3.1-8b-{qtype}/load", load, 20)
        if "engine" not in state:
            continue
        engine = state["engine"]
        read = read_bytes_per_token(engine.loaded.model)
        bw = bandwidth_from(r)
        for ctx in contexts:
            def cell(ctx=ctx, qtype=qtype):
                out = context_cell(engine, ctx, new, read, bw)
                rows.append({"qtype": qtype, **out})
                return out
            r.cell(f"llama-3.1-8b-{qtype}/context_{ctx}", cell, 8)
        state.clear()
        del engine
        release()
    if csv_path and rows:
        lines = ["qtype,context,decode_tok_s_median,decode_tok_s_min,decode_tok_s_max,ms_per_token,roofline_tok_s"]
        lines += [f"{o['qtype']},{o['context']},{o['decode_tok_s']['median']},{o['decode_tok_s']['min']},"
                  f"{o['decode_tok_s']['max']},{o['ms_per_token']},{o.get('roofline_tok_s', '')}" for o in rows]
        csv_path.write_text("\n".join(lines) + "\n")
    if svg_path and rows:
        svg_path.write_text(svg_plot(rows))


def svg_plot(rows: list[dict]) -> str:
    """Decode tok/s (solid) and its roofline (dashed) against context, log2 x axis, one
    colour per file type (``qtype`` of each row; rows without one are one line), as SVG."""
    import math
    W, H, L, B = 640, 360, 60, 40
    colours = ("#1f77b4", "#2ca02c", "#9467bd", "#ff7f0e")
    groups: dict[str, list[dict]] = {}
    for o in rows:
        groups.setdefault(o.get("qtype", ""), []).append(o)
    allx = [math.log2(o["context"]) for o in rows]
    ymax = max([o["decode_tok_s"]["median"] for o in rows] + [o["roofline_tok_s"] for o in rows
                                                               if o.get("roofline_tok_s")]) * 1.1
    x0 = min(allx)
    x1 = max(allx) if max(allx) > x0 else x0 + 1

    def px(x, y):
        return L + (x - x0) / (x1 - x0) * (W - L - 20), H - B - y / ymax * (H - B - 20)

    def line(pts, color, dash=""):
        xy = " ".join(f"{px(x, y)[0]:.1f},{px(x, y)[1]:.1f}" for x, y in pts if y)
        return f'<polyline fill="none" stroke="{color}" stroke-width="2" {dash} points="{xy}"/>'

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">',
             f'<rect width="{W}" height="{H}" fill="white"/>',
             f'<line x1="{L}" y1="{H - B}" x2="{W - 20}" y2="{H - B}" stroke="black"/>',
             f'<line x1="{L}" y1="20" x2="{L}" y2="{H - B}" stroke="black"/>']
    for i, (qtype, grp) in enumerate(groups.items()):
        colour = colours[i % len(colours)]
        xs = [math.log2(o["context"]) for o in grp]
        parts.append(line(zip(xs, [o["decode_tok_s"]["median"] for o in grp]), colour))
        parts.append(line(zip(xs, [o.get("roofline_tok_s") for o in grp]), colour, 'stroke-dasharray="5,4"'))
        parts.append(f'<text x="{W - 150}" y="{40 + 16 * i}" fill="{colour}">{qtype or "decode"}</text>')
    for x in sorted(set(allx)):
        X, _ = px(x, 0)
        parts.append(f'<text x="{X:.0f}" y="{H - B + 16}" text-anchor="middle">{round(2 ** x) // 1024}k</text>')
    for i in range(5):
        y = ymax * i / 4
        _, Y = px(x0, y)
        parts.append(f'<text x="{L - 6}" y="{Y + 4:.0f}" text-anchor="end">{y:.0f}</text>')
    parts += [f'<text x="{W / 2}" y="{H - 6}" text-anchor="middle">context (tokens)</text>',
              '<text x="14" y="14">decode tok/s — Llama-3.1-8B geometry, batch 1 '
              '(solid: measured, dashed: bandwidth roofline)</text>', "</svg>"]
    return "\n".join(parts)


# ------------------------------------------------------------------ HF transformers

def write_hf_folder(geometry: str, out: Path) -> Path:
    """A synthetic bf16 Hugging Face folder (config, tokenizer, shards), weights made on the GPU."""
    from safetensors.torch import save_file

    from lodestar.formats.synthetic import GEOMETRIES, hf_tokenizer_files, tokenizer_metadata_or_synthetic
    g = GEOMETRIES[geometry]
    d = out / f"{geometry}-bf16-hf"
    if (d / "config.json").is_file():
        return d
    d.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator(device="cuda").manual_seed(SEED)

    def w(rows, cols):
        return (torch.randn(rows, cols, generator=gen, device="cuda") * 0.02).to(torch.bfloat16).cpu()

    def ones(n):
        return torch.ones(n, dtype=torch.bfloat16)

    q, kv = g.n_heads * g.head_dim, g.n_kv_heads * g.head_dim
    shard, shard_bytes, files, index = {}, 0, [], {}

    def flush():
        nonlocal shard, shard_bytes
        if shard:
            name = f"model-{len(files) + 1:05d}.safetensors"
            save_file(shard, str(d / name), metadata={"format": "pt"})
            files.append(name)
            index.update(dict.fromkeys(shard, name))
            shard, shard_bytes = {}, 0

    def add(name, t):
        nonlocal shard_bytes
        shard[name] = t
        shard_bytes += t.numel() * t.element_size()
        if shard_bytes > (2 << 30):
            flush()

    add("model.embed_tokens.weight", w(g.vocab, g.d_model))
    for i in range(g.n_layers):
        p = f"model.layers.{i}."
        add(p + "input_layernorm.weight", ones(g.d_model))
        add(p + "post_attention_layernorm.weight", ones(g.d_model))
        add(p + "self_attn.q_proj.weight", w(q, g.d_model))
        add(p + "self_attn.k_proj.weight", w(kv, g.d_model))
        add(p + "self_attn.v_proj.weight", w(kv, g.d_model))
        add(p + "self_attn.o_proj.weight", w(g.d_model, q))
        add(p + "mlp.gate_proj.weight", w(g.ffn_dim, g.d_model))
        add(p + "mlp.up_proj.weight", w(g.ffn_dim, g.d_model))
        add(p + "mlp.down_proj.weight", w(g.d_model, g.ffn_dim))
    add("model.norm.weight", ones(g.d_model))
    if not g.tied:
        add("lm_head.weight", w(g.vocab, g.d_model))
    flush()
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": g.d_model,
        "num_hidden_layers": g.n_layers, "num_attention_heads": g.n_heads, "num_key_value_heads": g.n_kv_heads,
        "head_dim": g.head_dim, "intermediate_size": g.ffn_dim, "vocab_size": g.vocab,
        "max_position_embeddings": g.context, "rms_norm_eps": 1e-5, "rope_theta": g.rope_theta,
        "tie_word_embeddings": g.tied, "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2}))
    meta, _ = tokenizer_metadata_or_synthetic(g.vocab)
    for name, text in hf_tokenizer_files(meta).items():
        (d / name).write_text(text)
    return d


def hf_decode_tok_s(folder: Path, prompt: list[int], new: int) -> dict:
    import transformers
    from transformers import AutoModelForCausalLM
    t0 = time.perf_counter()
    try:
        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16)
    except TypeError:
        model = AutoModelForCausalLM.from_pretrained(str(folder), torch_dtype=torch.bfloat16)
    model = model.to("cuda").eval()
    load_s = time.perf_counter() - t0
    ids = torch.tensor([prompt], device="cuda")

    def gen(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        return time.perf_counter() - t

    gen(8)
    runs = []
    for _ in range(RUNS):
        t1, tn = gen(1), gen(new)
        runs.append((new - 1) / (tn - t1))
    attn = getattr(model.config, "_attn_implementation", None)
    del model
    release()
    return {"transformers": transformers.__version__, "attn_implementation": attn, "load_s": round(load_s, 2),
            "decode_tok_s": stat(runs)}


def lodestar_decode_on_folder(folder: Path, prompt: list[int], new: int) -> dict:
    from lodestar.engine.llm_engine import EngineConfig, LLMEngine
    from lodestar.engine.loader import load_model
    release()
    loaded = load_model(str(folder), mode="packed", progress=False, device="cuda")
    engine = LLMEngine(loaded, EngineConfig(max_num_seqs=1, max_model_len=1024, kv_tokens=1024,
                                            enable_prefix_cache=False, device="cuda"))
    timed_generate(engine, [prompt], 16)
    runs = [timed_generate(engine, [prompt], new)["decode_tok_s"] for _ in range(RUNS)]
    out = {"load_s": round(loaded.load_seconds, 2), "decode_tok_s": stat(runs)}
    del engine, loaded
    release()
    return out


def stage_hf(r: Results, workdir: Path) -> None:
    new = 128
    for geometry, need in (("smollm2-135m", 30), ("llama-3.2-1b", 60)):
        def cell(geometry=geometry):
            t0 = time.perf_counter()
            folder = write_hf_folder(geometry, workdir)
            write_s = time.perf_counter() - t0
            prompt = prompts(1, 128, 49152)[0]
            hf = hf_decode_tok_s(folder, prompt, new)
            ours = lodestar_decode_on_folder(folder, prompt, new)
            ratio = ours["decode_tok_s"]["median"] / hf["decode_tok_s"]["median"]
            return {"folder_write_s": round(write_s, 1), "prompt_tokens": 128, "new_tokens": new,
                    "hf_transformers": hf, "lodestar": ours, "lodestar_over_hf": round(ratio, 2)}
        r.cell(f"{geometry}-bf16-safetensors", cell, need)



# ------------------------------------------------------------------ kernel tuning

GEMV_SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
               "head": (49152, 4096)}


def _time_gpu(fn, reps: int = 50) -> float:
    """Median seconds of ``fn()`` over ``reps`` calls replayed from one CUDA graph."""
    fn()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    return statistics.median(replay_ms(g, 5)) / 1e3 / reps


def replay_ms(graph, n: int) -> list[float]:
    """Milliseconds of each of ``n`` replays of ``graph``, one at a time (CUDA events)."""
    times = []
    for _ in range(n):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        graph.replay()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    return times


def stage_gemv(r: Results) -> None:
    """Matrix-vector kernel speed on Llama-3.1-8B shapes: default tiling per type, then a
    sweep of tilings for Q4_0 / Q4_K at M = 1 (GB/s of weight bytes, fraction of copy bandwidth)."""
    from lodestar.formats.synthetic import random_weight
    from lodestar.kernels import triton_quant as tq
    bw = bandwidth_from(r)
    T = tq.T
    weights = {}

    def weight(qtype, name):
        key = (qtype, name)
        if key not in weights:
            n, k = GEMV_SHAPES[name]
            gen = torch.Generator(device="cuda").manual_seed(SEED)
            weights[key] = tq.pack(qtype, random_weight(qtype.name, n, k, gen, "cuda"), n, k)
        return weights[key]

    def measure(qtype, name, m, cfg=None):
        pw = weight(qtype, name)
        x = torch.randn(m, pw.k, device="cuda", dtype=torch.bfloat16)
        t = _time_gpu(lambda: tq.quant_matmul(x, pw, config=cfg))
        out = {"us": round(t * 1e6, 2), "gb_per_s": round(pw.nbytes / t / 1e9, 1)}
        if bw:
            out["fraction_of_copy_bw"] = round(pw.nbytes / t / bw, 3)
        return out

    def defaults():
        res = {}
        for qtype in (T.Q4_0, T.Q4_K, T.Q6_K, T.Q8_0, T.Q4_1, T.Q5_K):
            for name in GEMV_SHAPES:
                for m in (1, 8, 32):
                    res[f"{qtype.name}/{name}/m{m}"] = measure(qtype, name, m)
                    res[f"{qtype.name}/{name}/m{m}"]["config"] = dataclasses.asdict(
                        tq.gemv_config(*GEMV_SHAPES[name], torch.device("cuda")))
            weights.clear()
        return res

    r.cell("defaults", defaults, 30)
    for qtype in (T.Q4_0, T.Q4_K):
        def sweep(qtype=qtype):
            res, best = {}, {}
            for name in ("qkv", "o", "gate_up", "down"):
                for bn in (8, 16, 32):
                    for tg in (8, 16, 32):
                        for split in (1, 2, 4, 8):
                            for warps in ((4, 8) if tg == 32 else (4,)):
                                if r.left() < 20:
                                    return {"partial": True, "results": res, "best": best}
                                cfg = tq.GemvConfig(bn, tg, split, warps)
                                key = f"{name}/{bn},{tg},{split},{warps}"
                                try:
                                    res[key] = measure(qtype, name, 1, cfg)
                                except Exception as e:   # e.g. out of registers
                                    res[key] = {"error": f"{type(e).__name__}: {e}"[:200]}
                                    continue
                                if name not in best or res[key]["us"] < best[name]["us"]:
                                    best[name] = {"config": [bn, tg, split, warps], **res[key]}
            weights.clear()
            return {"results": res, "best": best}
        r.cell(f"sweep_{qtype.name}", sweep, 30)


def stage_profile(r: Results) -> None:
    """Where a decode step's time goes: wall time per engine step vs the GPU time of the
    graph replay (host gap), and per-kernel CUDA time of eager steps (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile
    from lodestar.engine.sampling import SamplingParams
    for geometry, qtype in (("smollm2-135m", "F16"), ("llama-3.1-8b", "F16"), ("llama-3.1-8b", "Q4_K"),
                            ("llama-3.1-8b", "Q4_0")):
        def cell(geometry=geometry, qtype=qtype):
            engine, _, _ = synthetic_engine(geometry, qtype, max_len=1024, max_seqs=1, kv_tokens=1024)
            runner = engine.runner
            vocab = engine.loaded.config.vocab_size
            params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
            rid = engine.add_request(prompts(1, 128, vocab)[0], params)
            for _ in range(20):                      # prefill, then decode: graph for batch 1 captured
                engine.step()
            torch.cuda.synchronize()
            steps = 100
            walls = {}
            for overlap in (False, True):      # step by step, then overlapped (the default)
                engine.overlap = overlap
                engine.step()
                engine.step()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(steps):
                    engine.step()
                torch.cuda.synchronize()
                walls[overlap] = (time.perf_counter() - t0) / steps
            wall = walls[True]
            g = runner.graphs[1]["graph"]
            # GPU time of the graph replay inside the engine's steps (vs back to back below)
            inner, replay = [], g.replay

            def timed_replay():
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                replay()
                b.record()
                inner.append((a, b))
            g.replay = timed_replay
            for _ in range(30):
                engine.step()
            torch.cuda.synchronize()
            g.replay = replay
            in_engine = statistics.median(a.elapsed_time(b) for a, b in inner) / 1e3 if inner else None
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for _ in range(steps):
                g.replay()
            e.record()
            e.synchronize()
            gpu = s.elapsed_time(e) / 1e3 / steps
            # eager steps under the profiler: kernel names and times
            runner.cuda_graphs = False
            for _ in range(3):
                engine.step()
            torch.cuda.synchronize()
            n_prof = 10
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(n_prof):
                    engine.step()
                torch.cuda.synchronize()
            runner.cuda_graphs = True
            kernels = {}
            for ev in prof.key_averages():
                dev_t = getattr(ev, "self_device_time_total", None) or getattr(ev, "self_cuda_time_total", 0)
                if dev_t and ev.key and not ev.key.startswith(("aten::", "cuda", "Memcpy", "Memset")):
                    kernels[ev.key[:90]] = (dev_t / n_prof, ev.count // n_prof)
            top = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:20]
            total_kernel_us = sum(v[0] for v in kernels.values())
            engine.abort(rid)
            out = {"wall_ms_per_step": round(wall * 1e3, 3),
                   "wall_ms_per_step_step_by_step": round(walls[False] * 1e3, 3),
                   "graph_replay_gpu_ms": round(gpu * 1e3, 3),
                   "in_engine_replay_gpu_ms": round(in_engine * 1e3, 3) if in_engine else None,
                   "host_gap_ms": round((wall - gpu) * 1e3, 3), "decode_tok_s_wall": round(1 / wall, 1),
                   "eager_kernel_ms_per_step": round(total_kernel_us / 1e3, 3),
                   "eager_kernels_per_step": sum(v[1] for v in kernels.values()),
                   "top_kernels_us_per_step": {k: {"us": round(v[0], 1), "calls": v[1]} for k, v in top}}
            del engine, runner
            release()
            return out
        r.cell(f"{geometry}-{qtype}", cell, 25)




# ------------------------------------------------------------ decode chain, kernel by kernel

PLACES_AFTER_LAYERS = 2     # calls of a per-layer kernel after the last layer (the head)


def chain_trace(events: list[tuple], replays: int, layers: int = 0) -> dict:
    """Where a replayed decode step's time goes, from the device kernels of ``replays`` graph
    replays as (key, start ns, end ns[, stream]) in launch order: each kernel's *advance* is
    how far it moved the end of the chain (its end minus the latest end before it, at least
    0; with dependent launch a kernel starts before the one ahead of it ends, so durations
    overlap and do not add up, advances do: their sum per step is the step's span from the
    first kernel's end). Kernels on another stream than the step's first kernel (the side
    prefetch) run beside the chain: they are counted, with their durations, but move
    nothing (``side_stream``). Per key: calls and advance per step, mean duration (start to
    end, which includes the time a dependently launched kernel's blocks sat waiting) and
    mean advance per call; sorted by advance per step. With ``layers``, a key called ``m *
    layers + r`` times a step (m >= 2, r <= ``PLACES_AFTER_LAYERS``) is told apart by its
    place in the layer: ``key #i`` is its i-th call of each layer (a layer's q|k|v, o, gate|up
    and down projections share one kernel), ``key #+`` the r calls after the last layer. A
    key called more often than that (layers of different forms: a Q4_K_M file's q|k|v is
    two kernels in half its layers) is left whole."""
    events = [(e[0], e[1], e[2], e[3] if len(e) > 3 else None) for e in events]
    per_key: dict[str, list] = {}
    spans = []
    # replays are apart by the host's synchronize and launch: cut at the replays - 1 widest gaps
    gaps, end = [], None
    for i, (_, start, stop, _) in enumerate(events):
        if end is not None:
            gaps.append((start - end, i))
        end = stop if end is None else max(end, stop)
    cuts = sorted(i for _, i in sorted(gaps, reverse=True)[:max(0, replays - 1)])
    bounds = [0, *cuts, len(events)]
    steps = [events[a:b] for a, b in zip(bounds, bounds[1:])]
    for step in steps:
        if layers:
            count: dict[str, int] = {}
            for key, *_ in step:
                count[key] = count.get(key, 0) + 1
            seen: dict[str, int] = {}
            labelled = []
            for key, start, end, stream in step:
                i, m = seen.get(key, 0), count[key] // layers
                seen[key] = i + 1
                if m >= 2 and count[key] - m * layers <= PLACES_AFTER_LAYERS:
                    key = f"{key} #{i % m}" if i < m * layers else f"{key} #+"
                labelled.append((key, start, end, stream))
            step = labelled
        main = step[0][3] if step else None
        last_end = None
        for key, start, end, stream in step:
            rec = per_key.setdefault(key, [0, 0, 0, False])
            rec[0] += 1
            rec[2] += end - start
            if stream != main:
                rec[3] = True
                continue
            rec[1] += 0 if last_end is None else max(0, end - last_end)
            last_end = end if last_end is None else max(last_end, end)
        if step:
            spans.append((last_end - step[0][1]) / 1e3)
    rows = {}
    for k, v in per_key.items():
        rows[k] = {"calls_per_step": v[0] / replays, "advance_us_per_step": round(v[1] / 1e3 / replays, 1),
                   "advance_us_per_call": round(v[1] / 1e3 / v[0], 2),
                   "duration_us_per_call": round(v[2] / 1e3 / v[0], 2)}
        if v[3]:
            rows[k]["side_stream"] = True
    rows = dict(sorted(rows.items(), key=lambda kv: -kv[1]["advance_us_per_step"]))
    return {"kernels_per_step": [len(st) for st in steps], "traced_span_us": stat(spans) if spans else None, "kernels": rows}


def stream_rates(kernels: dict, layer_bytes: list[int], head_bytes: int) -> None:
    """Add ``stream_tb_s`` (weight bytes / advance per call) to ``chain_trace``'s rows of the
    matrix-vector kernels: ``#i`` is a layer's i-th projection (``layer_bytes[i]``), ``#+``
    the head."""
    for key, row in kernels.items():
        if "gemv" not in key or row["advance_us_per_call"] <= 0:
            continue
        slot = key.rsplit(" #", 1)[-1] if " #" in key else None
        nbytes = head_bytes if slot == "+" else layer_bytes[int(slot)] if slot and slot.isdigit() \
            and int(slot) < len(layer_bytes) else None
        if nbytes:
            row["stream_tb_s"] = round(nbytes / (row["advance_us_per_call"] * 1e-6) / 1e12, 2)


def _projection_bytes(model) -> tuple[list[int], int] | None:
    """Weight bytes of the first block's q|k|v, o, gate|up and down, and of the head (a
    Llama-form model), in the order a decode step runs them; None for another form."""
    try:
        blk = model.layers[0]
        mods = (blk.attn.qkv, blk.attn.o, blk.mlp.gate_up, blk.mlp.down)
        size = lambda m: sum(x.nbytes for x in m) if isinstance(m, (list, torch.nn.ModuleList)) else m.nbytes  # noqa: E731
        return [size(m) for m in mods], size(model.head)
    except (AttributeError, IndexError, TypeError):
        return None


def _kernel_key(ev) -> str:
    """A device kernel's name, shortened (``void f<...>(args)`` -> ``f<...>``)."""
    import re
    return re.sub(r"^void |\(.*$", "", ev.name())[:60]


def stage_chain(r: Results) -> None:
    """The decode step's kernel chain as the GPU runs it: graph replays of one stream
    (8B, prompt 128) under torch.profiler (CUPTI records each kernel of a replayed graph),
    summarised by ``chain_trace``; with the untraced replay time of the same graph, to show
    how much tracing perturbs it. ``LODESTAR_CHAIN_CELLS``: geometry/type cells."""
    from torch.profiler import ProfilerActivity, profile
    from lodestar.engine.sampling import SamplingParams
    cells = [c.split("/") for c in os.environ.get(
        "LODESTAR_CHAIN_CELLS", "llama-3.1-8b/Q4_0 llama-3.1-8b/F16").split()]
    for geometry, qtype in cells:
        def cell(geometry=geometry, qtype=qtype):
            engine, _, _ = synthetic_engine(geometry, qtype, max_len=1024, max_seqs=1, kv_tokens=1024)
            runner = engine.runner
            params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
            rid = engine.add_request(prompts(1, 128, engine.loaded.config.vocab_size)[0], params)
            for _ in range(40):                      # prefill, then decode: graph for batch 1 captured
                engine.step()
            torch.cuda.synchronize()
            g = runner.graphs[1]["graph"]
            layers = engine.loaded.config.n_layers
            untraced = [ms * 1e3 for ms in replay_ms(g, 30)]
            replays = 10
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(replays):
                    g.replay()
                    torch.cuda.synchronize()
            evs = [ev for ev in prof.profiler.kineto_results.events()
                   if ev.device_type() == torch.autograd.DeviceType.CUDA
                   and not ev.name().startswith(("Memcpy", "Memset")) and ev.duration_ns() > 0]
            evs.sort(key=lambda ev: ev.start_ns())
            events = [(_kernel_key(ev), ev.start_ns(), ev.end_ns(), ev.device_resource_id()) for ev in evs]
            sizes = _projection_bytes(engine.loaded.model)
            engine.abort(rid)
            del engine, runner, g
            release()
            out = chain_trace(events, replays, layers)
            if sizes:
                stream_rates(out["kernels"], *sizes)
            out["untraced_replay_us"] = stat(untraced)
            out["traced_kernels"] = len(events)
            return out
        r.cell(f"{geometry}-{qtype}", cell, 40)


# ------------------------------------------------------------------ decode fusions A/B

def stage_fuse(r: Results) -> None:
    """Decode fusions (``LODESTAR_FUSE``: x quantization in the norm / activation, K-split
    sums inside the matrix-vector kernel, residual add in the next norm) off vs on, one
    engine each: identical greedy tokens and log-probabilities, and decode tok/s. "Off" is
    ``LODESTAR_FUSE_OFF`` (default 0: none; a comma list leaves just the others out); "on"
    is ``LODESTAR_FUSE_ON`` (default ``default``: the shipped set; ``1``: every fusion)."""
    from lodestar.engine.sampling import SamplingParams
    cells = [c.split("/") for c in os.environ.get(
        "LODESTAR_FUSE_CELLS", "smollm2-135m/F16 llama-3.1-8b/F16 llama-3.1-8b/Q4_0 smollm2-135m/Q4_0").split()]
    for geometry, qtype in cells:
        def cell(geometry=geometry, qtype=qtype):
            res = {}
            off_env = os.environ.get("LODESTAR_FUSE_OFF", "0")
            for fuse in ("0", "1"):
                os.environ["LODESTAR_FUSE"] = off_env if fuse == "0" else os.environ.get("LODESTAR_FUSE_ON", "default")
                engine, _, _ = synthetic_engine(geometry, qtype, max_len=1024, kv_tokens=4096)
                ps = prompts(3, 40, engine.loaded.config.vocab_size)
                sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
                comp = engine.generate(ps, sp)
                timed_generate(engine, [ps[0]], 16)
                one = [timed_generate(engine, [ps[0]], 128)["decode_tok_s"] for _ in range(RUNS)]
                res[fuse] = {"tokens": [c.token_ids for c in comp],
                             "logprobs": [[lp[0] for lp in c.logprobs] for c in comp],
                             "decode_tok_s": stat(one)}
                del engine, comp
                release()
            os.environ.pop("LODESTAR_FUSE", None)
            off, on = res["0"], res["1"]
            return {"off_means": off_env, "same_tokens": off["tokens"] == on["tokens"], "same_logprobs": off["logprobs"] == on["logprobs"],
                    "decode_tok_s_off": off["decode_tok_s"], "decode_tok_s_on": on["decode_tok_s"],
                    "on_over_off": round(on["decode_tok_s"]["median"] / off["decode_tok_s"]["median"], 3)}
        r.cell(f"{geometry}-{qtype}", cell, 30)


def stage_gemvform(r: Results) -> None:
    """8B Q4_0 / Q4_K decode with the matrix-vector tilings as shipped vs the form named by
    ``LODESTAR_GEMV_AB`` (a ``LODESTAR_GEMV_VARIANT`` name, default ``words``), one engine each:
    decode tok/s (roofline fraction) and whether the greedy tokens agree."""
    from lodestar.engine.sampling import SamplingParams
    bw = bandwidth_from(r)
    variant = os.environ.get("LODESTAR_GEMV_AB", "words")
    for qtype in ("Q4_0", "Q4_K"):
        def cell(qtype=qtype):
            res = {}
            for name in ("shipped", variant):
                if name == "shipped":
                    os.environ.pop("LODESTAR_GEMV_VARIANT", None)
                else:
                    os.environ["LODESTAR_GEMV_VARIANT"] = name
                engine, _, _ = synthetic_engine("llama-3.1-8b", qtype, max_len=1024, kv_tokens=4096)
                ps = prompts(2, 40, engine.loaded.config.vocab_size)
                toks = [c.token_ids for c in engine.generate(ps, SamplingParams(temperature=0.0, max_tokens=32,
                                                                                 ignore_eos=True))]
                res[name] = {"tokens": toks, **decode_cell(engine, read_bytes_per_token(engine.loaded.model), bw)}
                del engine
                release()
            os.environ.pop("LODESTAR_GEMV_VARIANT", None)
            a, b = res["shipped"], res[variant]
            return {"variant": variant, "same_tokens": a.pop("tokens") == b.pop("tokens"), "shipped": a, variant: b,
                    "ratio": round(b["decode_tok_s"]["median"] / a["decode_tok_s"]["median"], 3)}
        r.cell(f"llama-3.1-8b-{qtype}", cell, 40)


def first_divergence(tokens_a: list[int], logprobs_a: list, tokens_b: list[int], logprobs_b: list) -> dict:
    """Where greedy sequence b leaves sequence a (same prompt): the first differing step
    (None: none), the logit margin there (top-1 minus top-2 logprob) on each side, and the
    largest difference of the chosen tokens' logprobs before it."""
    step = next((i for i, (x, y) in enumerate(zip(tokens_a, tokens_b)) if x != y), None)
    upto = len(tokens_a) if step is None else step
    out = {"step": step, "max_abs_dlogprob_before": round(max(
        (abs(logprobs_a[i][0] - logprobs_b[i][0]) for i in range(upto)), default=0.0), 6)}
    if step is not None:
        for key, lp in (("margin_a", logprobs_a), ("margin_b", logprobs_b)):
            top = lp[step][1]
            out[key] = round(top[0][1] - top[1][1], 6) if top and len(top) > 1 else None
    return out


def stage_ab(r: Results) -> None:
    """Two settings of the environment, one engine each, runs interleaved: decode tok/s of
    one stream (prompt 128, 256 new) and whether greedy tokens agree. ``LODESTAR_AB`` names
    them as ``A|B``, each a space-separated list of VAR=value (default: programmatic
    dependent launch off | on; one setting without ``|`` is measured alone);
    ``LODESTAR_AB_CELLS`` lists geometry/type cells. Greedy
    tokens are compared with side 0's, side by side (``same_tokens_as_side_0``; where they
    differ, ``first_divergence`` gives the step and the logit margins there)."""
    from lodestar.engine.sampling import SamplingParams
    bw = bandwidth_from(r)
    sides = [dict(kv.split("=", 1) for kv in side.split()) for side in
             os.environ.get("LODESTAR_AB", "LODESTAR_PDL=0|LODESTAR_PDL=1").split("|")]
    cells = [c.split("/") for c in os.environ.get(
        "LODESTAR_AB_CELLS", "llama-3.1-8b/F16 llama-3.1-8b/Q4_0 smollm2-135m/F16").split()]

    def setenv(side):
        for k in {k for s in sides for k in s}:
            os.environ.pop(k, None)
        os.environ.update(side)

    for geometry, qtype in cells:
        def cell(geometry=geometry, qtype=qtype):
            engines, toks, lps, runs = [], [], [], [[] for _ in sides]
            for side in sides:
                setenv(side)
                engine, _, _ = synthetic_engine(geometry, qtype, max_len=1024, kv_tokens=4096)
                ps = prompts(2, 40, engine.loaded.config.vocab_size)
                comp = engine.generate(ps, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=2))
                toks.append([c.token_ids for c in comp])
                lps.append([c.logprobs for c in comp])
                timed_generate(engine, prompts(1, 128, engine.loaded.config.vocab_size), 16)
                engines.append(engine)
            p = prompts(1, 128, engines[0].loaded.config.vocab_size)
            for _ in range(RUNS):
                for i, (side, engine) in enumerate(zip(sides, engines)):
                    setenv(side)
                    runs[i].append(timed_generate(engine, p, 256)["decode_tok_s"])
            setenv({})
            read = read_bytes_per_token(engines[0].loaded.model)
            stored = file_weight_bytes(engines[0].loaded)
            out = {"sides": [" ".join(f"{k}={v}" for k, v in s.items()) for s in sides],
                   "same_tokens": all(t == toks[0] for t in toks),
                   "same_tokens_as_side_0": [t == toks[0] for t in toks],
                   "divergence_from_side_0": [[first_divergence(toks[0][j], lps[0][j], toks[i][j], lps[i][j])
                                               for j in range(len(toks[0]))] for i in range(len(sides))]}
            for i, side in enumerate(sides):
                out[f"side_{i}"] = {"decode_tok_s": stat(runs[i])}
                if bw:
                    out[f"side_{i}"]["fraction_of_weight_roofline"] = round(statistics.median(runs[i]) * read / bw, 3)
                    out[f"side_{i}"]["fraction_of_file_roofline"] = round(statistics.median(runs[i]) * stored / bw, 3)
            if len(sides) > 1:      # one side: that setting measured alone
                out["ratio_1_over_0"] = round(statistics.median(runs[1]) / statistics.median(runs[0]), 3)
            del engines
            release()
            return out
        r.cell(f"{geometry}-{qtype}", cell, 40)


def stage_hostprof(r: Results) -> None:
    """Where the host's time goes in one 8B F16 prefill step of 512 tokens and in one eager
    decode step (no CUDA graph): cProfile's top functions by own time and by cumulative
    time, with the step's wall time and the GPU's kernel time for comparison."""
    import cProfile
    import io
    import pstats
    from lodestar.engine.sampling import SamplingParams
    engine, _, _ = synthetic_engine("llama-3.1-8b", "F16", max_len=2048, kv_tokens=4096)
    vocab = engine.loaded.config.vocab_size

    def profiled(fn) -> dict:
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        fn()
        prof.disable()
        host = time.perf_counter() - t0
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        out = {"host_ms": round(host * 1e3, 3), "wall_ms": round(wall * 1e3, 3)}
        for key in ("tottime", "cumulative"):
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(35)
            out[f"top_by_{key}"] = buf.getvalue().splitlines()[-45:]
        return out

    def prefill():
        p = prompts(1, 512, vocab, seed=SEED + 512)[0]
        sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        for _ in range(3):
            engine.add_request(p, sp)
            while engine.has_unfinished():
                engine.step()

        def one():
            engine.add_request(p, sp)
            while engine.has_unfinished():
                engine.step()
        return profiled(one)

    def eager_decode():
        runner = engine.runner
        runner.cuda_graphs = False
        engine.overlap = False
        rid = engine.add_request(prompts(1, 64, vocab)[0], SamplingParams(temperature=0.0, max_tokens=64,
                                                                        ignore_eos=True))
        for _ in range(5):
            engine.step()
        out = profiled(lambda: [engine.step() for _ in range(5)])
        engine.abort(rid)
        runner.cuda_graphs = True
        return out

    r.cell("llama-3.1-8b-F16/prefill_512", prefill, 10)
    r.cell("llama-3.1-8b-F16/eager_decode_x5", eager_decode, 10)
    del engine
    release()


def stage_prefillgraph(r: Results) -> None:
    """Prefill of one prompt eagerly vs from a token-count bucket's CUDA graph
    (``EngineConfig.prefill_graphs``), one engine, runs interleaved: wall tok/s at 512 and
    4096 prompt tokens (8B F16, 8B Q4_0, SmolLM2 F16), first-token logits difference and
    greedy tokens of 32 steps after it."""
    from lodestar.engine.sampling import SamplingParams
    for geometry, qtype in (("llama-3.1-8b", "F16"), ("llama-3.1-8b", "Q4_0"), ("smollm2-135m", "F16")):
        def cell(geometry=geometry, qtype=qtype):
            engine, _, _ = synthetic_engine(geometry, qtype, max_len=8192, kv_tokens=16384)
            engine.runner.prefill_graphs = False
            vocab = engine.loaded.config.vocab_size
            out = {}
            for length in (512, 4096):
                p = prompts(1, length, vocab, seed=SEED + length)[0]
                runs = {False: [], True: []}
                toks = {}
                for on in (False, True):           # warm-up (and capture)
                    engine.runner.prefill_graphs = on
                    toks[on] = engine.generate([p], SamplingParams(temperature=0.0, max_tokens=32,
                                                                   ignore_eos=True))[0].token_ids
                for _ in range(RUNS + 2):
                    for on in (False, True):
                        engine.runner.prefill_graphs = on
                        runs[on].append(length / timed_generate(engine, [p], 1)["ttft_s"])
                out[f"prefill_{length}"] = {"eager_tok_s": stat(runs[False], 1), "graph_tok_s": stat(runs[True], 1),
                                            "ratio": round(statistics.median(runs[True]) /
                                                           statistics.median(runs[False]), 3),
                                            "same_tokens_32": toks[False] == toks[True]}
            out["prefill_graph_replays"] = engine.runner.prefill_replays
            del engine
            release()
            return out
        r.cell(f"{geometry}-{qtype}", cell, 40)


def stage_overlap(r: Results) -> None:
    """Overlapped decode off vs on in one engine (runs interleaved): greedy tokens must be
    identical; decode tok/s of one stream and of 8."""
    from lodestar.engine.sampling import SamplingParams
    for geometry, qtype in (("smollm2-135m", "F16"), ("llama-3.1-8b", "F16"), ("llama-3.1-8b", "Q4_0")):
        def cell(geometry=geometry, qtype=qtype):
            engine, _, _ = synthetic_engine(geometry, qtype, max_len=1024, kv_tokens=8192)
            ps = prompts(8, 64, engine.loaded.config.vocab_size)
            sp = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
            toks, runs = {}, {(o, b): [] for o in (False, True) for b in (1, 8)}
            for overlap in (False, True):
                engine.overlap = overlap
                toks[overlap] = [c.token_ids for c in engine.generate(ps[:3], sp)]
                timed_generate(engine, ps[:1], 16)
            for _ in range(RUNS):
                for overlap in (False, True):
                    engine.overlap = overlap
                    for b in (1, 8):
                        runs[(overlap, b)].append(timed_generate(engine, ps[:b], 128)["decode_tok_s"])
            engine.overlap = True
            out = {"same_tokens": toks[False] == toks[True]}
            for b in (1, 8):
                off, on = stat(runs[(False, b)]), stat(runs[(True, b)])
                out[f"batch_{b}"] = {"step_by_step_tok_s": off, "overlapped_tok_s": on,
                                     "overlapped_over_step_by_step": round(on["median"] / off["median"], 3)}
            del engine
            release()
            return out
        r.cell(f"{geometry}-{qtype}", cell, 40)


def stage_prefill(r: Results) -> None:
    """8B F16 prefill of 512 and 4096 tokens: wall time to the first token vs the time
    between CUDA events recorded around the engine's steps (which also counts GPU idle
    while the host works), 8 runs each, decode fusions off and on."""
    from lodestar.engine.sampling import SamplingParams
    engine, _, _ = synthetic_engine("llama-3.1-8b", "F16", max_len=8192)
    vocab = engine.loaded.config.vocab_size
    for fuse in ("0", "1"):
        for length in (512, 4096):
            def cell(fuse=fuse, length=length):
                os.environ["LODESTAR_FUSE"] = fuse
                p = prompts(1, length, vocab, seed=SEED + length)[0]
                walls, gpus = [], []
                for i in range(9):
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
                    a.record()
                    while engine.has_unfinished():
                        engine.step()
                    b.record()
                    b.synchronize()
                    if i:
                        walls.append(length / (time.perf_counter() - t0))
                        gpus.append(length / (a.elapsed_time(b) / 1e3))
                os.environ.pop("LODESTAR_FUSE", None)
                return {"wall_tok_s": stat(walls, 1), "gpu_tok_s": stat(gpus, 1)}
            r.cell(f"llama-3.1-8b-F16/prefill_{length}/fuse_{fuse}", cell, 8)
    for length in (512, 4096):
        r.cell(f"llama-3.1-8b-F16/prefill_{length}/profile", lambda length=length: prefill_profile(engine, length), 10)
    del engine
    release()


def prefill_profile(engine, length: int) -> dict:
    """One prompt's prefill, three ways: wall time; host time until ``step`` returns (the GPU
    may still be working); and under torch.profiler, the sum of kernel times (GPU busy) and
    the top kernels. Kernel sum well below wall time means the GPU waits for the host."""
    from torch.profiler import ProfilerActivity, profile
    from lodestar.engine.sampling import SamplingParams
    vocab = engine.loaded.config.vocab_size
    p = prompts(1, length, vocab, seed=SEED + length)[0]
    sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    walls, hosts = [], []
    for i in range(6):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.add_request(p, sp)
        host = 0.0
        while engine.has_unfinished():
            h0 = time.perf_counter()
            engine.step()
            host += time.perf_counter() - h0
        torch.cuda.synchronize()
        if i:
            walls.append((time.perf_counter() - t0) * 1e3)
            hosts.append(host * 1e3)
    mem0 = torch.cuda.memory_stats()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        engine.add_request(p, sp)
        while engine.has_unfinished():
            engine.step()
        torch.cuda.synchronize()
    mem1 = torch.cuda.memory_stats()
    kernels = {}
    for ev in prof.key_averages():
        dev_t = getattr(ev, "self_device_time_total", None) or getattr(ev, "self_cuda_time_total", 0)
        if dev_t and ev.key and not ev.key.startswith(("aten::", "cuda")):
            kernels[ev.key[:90]] = (dev_t, ev.count)
    busy = sum(v[0] for v in kernels.values()) / 1e3
    top = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:15]
    return {"wall_ms": stat(walls, 3), "host_ms_in_step_calls": stat(hosts, 3),
            "profiled_kernel_ms": round(busy, 3), "kernel_launches": sum(v[1] for v in kernels.values()),
            "allocator": {k: mem1.get(k, 0) - mem0.get(k, 0) for k in
                          ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams")},
            "top_kernels_ms": {k: {"ms": round(v[0] / 1e3, 3), "calls": v[1]} for k, v in top}}


PREFILL_ATTN_CASES = {  # name -> (context lengths, new tokens): 8B geometry, bf16
    "fresh_512": ([512], [512]),
    "fresh_4096": ([4096], [4096]),
    "prefix_3584+512": ([4096], [512]),
    "prefix_7680+512": ([8192], [512]),
    "prefix_15872+512": ([16384], [512]),
    "prefix_32256+512": ([32768], [512]),
    "batch_32x128": ([128] * 32, [128] * 32),
    "varlen_8": ([300, 1500, 128, 900, 2048, 77, 640, 1024], [300, 200, 128, 1, 512, 77, 64, 256]),
}


def stage_prefillattn(r: Results) -> None:
    """Prefill attention alone, Llama-3.1-8B geometry (32 query heads, 8 kv heads, head dim
    128, bf16, scattered 16-token blocks): the paged varlen kernel (``paged_prefill``)
    against the SDPA forms (``LODESTAR_PREFILL_ATTN=sdpa``: one fresh sequence, torch's causal
    flash kernel; otherwise keys gathered per sequence, padded, masked), ms per call (CUDA
    events, 20 calls after 3), and the largest difference between their outputs; then an 8B
    F16 engine's time to the first token of 32 prompts of 128 tokens, both ways
    (``LODESTAR_PREFILL_ATTN_CASES``: the names of ``PREFILL_ATTN_CASES`` to run, and no engine;
    unset: all of them and the engine)."""
    from lodestar.kernels import triton_attention as ta
    from lodestar.layers.attention import AttentionBatch, GpuAttentionMeta
    Hq, Hk, D, bs = 32, 8, 128, 16
    scale = D ** -0.5

    def timed(fn) -> dict:
        for _ in range(3):
            fn()
        ms = []
        for _ in range(20):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            ms.append(a.elapsed_time(b))
        return stat(ms, 4)

    only = os.environ.get("LODESTAR_PREFILL_ATTN_CASES", "").split()
    for name, (lens, qlens) in PREFILL_ATTN_CASES.items():
        if only and name not in only:
            continue

        def cell(lens=lens, qlens=qlens):
            g = torch.Generator().manual_seed(SEED)
            need = [-(-n // bs) for n in lens]
            blocks = sum(need) + 1
            perm = torch.randperm(blocks, generator=g).tolist()
            tables, at = [], 0
            for n in need:
                tables.append(perm[at:at + n])
                at += n
            kc = (torch.randn(blocks * bs, Hk, D, generator=g) * 0.5).to(torch.bfloat16).cuda()
            vc = torch.randn(blocks * bs, Hk, D, generator=g).to(torch.bfloat16).cuda()
            q = torch.randn(sum(qlens), Hq, D, generator=g).to(torch.bfloat16).cuda()
            batch = AttentionBatch.build(tables, lens, qlens, bs)
            batch.gpu = GpuAttentionMeta(batch.slot_mapping.cuda(), batch.block_tables.to(torch.int32).cuda(),
                                         batch.seq_lens.to(torch.int32).cuda(), ta.num_partitions(max(lens)), 1)
            os.environ["LODESTAR_PREFILL_ATTN"] = "sdpa"
            try:
                sdpa = timed(lambda: ta.prefill_attention(q, kc, vc, batch, scale))
                want = ta.prefill_attention(q, kc, vc, batch, scale).float()
            finally:
                os.environ.pop("LODESTAR_PREFILL_ATTN", None)
            g_ = batch.gpu

            def kernel():
                return ta.paged_prefill(q, kc, vc, g_.block_tables, g_.seq_lens, batch.query_start_loc,
                                        batch.query_lens_list, bs, scale, cache=batch._cache)
            paged = timed(kernel)
            diff = float((kernel().float() - want).abs().max())
            return {"new_tokens": sum(qlens), "context_tokens": sum(lens), "sdpa_ms": sdpa, "paged_kernel_ms": paged,
                    "sdpa_over_paged": round(sdpa["median"] / paged["median"], 3), "max_abs_diff": round(diff, 5)}
        r.cell(f"prefill_attention/{name}", cell, 20)
    if only:
        return
    engine, _, _ = synthetic_engine("llama-3.1-8b", "F16", max_len=4096)
    vocab = engine.loaded.config.vocab_size
    batch32 = prompts(32, 128, vocab, seed=SEED + 32)
    for mode in ("sdpa", "paged"):
        def ttft(mode=mode):
            os.environ["LODESTAR_PREFILL_ATTN"] = mode
            try:
                timed_generate(engine, batch32, 1)
                runs = [timed_generate(engine, batch32, 1)["ttft_s"] * 1e3 for _ in range(5)]
            finally:
                os.environ.pop("LODESTAR_PREFILL_ATTN", None)
            return {"prompts": 32, "prompt_tokens": 128, "ttft_ms": stat(runs, 2),
                    "prefill_tok_s": round(32 * 128 / (statistics.median(runs) / 1e3), 1)}
        r.cell(f"llama-3.1-8b-F16/ttft_32x128/{mode}", ttft, 40)
    del engine
    release()


def stage_densegemv(r: Results) -> None:
    """Decode with bf16 weights, the layers' Triton matrix-vector kernel off vs on
    (``LODESTAR_DENSE_GEMV=0/1``, one engine each): decode tok/s, and whether greedy tokens
    agree (the two sum in different orders)."""
    from lodestar.engine.sampling import SamplingParams
    for geometry in ("smollm2-135m", "llama-3.1-8b"):
        def cell(geometry=geometry):
            res = {}
            for flag in ("0", "1"):
                os.environ["LODESTAR_DENSE_GEMV"] = flag
                engine, _, _ = synthetic_engine(geometry, "F16", max_len=1024, kv_tokens=4096)
                ps = prompts(2, 40, engine.loaded.config.vocab_size)
                comp = engine.generate(ps, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
                timed_generate(engine, [ps[0]], 16)
                runs = [timed_generate(engine, [ps[0]], 256)["decode_tok_s"] for _ in range(RUNS)]
                res[flag] = {"tokens": [c.token_ids for c in comp], "decode_tok_s": stat(runs)}
                del engine, comp
                release()
            os.environ.pop("LODESTAR_DENSE_GEMV", None)
            return {"same_tokens": res["0"]["tokens"] == res["1"]["tokens"],
                    "decode_tok_s_cublas": res["0"]["decode_tok_s"], "decode_tok_s_triton": res["1"]["decode_tok_s"],
                    "triton_over_cublas": round(res["1"]["decode_tok_s"]["median"] / res["0"]["decode_tok_s"]["median"], 3)}
        r.cell(geometry, cell, 30)


def stage_dense(r: Results) -> None:
    """Dense bf16 matrix-vector product at M = 1: cuBLAS (F.linear, what the layers run)
    against the Triton kernel of ``kernels.triton_dense`` over a small tiling sweep."""
    import torch.nn.functional as F

    from lodestar.kernels import triton_dense as td
    bw = bandwidth_from(r)
    shapes = {"8b/qkv": (6144, 4096), "8b/o": (4096, 4096), "8b/gate_up": (28672, 4096), "8b/down": (4096, 14336),
              "smollm2/qkv": (960, 576), "smollm2/gate_up": (3072, 576), "smollm2/down": (576, 1536)}
    for name, (n, k) in shapes.items():
        def cell(n=n, k=k):
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
            x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
            nbytes = w.numel() * 2
            t = _time_gpu(lambda: F.linear(x, w))
            out = {"cublas_us": round(t * 1e6, 2), "cublas_gb_per_s": round(nbytes / t / 1e9, 1)}
            best = None
            ref = F.linear(x.float(), w.float())
            for bn in (4, 8, 16):
                for bk in (256, 512):
                    for split in (1, 4):
                        if r.left() < 15:
                            out["partial"] = True
                            break
                        cfg = td.DenseGemvConfig(bn, bk, split, 4)
                        try:
                            err = (td.dense_gemv(x, w, torch.float32, cfg) - ref).abs().max().item()
                            tt = _time_gpu(lambda: td.dense_gemv(x, w, config=cfg))
                        except Exception as e:
                            out[f"{bn},{bk},{split}"] = f"{type(e).__name__}: {e}"[:160]
                            continue
                        out[f"{bn},{bk},{split}"] = round(tt * 1e6, 2)
                        if best is None or tt < best[1]:
                            best = ((bn, bk, split), tt, err)
            if best:
                out.update(best_config=best[0], best_us=round(best[1] * 1e6, 2),
                           best_gb_per_s=round(nbytes / best[1] / 1e9, 1), best_max_abs_err=best[2],
                           triton_over_cublas_time=round(best[1] / t, 3))
            if bw:
                out["cublas_fraction_of_copy_bw"] = round(nbytes / t / bw, 3)
            return out
        r.cell(name, cell, 15)


# ----------------------------------------------------------------------- tensor parallel

def gpu_memory_used_gb() -> list[float] | None:
    """Memory in use on every GPU (all processes), from nvidia-smi."""
    import subprocess
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20).stdout
        return [round(float(v) * 1.048576 / 1e3, 2) for v in out.split()]
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return None


def tp_engine(spec: str, world: int, max_len: int, kv_tokens: int, max_seqs: int = 64):
    """(engine, load seconds) of ``spec`` in bf16 over ``world`` GPUs (load_model's own path:
    worker processes, sharded loading, NCCL)."""
    from lodestar.engine.llm_engine import EngineConfig, LLMEngine
    from lodestar.engine.loader import load_model
    release()
    t0 = time.perf_counter()
    loaded = load_model(spec, mode="bf16", progress=False, device="cuda", tensor_parallel=world)
    torch.cuda.synchronize()
    load_s = time.perf_counter() - t0
    cfg = EngineConfig(max_num_seqs=max_seqs, max_num_batched_tokens=8192, block_size=16, max_model_len=max_len,
                       kv_tokens=kv_tokens, enable_prefix_cache=False, device="cuda", tensor_parallel=world)
    return LLMEngine(loaded, cfg), load_s


def tp_load(state: dict, spec: str, world: int, max_len: int, kv_tokens: int, max_seqs: int = 64) -> dict:
    """Load cell of a tensor-parallel model: the engine and its per-rank read bytes go in ``state``."""
    engine, load_s = tp_engine(spec, world, max_len, kv_tokens, max_seqs)
    state["engine"] = engine
    state["read"] = read_bytes_per_token(engine.loaded.model)
    return {"load_s": round(load_s, 2), "weight_bytes_read_per_token_rank0": state["read"],
            "allreduce": getattr(engine.runner, "allreduce", None), "gpu_mem_used_gb": gpu_memory_used_gb()}


def stage_tp(r: Results) -> None:
    n = torch.cuda.device_count()
    r.cell("devices", lambda: {"count": n, "names": [torch.cuda.get_device_name(i) for i in range(n)],
                               "nccl": ".".join(map(str, torch.cuda.nccl.version())),
                               "env": {k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                                                                      "NVSHMEM_DISABLE_NVLS")}}, 5)
    if n < 2:
        r.put("skipped", {"reason": f"{n} CUDA device(s) visible; tensor parallelism needs 2"})
        return
    bw = bandwidth_from(r)
    decode = {}
    from lodestar.distributed.allreduce import MODE_ENV
    # symmetric memory is set up once per process: the first two-GPU load gets it
    for world, allreduce in ((1, "auto"), (2, "auto"), (2, "nccl")):
        key = f"llama-3.1-8b-BF16/tp{world}" + ("-nccl" if allreduce == "nccl" else "")
        state = {}

        def load(world=world, allreduce=allreduce):
            os.environ[MODE_ENV] = allreduce      # the workers inherit it
            return tp_load(state, "synthetic:llama-3.1-8b:BF16", world, 4096 + 64, 32 * 420)

        r.cell(f"{key}/load", load, 40)
        if "engine" not in state:
            continue
        engine = state["engine"]

        def dec(key=key):
            out = decode_cell(engine, state["read"], bw)
            decode[key] = out["decode_tok_s"]["median"]
            out["gpu_mem_used_gb"] = gpu_memory_used_gb()
            return out

        r.cell(f"{key}/decode", dec, 20)
        r.cell(f"{key}/batch_32", lambda: batch_cell(engine, 32), 20)
        engine.loaded.close()
        state.clear()
        del engine
        release()
    one = decode.get("llama-3.1-8b-BF16/tp1")
    if one:
        r.put("llama-3.1-8b-BF16/tp2_over_tp1", {
            "decode_speedup": {k.split("/")[1]: round(v / one, 3) for k, v in decode.items()}, "target": 1.6})
    os.environ[MODE_ENV] = "auto"


def stage_tp70(r: Results) -> None:
    if torch.cuda.device_count() < 2:
        r.put("skipped", {"reason": f"{torch.cuda.device_count()} CUDA device(s) visible; needs 2"})
        return
    bw = bandwidth_from(r)
    key, contexts, new = "llama-70b-BF16/tp2", (1024, 32768, 131000), 32
    state = {}

    r.cell(f"{key}/load", lambda: tp_load(state, "synthetic:llama-70b:BF16", 2, 131072, 131072 + 512, 8), 90)
    if "engine" not in state:
        return
    engine = state["engine"]
    r.cell(f"{key}/decode", lambda: {**decode_cell(engine, state["read"], bw, new=64),
                                     "gpu_mem_used_gb": gpu_memory_used_gb()}, 30)
    for ctx in contexts:
        def cell(ctx=ctx):
            return {**context_cell(engine, ctx, new, state["read"], bw), "gpu_mem_used_gb": gpu_memory_used_gb()}
        r.cell(f"{key}/context_{ctx}", cell, 15)
    engine.loaded.close()
    state.clear()
    del engine
    release()

# ------------------------------------------------------------------------------- main

STAGES = {"env": stage_env, "small": stage_small, "8b-f16": stage_8b_f16, "8b-q4k": stage_8b_q4k,
          "8b-q4km": stage_8b_q4km, "8b-q4_0": stage_8b_q4_0, "gemv": stage_gemv, "profile": stage_profile, "tp": stage_tp,
          "tp70": stage_tp70, "fuse": stage_fuse, "dense": stage_dense,
          "densegemv": stage_densegemv, "overlap": stage_overlap, "prefill": stage_prefill,
          "gemvform": stage_gemvform, "ab": stage_ab, "hostprof": stage_hostprof,
          "prefillgraph": stage_prefillgraph, "prefillattn": stage_prefillattn,
          "chain": stage_chain}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stage", choices=[*STAGES, "sweep", "hf"])
    ap.add_argument("--json", type=Path, required=True, help="results file (merged into)")
    ap.add_argument("--seconds", type=float, default=120.0, help="time this stage may take")
    ap.add_argument("--csv", type=Path, default=None)
    ap.add_argument("--svg", type=Path, default=None)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/lodestar-bench"))
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("lodestar.bench.gpu: no CUDA device", file=sys.stderr)
        return 2
    # leave a few seconds for the process to exit cleanly
    r = Results(a.json, a.stage, time.time() + a.seconds - 5)
    import faulthandler   # a stage that hangs prints every thread's stack before it is killed
    faulthandler.dump_traceback_later(max(a.seconds - 12, 5), exit=False)
    try:
        if a.stage == "sweep":
            stage_sweep(r, a.csv, a.svg)
        elif a.stage == "hf":
            a.workdir.mkdir(parents=True, exist_ok=True)
            stage_hf(r, a.workdir)
        else:
            STAGES[a.stage](r)
    except Exception as e:
        r.error("stage", e)
        return 1
    r.section["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    r.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
