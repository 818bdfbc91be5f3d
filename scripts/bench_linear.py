"""Micro-benchmark of the CPU linear paths on SmolLM2-135M's real weights.

    .venv/bin/python scripts/bench_linear.py [--threads 2] [--repeats 7] [--sweep]

Prints min / median / max milliseconds per call for every projection shape and path at
M = 1, 128, 1024 (each call cycles through the 30 layers' weights so the caches see a
model's worth of bytes, as in decoding), the crossover sweep behind the M thresholds in
``lodestar/layers/linear.py`` (``--sweep``), the total linear time of one decode step
and of prefill chunks, and the RSS the packed weights add.
"""
from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader

from lodestar.formats.catalog import known_model_path
from lodestar.kernels import cpu_quant as cq
from lodestar.layers.linear import (
    INT4_KERNEL_MAX_M,
    INT8_KERNEL_MAX_M,
    QuantizedEmbedding,
    QuantizedLinear,
    make_linear,
)

PROJECTIONS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def rss_kb() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile"):
                out[key] = int(value.split()[0])
    return out


def timed(fn: Callable[[], object], repeats: int, warmup: int = 2) -> tuple[float, float, float]:
    """(min, median, max) milliseconds of ``fn()`` over ``repeats`` runs after warm-up."""
    for _ in range(warmup):
        fn()
    xs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        xs.append((time.perf_counter() - t0) * 1e3)
    return min(xs), statistics.median(xs), max(xs)


def fmt(t: tuple[float, float, float]) -> str:
    return f"{t[0]:9.3f} {t[1]:9.3f} {t[2]:9.3f}"


def raw_tensors(path) -> tuple[GGUFReader, dict[str, tuple[GGMLQuantizationType, torch.Tensor, int, int]]]:
    reader = GGUFReader(path)
    out = {}
    for t in reader.tensors:
        if len(t.shape) != 2:
            continue
        k, n = int(t.shape[0]), int(t.shape[1])
        raw = t.data.view(np.uint8).reshape(n, -1)
        out[t.name] = (GGMLQuantizationType(t.tensor_type), torch.from_numpy(raw), n, k)
    return reader, out


def per_call(mods: list[torch.nn.Module], fn, m: int, k: int, repeats: int) -> tuple[float, float, float]:
    """Per-call time of ``fn(x, module)`` cycling through ``mods`` (one pass = one sample)."""
    x = torch.randn(m, k)
    t = timed(lambda: [fn(x, mod) for mod in mods], repeats)
    return tuple(v / len(mods) for v in t)


def gemma_by_type(repeats: int) -> None:
    """One M=1 pass over Gemma-3-270M's projections, summed by weight type."""
    try:
        path = known_model_path("gemma3-270m")
    except FileNotFoundError as e:
        print(f"\ngemma skipped: {e}")
        return
    reader, raw = raw_tensors(path)
    mods = [QuantizedLinear(q, d, k, n) for name, (q, d, n, k) in raw.items() if name.startswith("blk.")]
    del reader, raw
    print(f"\nGemma-3-270M projections at M=1 (median of {repeats}), packed {sum(m.nbytes for m in mods) / 2**20:.1f} MiB")
    total = 0.0
    for qtype in sorted({m.qtype for m in mods}, key=lambda t: t.name):
        group = [m for m in mods if m.qtype == qtype]
        xs = {k: torch.randn(1, k) for k in {m.in_features for m in group}}
        t = timed(lambda g=group: [m(xs[m.in_features]) for m in g], repeats)
        total += t[1]
        print(f"  {qtype.name:5s} x{len(group):3d} path {group[0].path:7s} {fmt(t)} ms")
    print(f"  total {total:.2f} ms per token (without the 262144-row head)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--sweep", action="store_true", help="also sweep M for the kernel/dense crossover")
    ap.add_argument("--dense", action="store_true", help="also time the dense fp32/bf16 modes")
    ap.add_argument("--gemma", action="store_true", help="also time Gemma-3-270M's projections by type")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    path = known_model_path("default")
    print(f"model {path.name}  torch {torch.__version__}  threads {torch.get_num_threads()}  "
          f"thresholds int4<= {INT4_KERNEL_MAX_M} int8<= {INT8_KERNEL_MAX_M}")

    reader, raw = raw_tensors(path)
    gc.collect()
    before = rss_kb()
    layers = {p: [] for p in PROJECTIONS}
    n_layers = 0
    while f"blk.{n_layers}.attn_q.weight" in raw:
        for p in PROJECTIONS:
            qtype, data, n, k = raw[f"blk.{n_layers}.{p}.weight"]
            layers[p].append(QuantizedLinear(qtype, data, k, n))
        n_layers += 1
    qtype, data, n, k = raw["token_embd.weight"]
    embedding = QuantizedEmbedding(qtype, data, n, k)
    head = embedding.as_linear()
    packed_bytes = sum(m.nbytes for ms in layers.values() for m in ms) + head.nbytes
    loaded = rss_kb()
    del raw, reader, data
    gc.collect()
    released = rss_kb()
    mib = lambda a, b, key: (a[key] - b[key]) / 1024  # noqa: E731
    print(f"\nRSS added by packing all weights, MiB: total {mib(loaded, before, 'VmRSS'):.1f} "
          f"(anon {mib(loaded, before, 'RssAnon'):.1f}, file-backed mmap pages read "
          f"{mib(loaded, before, 'RssFile'):.1f}); after closing the GGUF mmap: "
          f"total {mib(released, before, 'VmRSS'):.1f} (anon {mib(released, before, 'RssAnon'):.1f}, "
          f"file {mib(released, before, 'RssFile'):.1f})")
    print(f"packed bytes held: {packed_bytes / 2**20:.1f} MiB  "
          f"(paths: {layers['attn_q'][0].path} for {layers['attn_q'][0].qtype.name}, {head.path} for the head)")

    rep = args.repeats
    print("\nper call, ms (min median max), cycling through the 30 layers' weights")
    print(f"{'shape':24s} {'path':14s} {'M':>5s} {'min':>9s} {'median':>9s} {'max':>9s}")
    int4_paths = {"int4-kernel": cq.int4_matmul, "int4-dense-bf16": cq.int4_dense_matmul}
    for p in PROJECTIONS:
        mods = layers[p]
        n, k = mods[0].out_features, mods[0].in_features
        for m in (1, 128, 1024):
            for name, fn in int4_paths.items():
                sub = mods if m <= 128 else mods[:6]
                t = per_call(sub, lambda x, mod, fn=fn: fn(x, mod.storage), m, k, rep)
                print(f"{p + f' {n}x{k}':24s} {name:14s} {m:5d} {fmt(t)}")
    heads = [head]
    for m in (1, 128, 1024):
        for name, fn in {"int8-kernel": cq.int8_matmul, "int8-dense-bf16": cq.int8_dense_matmul}.items():
            if m == 1024 and name == "int8-kernel":
                continue
            t = per_call(heads, lambda x, mod, fn=fn: fn(x, mod.storage), m, head.in_features, max(3, rep // 2))
            print(f"{'head 49152x576':24s} {name:15s}{m:5d} {fmt(t)}")

    if args.sweep:
        print("\ncrossover sweep, median ms per call")
        for p in ("attn_q", "ffn_up", "ffn_down"):
            mods = layers[p][:10]
            for m in (8, 16, 32, 48, 64, 96, 128, 192):
                a = per_call(mods, lambda x, mod: cq.int4_matmul(x, mod.storage), m, mods[0].in_features, rep)[1]
                b = per_call(mods, lambda x, mod: cq.int4_dense_matmul(x, mod.storage), m, mods[0].in_features, rep)[1]
                print(f"  {p:12s} M={m:4d}  int4-kernel {a:8.3f}  int4-dense-bf16 {b:8.3f}")
        for m in (1, 2, 4, 8, 16, 32, 48, 64, 96):
            a = per_call(heads, lambda x, mod: cq.int8_matmul(x, mod.storage), m, 576, max(3, rep // 2))[1]
            b = per_call(heads, lambda x, mod: cq.int8_dense_matmul(x, mod.storage), m, 576, max(3, rep // 2))[1]
            print(f"  {'head':12s} M={m:4d}  int8-kernel {a:8.3f}  int8-dense-bf16 {b:8.3f}")

    def step(m: int, with_head: bool) -> Callable[[], None]:
        x = torch.randn(m, 576)
        xf = torch.randn(m, 1536)
        last = x[-1:]

        def run() -> None:
            for i in range(n_layers):
                for p in PROJECTIONS:
                    layers[p][i](xf if p == "ffn_down" else x)
            if with_head:
                head(last)
        return run

    print("\nwhole model, linear layers only (module forward, paths chosen by M)")
    t = timed(step(1, True), max(rep, 9))
    t_head = per_call(heads, lambda x, mod: mod(x), 1, 576, max(rep, 9))
    print(f"  decode M=1, 210 projections + head: {fmt(t)} ms  (head alone {t_head[1]:.3f} ms) "
          f"-> {1000 / t[1]:.0f} tok/s if linears were all")
    for m in (128, 1024):
        t = timed(step(m, True), 3, warmup=1)
        print(f"  prefill M={m}, 210 projections + head on the last row: {fmt(t)} ms "
              f"-> {m * 1000 / t[1]:.0f} tok/s")

    if args.gemma:
        gemma_by_type(args.repeats)

    if args.dense:
        del layers, head, embedding
        gc.collect()
        for mode in ("bf16", "fp32"):
            reader, raw = raw_tensors(path)
            dense = {p: [] for p in PROJECTIONS}
            for i in range(n_layers):
                for p in PROJECTIONS:
                    qtype, data, n, k = raw[f"blk.{i}.{p}.weight"]
                    dense[p].append(make_linear(qtype, data, k, n, mode))
            qtype, data, n, k = raw["token_embd.weight"]
            dhead = make_linear(qtype, data, k, n, mode)
            del raw, reader
            layers, head = dense, dhead
            t = timed(step(1, True), max(rep, 9))
            print(f"  dense {mode}: decode M=1 {fmt(t)} ms; head alone "
                  f"{per_call([dhead], lambda x, mod: mod(x), 1, 576, rep)[1]:.3f} ms")
            del dense, dhead, layers, head
            gc.collect()


if __name__ == "__main__":
    main()
