"""Matrix-vector product over dense bf16/fp16 weights for decode (Triton).

``y[m] = x[m] @ w.T`` with one program per (row of x, tile of ``BLOCK_N`` output rows,
K split): the weight tile streams through in ``BLOCK_K`` chunks, products accumulate in
fp32 per (output row, lane) and are summed once at the end; K splits write fp32 partials
summed in split order by a second kernel. Every row of x is computed the same way
whatever the number of rows, so results do not depend on the batch.

``CudaDenseLinear`` runs it for single-row bf16 x (``MAX_ROWS``: one-stream decode),
cuBLAS above:
on the H200 it took 1.97-2.37 us against cuBLAS's 3.26-4.55 us on SmolLM2's matrices and
matched cuBLAS on the 8B MLP's (``lodestar.bench.gpu dense``). ``LODESTAR_DENSE_GEMV=0``
turns it off.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:      # the CPU build runs without Triton
    triton = None


@dataclass(frozen=True)
class DenseGemvConfig:
    block_n: int = 8
    block_k: int = 512
    split: int = 1
    warps: int = 4


# Rows of x up to which the layers use this kernel. Each row streams the weights again, so
# at 2-4 rows an 8B model decoded slower than with cuBLAS (batch 4: 429 vs 730 tok/s).
MAX_ROWS = 1


def enabled() -> bool:
    """``LODESTAR_DENSE_GEMV`` unset or 1: on; 0: off (read at each call)."""
    env = os.environ.get("LODESTAR_DENSE_GEMV", "1").strip()
    if env not in ("", "0", "1"):
        raise ValueError(f"LODESTAR_DENSE_GEMV={env!r}: expected 0 or 1")
    return env != "0"


def config_for(n: int, k: int) -> DenseGemvConfig:
    """The tiling for an ``[n, k]`` weight (from the H200 sweep: narrow row tiles; long
    rows split in four)."""
    return DenseGemvConfig(4, 512 if k % 512 == 0 else 256, 4 if k >= 8192 else 1, 4)


def dense_gemv_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """fp32 reference of ``x @ w.T``."""
    return x.float() @ w.float().T


def dense_gemv(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None = None,
               config: DenseGemvConfig | None = None) -> torch.Tensor:
    """``x [M, K] @ w[N, K].T`` -> ``[M, N]`` in ``out_dtype`` (default x's dtype)."""
    cfg = config or DenseGemvConfig()
    m, k = x.shape
    n = w.shape[0]
    if w.shape[1] != k:
        raise ValueError(f"x has {k} columns, w has {w.shape[1]}")
    k_split = triton.cdiv(triton.cdiv(k, cfg.split), cfg.block_k) * cfg.block_k   # columns per split
    x = x.contiguous()
    w = w.contiguous()
    out_dtype = out_dtype or x.dtype
    grid = (m, triton.cdiv(n, cfg.block_n), cfg.split)
    if cfg.split == 1:
        out = torch.empty((m, n), dtype=out_dtype, device=x.device)
        _dense_gemv_kernel[grid](x, w, out, n, k, k_split, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                                 num_warps=cfg.warps)
        return out
    part = torch.empty((cfg.split, m, n), dtype=torch.float32, device=x.device)
    _dense_gemv_kernel[grid](x, w, part, n, k, k_split, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                             num_warps=cfg.warps)
    out = torch.empty((m, n), dtype=out_dtype, device=x.device)
    total = m * n
    _dense_split_sum_kernel[(triton.cdiv(total, 1024),)](part, out, total, SPLIT=cfg.split, BLOCK=1024)
    return out


if triton is not None:
    @triton.jit
    def _dense_gemv_kernel(x_ptr, w_ptr, out_ptr, N, K: tl.constexpr, K_SPLIT: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        row = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_k = tl.program_id(2)
        rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = rows < N
        lanes = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        k0 = pid_k * K_SPLIT
        for kk in range(0, K_SPLIT, BLOCK_K):
            cols = k0 + kk + lanes
            if K % K_SPLIT == 0 and K_SPLIT % BLOCK_K == 0:
                xv = tl.load(x_ptr + row * K + cols).to(tl.float32)
                wv = tl.load(w_ptr + rows[:, None].to(tl.int64) * K + cols[None, :], mask=mask_n[:, None], other=0.0)
            else:
                mask_k = cols < K
                xv = tl.load(x_ptr + row * K + cols, mask=mask_k, other=0.0).to(tl.float32)
                wv = tl.load(w_ptr + rows[:, None].to(tl.int64) * K + cols[None, :],
                             mask=mask_n[:, None] & mask_k[None, :], other=0.0)
            acc += wv.to(tl.float32) * xv[None, :]
        y = tl.sum(acc, axis=1)
        # split partials: [SPLIT, M, N] fp32; one split: [M, N] in the output dtype
        M = tl.num_programs(0)
        dst = out_ptr + (pid_k * M + row).to(tl.int64) * N + rows
        tl.store(dst, y.to(out_ptr.dtype.element_ty), mask=mask_n)

    @triton.jit
    def _dense_split_sum_kernel(part_ptr, out_ptr, total, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < total
        acc = tl.load(part_ptr + offs, mask=mask, other=0.0)
        for s in tl.static_range(1, SPLIT):
            acc += tl.load(part_ptr + s * total + offs, mask=mask, other=0.0)
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
