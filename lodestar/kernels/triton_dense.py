"""Matrix-vector product over dense bf16/fp16 weights for decode (Triton).

``y[m] = x[m] @ w.T`` with one program per (row of x, tile of ``BLOCK_N`` output rows,
K split): the weight tile streams through in ``BLOCK_K`` chunks, products accumulate in
fp32 per (output row, lane) and are summed once at the end; K splits write fp32 partials
summed in split order by a second kernel. Every row of x is computed the same way
whatever the number of rows, so results do not depend on the batch.

``CudaDenseLinear`` runs it for single-row bf16 x (``MAX_ROWS``: one-stream decode), cuBLAS
above: on small matrices it takes about half of cuBLAS's time, on the 8B MLP's it matches it
(``lodestar.bench.gpu dense``). Policy ``dense_gemv`` off runs cuBLAS instead.

Producer fusion (``dense_norm``): ``PendingNorm`` [``dense_gemv(rms_norm(x, residual=r), w)``]
    RMSNorm (Llama form, ``w * y.to(dtype)``) of ``x + residual`` computed in the kernel's
    prologue, for small weights (``FUSE_MAX_WEIGHT``). Every program recomputes the row's
    sum of squares (the row is small and read from L2) with ``_rms_rstd``, the helper
    ``triton_fused._rms_norm_kernel`` uses too, whose sum is exact (int64) so the scale is the
    same bits in both kernels whatever their layouts; tiles are normalized and rounded to bf16
    as the norm kernel does. The programs of the first row tile write the residual stream
    ``h = x + residual``.

Epilogue fusion (``glu_epilogue``): the consumer's work done by
the kernel itself, saving the activation kernel's launch after a gate|up projection.

``dense_gemv_glu`` [``silu_mul(*dense_gemv(x, w).split(F, -1))``]
    For a [gate; up] weight ``[2F, K]`` (a fused gate|up projection, one K split) the
    kernel writes ``act(gate) * up`` ``[M, F]`` instead of gate|up. Same tiles, other rows:
    program ``pid_n`` loads ``BLOCK_N / 2`` gate rows and the matching up rows interleaved
    (tile row 2i: gate row r0 + i, 2i + 1: up row F + r0 + i, r0 = pid_n * BLOCK_N / 2), so
    every output row's dot product runs the plain kernel's code and register layout; the
    row sums are paired (``tl.split``), each rounded to bf16 as the plain store rounds it,
    and go through ``_glu_act`` as in ``triton_fused._glu_kernel``: the same bits as the
    projection then ``silu_mul`` / ``gelu_tanh_mul``. Combines with ``PendingNorm``. The
    weight layout is unchanged (prefill's cuBLAS matmul reads the same matrix). The
    Llama and Gemma 3 MLPs use it in one-row decode whenever the projection's tiling fits
    (``glu_epilogue_fits``; ``CudaDenseLinear.forward_glu``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from lodestar.kernels.gemv_tiling import table_entry
from lodestar.kernels.launch import pdl, triton_enabled
from lodestar.kernels.policy import active
from lodestar.kernels.triton_fused import rms_norm

triton = None
if triton_enabled():
    import triton
    import triton.language as tl

    from lodestar.kernels.launch import _pdl_enter
    from lodestar.kernels.triton_common import _glu_act, _residual_chunk, _rms_apply, _rms_rstd


@dataclass(frozen=True)
class DenseGemvConfig:
    block_n: int = 8
    block_k: int = 512
    split: int = 1
    warps: int = 4


# Rows of x up to which the layers use this kernel. Each row streams the weights again, so
# at 2-4 rows an 8B model decoded slower than with cuBLAS (batch 4: 429 vs 730 tok/s).
MAX_ROWS = 1
# Weight elements up to which the layers hand a projection the RMSNorm feeding it (launch
# latency dominates there; on larger weights every program recomputing the row's scale costs
# more than the launch it saves).
FUSE_MAX_WEIGHT = 1 << 22
# Gated activations (the ``ACT`` of ``triton_fused._glu_kernel``).
SILU, GELU_TANH = 0, 1


def enabled() -> bool:
    """One-row bf16 products run this kernel (policy ``dense_gemv``)."""
    return active().dense_gemv


def default_config(n: int, k: int) -> DenseGemvConfig:
    """The tiling rule (from the first H200 sweep: narrow row tiles; long rows split in four)."""
    return DenseGemvConfig(4, 512 if k % 512 == 0 else 256, 4 if k >= 8192 else 1, 4)


def parse_config(text: str) -> DenseGemvConfig:
    """``"block_n,block_k,split,warps"`` (powers of two; block_k >= 16)."""
    try:
        bn, bk, split, warps = (int(v) for v in text.split(","))
    except ValueError:
        raise ValueError(f"dense matrix-vector config {text!r}: expected block_n,block_k,split,warps") from None
    for name, v in (("block_n", bn), ("block_k", bk), ("split", split), ("warps", warps)):
        if v < 1 or v & (v - 1):
            raise ValueError(f"dense matrix-vector config {text!r}: {name} must be a power of two")
    if bk < 16:
        raise ValueError(f"dense matrix-vector config {text!r}: block_k must be at least 16")
    return DenseGemvConfig(bn, bk, split, warps)


def config_text(cfg: DenseGemvConfig) -> str:
    return f"{cfg.block_n},{cfg.block_k},{cfg.split},{cfg.warps}"


def config_for(n: int, k: int, device: torch.device | None = None) -> DenseGemvConfig:
    """The tiling for an ``[n, k]`` weight: the tiling table's ``BF16:n,k`` entry
    (``gemv_tiling.table_entry``; ``python -m lodestar.bench.gemv_variants --dense`` measures
    them), else the rule (``default_config``). Read when a layer is built."""
    text = table_entry(f"BF16:{n},{k}", device)
    return parse_config(text) if text else default_config(n, k)


@dataclass
class PendingNorm:
    """``rms_norm(x, weight, eps, residual=residual)`` (Llama form) left for the dense
    matrix-vector kernel that reads it to compute in its prologue; ``h`` (``x + residual``,
    or ``x`` itself without one) is written by that kernel."""

    x: torch.Tensor                  # [M, K]
    residual: torch.Tensor | None    # [M, K] or None
    weight: torch.Tensor             # fp32 [K]
    eps: float
    h: torch.Tensor                  # [M, K]

    @classmethod
    def of(cls, x: torch.Tensor, weight: torch.Tensor, eps: float,
           residual: torch.Tensor | None = None) -> "PendingNorm":
        x = x.contiguous()
        if residual is None:
            return cls(x, None, weight, eps, x)
        return cls(x, residual.contiguous(), weight, eps, torch.empty_like(x))

    @property
    def shape(self) -> torch.Size:
        return self.x.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.x.dtype

    def materialize(self) -> torch.Tensor:
        """The norm as a tensor (for a consumer that cannot fuse it); fills ``h``."""
        if self.residual is None:
            return rms_norm(self.x, self.weight, self.eps)
        y, h = rms_norm(self.x, self.weight, self.eps, residual=self.residual)
        self.h.copy_(h)
        return y


def dense_gemv_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """fp32 reference of ``x @ w.T``."""
    return x.float() @ w.float().T


def dense_gemv(x: torch.Tensor | PendingNorm, w: torch.Tensor, out_dtype: torch.dtype | None = None,
               config: DenseGemvConfig | None = None) -> torch.Tensor:
    """``x [M, K] @ w[N, K].T`` -> ``[M, N]`` in ``out_dtype`` (default x's dtype). ``x`` may
    be a ``PendingNorm`` (bf16): the kernel computes it tile by tile."""
    cfg = config or DenseGemvConfig()
    args = _x_args(x)
    m, k = args["shape"]
    n = w.shape[0]
    if w.shape[1] != k:
        raise ValueError(f"x has {k} columns, w has {w.shape[1]}")
    k_split = triton.cdiv(triton.cdiv(k, cfg.split), cfg.block_k) * cfg.block_k   # columns per split
    split = triton.cdiv(k, k_split)       # rounding k_split up can leave a configured split empty
    w = w.contiguous()
    out_dtype = out_dtype or args["dtype"]
    grid = (m, triton.cdiv(n, cfg.block_n), split)
    out = torch.empty((m, n), dtype=out_dtype, device=w.device)
    dst = out if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=w.device)
    _dense_gemv_kernel[grid](args["x"], args["x2"], args["nw"], args["h"], args["sx"], args["eps"], w, dst, n, k,
                             k_split, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, X_MODE=args["mode"],
                             HAS_RES=args["has_res"], K_POW2=1 << (k - 1).bit_length(),
                             GLU_OUT=-1, num_warps=cfg.warps, **pdl())
    if split > 1:
        total = m * n
        _dense_split_sum_kernel[(triton.cdiv(total, 1024),)](dst, out, total, SPLIT=split, BLOCK=1024, **pdl())
    return out


def glu_epilogue_fits(config: DenseGemvConfig, n: int, k: int) -> bool:
    """Whether ``dense_gemv_glu`` can run an ``[n, k]`` [gate; up] weight with ``config``:
    one K split (the activation needs whole sums), at least one (gate, up) pair per row
    tile, and 16-byte weight rows (``k % 8``: the loads then vectorize as in the plain
    kernel whatever the order of the rows, so the register layout, hence every row's order
    of additions, is the plain kernel's)."""
    return config.split == 1 and config.block_n >= 2 and n % 2 == 0 and k % 8 == 0


def dense_gemv_glu(x: torch.Tensor | PendingNorm, w: torch.Tensor, act: int = SILU,
                   config: DenseGemvConfig | None = None) -> torch.Tensor:
    """``act(gate) * up`` -> ``[M, F]`` in x's dtype, where ``gate | up = x @ w.T`` and ``w
    [2F, K]`` holds the gate rows then the up rows (a fused gate|up projection): one kernel,
    the same bits as ``dense_gemv(x, w, config=config)`` split in halves then
    ``triton_fused.silu_mul`` / ``gelu_tanh_mul`` (``act``: ``SILU`` / ``GELU_TANH``). ``x``
    may be a ``PendingNorm``. ``config`` must pass ``glu_epilogue_fits``."""
    cfg = config or DenseGemvConfig()
    if act not in (SILU, GELU_TANH):
        raise ValueError(f"act {act!r}: expected SILU ({SILU}) or GELU_TANH ({GELU_TANH})")
    args = _x_args(x)
    m, k = args["shape"]
    n2 = w.shape[0]
    if w.shape[1] != k:
        raise ValueError(f"x has {k} columns, w has {w.shape[1]}")
    if not glu_epilogue_fits(cfg, n2, k):
        raise ValueError(f"dense_gemv_glu: config {config_text(cfg)} does not fit a [{n2}, {k}] gate|up weight "
                         f"(needs split 1, block_n >= 2, an even row count and k % 8 == 0)")
    f = n2 // 2
    w = w.contiguous()
    k_split = triton.cdiv(k, cfg.block_k) * cfg.block_k
    out = torch.empty((m, f), dtype=args["dtype"], device=w.device)
    grid = (m, triton.cdiv(f, cfg.block_n // 2), 1)
    _dense_gemv_kernel[grid](args["x"], args["x2"], args["nw"], args["h"], args["sx"], args["eps"], w, out, f, k,
                             k_split, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, X_MODE=args["mode"],
                             HAS_RES=args["has_res"], K_POW2=1 << (k - 1).bit_length(),
                             GLU_OUT=act, num_warps=cfg.warps, **pdl())
    return out


# X_MODE of _dense_gemv_kernel: where its x tiles come from
_X_PLAIN, _X_NORM = 0, 1


def _x_args(x: torch.Tensor | PendingNorm) -> dict:
    """The kernel's x arguments (unused pointers point at x, never read)."""
    if isinstance(x, PendingNorm):
        _need_bf16(x.x)
        has_res = x.residual is not None
        return dict(shape=x.x.shape, dtype=x.x.dtype, x=x.x, x2=x.residual if has_res else x.x, nw=x.weight,
                    h=x.h, sx=x.x.shape[1], eps=x.eps, mode=_X_NORM, has_res=has_res)
    x = x.contiguous()
    return dict(shape=x.shape, dtype=x.dtype, x=x, x2=x, nw=x, h=x, sx=x.shape[1], eps=0.0, mode=_X_PLAIN,
                has_res=False)


def _need_bf16(x: torch.Tensor) -> None:
    if x.dim() != 2 or x.dtype != torch.bfloat16:
        raise ValueError(f"a fused x prologue needs bf16 [rows, features]; got {x.dtype} {tuple(x.shape)}")


if triton_enabled():
    @triton.jit
    def _fused_x_tile(x_ptr, x2_ptr, nw_ptr, h_ptr, cols, mask_k, rstd, is_writer, HAS_RES: tl.constexpr):
        """fp32 x at ``cols``: the RMSNorm of ``x + x2`` rounded to bf16 first exactly as the norm
        kernel stores it (the writer programs also store ``h = x + x2``)."""
        x = _residual_chunk(x_ptr, x2_ptr, cols, mask_k, HAS_RES)
        if HAS_RES:
            tl.store(h_ptr + cols, x, mask=tl.where(is_writer, mask_k, False))
        w = tl.load(nw_ptr + cols, mask=mask_k, other=0.0).to(tl.float32)
        return _rms_apply(x, rstd, w, False).to(tl.float32)

    @triton.jit
    def _dense_w_tile(w_ptr, rows, mask_n, cols, K: tl.constexpr, EVEN: tl.constexpr):
        """Weight tile [BLOCK_N, BLOCK_K] at ``rows`` x ``cols`` (0 outside the matrix)."""
        ptrs = w_ptr + rows[:, None].to(tl.int64) * K + cols[None, :]
        if EVEN:
            return tl.load(ptrs, mask=mask_n[:, None], other=0.0)
        return tl.load(ptrs, mask=mask_n[:, None] & (cols < K)[None, :], other=0.0)

    @triton.jit
    def _dense_x_tile(x_row, x2_row, nw_ptr, h_row, cols, rstd, is_writer, K: tl.constexpr, EVEN: tl.constexpr,
                      X_MODE: tl.constexpr, HAS_RES: tl.constexpr):
        """fp32 x at ``cols`` (0 past K): given, or computed (``_fused_x_tile``)."""
        if X_MODE == 0:
            if EVEN:
                return tl.load(x_row + cols).to(tl.float32)
            return tl.load(x_row + cols, mask=cols < K, other=0.0).to(tl.float32)
        return _fused_x_tile(x_row, x2_row, nw_ptr, h_row, cols, cols < K, rstd, is_writer, HAS_RES)

    @triton.jit
    def _dense_gemv_kernel(x_ptr, x2_ptr, nw_ptr, h_ptr, sx, eps, w_ptr, out_ptr, N, K: tl.constexpr,
                           K_SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           X_MODE: tl.constexpr, HAS_RES: tl.constexpr, K_POW2: tl.constexpr,
                           GLU_OUT: tl.constexpr, PDL: tl.constexpr):
        """X_MODE 0: x given (row stride ``sx``); 1: x = rms_norm(x + x2) with weight nw (h = x +
        x2 written by the programs of row tile 0). GLU_OUT -1: out = x @ w.T
        ([M, N], or [SPLIT, M, N] fp32 partials); 0 / 1 (one split; w is [gate; up], 2N rows):
        out [M, N] = act(gate) * up with act silu / gelu_tanh (``dense_gemv_glu``). The first
        weight tile is loaded before ``_pdl_enter``: weights are never written, so under
        programmatic dependent launch that read overlaps the previous kernel's tail."""
        row = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_k = tl.program_id(2)
        if GLU_OUT >= 0:
            # the same [BLOCK_N, BLOCK_K] tiles, other rows: tile row 2i is gate row r0 + i and
            # tile row 2i + 1 up row N + r0 + i (r0 = pid_n * BLOCK_N / 2)
            t = tl.arange(0, BLOCK_N)
            units = pid_n * (BLOCK_N // 2) + t // 2
            mask_n = units < N
            rows = units + (t % 2) * N
        else:
            rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            mask_n = rows < N
        lanes = tl.arange(0, BLOCK_K)
        k0 = pid_k * K_SPLIT
        EVEN: tl.constexpr = K % K_SPLIT == 0 and K_SPLIT % BLOCK_K == 0
        w0 = _dense_w_tile(w_ptr, rows, mask_n, k0 + lanes, K, EVEN)
        _pdl_enter(PDL)
        x_row = x_ptr + row.to(tl.int64) * sx
        x2_row = x2_ptr + row.to(tl.int64) * sx
        h_row = h_ptr + row.to(tl.int64) * K
        rstd = 0.0
        if X_MODE == 1:   # the whole row (L2-resident) for the scale, as the norm kernel reads it
            row_cols = tl.arange(0, K_POW2)
            xr = _residual_chunk(x_row, x2_row, row_cols, row_cols < K, HAS_RES)
            rstd = _rms_rstd(xr.to(tl.float32), eps, K)
        xv = _dense_x_tile(x_row, x2_row, nw_ptr, h_row, k0 + lanes, rstd, pid_n == 0, K, EVEN, X_MODE, HAS_RES)
        acc = w0.to(tl.float32) * xv[None, :]
        for kk in range(BLOCK_K, K_SPLIT, BLOCK_K):
            cols = k0 + kk + lanes
            xv = _dense_x_tile(x_row, x2_row, nw_ptr, h_row, cols, rstd, pid_n == 0, K, EVEN, X_MODE, HAS_RES)
            wv = _dense_w_tile(w_ptr, rows, mask_n, cols, K, EVEN)
            acc += wv.to(tl.float32) * xv[None, :]
        y = tl.sum(acc, axis=1)
        if GLU_OUT >= 0:
            # (gate, up) pairs of the tile, each rounded as the plain kernel stores it, then
            # the activation as triton_fused._glu_kernel computes it from those stored values
            g, u = tl.split(tl.reshape(y, (BLOCK_N // 2, 2)))
            dt = out_ptr.dtype.element_ty
            z = _glu_act(g.to(dt).to(tl.float32), u.to(dt).to(tl.float32), GLU_OUT).to(dt)
            units = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
            tl.store(out_ptr + row.to(tl.int64) * N + units, z, mask=units < N)
        else:
            # split partials: [SPLIT, M, N] fp32; one split: [M, N] in the output dtype
            M = tl.num_programs(0)
            dst = out_ptr + (pid_k * M + row).to(tl.int64) * N + rows
            tl.store(dst, y.to(out_ptr.dtype.element_ty), mask=mask_n)

    @triton.jit
    def _dense_split_sum_kernel(part_ptr, out_ptr, total, SPLIT: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        _pdl_enter(PDL)
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < total
        acc = tl.load(part_ptr + offs, mask=mask, other=0.0)
        for s in tl.static_range(1, SPLIT):
            acc += tl.load(part_ptr + s * total + offs, mask=mask, other=0.0)
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
