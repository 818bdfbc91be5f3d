"""Quantized matrix-vector kernel variants on Llama-3.1-8B shapes (M = 1), on one GPU.

For each weight type and shape it times the rule's tiling (``default``), every loop variant
of ``triton_quant.GEMV_VARIANTS`` and a handful of other tilings, and reports per config
the kernel's median / min / max microseconds and effective TB/s (weight bytes / time),
its largest difference from the default's output, then the best config per shape, the
whole-token matrix-vector time (32 x (qkv, o, gate_up, down) + head, every weight of the
swept type) with the default against the best per shape, and a device-copy bandwidth
measured in the same run. ``table`` is what ``LODESTAR_GEMV_TABLE`` reads, per weight type.

Timing: x is quantized once (``QuantizedRows``), so only the matrix-vector kernel runs;
``REPS`` launches go into one CUDA graph, replayed ``iters`` times with CUDA events around
each replay. The launches cycle through copies of the weight adding up to more than
``ROTATE_BYTES``, so that no launch finds its weight in L2 (a decode step reads every
weight once). Compilation dominates the run time: configs are measured in rounds (all
defaults, then the variants, then the tilings) until ``budget_s`` is spent; what did not
fit is listed under ``skipped``.

    python -m lodestar.bench.gemv_variants [--qtypes Q4_0,Q4_K] [--iters 20] [--budget 90] > gemv.json

Progress goes to stderr. Nothing GPU-only is imported until ``run`` is called.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from typing import Callable

import torch

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "head": (49152, 4096)}
# launches of each shape per decode token of the 8B (32 layers, one head)
PER_TOKEN = {"qkv": 32, "o": 32, "gate_up": 32, "down": 32, "head": 1}
REPS = 40
ROTATE_BYTES = 256 << 20        # > 4x the H200's 50 MB L2
SEED = 1234

# Other tilings, as edits of the rule's config (name -> function of it).
TILINGS: dict[str, Callable] = {
    "bn8": lambda c: dataclasses.replace(c, block_n=8),
    "bn32_tg8": lambda c: dataclasses.replace(c, block_n=32, tile_groups=8),
    "tg32_w8": lambda c: dataclasses.replace(c, tile_groups=32, num_warps=8),
    "bn32_w8": lambda c: dataclasses.replace(c, block_n=32, num_warps=8),
    "split_half": lambda c: dataclasses.replace(c, split_k=max(1, c.split_k // 2)),
    "split_double": lambda c: dataclasses.replace(c, split_k=c.split_k * 2),
    "prefetch_split_half": lambda c: dataclasses.replace(c, split_k=max(1, c.split_k // 2), prefetch=True),
    "prefetch_w8": lambda c: dataclasses.replace(c, num_warps=8, prefetch=True),
    # fewer warps: each thread holds more rows of a tile, so one load of x serves them all
    "w2": lambda c: dataclasses.replace(c, num_warps=2),
    "w1": lambda c: dataclasses.replace(c, num_warps=1),
    "bn32_w2": lambda c: dataclasses.replace(c, block_n=32, num_warps=2),
    "prefetch_w2": lambda c: dataclasses.replace(c, num_warps=2, prefetch=True),
    "prefetch_w2_split_half": lambda c: dataclasses.replace(c, num_warps=2, prefetch=True,
                                                            split_k=max(1, c.split_k // 2)),
    "unroll_w2": lambda c: dataclasses.replace(c, num_warps=2, unroll=True),
    "prefetch_bn8": lambda c: dataclasses.replace(c, block_n=8, prefetch=True),
    # the word-tile kernel (``words``) with other tilings
    "words_split_half": lambda c: dataclasses.replace(c, words=True, tile_groups=32, split_k=max(1, c.split_k // 2)),
    "words_split_double": lambda c: dataclasses.replace(c, words=True, tile_groups=32, split_k=c.split_k * 2),
    "words_bn8_w2": lambda c: dataclasses.replace(c, words=True, tile_groups=32, block_n=8, num_warps=2),
    "words_bn32_w4": lambda c: dataclasses.replace(c, words=True, tile_groups=32, block_n=32, num_warps=4),
    "words_w2": lambda c: dataclasses.replace(c, words=True, tile_groups=32, num_warps=2),
}


def configs(n: int, k: int, device: torch.device, qtype=None,
            only: tuple[str, ...] | None = None) -> list[tuple[str, str, object]]:
    """(round, name, GemvConfig) for one shape: the type-blind rule (``default``: the
    group-tile kernel), the type's rule, the shipped table's entry (if any),
    each loop variant, each tiling (with ``only``: just those names). Configs equal to an
    earlier one are left out."""
    from lodestar.kernels import triton_quant as tq
    base = tq.default_gemv_config(n, k, device)
    out = [("default", "default", base)]
    if qtype is not None:
        out.append(("default", "rule", tq.default_gemv_config(n, k, device, qtype)))   # the type's own rule
    shipped = tq._tuned_config(n, k, device, qtype) if qtype is not None else None
    if shipped is not None:
        out.append(("default", "shipped", shipped))
    out += [("variant", name, tq.with_variant(base, name)) for name in tq.GEMV_VARIANTS
            if name != "default" and (only is None or name in only)]
    out += [("tiling", name, edit(base)) for name, edit in TILINGS.items() if only is None or name in only]
    seen, unique = set(), []
    for rnd, name, cfg in out:
        if cfg not in seen and (k // tq.GROUP) >= cfg.tile_groups:
            seen.add(cfg)
            unique.append((rnd, name, cfg))
    return unique


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _stat(values: list[float]) -> dict:
    return {"median": round(statistics.median(values), 2), "min": round(min(values), 2),
            "max": round(max(values), 2)}


def copy_bandwidth(device: str, iters: int) -> dict:
    """Device-copy bandwidth: a 2 GiB torch copy, read + write bytes per second."""
    n = 2 << 30
    a = torch.ones(n, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    times = []
    for _ in range(max(5, iters // 2)):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    del a, b
    torch.cuda.empty_cache()
    t = statistics.median(times)
    return {"bytes_per_s": 2 * n / t, "tb_per_s": round(2 * n / t / 1e12, 3)}


def _weights(qtype, n: int, k: int, device: str) -> list:
    """Enough copies of one random packed weight to exceed ROTATE_BYTES."""
    from lodestar.formats.synthetic import random_weight
    from lodestar.kernels import triton_quant as tq
    gen = torch.Generator(device=device).manual_seed(SEED)
    pw = tq.pack(qtype, random_weight(qtype.name, n, k, gen, device), n, k)
    copies = [pw]
    while len(copies) * pw.nbytes < ROTATE_BYTES:
        copies.append(dataclasses.replace(pw, **{f.name: getattr(pw, f.name).clone() for f in dataclasses.fields(pw)
                                                 if isinstance(getattr(pw, f.name), torch.Tensor)}))
    return copies


def _time_config(xq, weights: list, cfg, iters: int) -> tuple[list[float], torch.Tensor]:
    """Per-launch microseconds of ``iters`` graph replays of REPS launches, and one output."""
    from lodestar.kernels import triton_quant as tq
    for pw in weights:
        tq.reserve_tile_counters(pw, cfg)
    out = tq.quant_matmul(xq, weights[0], torch.float32, config=cfg)     # compiles
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        tq.quant_matmul(xq, weights[0], torch.float32, config=cfg)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(REPS):
            tq.quant_matmul(xq, weights[i % len(weights)], torch.float32, config=cfg)
    graph.replay()
    times = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        graph.replay()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e3 / REPS)
    del graph
    return times, out


def _measure(rec: dict, xq, weights: list, cfg, ref: torch.Tensor | None, iters: int,
             bw: float) -> torch.Tensor | None:
    from lodestar.kernels import triton_quant as tq
    rec["config"] = tq.config_text(cfg)
    try:
        times, out = _time_config(xq, weights, cfg, iters)
    except Exception as exc:    # e.g. out of registers or shared memory for this tiling
        rec["error"] = f"{type(exc).__name__}: {exc}"[:300]
        return None
    rec["us"] = _stat(times)
    rate = weights[0].nbytes / (rec["us"]["median"] * 1e-6)
    rec["tb_per_s"] = round(rate / 1e12, 3)
    rec["fraction_of_copy_bw"] = round(rate / bw, 3)
    if ref is not None:
        scale = float(ref.abs().max()) or 1.0
        rec["max_diff_vs_default"] = float((out - ref).abs().max()) / scale
    return out


def _summary(qname: str, qtype_res: dict) -> dict:
    """Best config per shape and the whole-token time, default vs best per shape."""
    best, table, token_default, token_best = {}, {}, 0.0, 0.0
    for shape, res in qtype_res.items():
        timed = {name: r for name, r in res.items() if "us" in r}
        if "default" not in timed:
            continue
        name = min(timed, key=lambda c: timed[c]["us"]["median"])
        best[shape] = {"name": name, "config": timed[name]["config"], "us": timed[name]["us"]["median"],
                       "default_us": timed["default"]["us"]["median"],
                       "speedup": round(timed["default"]["us"]["median"] / timed[name]["us"]["median"], 3)}
        table[f"{qname}:{SHAPES[shape][0]},{SHAPES[shape][1]}"] = timed[name]["config"]
        token_default += PER_TOKEN[shape] * timed["default"]["us"]["median"]
        token_best += PER_TOKEN[shape] * timed[name]["us"]["median"]
    out = {"best": best, "table": table}
    if len(best) == len(SHAPES):
        out["token_us"] = {"default": round(token_default, 1), "best_per_shape": round(token_best, 1)}
    return out


def run(device: str = "cuda", qtypes: tuple[str, ...] = ("Q4_0", "Q4_K"), iters: int = 20,
        budget_s: float = 90.0, only: tuple[str, ...] | None = None) -> dict:
    """Measure every (qtype, shape, config) that fits in ``budget_s``; see the module docstring."""
    from lodestar.kernels import triton_quant as tq
    start = time.monotonic()
    dev = torch.device(device)
    props = torch.cuda.get_device_properties(dev)
    bw = copy_bandwidth(device, iters)
    _log(f"copy bandwidth {bw['tb_per_s']} TB/s")
    results: dict = {"device": props.name, "sms": props.multi_processor_count, "torch": torch.__version__,
                     "copy_bandwidth": bw, "reps_per_graph": REPS, "iters": iters, "results": {}, "skipped": []}
    plan = {(q, s): configs(*SHAPES[s], dev, tq.T[q], only) for q in qtypes for s in SHAPES}
    outputs: dict = {}
    for rnd in ("default", "variant", "tiling"):
        for (qname, shape), cfgs in plan.items():
            n, k = SHAPES[shape]
            weights = None
            for r, name, cfg in cfgs:
                if r != rnd:
                    continue
                if time.monotonic() - start > budget_s:
                    results["skipped"].append(f"{qname}/{shape}/{name}")
                    continue
                if weights is None:
                    weights = _weights(tq.T[qname], n, k, device)
                    x = torch.randn(1, k, generator=torch.Generator(device=device).manual_seed(SEED),
                                    device=device).to(torch.bfloat16)
                    xq = tq.QuantizedRows(x, *tq.quantize_x(x))
                rec = results["results"].setdefault(qname, {}).setdefault(shape, {}).setdefault(name, {})
                out = _measure(rec, xq, weights, cfg, outputs.get((qname, shape)), iters, bw["bytes_per_s"])
                if name == "default" and out is not None:
                    outputs[(qname, shape)] = out
                _log(f"[{time.monotonic() - start:5.1f}s] {qname} {shape} {name} {rec.get('config')}: "
                     f"{rec.get('us', {}).get('median', rec.get('error'))} us, {rec.get('tb_per_s')} TB/s")
            del weights
            torch.cuda.empty_cache()
    results["summary"] = {q: _summary(q, results["results"].get(q, {})) for q in qtypes}
    # the whole output is a LODESTAR_GEMV_TABLE file: best config per type and shape
    results["table"] = {key: cfg for s in results["summary"].values() for key, cfg in s["table"].items()}
    results["seconds"] = round(time.monotonic() - start, 1)
    return results


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--qtypes", default="Q4_0,Q4_K", help="comma list of weight types")
    p.add_argument("--iters", type=int, default=20, help="graph replays per config")
    p.add_argument("--budget", type=float, default=90.0, help="seconds; configs past it are skipped")
    p.add_argument("--only", default="", help="comma list of variant / tiling names (default: all)")
    args = p.parse_args(argv)
    only = tuple(n.strip() for n in args.only.split(",") if n.strip()) or None
    res = run("cuda", tuple(q.strip() for q in args.qtypes.split(",") if q.strip()), args.iters, args.budget, only)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
