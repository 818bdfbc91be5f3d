"""Launch one matrix-vector kernel a few times, eagerly, for a kernel profiler to attach to;
and a read-only streaming kernel that measures how fast a kernel can read HBM.

    python -m lodestar.bench.kernel_probe quant Q4_0 gate_up [--launches 8]
    python -m lodestar.bench.kernel_probe dense BF16 gate_up
    python -m lodestar.bench.kernel_probe readbw              # prints JSON
    python -m lodestar.bench.kernel_probe pattern             # prints JSON

``quant`` runs only ``triton_quant``'s matrix-vector kernel (x is quantized once before),
``dense`` only ``triton_dense``'s; shapes are Llama-3.1-8B's (``gemv_variants.SHAPES``).
Each launch reads a different copy of the weight, so none finds it in L2. Used by
``scripts/device_bench.sh``'s ``ncu`` stage (Nsight Compute, where the machine allows it).
"""
from __future__ import annotations

import argparse
import functools
import json
import statistics

import torch

from lodestar.bench.gemv_variants import SEED, SHAPES, copy_bandwidth


def run_quant(qtype_name: str, shape: str, launches: int) -> None:
    from lodestar.bench.gemv_variants import _weights
    from lodestar.kernels import triton_quant as tq
    from lodestar.kernels.gemv_tiling import T, config_text, gemv_config
    from lodestar.kernels.quant_layout import QuantizedRows
    qtype = T[qtype_name]
    n, k = SHAPES[shape]
    weights = _weights(qtype, n, k, "cuda")
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    words, d1, sums = tq.quantize_x(x)
    xq = QuantizedRows(x, words, d1, sums)
    cfg = gemv_config(n, k, x.device, qtype)
    for pw in weights:
        tq.reserve_tile_counters(pw, cfg)
    print(f"quant {qtype_name} {shape} config {config_text(cfg)}", flush=True)
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


_KERNELS: dict = {}


def _read_kernels():
    """The load-only kernels (built on first use: Triton is imported lazily): ``pattern``, a
    program per block of rows reading its tiles one after another, and ``flat``, a program
    per contiguous share of the words."""
    if _KERNELS:
        return _KERNELS["pattern"], _KERNELS["flat"]
    import triton
    import triton.language as tl

    @triton.jit
    def _pattern_kernel(src, sc, dst, RW: tl.constexpr, BN: tl.constexpr, TW: tl.constexpr, TILES: tl.constexpr,
                        SPLIT: tl.constexpr, CONTIG: tl.constexpr, SCALES: tl.constexpr):
        """Program (row block ``pid // SPLIT``, K split ``pid % SPLIT``): its TILES tiles [BN, TW]
        of rows of RW words (CONTIG: every program's tiles stored one after another), with
        the tile's fp16 scales [BN, TW / 4] from ``sc`` (SCALES); the xor of all into ``dst``."""
        pid = tl.program_id(0)
        rb = pid.to(tl.int64) // SPLIT
        t0 = (pid % SPLIT) * TILES
        r = tl.arange(0, BN)
        c = tl.arange(0, TW)
        acc = tl.zeros((BN, TW), dtype=tl.int32)
        for t in range(TILES):
            if CONTIG:
                offs = ((pid.to(tl.int64) * TILES + t) * BN + r[:, None]) * TW + c[None, :]
            else:
                offs = (rb * BN + r[:, None]) * RW + (t0 + t) * TW + c[None, :]
            acc ^= tl.load(src + offs)
            if SCALES:
                g = tl.arange(0, TW // 4)
                s = tl.load(sc + (rb * BN + r[:, None]) * (RW // 4) + (t0 + t) * (TW // 4) + g[None, :])
                acc ^= tl.reshape(tl.broadcast_to(s.to(tl.int32)[:, :, None], (BN, TW // 4, 4)), (BN, TW))
        tl.store(dst + pid, tl.xor_sum(tl.xor_sum(acc, axis=1), axis=0))

    @triton.jit
    def _flat_kernel(src, dst, n_words, PER: tl.constexpr, BLOCK: tl.constexpr, UNROLL: tl.constexpr):
        """Program p reads words [p * PER, (p + 1) * PER) in pieces of UNROLL * BLOCK
        (UNROLL loads issued before their xor)."""
        pid = tl.program_id(0)
        acc = tl.zeros((BLOCK,), dtype=tl.int32)
        base = pid.to(tl.int64) * PER
        end = tl.minimum(base + PER, n_words)
        for i in range(0, PER, BLOCK * UNROLL):
            for u in tl.static_range(UNROLL):
                offs = base + i + u * BLOCK + tl.arange(0, BLOCK)
                acc ^= tl.load(src + offs, mask=offs < end, other=0)
        tl.store(dst + pid, tl.xor_sum(acc, axis=0))

    _KERNELS.update(pattern=_pattern_kernel, flat=_flat_kernel)
    return _pattern_kernel, _flat_kernel


def read_bandwidth(iters: int = 20) -> dict:
    """Bytes per second a Triton kernel reads (and xors) from a 2 GiB buffer, per block size
    and warp count; with the device-copy figure from the same process for comparison."""
    import triton
    _, flat = _read_kernels()
    n = (2 << 30) // 4
    src = torch.ones(n, dtype=torch.int32, device="cuda")
    out = {"copy": copy_bandwidth("cuda", iters)}
    for block, per, warps in ((1024, 8, 4), (2048, 8, 8), (4096, 4, 8), (1024, 32, 4), (512, 16, 2)):
        progs = triton.cdiv(n, block * per)
        dst = torch.empty(progs, dtype=torch.int32, device="cuda")

        def launch(i, progs=progs, dst=dst, block=block, per=per, warps=warps):
            flat[(progs,)](src, dst, n, PER=block * per, BLOCK=block, UNROLL=1, num_warps=warps)
        launch(0)
        out[f"read_b{block}_i{per}_w{warps}"] = _stream_rate(launch, iters, n * 4)
    return out


# The Q4_0 code arrays the patterns read: name -> (rows, 32-bit words a row) of the 8B
# gate|up (K 4,096: 512 words a row) and down (K 14,336: 1,792 words a row).
ARRAYS = {"gate_up": (28672, 512), "down": (4096, 1792)}
# Access patterns of the word-tile kernel's weight stream (``pattern``): name -> (array, rows a
# tile, words a row of a tile, tiles a program, K splits, warps, contiguous tiles, scales too)
PATTERNS = {
    "gate_up_8x128_t4_w1": ("gate_up", 8, 128, 4, 1, 1, False, False),
    "gate_up_8x128_t4_w1_scales": ("gate_up", 8, 128, 4, 1, 1, False, True),
    "gate_up_8x128_t4_w1_contig": ("gate_up", 8, 128, 4, 1, 1, True, False),
    "gate_up_8x128_t4_w1_contig_scales": ("gate_up", 8, 128, 4, 1, 1, True, True),
    "gate_up_8x512_t1_w1": ("gate_up", 8, 512, 1, 1, 1, False, False),
    "gate_up_8x512_t1_w4": ("gate_up", 8, 512, 1, 1, 4, False, False),
    "gate_up_2x512_t1_w1": ("gate_up", 2, 512, 1, 1, 1, False, False),
    "gate_up_8x128_t4_w4": ("gate_up", 8, 128, 4, 1, 4, False, False),
    "gate_up_32x128_t4_w4": ("gate_up", 32, 128, 4, 1, 4, False, False),
    "gate_up_32x128_t4_w4_contig": ("gate_up", 32, 128, 4, 1, 4, True, False),
    "gate_up_16x256_t2_w4": ("gate_up", 16, 256, 2, 1, 4, False, False),
    "gate_up_16x256_t2_w4_contig": ("gate_up", 16, 256, 2, 1, 4, True, False),
    "gate_up_64x64_t8_w4": ("gate_up", 64, 64, 8, 1, 4, False, False),          # glu_quant's tiling
    # down as shipped on the H200 (32 rows, 2 tiles of 32 groups, 7 K splits, 4 warps): each
    # program reads 32 pieces of 1 KB, 7 KB apart; the same tiles stored contiguously; other
    # tilings, whole rows (no split) among them
    "down_32x128_t2_s7_w4": ("down", 32, 128, 2, 7, 4, False, False),
    "down_32x128_t2_s7_w4_scales": ("down", 32, 128, 2, 7, 4, False, True),
    "down_32x128_t2_s7_w4_contig": ("down", 32, 128, 2, 7, 4, True, False),
    "down_32x128_t2_s7_w4_contig_scales": ("down", 32, 128, 2, 7, 4, True, True),
    "down_16x128_t2_s7_w2": ("down", 16, 128, 2, 7, 2, False, False),
    "down_8x128_t2_s7_w1": ("down", 8, 128, 2, 7, 1, False, False),
    "down_32x128_t1_s14_w4": ("down", 32, 128, 1, 14, 4, False, False),
    "down_8x128_t7_s2_w1": ("down", 8, 128, 7, 2, 1, False, False),
    "down_8x128_t14_s1_w1": ("down", 8, 128, 14, 1, 1, False, False),
    "down_16x128_t14_s1_w2": ("down", 16, 128, 14, 1, 2, False, False),
    "down_32x128_t14_s1_w4": ("down", 32, 128, 14, 1, 4, False, False),
    "down_8x256_t7_s1_w2": ("down", 8, 256, 7, 1, 2, False, False),
}
# The gate|up words as one flat stream: (programs, words a program's load, loads in flight,
# warps); programs 0: one program per 4 * BLOCK * UNROLL words (not persistent), else
# multiples of the SM count (a persistent program's contiguous share each)
FLAT_STREAMS = ((0, 1024, 1, 4), (0, 4096, 1, 8), (0, 2048, 2, 8), ("1", 4096, 4, 8), ("1", 2048, 8, 8),
                ("2", 2048, 4, 8), ("2", 1024, 8, 4), ("4", 1024, 4, 4), ("4", 512, 8, 2), ("8", 512, 4, 2),
                ("16", 256, 4, 1))


def pattern_words(array: str, rows: int, device: str, copy: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Copy ``copy`` of an array's random code words (``rows`` rows of ``ARRAYS[array]``'s
    width) and fp16 scales (one per 4 words), the same for a seed, device and size."""
    rw = ARRAYS[array][1]
    gen = torch.Generator(device=device).manual_seed(SEED + 1000 * copy + rw)
    words = torch.randint(-2**31, 2**31 - 1, (rows * rw,), dtype=torch.int32, device=device, generator=gen)
    return words, torch.randn(rows * rw // 4, device=device, generator=gen).to(torch.float16)


def read_patterns(iters: int = 20, rows: dict[str, int] | None = None, device: str = "cuda",
                  check: bool = False) -> dict:
    """Bytes per second a Triton kernel reads from the 8B Q4_0 code arrays (``ARRAYS``: gate|up
    28,672 rows of 512 words, 58.7 MB; down 4,096 rows of 1,792 words, 29.4 MB; four copies
    of each in turn, so none is in L2) in the tile patterns of the word-tile kernel
    (``PATTERNS``): one program per block of rows and K split, its tiles one after another,
    each tile [rows, words] loaded at once (row stride: the array's width) or, ``contig``, the
    same tiles stored one after another (each tile one contiguous piece); ``scales``: and the
    tile's fp16 scales ([rows, words/4] of a second array); then the gate|up words as flat
    streams (``FLAT_STREAMS``). Only loads and an xor: what the access pattern alone allows,
    without the kernel's arithmetic. ``rows``: rows per array (default ``ARRAYS``'). ``check``:
    launch each once and return the xor of every word each read (per array one value for
    all: each reads every word once), no timing."""
    import triton
    pattern, flat = _read_kernels()
    rows = {a: (rows or {}).get(a, ARRAYS[a][0]) for a in ARRAYS}
    copies = 4
    data = {a: [pattern_words(a, rows[a], device, i) for i in range(copies)] for a in ARRAYS}
    out = {} if check else {"copy": copy_bandwidth(device, iters)}

    def measure(name: str, array: str, grid: int, run, nbytes: int, checked: bool = True) -> None:
        dst = torch.empty(grid, dtype=torch.int32, device=device)

        def launch(i):
            run(*data[array][i % copies], dst)
        launch(0)
        if not check:
            out[name] = _stream_rate(launch, iters, nbytes)
        elif checked:
            out[name] = int(functools.reduce(lambda a, b: a ^ b, dst.tolist()))

    for name, (array, bn, tw, tiles, split, warps, contig, scales) in PATTERNS.items():
        n_rows, rw = rows[array], ARRAYS[array][1]
        assert n_rows % bn == 0 and tiles * tw * split == rw, name
        grid = n_rows // bn * split
        measure(name, array, grid, lambda src, sc, dst, grid=grid, rw=rw, bn=bn, tw=tw, tiles=tiles, split=split,
                warps=warps, contig=contig, scales=scales:
                pattern[(grid,)](src, sc, dst, RW=rw, BN=bn, TW=tw, TILES=tiles, SPLIT=split, CONTIG=contig,
                                 SCALES=scales, num_warps=warps),
                n_rows * rw * 4 + (n_rows * rw // 4 * 2 if scales else 0), checked=not scales)
    sms = torch.cuda.get_device_properties(device).multi_processor_count if torch.device(device).type == "cuda" else 4
    n = rows["gate_up"] * ARRAYS["gate_up"][1]
    for per_sm, block, unroll, warps in FLAT_STREAMS:
        grid = int(per_sm) * sms if per_sm else triton.cdiv(n, block * unroll * 4)
        per = triton.cdiv(triton.cdiv(n, grid), block * unroll) * block * unroll
        name = f"flat_p{grid}_b{block}_u{unroll}_w{warps}" + ("_persistent" if per_sm else "")
        measure(name, "gate_up", grid, lambda src, sc, dst, grid=grid, per=per, block=block, unroll=unroll,
                warps=warps: flat[(grid,)](src, dst, n, PER=per, BLOCK=block, UNROLL=unroll, num_warps=warps), n * 4)
    return out


def _stream_rate(launch, iters: int, nbytes: int) -> dict:
    """Median time of ``launch(i)`` (8 launches a timing, so launch gaps are amortized; each
    launch may read another copy) and the rate of ``nbytes`` read per launch."""
    times = []
    for i in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for j in range(8):
            launch(i + 1 + j)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3 / 8)
    t = statistics.median(times)
    return {"us": round(t * 1e6, 2), "tb_per_s": round(nbytes / t / 1e12, 3),
            "min_tb_per_s": round(nbytes / max(times) / 1e12, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=("quant", "dense", "readbw", "pattern"))
    ap.add_argument("qtype", nargs="?", default="Q4_0")
    ap.add_argument("shape", nargs="?", default="gate_up", choices=tuple(SHAPES))
    ap.add_argument("--launches", type=int, default=8)
    a = ap.parse_args()
    if a.what == "quant":
        run_quant(a.qtype, a.shape, a.launches)
    elif a.what == "dense":
        run_dense(a.shape, a.launches)
    elif a.what == "pattern":
        print(json.dumps(read_patterns(), indent=1))
    else:
        print(json.dumps(read_bandwidth(), indent=1))


if __name__ == "__main__":
    main()
