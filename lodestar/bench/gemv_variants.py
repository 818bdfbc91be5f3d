"""Quantized matrix-vector kernel tilings on Llama-3.1-8B shapes (M = 1), on one GPU.

For each weight type and shape it times the type-blind rule's tiling (``default``), the
type's rule and shipped entry, and the candidate tilings of ``TILINGS`` (group tiles and word
tiles, some with the next tile prefetched or the tile loop unrolled), and reports per config
the kernel's median / min / max microseconds and effective TB/s (weight bytes / time),
its largest difference from the default's output, then the best config per shape, the
whole-token matrix-vector time (32 x (qkv, o, gate_up, down) + head, every weight of the
swept type) with the default against the best per shape, and a device-copy bandwidth
measured in the same run. ``table`` is what ``LODESTAR_GEMV_TABLE`` reads, per weight type.
Weights are packed with the scale form the table in force gives their shape (``kquant_scales``).

Timing: x is quantized once (``QuantizedRows``), so only the matrix-vector kernel runs;
``REPS`` launches go into one CUDA graph, replayed ``iters`` times with CUDA events around
each replay. The launches cycle through copies of the weight adding up to more than
``ROTATE_BYTES``, so that no launch finds its weight in L2 (a decode step reads every
weight once). Compilation dominates the run time: configs are measured in rounds (all
defaults, then the tilings) until ``budget_s`` is spent; what did not fit is listed under
``skipped``.

    python -m lodestar.bench.gemv_variants [--qtypes Q4_0,Q4_K] [--iters 20] [--budget 90] > gemv.json
    python -m lodestar.bench.gemv_variants --qtypes Q4_K --configs "down:8,32,7,1,0,0,1 down:16,32,2,4,0,0,1,128"

``--configs`` times named tilings (``SHAPE:CONFIG``, CONFIG as ``gemv_tiling.parse_gemv_config``
reads it: ``block_n,tile_groups,split_k,num_warps[,prefetch,unroll,words,maxnreg]``) of those
shapes only, after the rule and the shipped entry (``default``, ``rule``, ``shipped``), instead
of ``TILINGS``.

``--dense`` times the dense bf16 kernel (``triton_dense``) the same way over the same shapes:
the shape's current config, the rule and ``DENSE_CONFIGS`` (a K split's sum kernel counted in
its time); its ``table`` holds ``BF16:n,k`` entries.

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

from lodestar.bench.gpu_kernels import replay_ms

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "head": (49152, 4096)}
# Shapes timed only when ``--configs`` names them: Llama-3.1-8B's v and q|k alone (Q4_K_M keeps
# v in Q6_K beside q|k in Q4_K, a stack of two launches).
EXTRA_SHAPES = {"v": (1024, 4096), "qk": (5120, 4096)}
ALL_SHAPES = {**SHAPES, **EXTRA_SHAPES}
# launches of each shape per decode token of the 8B (32 layers, one head)
PER_TOKEN = {"qkv": 32, "o": 32, "gate_up": 32, "down": 32, "head": 1}
REPS = 40
ROTATE_BYTES = 256 << 20        # > 4x the H200's 50 MB L2
SEED = 1234


def _words(c, **change):
    """``c`` as a word-tile config (tiles of 32 groups) with ``change``."""
    return dataclasses.replace(c, **{"words": True, "tile_groups": 32, **change})


# Candidate tilings, as edits of the type-blind rule's config (name -> function of it).
TILINGS: dict[str, Callable] = {
    # group tiles (``_gemv_kernel``)
    "bn8": lambda c: dataclasses.replace(c, block_n=8),
    "bn32": lambda c: dataclasses.replace(c, block_n=32),       # x terms loaded once per 32 rows
    "bn32_tg8": lambda c: dataclasses.replace(c, block_n=32, tile_groups=8),
    "tg32_w8": lambda c: dataclasses.replace(c, tile_groups=32, num_warps=8),
    "bn32_w8": lambda c: dataclasses.replace(c, block_n=32, num_warps=8),
    "split_half": lambda c: dataclasses.replace(c, split_k=max(1, c.split_k // 2)),
    "split_double": lambda c: dataclasses.replace(c, split_k=c.split_k * 2),
    # fewer warps: each thread holds more rows of a tile, so one load of x serves them all
    "w2": lambda c: dataclasses.replace(c, num_warps=2),
    "w1": lambda c: dataclasses.replace(c, num_warps=1),
    "bn32_w2": lambda c: dataclasses.replace(c, block_n=32, num_warps=2),
    # word tiles (``_gemv_words_kernel``): the tile held as code words, whole groups per thread
    "words": lambda c: _words(c),
    "words_tg16": lambda c: _words(c, tile_groups=16),
    "words_bn8": lambda c: _words(c, block_n=8),
    "words_bn32_w8": lambda c: _words(c, block_n=32, num_warps=8),
    "words_split_half": lambda c: _words(c, split_k=max(1, c.split_k // 2)),
    "words_split_double": lambda c: _words(c, split_k=c.split_k * 2),
    "words_bn8_w2": lambda c: _words(c, block_n=8, num_warps=2),
    "words_bn32_w4": lambda c: _words(c, block_n=32, num_warps=4),
    "words_w2": lambda c: _words(c, num_warps=2),
    # whole 32-group tiles in each K split of a 14,336-wide row (448 groups: 7 or 14 splits)
    "words_split7": lambda c: _words(c, split_k=7),
    "words_split7_w2": lambda c: _words(c, split_k=7, num_warps=2),
    "words_split14": lambda c: _words(c, split_k=14),
    # more, smaller programs for the 4,096-wide rows
    "words_bn8_w2_split2": lambda c: _words(c, block_n=8, num_warps=2, split_k=2),
    "words_bn8_split4": lambda c: _words(c, block_n=8, split_k=4),
    # the next tile's words and scales loaded before this tile's math
    "words_prefetch": lambda c: _words(c, prefetch=True),
    "words_prefetch_bn8": lambda c: _words(c, block_n=8, prefetch=True),
    "words_prefetch_w2": lambda c: _words(c, num_warps=2, prefetch=True),
    "words_prefetch_w8": lambda c: _words(c, num_warps=8, prefetch=True),
    "words_prefetch_split_half": lambda c: _words(c, split_k=max(1, c.split_k // 2), prefetch=True),
    "words_prefetch_w2_split_half": lambda c: _words(c, num_warps=2, split_k=max(1, c.split_k // 2), prefetch=True),
    # the whole tile loop unrolled
    "words_unroll": lambda c: _words(c, unroll=True),
    "words_unroll_w2": lambda c: _words(c, num_warps=2, unroll=True),
    "words_split2_unroll": lambda c: _words(c, split_k=2, unroll=True),
}


def configs(n: int, k: int, device: torch.device, qtype=None,
            only: tuple[str, ...] | None = None,
            explicit: tuple[str, ...] | None = None) -> list[tuple[str, str, object]]:
    """(round, name, GemvConfig) for one shape: the type-blind rule (``default``: the
    group-tile kernel), the type's rule, the shipped table's entry (if any), then either
    each of ``TILINGS`` (with ``only``: just those names) or, with ``explicit`` (config
    texts), those configs named by their text (round ``config``). Configs equal to an
    earlier one, or with tiles wider than the row, are left out."""
    from lodestar.kernels.gemv_tiling import (
        T,
        default_gemv_config,
        parse_gemv_config,
        table_entry,
    )
    from lodestar.kernels.quant_layout import GROUP
    base = default_gemv_config(n, k, device)
    out = [("default", "default", base)]
    if qtype is not None:
        out.append(("default", "rule", default_gemv_config(n, k, device, qtype)))   # the type's own rule
        shipped = table_entry(f"{T(int(qtype)).name}:{n},{k}", device)
        if shipped:
            out.append(("default", "shipped", parse_gemv_config(shipped)))
    if explicit is not None:
        out += [("config", text, parse_gemv_config(text)) for text in explicit]
    else:
        out += [("tiling", name, edit(base)) for name, edit in TILINGS.items() if only is None or name in only]
    seen, unique = set(), []
    for rnd, name, cfg in out:
        if cfg not in seen and (k // GROUP) >= cfg.tile_groups:
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
    from lodestar.kernels.gemv_tiling import kquant_scales
    from lodestar.kernels.quant_layout import pack
    gen = torch.Generator(device=device).manual_seed(SEED)
    pw = pack(qtype, random_weight(qtype.name, n, k, gen, device), n, k, kquant_scales(qtype, n, k, torch.device(device)))
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
    return _graph_times(lambda w: tq.quant_matmul(xq, w, torch.float32, config=cfg), weights, iters), out


def _graph_times(launch: Callable, weights: list, iters: int) -> list[float]:
    """Per-launch microseconds of ``iters`` replays of one CUDA graph holding REPS calls of
    ``launch(weight)`` cycling through ``weights`` (after one warm-up call on a side stream)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        launch(weights[0])
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(REPS):
            launch(weights[i % len(weights)])
    graph.replay()
    times = [ms * 1e3 / REPS for ms in replay_ms(graph, iters)]
    del graph
    return times


def _measure(rec: dict, xq, weights: list, cfg, ref: torch.Tensor | None, iters: int,
             bw: float) -> torch.Tensor | None:
    from lodestar.kernels.gemv_tiling import config_text
    rec["config"] = config_text(cfg)
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
        table[f"{qname}:{ALL_SHAPES[shape][0]},{ALL_SHAPES[shape][1]}"] = timed[name]["config"]
        if shape in PER_TOKEN:
            token_default += PER_TOKEN[shape] * timed["default"]["us"]["median"]
            token_best += PER_TOKEN[shape] * timed[name]["us"]["median"]
    out = {"best": best, "table": table}
    if set(SHAPES) <= set(best):
        out["token_us"] = {"default": round(token_default, 1), "best_per_shape": round(token_best, 1)}
    return out


def _results_head(device: str, iters: int) -> dict:
    """A sweep's result document before any measurement: the device, and the copy
    bandwidth measured now (the TB/s figures are fractions of it)."""
    props = torch.cuda.get_device_properties(torch.device(device))
    bw = copy_bandwidth(device, iters)
    _log(f"copy bandwidth {bw['tb_per_s']} TB/s")
    return {"device": props.name, "sms": props.multi_processor_count, "torch": torch.__version__,
            "copy_bandwidth": bw, "reps_per_graph": REPS, "iters": iters, "results": {}, "skipped": []}


def parse_explicit(text: str) -> dict[str, tuple[str, ...]]:
    """``--configs``: space- or semicolon-separated ``SHAPE:CONFIG`` -> {shape: config texts},
    each config checked (``parse_gemv_config``) and each shape one of SHAPES."""
    from lodestar.kernels.gemv_tiling import parse_gemv_config
    out: dict[str, list[str]] = {}
    for item in text.replace(";", " ").split():
        shape, sep, cfg = item.partition(":")
        if not sep or shape not in ALL_SHAPES:
            raise ValueError(f"--configs item {item!r}: give SHAPE:CONFIG with SHAPE one of {', '.join(ALL_SHAPES)}")
        parse_gemv_config(cfg)
        out.setdefault(shape, []).append(cfg)
    return {shape: tuple(cfgs) for shape, cfgs in out.items()}


def run(device: str = "cuda", qtypes: tuple[str, ...] = ("Q4_0", "Q4_K"), iters: int = 20,
        budget_s: float = 90.0, only: tuple[str, ...] | None = None,
        explicit: dict[str, tuple[str, ...]] | None = None) -> dict:
    """Measure every (qtype, shape, config) that fits in ``budget_s``; see the module docstring.
    ``explicit`` ({shape: config texts}, ``parse_explicit``): only those shapes, with those configs."""
    from lodestar.kernels.gemv_tiling import T
    from lodestar.kernels.quant_layout import QuantizedRows
    from lodestar.kernels.triton_quant import quantize_x
    start = time.monotonic()
    dev = torch.device(device)
    results = _results_head(device, iters)
    bw = results["copy_bandwidth"]
    shapes = list(explicit) if explicit else list(SHAPES)
    plan = {(q, s): configs(*ALL_SHAPES[s], dev, T[q], only, explicit[s] if explicit else None)
            for q in qtypes for s in shapes}
    outputs: dict = {}
    for rnd in ("default", "tiling", "config"):
        for (qname, shape), cfgs in plan.items():
            n, k = ALL_SHAPES[shape]
            weights = None
            for r, name, cfg in cfgs:
                if r != rnd:
                    continue
                if time.monotonic() - start > budget_s:
                    results["skipped"].append(f"{qname}/{shape}/{name}")
                    continue
                if weights is None:
                    weights = _weights(T[qname], n, k, device)
                    x = torch.randn(1, k, generator=torch.Generator(device=device).manual_seed(SEED),
                                    device=device).to(torch.bfloat16)
                    xq = QuantizedRows(x, *quantize_x(x))
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


# Dense bf16 tilings (``triton_dense.DenseGemvConfig``: block_n, block_k, split, warps) timed by
# ``--dense`` besides the shape's current config.
DENSE_CONFIGS = ("4,512,1,4", "4,512,2,4", "4,512,4,4", "4,256,1,4", "4,1024,1,4", "4,1024,1,8", "4,512,1,2",
                 "2,512,1,4", "2,1024,1,4", "2,512,1,2", "8,512,1,4", "8,512,1,8", "8,256,1,4", "8,1024,1,8",
                 "16,512,1,8", "4,256,2,4", "8,512,2,8", "2,256,1,2", "2,1024,1,4", "4,1024,1,4",
                 "2,2048,1,4", "4,2048,1,4", "2,2048,1,8", "4,2048,1,8", "1,2048,1,4", "1,1024,1,2",
                 "2,1024,1,2", "4,1024,2,4")


def _dense_weights(n: int, k: int, device: str) -> list[torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(SEED)
    w = (torch.randn(n, k, generator=gen, device=device) * 0.02).to(torch.bfloat16)
    copies = [w]
    while len(copies) * w.nbytes < ROTATE_BYTES:
        copies.append(w.clone())
    return copies


def _time_dense(x: torch.Tensor, weights: list[torch.Tensor], cfg, iters: int) -> tuple[list[float], torch.Tensor]:
    """Per-launch microseconds (a K split's sum kernel included) over graph replays."""
    from lodestar.kernels import triton_dense as td
    out = td.dense_gemv(x, weights[0], torch.float32, config=cfg)     # compiles
    torch.cuda.synchronize()
    return _graph_times(lambda w: td.dense_gemv(x, w, config=cfg), weights, iters), out


def run_dense(device: str = "cuda", iters: int = 20, budget_s: float = 90.0,
              configs: tuple[str, ...] = DENSE_CONFIGS) -> dict:
    """The dense bf16 kernel over the 8B shapes: the shape's config (``config_for``: shipped
    table or rule), the rule, and ``configs``; best per shape, whole-token time, and a
    ``table`` of ``BF16:n,k`` entries (``LODESTAR_GEMV_TABLE`` reads it)."""
    from lodestar.kernels import triton_dense as td
    start = time.monotonic()
    dev = torch.device(device)
    results = _results_head(device, iters)
    bw = results["copy_bandwidth"]
    best, table, token = {}, {}, {"current": 0.0, "best_per_shape": 0.0}
    for shape, (n, k) in SHAPES.items():
        weights = _dense_weights(n, k, device)
        x = torch.randn(1, k, generator=torch.Generator(device=device).manual_seed(SEED), device=device
                        ).to(torch.bfloat16)
        current = td.config_text(td.config_for(n, k, dev))
        cands = [("current", current), ("rule", td.config_text(td.default_config(n, k)))]
        cands += [(c, c) for c in configs]
        seen, res, ref = set(), results["results"].setdefault(shape, {}), None
        for name, text in cands:
            cfg = td.parse_config(text)
            if cfg in seen or (name not in ("current", "rule") and time.monotonic() - start > budget_s):
                if cfg not in seen:
                    results["skipped"].append(f"{shape}/{name}")
                continue
            seen.add(cfg)
            rec = res.setdefault(name, {"config": text})
            try:
                times, out = _time_dense(x, weights, cfg, iters)
            except Exception as exc:
                rec["error"] = f"{type(exc).__name__}: {exc}"[:300]
                continue
            rec["us"] = _stat(times)
            rate = weights[0].nbytes / (rec["us"]["median"] * 1e-6)
            rec["tb_per_s"] = round(rate / 1e12, 3)
            rec["fraction_of_copy_bw"] = round(rate / bw["bytes_per_s"], 3)
            if ref is None:
                ref = out
            else:
                rec["max_diff_vs_current"] = float((out - ref).abs().max()) / (float(ref.abs().max()) or 1.0)
            _log(f"[{time.monotonic() - start:5.1f}s] BF16 {shape} {name} {text}: {rec['us']['median']} us, "
                 f"{rec['tb_per_s']} TB/s")
        timed = {nm: r for nm, r in res.items() if "us" in r}
        if "current" in timed:
            nm = min(timed, key=lambda c: timed[c]["us"]["median"])
            best[shape] = {"name": nm, "config": timed[nm]["config"], "us": timed[nm]["us"]["median"],
                           "current_us": timed["current"]["us"]["median"],
                           "speedup": round(timed["current"]["us"]["median"] / timed[nm]["us"]["median"], 3)}
            table[f"BF16:{n},{k}"] = timed[nm]["config"]
            token["current"] += PER_TOKEN[shape] * timed["current"]["us"]["median"]
            token["best_per_shape"] += PER_TOKEN[shape] * timed[nm]["us"]["median"]
        del weights
        torch.cuda.empty_cache()
    results["summary"] = {"best": best}
    if len(best) == len(SHAPES):
        results["summary"]["token_us"] = {k: round(v, 1) for k, v in token.items()}
    results["table"] = table
    results["seconds"] = round(time.monotonic() - start, 1)
    return results


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--qtypes", default="Q4_0,Q4_K", help="comma list of weight types")
    p.add_argument("--iters", type=int, default=20, help="graph replays per config")
    p.add_argument("--budget", type=float, default=90.0, help="seconds; configs past it are skipped")
    p.add_argument("--only", default="", help="comma list of TILINGS names (default: all)")
    p.add_argument("--configs", default="", help="SHAPE:CONFIG items (space or ; separated): time only "
                   "these tilings of these shapes, after the rule and the shipped entry")
    p.add_argument("--dense", action="store_true", help="time the dense bf16 kernel's tilings instead")
    args = p.parse_args(argv)
    if args.dense:
        print(json.dumps(run_dense("cuda", args.iters, args.budget), indent=1))
        return
    only = tuple(n.strip() for n in args.only.split(",") if n.strip()) or None
    explicit = parse_explicit(args.configs) if args.configs.strip() else None
    res = run("cuda", tuple(q.strip() for q in args.qtypes.split(",") if q.strip()), args.iters, args.budget, only,
              explicit)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
