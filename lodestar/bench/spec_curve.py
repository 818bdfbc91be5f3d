"""The cost of a speculative verify step of k rows against a one-row decode step.

A verify step feeds a sequence's last token and its k - 1 drafts as one run of k rows at
consecutive positions (``runner.run([seq], [k], [k])``): on a GPU the run replays the decode
graph of the smallest bucket of ``GRAPH_BATCH_SIZES`` holding k rows, one row per token; on
the CPU it runs eagerly with row-by-row attention (``AttentionBatch.stepwise``). Logits come
back for all k rows (the head runs on each, as verify needs them). The ratio t(k) / t(1)
bounds every speculative speedup: verify steps that emit E tokens each on average run at
E / (t(k) / t(1)) times plain decode's speed, and E <= k.

    python -m lodestar.bench.spec_curve --model default --dtype packed --device cpu --threads 2 \\
        --rows 1 2 3 4 5 6 7 8 --context 512 --runs 3 --json bench/results/spec-curve-cpu-smollm2.json
    python -m lodestar.bench.spec_curve --model llama-3.1-8b --dtype q4_k_m --device cuda --json OUT.json

``--model`` takes what ``engine.loader.load_model`` takes (a GGUF path, a Hugging Face folder,
a known name, ``synthetic:<geometry>:<type>``), or a geometry of ``formats.synthetic.GEOMETRIES``
whose file type ``--dtype`` names (random weights of the real shapes, as ``lodestar.bench.gpu``
builds them). One sequence is prefilled to ``--context`` random tokens; every timed step feeds
k rows at positions context .. context + k - 1 and then puts the sequence back (its computed
tokens and block table as before), so every step sees the same context. A step's time is
wall-clock from the call to its logits being ready (``torch.cuda.synchronize`` on a GPU,
where CUDA events also give the device's time); each of ``--runs`` repetitions takes the
median of ``--steps`` steps per k, the ks interleaved so that drift reaches all of them.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch

from lodestar.bench.common import device_info, git_commit, ids_hash
from lodestar.bench.gpu_cells import SEED, prompts, stat
from lodestar.engine.model_runner import GRAPH_BATCH_SIZES, STEPWISE_MAX

DEFAULT_ROWS = (1, 2, 3, 4, 5, 6, 7, 8)


def parse_rows(values: list[int]) -> list[int]:
    """``--rows``: sorted, unique, 1 always included (the ratios' base), each a run the
    runner feeds as decoded rows (at most ``STEPWISE_MAX`` and the largest graph bucket)."""
    top = min(STEPWISE_MAX, GRAPH_BATCH_SIZES[-1])
    bad = [k for k in values if not 1 <= k <= top]
    if bad:
        raise ValueError(f"--rows {' '.join(map(str, bad))}: a verify run has 1 to {top} rows")
    return sorted(set(values) | {1})


def load(model: str, dtype: str, device: str):
    """(loaded model, weight mode, file type) of ``--model`` / ``--dtype`` (see the module doc)."""
    from lodestar.engine.loader import load_model
    from lodestar.formats.synthetic import GEOMETRIES, QTYPES
    if model in GEOMETRIES:
        qtype = dtype.upper()
        if qtype not in QTYPES:
            raise ValueError(f"--model {model} is a synthetic geometry: --dtype names its file type, one of "
                             f"{', '.join(q.lower() for q in QTYPES)}")
        return load_model(f"synthetic:{model}:{qtype}", mode="packed", progress=False, device=device), "packed", qtype
    if dtype.upper() in QTYPES and dtype.lower() != "bf16":     # bf16 is also a weight mode
        raise ValueError(f"--dtype {dtype} is a file type, for a synthetic geometry (--model one of "
                         f"{', '.join(GEOMETRIES)}); a model file takes a weight mode: packed, fp32 or bf16")
    loaded = load_model(None if model == "default" else model, mode=dtype, progress=False, device=device)
    return loaded, dtype, None


def build_engine(loaded, context: int, max_rows: int, device: str):
    """An engine with room for one sequence of ``context`` tokens plus a run of ``max_rows``."""
    from lodestar.engine.llm_engine import EngineConfig, LLMEngine
    block = 16
    kv_tokens = -(-(context + max_rows) // block) * block + block
    cfg = EngineConfig(max_num_seqs=1, max_num_batched_tokens=max(512, context), block_size=block,
                       max_model_len=kv_tokens, kv_tokens=kv_tokens, enable_prefix_cache=False, device=device,
                       prefill_graphs=False)
    engine = LLMEngine(loaded, cfg)
    if context + max_rows > engine.max_model_len:
        raise ValueError(f"--context {context} plus a run of {max_rows} rows exceeds the model's context "
                         f"of {engine.max_model_len} tokens")
    return engine


def reserve(pool, seq, num_tokens: int) -> None:
    """Blocks for ``num_tokens`` tokens of ``seq``, grown in place as the scheduler grows them."""
    need = pool.blocks_needed(num_tokens) - len(seq.block_table)
    if need > 0:
        tail = seq.block_table[-1] if seq.block_table else None
        seq.block_table.extend(pool.allocate(need, after=tail))


def prefill(engine, context: int, seed: int = SEED):
    """A sequence whose ``context`` random prompt tokens are computed, one output token after
    them (the one a verify step feeds first) and ``STEPWISE_MAX`` random drafts to draw from."""
    from lodestar.engine.sampling import SamplingParams
    from lodestar.engine.sequence import Sequence
    vocab = engine.loaded.config.vocab_size
    ids = prompts(1, context + 1 + STEPWISE_MAX, vocab, seed)[0]
    seq = Sequence(0, ids[:context], SamplingParams(temperature=0.0))
    reserve(engine.pool, seq, context)
    engine.runner.run([seq], [context], [0])
    seq.output_ids.append(ids[context])
    seq.draft_ids = []
    return seq, ids[context + 1:]


def verify_step(runner, seq, drafts: list[int], k: int) -> torch.Tensor | None:
    """One verify step of ``k`` rows (the last token and ``k - 1`` drafts) for ``seq``; then
    the sequence is put back: computed tokens, block table and drafts as before. Returns the
    logits of the k rows."""
    base, held = seq.num_computed, len(seq.block_table)
    seq.draft_ids = drafts[:k - 1]
    reserve(runner.pool, seq, base + k)
    try:
        return runner.run([seq], [k], [k])
    finally:
        seq.num_computed = base
        seq.draft_ids = []
        extra = seq.block_table[held:]
        if extra:
            runner.pool.free(extra)
            del seq.block_table[held:]


def time_steps(runner, seq, drafts: list[int], k: int, steps: int) -> tuple[float, float | None, int]:
    """(median wall ms, median device ms or None on the CPU, logit rows returned) of ``steps``
    verify steps of ``k`` rows, each waited for."""
    cuda = runner.device.type == "cuda"
    wall, dev, rows = [], [], 0
    for _ in range(steps):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            a.record()
            out = verify_step(runner, seq, drafts, k)
            b.record()
            b.synchronize()
            wall.append((time.perf_counter() - t0) * 1e3)
            dev.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            out = verify_step(runner, seq, drafts, k)
            wall.append((time.perf_counter() - t0) * 1e3)
        rows = 0 if out is None else out.shape[0]
    return statistics.median(wall), (statistics.median(dev) if dev else None), rows


def rows_fed(k: int, device: str) -> int:
    """Rows the kernels see for a run of ``k``: the graph bucket on a GPU, k on the CPU."""
    return next(b for b in GRAPH_BATCH_SIZES if b >= k) if device == "cuda" else k


def kernel_paths(model, rows: list[int], device: str) -> dict:
    """Which matrix-product path a run of k rows takes in each kind of projection the model
    holds, from the thresholds the layers read (``kernels.launch.SMALL_M_MAX`` for packed
    weights on a GPU, ``kernels.triton_dense.MAX_ROWS`` for dense ones)."""
    from lodestar.kernels import triton_dense as td
    from lodestar.kernels.launch import SMALL_M_MAX
    from lodestar.layers.cuda_linear import CudaDenseLinear, CudaQuantLinear
    from lodestar.layers.linear import DenseLinear, QuantizedLinear
    kinds: Counter = Counter()
    seen: set[type] = set()
    cpu_max_m = 1 << 62
    for m in model.modules():
        if isinstance(m, (CudaQuantLinear, QuantizedLinear)):
            kinds[f"{type(m).__name__} {m.qtype.name}" + (f" ({m.path})" if hasattr(m, "path") else "")] += 1
        elif isinstance(m, (CudaDenseLinear, DenseLinear)):
            kinds[f"{type(m).__name__} {str(m.weight.dtype).removeprefix('torch.')}"] += 1
        else:
            continue
        seen.add(type(m))
        if isinstance(m, QuantizedLinear):
            cpu_max_m = min(cpu_max_m, m._max_m)     # rows above it take the dense route (dense_min_m)

    def path(k: int) -> dict:
        m = rows_fed(k, device)
        out = {"rows_fed": m}
        if k > 1:
            out["attention"] = ("decode attention, one row per token, each reading the context's KV itself"
                                if device == "cuda" else "stepwise: one SDPA call per row over its own prefix")
        if CudaQuantLinear in seen:
            out["packed"] = ("triton matrix-vector kernel, grid (rows, weight blocks, K splits): one program per row"
                             if m <= SMALL_M_MAX else "dequantize to bf16, one cuBLAS matmul")
        if CudaDenseLinear in seen:
            out["dense"] = ("triton dense matrix-vector kernel (one-row fusions: dense_norm, glu_epilogue)"
                            if m <= td.MAX_ROWS and td.enabled() else "cuBLAS F.linear")
        if QuantizedLinear in seen:
            out["packed_cpu"] = ("the packed kernel (one for every M)" if m <= cpu_max_m
                                 else "dequantize to bf16, bf16 matmul (dense_min_m)")
        if DenseLinear in seen:
            out["dense_cpu"] = "torch F.linear"
        return out

    doc = {"projections": dict(kinds), "by_rows": {str(k): path(k) for k in rows}}
    if device == "cuda":
        doc["thresholds"] = {"packed_gemv_max_rows": SMALL_M_MAX, "dense_gemv_max_rows": td.MAX_ROWS,
                             "graph_batch_sizes": list(GRAPH_BATCH_SIZES),
                             "source": "kernels.launch.SMALL_M_MAX, kernels.triton_dense.MAX_ROWS, "
                                       "engine.model_runner.GRAPH_BATCH_SIZES"}
    return doc


def model_record(loaded, weight_mode: str, qtype: str | None) -> dict:
    """What identifies the weights: file name and SHA-256, or the synthetic checkpoint's
    fingerprint; the geometry; the weight mode and file type."""
    c = loaded.config
    rec = {"name": Path(str(loaded.path)).name, "weight_mode": weight_mode, "file_type": qtype,
           "geometry": {"arch": c.arch, "n_layers": c.n_layers, "d_model": c.d_model, "n_heads": c.n_heads,
                        "n_kv_heads": c.n_kv_heads, "head_dim": c.head_dim, "ffn_dim": c.ffn_dim,
                        "vocab_size": c.vocab_size}}
    fingerprint = getattr(loaded.file, "fingerprint", None)
    if fingerprint:
        rec["synthetic_fingerprint"] = fingerprint
    elif Path(str(loaded.path)).is_file():
        from lodestar.formats.catalog import file_sha256
        rec["sha256"] = file_sha256(loaded.path)
    return rec


def curve(engine, rows: list[int], context: int, runs: int, steps: int, warmup: int = 2, seed: int = SEED) -> dict:
    """Time verify steps of each k in ``rows`` (from ``parse_rows``); the measurements part of
    the JSON document (``results``: one record per k, in ``rows`` order)."""
    runner = engine.runner
    device = runner.device.type
    seq, drafts = prefill(engine, context, seed)
    paths, fed = {}, {}
    for k in rows:          # capture each bucket's graph, compile kernels
        before = getattr(runner, "graph_replays", 0)
        verify_step(runner, seq, drafts, k)
        replayed = getattr(runner, "graph_replays", 0) > before
        fed[k] = rows_fed(k, device) if replayed else k
        paths[k] = f"graph {fed[k]}" if replayed else ("stepwise" if device == "cpu" and k > 1 else "eager")
        for _ in range(warmup):
            verify_step(runner, seq, drafts, k)
    wall = {k: [] for k in rows}
    dev = {k: [] for k in rows}
    logit_rows = {}
    for _ in range(runs):
        for k in rows:
            w, d, logit_rows[k] = time_steps(runner, seq, drafts, k, steps)
            wall[k].append(w)
            if d is not None:
                dev[k].append(d)
    base = wall[rows[0]]
    results = []
    for k in rows:
        ratios = [w / b for w, b in zip(wall[k], base)]
        rec = {"k": k, "drafts": k - 1, "rows_fed": fed[k], "path": paths[k], "logit_rows": logit_rows[k],
               "ms": stat(wall[k], 3),
               "ratio": {"median": round(statistics.median(wall[k]) / statistics.median(base), 3),
                         "min": round(min(ratios), 3), "max": round(max(ratios), 3)}}
        if dev[k]:
            rec["device_ms"] = stat(dev[k], 3)
        results.append(rec)
    return {"context": context, "position": seq.num_computed, "prompt_ids_sha": ids_hash(seq.prompt_ids),
            "output_id": seq.output_ids[-1], "draft_ids": drafts[:rows[-1] - 1], "runs": runs, "steps_per_run": steps,
            "warmup_steps": warmup + 1, "rows": rows, "results": results}


def device_record(device: str) -> dict:
    info = device_info()
    if device == "cuda":
        info["name"] = torch.cuda.get_device_name(0)
        info["cuda"] = torch.version.cuda
        try:
            import triton
            info["triton"] = triton.__version__
        except ImportError:
            info["triton"] = None
    else:
        info["name"] = info["cpu"]
    return info


def table(doc: dict) -> str:
    """The curve as a compact text table."""
    m = doc["model"]
    what = m["file_type"] or m["weight_mode"]
    dev = doc["device"]
    lines = [f"spec-curve: {m['name']} ({what}) on {doc['lodestar_device']} ({dev['name']}), context {doc['context']}"
             + (f", {dev['torch_threads']} threads" if doc["lodestar_device"] == "cpu" else "")
             + f"; median [min-max] of {doc['runs']} runs x median of {doc['steps_per_run']} steps",
             f"{'k':>3} {'path':>9} {'ms per step':>26} {'t(k)/t(1)':>22}"
             + ("   device ms" if doc["lodestar_device"] == "cuda" else "")]
    for r in doc["results"]:
        ms, ra = r["ms"], r["ratio"]
        line = (f"{r['k']:>3} {r['path']:>9} {ms['median']:>10.3f} [{ms['min']:.3f}-{ms['max']:.3f}]"
                f" {ra['median']:>8.3f} [{ra['min']:.3f}-{ra['max']:.3f}]")
        if "device_ms" in r:
            line += f"   {r['device_ms']['median']:.3f}"
        lines.append(line)
    kp = doc["kernel_path"].get("thresholds")
    if kp:
        lines.append(f"packed matrix-vector kernel up to {kp['packed_gemv_max_rows']} rows, dense bf16 one up to "
                     f"{kp['dense_gemv_max_rows']}; graph buckets {kp['graph_batch_sizes']}")
    return "\n".join(lines)


def run(loaded, weight_mode: str, qtype: str | None, device: str, rows: list[int], context: int, runs: int,
        steps: int, warmup: int = 2, seed: int = SEED) -> dict:
    """The whole JSON document for ``loaded`` (an engine is built here and dropped after)."""
    engine = build_engine(loaded, context, rows[-1], device)
    measured = curve(engine, rows, context, runs, steps, warmup, seed)
    return {"bench": "spec-curve", "model": model_record(loaded, weight_mode, qtype), "lodestar_device": device,
            "device": device_record(device), "torch": torch.__version__, "commit": git_commit(), "sampler": "greedy",
            **measured, "kernel_path": kernel_paths(loaded.model, rows, device)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="default", help="load_model's spec, or a synthetic geometry (see --dtype)")
    p.add_argument("--dtype", default="packed", help="weight mode (packed, fp32, bf16); for a geometry its file "
                                                     "type (f16, q4_0, q4_k_m, ...)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--rows", type=int, nargs="+", default=list(DEFAULT_ROWS), help="k values (1 is always added)")
    p.add_argument("--context", type=int, default=512, help="tokens prefilled before the timed steps")
    p.add_argument("--runs", type=int, default=5, help="repetitions per k (each the median of --steps)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per repetition and k")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per k after the first (graph capture)")
    p.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    p.add_argument("--seed", type=int, default=SEED)
    p.add_argument("--json", type=Path, help="write the results here")
    a = p.parse_args(argv)
    try:
        rows = parse_rows(a.rows)
        if a.context < 1 or a.runs < 1 or a.steps < 1 or a.warmup < 0:
            raise ValueError("--context, --runs and --steps must be >= 1, --warmup >= 0")
    except ValueError as e:
        p.error(str(e))
    if a.threads:
        torch.set_num_threads(a.threads)
    try:
        loaded, mode, qtype = load(a.model, a.dtype, a.device)
    except (ValueError, FileNotFoundError) as e:     # a bad --dtype / --device, a model not found
        p.error(str(e))
    doc = run(loaded, mode, qtype, a.device, rows, a.context, a.runs, a.steps, a.warmup, a.seed)
    print(table(doc))
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
