"""Whole-model GPU benchmark stages (``lodestar.bench.gpu``): the device, decode / prefill /
batch speed per model file type, decode against context, Hugging Face transformers on the
same weights, and tensor parallelism."""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

from lodestar.bench.gpu_cells import (RUNS, SEED, Results, bandwidth_from, batch_cell, context_cell, decode_cell,
                                      kv_bytes_per_token, prefill_cell, prompts, read_bytes_per_token, release, stat,
                                      synthetic_engine, timed_generate)

SWEEP_CONTEXTS = "1024,2048,4096,8192,16384,32768"
SWEEP_QTYPES = "Q4_K,F16"


def stage_env(r: Results, opts: argparse.Namespace) -> None:
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
                 batches: tuple[int, ...] = ()) -> None:
    """Load, single-stream decode, prefill at each length and aggregate decode at each batch
    size of one synthetic model."""
    key = f"{geometry}-{qtype}"
    bw = bandwidth_from(r)
    max_len = 4096 + 64
    kv = max(max_len, max(batches, default=1) * (128 + 256 + 16))
    state = {}

    def load():
        engine, load_s, file_bytes = synthetic_engine(geometry, qtype, max_len=max_len, kv_tokens=kv)
        state["engine"] = engine
        state["read"] = read_bytes_per_token(engine.loaded.model)
        return {"load_s": round(load_s, 2), "checkpoint_bytes": file_bytes, "weight_bytes_read_per_token": state["read"],
                "kv_bytes_per_token": kv_bytes_per_token(engine)}

    r.cell(f"{key}/load", load, 20)
    if "engine" not in state:
        return
    r.cell(f"{key}/decode", lambda: decode_cell(state["engine"], state["read"], bw), 15)
    for n in prefill:
        r.cell(f"{key}/prefill_{n}", lambda n=n: prefill_cell(state["engine"], n), 10)
    for b in batches:
        r.cell(f"{key}/batch_{b}", lambda b=b: batch_cell(state["engine"], b), 12)
    state.clear()
    release()


def stage_small(r: Results, opts: argparse.Namespace) -> None:
    _model_cells(r, "smollm2-135m", "F16")
    _model_cells(r, "smollm2-135m", "Q4_0")


def stage_8b_f16(r: Results, opts: argparse.Namespace) -> None:
    _model_cells(r, "llama-3.1-8b", "F16", batches=(1, 2, 4, 8, 16, 32, 64))


def stage_8b_q4k(r: Results, opts: argparse.Namespace) -> None:
    _model_cells(r, "llama-3.1-8b", "Q4_K")


def stage_8b_q4km(r: Results, opts: argparse.Namespace) -> None:
    _model_cells(r, "llama-3.1-8b", "Q4_K_M")


def stage_8b_q4_0(r: Results, opts: argparse.Namespace) -> None:
    _model_cells(r, "llama-3.1-8b", "Q4_0")


# ----------------------------------------------------------------------- context sweep

def sweep_qtypes(text: str = SWEEP_QTYPES) -> list[str]:
    """``--qtypes``: the 8B file types the context sweep decodes (a comma list)."""
    types = [q.strip() for q in text.split(",") if q.strip()]
    if not types:
        raise ValueError(f"--qtypes {text!r}: give a comma list of file types, e.g. {SWEEP_QTYPES}")
    return types


def sweep_contexts(text: str = SWEEP_CONTEXTS) -> tuple[int, ...]:
    """``--contexts``: the sweep's contexts, a comma list of ascending positive integers."""
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        values = ()
    if not values or min(values) < 1 or list(values) != sorted(set(values)):
        raise ValueError(f"--contexts {text!r}: use ascending positive integers, comma-separated")
    return values


def stage_sweep(r: Results, opts: argparse.Namespace) -> None:
    """Decode speed against context (``--contexts``), one 8B file per type of ``--qtypes``: CSV
    (``--csv``: a row per type and context) and SVG (``--svg``: a line per type, with its
    roofline). The context is filled with zeros rather than prefilled, which changes no byte
    read per token."""
    contexts = opts.contexts
    new = 64
    max_len = contexts[-1] + new + 16
    rows = []
    for qtype in opts.qtypes:
        state = {}

        def load(qtype=qtype):
            engine, load_s, _ = synthetic_engine("llama-3.1-8b", qtype, max_len=max_len, max_seqs=1,
                                                 kv_tokens=max_len, context=65536)
            state["engine"] = engine
            state["read"] = read_bytes_per_token(engine.loaded.model)
            return {"load_s": round(load_s, 2)}

        r.cell(f"llama-3.1-8b-{qtype}/load", load, 20)
        if "engine" not in state:
            continue
        bw = bandwidth_from(r)
        for ctx in contexts:
            def cell(ctx=ctx, qtype=qtype):
                out = context_cell(state["engine"], ctx, new, state["read"], bw)
                rows.append({"qtype": qtype, **out})
                return out
            r.cell(f"llama-3.1-8b-{qtype}/context_{ctx}", cell, 8)
        state.clear()
        release()
    if opts.csv and rows:
        lines = ["qtype,context,decode_tok_s_median,decode_tok_s_min,decode_tok_s_max,ms_per_token,roofline_tok_s"]
        lines += [f"{o['qtype']},{o['context']},{o['decode_tok_s']['median']},{o['decode_tok_s']['min']},"
                  f"{o['decode_tok_s']['max']},{o['ms_per_token']},{o.get('roofline_tok_s', '')}" for o in rows]
        opts.csv.write_text("\n".join(lines) + "\n")
    if opts.svg and rows:
        opts.svg.write_text(svg_plot(rows))


def svg_plot(rows: list[dict]) -> str:
    """Decode tok/s (solid) and its roofline (dashed) against context, log2 x axis, one
    colour per file type (``qtype`` of each row; rows without one are one line), as SVG."""
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
    model = None        # gen() holds the name, not the model: release() can free it
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


def stage_hf(r: Results, opts: argparse.Namespace) -> None:
    """Hugging Face transformers (eager generate, sdpa attention) against lodestar on the same
    synthetic safetensors folders, written under ``--workdir``."""
    opts.workdir.mkdir(parents=True, exist_ok=True)
    new = 128
    for geometry, need in (("smollm2-135m", 30), ("llama-3.2-1b", 60)):
        def cell(geometry=geometry):
            t0 = time.perf_counter()
            folder = write_hf_folder(geometry, opts.workdir)
            write_s = time.perf_counter() - t0
            prompt = prompts(1, 128, 49152)[0]
            hf = hf_decode_tok_s(folder, prompt, new)
            ours = lodestar_decode_on_folder(folder, prompt, new)
            ratio = ours["decode_tok_s"]["median"] / hf["decode_tok_s"]["median"]
            return {"folder_write_s": round(write_s, 1), "prompt_tokens": 128, "new_tokens": new,
                    "hf_transformers": hf, "lodestar": ours, "lodestar_over_hf": round(ratio, 2)}
        r.cell(f"{geometry}-bf16-safetensors", cell, need)


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


def stage_tp(r: Results, opts: argparse.Namespace) -> None:
    """Llama-3.1-8B bf16 single-stream decode and batch 32 with --tensor-parallel 1 and 2
    (symmetric-memory and NCCL all-reduce) in the same run; needs 2 GPUs."""
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

        def dec(key=key):
            out = decode_cell(state["engine"], state["read"], bw)
            decode[key] = out["decode_tok_s"]["median"]
            out["gpu_mem_used_gb"] = gpu_memory_used_gb()
            return out

        r.cell(f"{key}/decode", dec, 20)
        r.cell(f"{key}/batch_32", lambda: batch_cell(state["engine"], 32), 20)
        state["engine"].loaded.close()
        state.clear()
        release()
    one = decode.get("llama-3.1-8b-BF16/tp1")
    if one:
        r.put("llama-3.1-8b-BF16/tp2_over_tp1", {
            "decode_speedup": {k.split("/")[1]: round(v / one, 3) for k, v in decode.items()}, "target": 1.6})
    os.environ[MODE_ENV] = "auto"


def stage_tp70(r: Results, opts: argparse.Namespace) -> None:
    """A 70B-geometry bf16 model (more than one H200 holds with a 128k-token cache) with
    --tensor-parallel 2: decode at 1k / 32k / 128k context, per-GPU memory from nvidia-smi."""
    if torch.cuda.device_count() < 2:
        r.put("skipped", {"reason": f"{torch.cuda.device_count()} CUDA device(s) visible; needs 2"})
        return
    bw = bandwidth_from(r)
    key, contexts, new = "llama-70b-BF16/tp2", (1024, 32768, 131000), 32
    state = {}

    r.cell(f"{key}/load", lambda: tp_load(state, "synthetic:llama-70b:BF16", 2, 131072, 131072 + 512, 8), 90)
    if "engine" not in state:
        return
    r.cell(f"{key}/decode", lambda: {**decode_cell(state["engine"], state["read"], bw, new=64),
                                     "gpu_mem_used_gb": gpu_memory_used_gb()}, 30)
    for ctx in contexts:
        def cell(ctx=ctx):
            return {**context_cell(state["engine"], ctx, new, state["read"], bw),
                    "gpu_mem_used_gb": gpu_memory_used_gb()}
        r.cell(f"{key}/context_{ctx}", cell, 15)
    state["engine"].loaded.close()
    state.clear()
    release()
