"""Micro-benchmark of the CPU linear paths on SmolLM2-135M's real weights.

    .venv/bin/python scripts/bench_linear.py [--threads 2] [--repeats 9] [--sweep] [--types]
                                             [--gemma] [--dense] [--no-shapes]

Prints min / median / max milliseconds for:
* every projection shape and the tied Q8_0 head, per path, at M = 1, 128, 1024 (a sample
  is one call on each of the 30 layers' weights, so the caches see a model's worth of
  bytes as in decoding; times are per call);
* ``--sweep``: the kernel-vs-dequantize crossover behind ``INT4_CROSSOVER_M`` and
  ``INT8_CROSSOVER_M`` in ``lodestar/layers/linear.py``;
* one decode step (M=1: 210 projections + head) and prefill chunks of 128 and 1024 rows
  through the modules, with the default single kernel per weight and with the opt-in
  dense route for large M;
* ``--types``: every supported weight type (random weights) at 576x1536, M = 1, 128, 1024;
* ``--gemma``: Gemma-3-270M's projections at M=1, by weight type;
* ``--dense``: the same decode step with the weights dense in bf16 and fp32;
and the RSS the packed weights add. The load average is printed first and last: on a
shared machine, compare runs taken at similar load, and trust minimums over medians.
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
import warnings
from collections.abc import Callable

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader

from lodestar.formats.catalog import ModelNotFoundError, known_model_path
from lodestar.kernels import cpu_quant as cq
from lodestar.layers.linear import (
    INT4_CROSSOVER_M,
    INT8_CROSSOVER_M,
    QuantizedEmbedding,
    QuantizedLinear,
    make_linear,
)

PROJECTIONS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
Raw = dict[str, tuple[GGMLQuantizationType, torch.Tensor, int, int]]


def rss_mib() -> dict[str, float]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) / 1024
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


def raw_tensors(path) -> tuple[GGUFReader, Raw]:
    """2-D tensors of a GGUF file as (type, uint8 bytes [rows, bytes_per_row], rows, cols)."""
    reader = GGUFReader(path)
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # read-only mmap: torch warns, nothing writes to it
        for t in reader.tensors:
            if len(t.shape) == 2:
                k, n = int(t.shape[0]), int(t.shape[1])
                raw = t.data.view(np.uint8).reshape(n, -1)
                out[t.name] = (GGMLQuantizationType(t.tensor_type), torch.from_numpy(raw), n, k)
    return reader, out


def per_call(mods: list, fn: Callable, m: int, k: int, repeats: int) -> tuple[float, float, float]:
    """Per-call time of ``fn(x, module)``, one sample being a pass over ``mods``."""
    x = torch.randn(m, k)
    t = timed(lambda: [fn(x, mod) for mod in mods], repeats)
    return t[0] / len(mods), t[1] / len(mods), t[2] / len(mods)


def build_layers(raw: Raw, mode: str = "packed", dense_min_m: int | None = None
                 ) -> tuple[dict[str, list], torch.nn.Module]:
    layers = {p: [] for p in PROJECTIONS}
    i = 0
    while f"blk.{i}.attn_q.weight" in raw:
        for p in PROJECTIONS:
            qtype, data, n, k = raw[f"blk.{i}.{p}.weight"]
            layers[p].append(make_linear(qtype, data, k, n, mode, dense_min_m))
        i += 1
    qtype, data, n, k = raw["token_embd.weight"]
    head = QuantizedEmbedding(qtype, data, n, k).as_linear() if mode == "packed" else make_linear(
        qtype, data, k, n, mode)
    return layers, head


def model_pass(layers: dict[str, list], head, m: int) -> Callable[[], None]:
    """All projections at M rows (inputs stand in for the activations) + head on one row."""
    x, xf = torch.randn(m, 576), torch.randn(m, 1536)
    last = x[-1:]
    n_layers = len(layers["attn_q"])

    def run() -> None:
        for i in range(n_layers):
            for p in PROJECTIONS:
                layers[p][i](xf if p == "ffn_down" else x)
        head(last)
    return run


def shapes_and_paths(layers: dict[str, list], head, repeats: int) -> None:
    print("\nper call, ms (min median max); a sample runs each of the 30 layers' weights once")
    print(f"{'shape':24s} {'path':16s} {'M':>5s} {'min':>9s} {'median':>9s} {'max':>9s}")
    for p in PROJECTIONS:
        mods = layers[p]
        n, k = mods[0].out_features, mods[0].in_features
        for m in (1, 128, 1024):
            for name, fn in (("int4-kernel", cq.int4_matmul), ("int4-dequant-bf16", cq.int4_dense_matmul)):
                sub = mods if m <= 128 else mods[:6]
                t = per_call(sub, lambda x, mod, fn=fn: fn(x, mod.storage), m, k, repeats)
                print(f"{f'{p} {n}x{k}':24s} {name:16s} {m:5d} {fmt(t)}")
    for m in (1, 128, 1024):
        for name, fn in (("int8-kernel", cq.int8_matmul), ("int8-dequant-bf16", cq.int8_dense_matmul)):
            if m == 1024 and name == "int8-kernel":
                continue  # tens of seconds, and never picked
            t = per_call([head], lambda x, mod, fn=fn: fn(x, mod.storage), m, head.in_features,
                         max(3, repeats // 2))
            print(f"{'head 49152x576':24s} {name:16s} {m:5d} {fmt(t)}")


def sweep(layers: dict[str, list], head, repeats: int) -> None:
    print("\ncrossover sweep, per call ms (min / median)")
    for p in ("attn_q", "ffn_up", "ffn_down"):
        mods = layers[p][:10]
        k = mods[0].in_features
        for m in (16, 32, 48, 64, 80, 96, 128, 192):
            a = per_call(mods, lambda x, mod: cq.int4_matmul(x, mod.storage), m, k, repeats)
            b = per_call(mods, lambda x, mod: cq.int4_dense_matmul(x, mod.storage), m, k, repeats)
            print(f"  {p:12s} M={m:4d}  int4-kernel {a[0]:7.3f} / {a[1]:7.3f}   "
                  f"int4-dequant-bf16 {b[0]:7.3f} / {b[1]:7.3f}")
    for m in (1, 2, 4, 8, 16, 24, 32, 48, 64):
        a = per_call([head], lambda x, mod: cq.int8_matmul(x, mod.storage), m, 576, max(3, repeats // 2))
        b = per_call([head], lambda x, mod: cq.int8_dense_matmul(x, mod.storage), m, 576, max(3, repeats // 2))
        print(f"  {'head':12s} M={m:4d}  int8-kernel {a[0]:7.3f} / {a[1]:7.3f}   "
              f"int8-dequant-bf16 {b[0]:7.3f} / {b[1]:7.3f}")


ALL_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
             "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")


def synthetic_bytes(qtype: GGMLQuantizationType, n: int, k: int, rng: np.random.Generator) -> torch.Tensor:
    """GGUF bytes of random weights: gguf's quantizer, or random codes with sane scales."""
    from gguf import quants
    from gguf.constants import GGML_QUANT_SIZES

    try:
        w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
        return torch.from_numpy(np.ascontiguousarray(quants.quantize(w, qtype)).view(np.uint8).reshape(n, -1))
    except NotImplementedError:
        block, size = GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, (n, k // block * size), dtype=np.uint8)
        blocks = raw.reshape(-1, size)
        offsets = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
        for off in offsets[qtype.name]:
            scales = rng.uniform(1e-3, 2e-2, blocks.shape[0]).astype(np.float16)
            blocks[:, off:off + 2] = scales.view(np.uint8).reshape(-1, 2)
        return torch.from_numpy(raw)


def by_type(repeats: int, copies: int = 8) -> None:
    """Every supported type at the down-projection shape 576x1536, through the module."""
    n, k = 576, 1536
    rng = np.random.default_rng(0)
    print(f"\nby weight type, {n}x{k} (random weights, {copies} copies cycled), per call ms (min median max)")
    print(f"{'type':6s} {'path':8s} {'MiB':>6s} {'M':>5s} {'min':>9s} {'median':>9s} {'max':>9s}")
    for name in ALL_TYPES:
        qtype = GGMLQuantizationType[name]
        mods = [QuantizedLinear(qtype, synthetic_bytes(qtype, n, k, rng), k, n) for _ in range(copies)]
        for m in (1, 128, 1024):
            t = per_call(mods if m < 1024 else mods[:2], lambda x, mod: mod(x), m, k, max(3, repeats // 2))
            print(f"{name:6s} {mods[0].path:8s} {mods[0].nbytes / 2**20:6.2f} {m:5d} {fmt(t)}")


def gemma_by_type(repeats: int) -> None:
    """One M=1 pass over Gemma-3-270M's projections, summed by weight type."""
    try:
        path = known_model_path("gemma3-270m")
    except ModelNotFoundError as e:
        print(f"\ngemma skipped: {e}")
        return
    reader, raw = raw_tensors(path)
    mods = [QuantizedLinear(q, d, k, n) for name, (q, d, n, k) in raw.items() if name.startswith("blk.")]
    del reader, raw
    packed = sum(m.nbytes for m in mods) / 2**20
    print(f"\nGemma-3-270M projections at M=1, packed {packed:.1f} MiB; ms per token (min median max)")
    total = 0.0
    for qtype in sorted({m.qtype for m in mods}, key=lambda t: t.name):
        group = [m for m in mods if m.qtype == qtype]
        xs = {k: torch.randn(1, k) for k in {m.in_features for m in group}}
        t = timed(lambda g=group: [m(xs[m.in_features]) for m in g], repeats)
        total += t[1]
        print(f"  {qtype.name:5s} x{len(group):3d} path {group[0].path:7s} {fmt(t)}")
    print(f"  total {total:.2f} ms (medians; without the 262144-row head)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--sweep", action="store_true", help="kernel vs dequantize crossover in M")
    ap.add_argument("--types", action="store_true", help="every supported weight type at 576x1536")
    ap.add_argument("--gemma", action="store_true", help="Gemma-3-270M's projections by weight type")
    ap.add_argument("--dense", action="store_true", help="decode step with dense bf16/fp32 weights")
    ap.add_argument("--no-shapes", action="store_true", help="skip the per-shape table")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rep = args.repeats
    path = known_model_path("default")
    print(f"model {path.name}  torch {torch.__version__}  threads {torch.get_num_threads()}  "
          f"crossovers int4 M~{INT4_CROSSOVER_M} int8 M~{INT8_CROSSOVER_M}  "
          f"load average {os.getloadavg()[0]:.2f}")

    reader, raw = raw_tensors(path)
    gc.collect()
    before = rss_mib()
    layers, head = build_layers(raw)
    loaded = rss_mib()
    del raw, reader
    gc.collect()
    closed = rss_mib()
    packed = sum(m.nbytes for ms in layers.values() for m in ms) + head.nbytes
    print(f"\npacked weights held: {packed / 2**20:.1f} MiB ({layers['attn_q'][0].qtype.name} projections "
          f"-> {layers['attn_q'][0].path}, {head.qtype.name} tied head -> {head.path})")
    print(f"RSS added while building: anon {loaded['RssAnon'] - before['RssAnon']:.1f} MiB, file-backed "
          f"{loaded['RssFile'] - before['RssFile']:.1f} MiB (GGUF pages read through the mmap); "
          f"file-backed once the mmap is closed: {closed['RssFile'] - before['RssFile']:.1f} MiB")

    if not args.no_shapes:
        shapes_and_paths(layers, head, rep)
    if args.sweep:
        sweep(layers, head, rep)

    print("\nwhole model through the modules (one kernel for every M), ms (min median max)")
    t = timed(model_pass(layers, head, 1), max(rep, 25))
    t_head = timed(lambda x=torch.randn(1, 576): head(x), max(rep, 25))
    print(f"  decode M=1: 210 projections + head {fmt(t)}   head alone {fmt(t_head)}")
    print(f"      -> linear layers alone allow {1000 / t[1]:.0f} tok/s (median), {1000 / t[0]:.0f} (min)")
    for m in (128, 1024):
        t = timed(model_pass(layers, head, m), 3, warmup=1)
        print(f"  prefill M={m}: 210 projections + head on the last row {fmt(t)} "
              f"-> {m * 1000 / t[1]:.0f} tok/s (median)")

    print(f"  with dense_min_m={INT4_CROSSOVER_M} (prefill rows then depend on the batch):")
    reader, raw = raw_tensors(path)
    fast_layers, _ = build_layers(raw, dense_min_m=INT4_CROSSOVER_M)
    del raw, reader
    for m in (128, 1024):
        t = timed(model_pass(fast_layers, head, m), 3, warmup=1)
        print(f"  prefill M={m}: {fmt(t)} -> {m * 1000 / t[1]:.0f} tok/s (median)")
    del fast_layers
    gc.collect()

    if args.types:
        by_type(rep)
    if args.gemma:
        gemma_by_type(rep)

    if args.dense:
        del layers, head
        gc.collect()
        for mode in ("bf16", "fp32"):
            reader, raw = raw_tensors(path)
            dense_layers, dense_head = build_layers(raw, mode)
            del raw, reader
            t = timed(model_pass(dense_layers, dense_head, 1), max(rep, 25))
            t_head = timed(lambda x=torch.randn(1, 576): dense_head(x), rep)
            print(f"  dense {mode}: decode M=1 {fmt(t)}   head alone {fmt(t_head)}")
            del dense_layers, dense_head
            gc.collect()
    print(f"\nload average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
