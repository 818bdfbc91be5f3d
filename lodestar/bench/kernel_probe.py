"""Launch one matrix-vector kernel a few times, eagerly, for a kernel profiler to attach to;
and a read-only streaming kernel that measures how fast a kernel can read HBM.

    python -m lodestar.bench.kernel_probe quant Q4_0 gate_up [--launches 8]
    python -m lodestar.bench.kernel_probe dense BF16 gate_up
    python -m lodestar.bench.kernel_probe readbw              # prints JSON

``quant`` runs only ``triton_quant``'s matrix-vector kernel (x is quantized once before),
``dense`` only ``triton_dense``'s; shapes are Llama-3.1-8B's (``gemv_variants.SHAPES``).
Each launch reads a different copy of the weight, so none finds it in L2. Used by
``scripts/device_bench.sh``'s ``ncu`` stage (Nsight Compute, where the machine allows it).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics

import torch

from lodestar.bench.gemv_variants import SEED, SHAPES, copy_bandwidth


def run_quant(qtype_name: str, shape: str, launches: int) -> None:
    from lodestar.bench.gemv_variants import _weights
    from lodestar.kernels import triton_quant as tq
    qtype = tq.T[qtype_name]
    n, k = SHAPES[shape]
    weights = _weights(qtype, n, k, "cuda")
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    words, d1, sums = tq.quantize_x(x)
    xq = tq.QuantizedRows(x, words, d1, sums)
    cfg = tq.gemv_config(n, k, x.device, qtype)
    for pw in weights:
        tq.reserve_tile_counters(pw, cfg)
    print(f"quant {qtype_name} {shape} config {tq.config_text(cfg)}", flush=True)
    for i in range(launches):
        tq.quant_matmul(xq, weights[i % len(weights)], torch.float32, config=cfg)
    torch.cuda.synchronize()


def run_dense(shape: str, launches: int) -> None:
    from lodestar.kernels import triton_dense as td
    n, k = SHAPES[shape]
    copies = max(2, (256 << 20) // (n * k * 2) + 1)
    gen = torch.Generator(device="cuda").manual_seed(SEED)
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02 for _ in range(copies)]
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    cfg = td.config_for(n, k)
    print(f"dense {shape} config {cfg}", flush=True)
    for i in range(launches):
        td.dense_gemv(x, ws[i % len(ws)], config=cfg)
    torch.cuda.synchronize()


def read_bandwidth(iters: int = 20) -> dict:
    """Bytes per second a Triton kernel reads (and sums) from a 2 GiB buffer, per block size
    and warp count; with the device-copy figure from the same process for comparison."""
    import triton
    import triton.language as tl

    @triton.jit
    def _read_kernel(src, dst, n_words, BLOCK: tl.constexpr, ITERS: tl.constexpr):
        pid = tl.program_id(0)
        acc = tl.zeros((BLOCK,), dtype=tl.int32)
        base = pid.to(tl.int64) * BLOCK * ITERS
        for i in range(ITERS):
            offs = base + i * BLOCK + tl.arange(0, BLOCK)
            acc ^= tl.load(src + offs, mask=offs < n_words, other=0)
        tl.store(dst + pid, tl.sum(acc, axis=0))

    n = (2 << 30) // 4
    src = torch.ones(n, dtype=torch.int32, device="cuda")
    out = {"copy": copy_bandwidth("cuda", iters)}
    for block, per, warps in ((1024, 8, 4), (2048, 8, 8), (4096, 4, 8), (1024, 32, 4), (512, 16, 2)):
        progs = triton.cdiv(n, block * per)
        dst = torch.empty(progs, dtype=torch.int32, device="cuda")
        _read_kernel[(progs,)](src, dst, n, BLOCK=block, ITERS=per, num_warps=warps)
        times = []
        for _ in range(iters):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            _read_kernel[(progs,)](src, dst, n, BLOCK=block, ITERS=per, num_warps=warps)
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e) / 1e3)
        t = statistics.median(times)
        out[f"read_b{block}_i{per}_w{warps}"] = {"tb_per_s": round(n * 4 / t / 1e12, 3),
                                                  "min_tb_per_s": round(n * 4 / max(times) / 1e12, 3)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=("quant", "dense", "readbw"))
    ap.add_argument("qtype", nargs="?", default="Q4_0")
    ap.add_argument("shape", nargs="?", default="gate_up", choices=tuple(SHAPES))
    ap.add_argument("--launches", type=int, default=8)
    a = ap.parse_args()
    if a.what == "quant":
        run_quant(a.qtype, a.shape, a.launches)
    elif a.what == "dense":
        run_dense(a.shape, a.launches)
    else:
        print(json.dumps(read_bandwidth(), indent=1))


if __name__ == "__main__":
    main()
