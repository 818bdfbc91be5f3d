"""Packed matrix products on the GPU: launchers of the Triton kernels in ``quant_kernels``.

``quant_matmul`` (M <= ``SMALL_M_MAX``) [``quant_layout.quant_matmul_ref``]
    ``y = x @ W.T`` as matrix-vector products on integer units. ``quantize_x`` first
    splits each 32-element group of x into two int8 terms, ``x ~ d1*q1 + d2*q2``
    (``d2 = d1/254``; the CPU int8 path's scheme, error at most ``amax/64516`` per
    element, far below bf16's rounding of x itself) packed four per int32 word, and the
    exact fp32 sum of each 16-element half. Then one program per (row of x, block of
    ``block_n`` weight rows, K split) streams its rows in tiles of ``tile_groups`` groups
    and multiplies codes and x terms by ``dp4a`` (exact int32). Per group the fp32 result
    is ``scale * (d1*i1 + d2*i2 - bias*sum(x)) + offset*sum(x)``. K splits write fp32
    partials; the last program of an output tile to finish (an atomic counter per tile,
    reset to 0 by that program, so CUDA-graph replays find it zeroed) adds them in split
    order, which is what ``_split_sum_kernel`` (fusion ``split_sum`` off) does. An x that a
    fused kernel already quantized (``QuantizedRows``: RMSNorm, gated activation) skips
    ``quantize_x``; the values are the same bits, since every kernel that quantizes uses
    one function (``triton_common._quant_groups``). The tiling (``gemv_tiling``) depends on
    (type, N, K) only and every row of x goes through the same program whatever M is, so a
    row's result does not depend on which other rows share the batch.
``quant_glu`` (fusion ``glu_quant``)
    A gate|up product that applies the gated activation and quantizes it for down.
``dequantize_packed`` [``quant_layout.dequantize_packed_ref``, bit-identical to ``dequant.dequantize``]
    The whole weight as bf16 (or fp32); more rows than ``SMALL_M_MAX`` (prefill) dequantize
    per call into a temporary and run one cuBLAS matmul (``matmul``).

``import triton`` happens only when CUDA is available or ``TRITON_INTERPRET=1`` (the
interpreter runs the same kernels on CPU tensors, which is how the tests exercise them
without a GPU).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lodestar.kernels import quant_kernels as qk
from lodestar.kernels.gemv_tiling import (WORDS_CAPABLE, GemvConfig, gemv_config, gemv_early, glu_epilogue_ok,
                                          glu_gemv_config, qkv_rope_waits, rope_epilogue_ok, whole_rows)
from lodestar.kernels.launch import PDL_WAIT, interpreted, pdl
from lodestar.kernels.policy import active
from lodestar.kernels.quant_layout import GROUP, SMALL_M_MAX, PackedWeight, QuantizedRows


@dataclass
class SplitPartials:
    """The K-split partial products ``part [splits, M, N]`` (fp32) of a matrix-vector product
    whose sum (``part[0] + part[1] + ...`` in that order, then cast to ``dtype``, as
    ``_split_sum_kernel`` adds them) is left to the kernel that reads the product (fusion
    ``norm_sum``: the next RMSNorm; ``triton_fused.rms_norm``)."""

    part: torch.Tensor
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.part.shape[1:]

    def materialize(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The summed product [M, N] in ``dtype`` (the bits of the unfused sum), into ``out``
        when given."""
        split, m, n = self.part.shape
        if out is None:
            out = torch.empty(m, n, device=self.part.device, dtype=self.dtype)
        total = m * n
        qk._split_sum_kernel[(-(-total // 1024),)](self.part, out, total, SPLIT=split, BLOCK=1024, num_warps=4,
                                                **pdl())
        return out



def quantize_x(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """bf16 ``x [M, K]`` -> int8 terms packed as int32 words ``[M, K/32, 2, 8]``, ``d1 [M, K/32]``
    and the exact fp32 sums of each 16-element half ``[M, K/32, 2]``.

    Per 32-element group: ``x ~ d1*q1 + d2*q2`` with ``d1 = amax/127``, ``q1 = round(x/d1)``
    and the remainder quantized again at ``d2 = d1/254`` (the CPU int8 path's scheme):
    ``|x - d1*q1 - d2*q2| <= amax/64516``. Word ``w`` of term ``t`` holds elements
    ``4w..4w+3`` as bytes, for ``dp4a``.
    """
    M, K = x.shape
    G = K // GROUP
    words, d1, sums = QuantizedRows.empty(M, K, x.device)
    gb = 16
    qk._quant_x_kernel[(M, -(-G // gb))](x, words, d1, sums, x.stride(0), G, GB=gb, num_warps=4, **pdl())
    return words, d1, sums


def reserve_tile_counters(pw: PackedWeight, config: GemvConfig | None = None) -> None:
    """Allocate ``pw``'s tile counters for up to SMALL_M_MAX rows now (before any CUDA-graph
    capture) if its products split K, or if ``glu_quant`` runs it as a gate|up in programs of
    fewer than 32 units (group arrival counters)."""
    cfg = config or gemv_config(pw.n, pw.k, pw.device, pw.qtype)
    if cfg.split_k > 1:
        _tile_counters(pw, SMALL_M_MAX * -(-pw.n // cfg.block_n))
    glu = glu_gemv_config(pw) if config is None and pw.qtype in WORDS_CAPABLE else None
    if glu is not None and glu.block_n < 2 * GROUP:     # a gate|up of glu_quant in small programs
        _tile_counters(pw, SMALL_M_MAX * (pw.n // 2) // GROUP)



def _tile_counters(pw: PackedWeight, tiles: int) -> torch.Tensor:
    c = pw.tile_counters
    if c is None or c.numel() < tiles:
        c = pw.tile_counters = torch.zeros(tiles, device=pw.device, dtype=torch.int32)
    return c


@dataclass
class RopeStore:
    """Step inputs with which a q|k|v projection's kernel rotates q and k and stores k and v
    itself (fusion ``qkv_rope``, ``quant_matmul(rope=...)``): per token ``positions`` and KV
    ``slots`` [M]; fp32 ``cos``/``sin`` tables [positions, head_dim] (``RotaryEmbedding``'s,
    each row ``[c(f), c(f)]``); caches [slots, kv heads, head_dim]; the weight's rows are
    ``n_q`` of q, then ``n_k`` of k, then ``n_k`` of v."""

    positions: torch.Tensor
    slots: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    n_q: int
    n_k: int
    head_dim: int



def _ptr_args(pw: PackedWeight) -> list[torch.Tensor]:
    # Absent arrays are replaced by ``d`` (never read: the kernel's QTYPE branch skips them).
    return [pw.codes, pw.high if pw.high is not None else pw.d, pw.d,
            pw.dmin if pw.dmin is not None else pw.d, pw.sc if pw.sc is not None else pw.d,
            pw.m if pw.m is not None else pw.d]



def quant_matmul(x, pw: PackedWeight, out_dtype: torch.dtype | None = None,
                 config: GemvConfig | None = None, rope: RopeStore | None = None,
                 defer_sum: bool = False, out: torch.Tensor | None = None,
                 row0: int = 0) -> torch.Tensor | SplitPartials:
    """``x [M, K] @ W.T`` for M <= SMALL_M_MAX with the Triton matrix-vector kernel; bf16 in, out_dtype out.

    ``x`` may come quantized already (``QuantizedRows``). ``config`` replaces
    ``gemv_config(N, K)`` (tests and tuning). ``rope`` (fusion ``qkv_rope``, when
    ``rope_epilogue_ok``): the q and k columns of the result come out rotated at each row's
    position and k and v are also stored at each row's slot: the bits of this product, then
    ``triton_fused.rope_`` with the KV store. ``defer_sum`` (fusion ``norm_sum``): a tiling
    with K splits returns its ``SplitPartials`` unsummed (without ``rope``).

    ``out`` [M, N] (a stack of projections of one input, ``cuda_linear.CudaQuantStack``):
    this weight's products are written to its columns ``row0 .. row0 + pw.n`` (the word-tile
    kernel, ``row0`` a multiple of its ``block_n``; with ``rope``, the q|k|v layout's
    ``n_q + 2 * n_k`` columns are ``out``'s), and ``out`` is returned; the same bits as the
    weight's own product."""
    M, K = x.shape
    if K != pw.k:
        raise ValueError(f"x has {K} features, weight expects {pw.k}")
    if isinstance(x, QuantizedRows):
        out_dtype = out_dtype or x.x.dtype
        words, d1, sums = x.words, x.d1, x.sums
    else:
        out_dtype = out_dtype or x.dtype
        words, d1, sums = quantize_x(x.to(torch.bfloat16).contiguous())
    device = words.device
    cfg = config or gemv_config(pw.n, pw.k, device, pw.qtype)
    groups = pw.k // GROUP
    per_split = -(-groups // cfg.split_k)
    n_blocks = -(-pw.n // cfg.block_n)
    grid = (M, n_blocks, cfg.split_k)
    if out is None:
        if row0:
            raise ValueError("quant_matmul(row0=...) writes into a given out")
        out = torch.empty(M, pw.n, device=device, dtype=out_dtype)
    elif (out.dim() != 2 or out.shape[0] != M or not out.is_contiguous() or out.dtype != out_dtype
          or not 0 <= row0 <= out.shape[1] - pw.n or row0 % cfg.block_n or not cfg.words
          or pw.qtype not in WORDS_CAPABLE or defer_sum):
        raise ValueError(f"quant_matmul(out=..., row0={row0}): need a contiguous {out_dtype} [{M}, >= row0 + {pw.n}] "
                         f"and the word-tile kernel with row0 a multiple of block_n {cfg.block_n} (got "
                         f"{out.dtype} {list(out.shape)}, {cfg})")
    n_out = out.shape[1]
    part = out if cfg.split_k == 1 else torch.empty(cfg.split_k, M, n_out, device=device, dtype=torch.float32)
    defer_sum = defer_sum and cfg.split_k > 1 and rope is None
    fused_sum = cfg.split_k > 1 and "split_sum" in active().fusions and not defer_sum
    # sized for SMALL_M_MAX rows at once, so that later calls with more rows reuse it
    counters = _tile_counters(pw, max(M, SMALL_M_MAX) * n_blocks) if fused_sum else d1   # d1: never read
    codes = pw.codes.view(torch.int32)
    if rope is not None:
        if not rope_epilogue_ok(pw, M, rope.head_dim, rope.n_q, rope.n_k, cfg, n_out):
            raise ValueError(f"quant_matmul(rope=...): {pw.qtype.name} [{pw.n}, {pw.k}] with {cfg} cannot rotate "
                             f"heads of {rope.head_dim} (see rope_epilogue_ok)")
        if not fused_sum and cfg.split_k > 1:
            raise ValueError("quant_matmul(rope=...) with K splits needs the fusion split_sum")
        r = rope
        rope_args = (r.positions, r.slots, r.cos, r.sin, r.k_cache, r.v_cache, r.cos.stride(0),
                     r.k_cache.stride(0), r.k_cache.stride(1), r.v_cache.stride(0), r.v_cache.stride(1))
        rope_c = dict(ROPE=True, NQ=r.n_q, NK=r.n_k, HD=r.head_dim)
    else:
        rope_args = (d1,) * 6 + (0,) * 5        # never read
        rope_c = dict(ROPE=False, NQ=0, NK=0, HD=0)
    if cfg.words and pw.qtype in WORDS_CAPABLE:
        even = pw.n % cfg.block_n == 0 and per_split % cfg.tile_groups == 0 and per_split * cfg.split_k == groups
        launch = pdl()
        if rope is not None and launch["PDL"] is True and qkv_rope_waits(pw.k):
            launch = PDL_WAIT
        qk._gemv_words_kernel[grid](words, d1, sums, part, out, counters, codes, *_ptr_args(pw)[1:], row0 + pw.n,
                                    n_out, M * n_out, *rope_args, K=pw.k, QTYPE=int(pw.qtype), BLOCK_N=cfg.block_n,
                                    TG=cfg.tile_groups, GROUPS_PER_SPLIT=per_split, SPLIT=cfg.split_k,
                                    LAST_SUMS=fused_sum, ASM=not interpreted(), UNROLL=cfg.unroll, EVEN=even,
                                    EARLY=gemv_early(pw.n, pw.k, whole_rows(cfg, pw.k)), **rope_c,
                                    KPAIR=pw.scale_form, PREFETCH=cfg.prefetch, PID0=row0 // cfg.block_n,
                                    num_warps=cfg.num_warps, maxnreg=cfg.maxnreg or None, **launch)
    else:
        qk._gemv_kernel[grid](words, d1, sums, part, out, counters, codes, *_ptr_args(pw)[1:], pw.n, pw.n, M * pw.n,
                              K=pw.k, QTYPE=int(pw.qtype), BLOCK_N=cfg.block_n, TG=cfg.tile_groups,
                              GROUPS_PER_SPLIT=per_split, SPLIT=cfg.split_k, LAST_SUMS=fused_sum,
                              ASM=not interpreted(), KPAIR=pw.scale_form, num_warps=cfg.num_warps,
                              maxnreg=cfg.maxnreg or None, **pdl())
    if defer_sum:
        return SplitPartials(part, out_dtype)
    if cfg.split_k > 1 and not fused_sum:
        if n_out == pw.n:
            SplitPartials(part, out_dtype).materialize(out)
        else:   # a part of a stack: its own columns only
            cols = slice(row0, row0 + pw.n)
            out[:, cols] = SplitPartials(part[:, :, cols].contiguous(), out_dtype).materialize()
    return out




def quant_glu(x, pw: PackedWeight, ffn: int, act: int, config: GemvConfig | None = None) -> QuantizedRows:
    """``act(x @ gate.T) * (x @ up.T)`` for a gate|up weight ``pw`` of 2 * ``ffn`` rows (gate
    rows, then up rows), quantized for the next projection, in one kernel (fusion
    ``glu_quant``): the bits of ``quant_matmul`` with the same tiling, then
    ``triton_fused.silu_mul`` / ``gelu_tanh_mul`` with ``quantize=True`` (``act``:
    ``triton_dense.SILU`` / ``GELU_TANH``). ``x``: bf16 [M, K] or ``QuantizedRows``;
    ``config`` replaces ``glu_gemv_config`` (tests)."""
    M, K = x.shape
    if K != pw.k:
        raise ValueError(f"x has {K} features, weight expects {pw.k}")
    cfg = config or glu_gemv_config(pw)
    if not glu_epilogue_ok(pw, M, ffn, cfg):
        raise ValueError(f"quant_glu: {pw.qtype.name} [{pw.n}, {pw.k}] with {cfg} cannot run {M} rows as a "
                         f"gate|up of 2 x {ffn} (see glu_epilogue_ok)")
    if isinstance(x, QuantizedRows):
        words, d1, sums, dtype = x.words, x.d1, x.sums, x.x.dtype
    else:
        dtype = x.dtype
        words, d1, sums = quantize_x(x.to(torch.bfloat16).contiguous())
    groups = pw.k // GROUP
    out = torch.empty(M, ffn, device=words.device, dtype=dtype)
    qw, qd, qs = QuantizedRows.empty(M, ffn, words.device)
    even = groups % cfg.tile_groups == 0
    # arrival counters of the 32-unit groups when a program holds fewer than 32 units
    counters = _tile_counters(pw, max(M, SMALL_M_MAX) * ffn // GROUP) if cfg.block_n < 2 * GROUP else d1
    qk._gemv_words_kernel[(M, pw.n // cfg.block_n, 1)](
        words, d1, sums, out, out, counters, pw.codes.view(torch.int32), *_ptr_args(pw)[1:], pw.n, ffn, 0,
        *(d1,) * 6, *(0,) * 5, K=pw.k, QTYPE=int(pw.qtype), BLOCK_N=cfg.block_n, TG=cfg.tile_groups,
        GROUPS_PER_SPLIT=groups, SPLIT=1, LAST_SUMS=False, ASM=not interpreted(),
        UNROLL=cfg.unroll, EVEN=even, EARLY=gemv_early(pw.n, pw.k, whole_rows(cfg, pw.k)), ROPE=False, NQ=0,
        NK=0, HD=0, qw_ptr=qw, qd_ptr=qd, qs_ptr=qs, F=ffn, GLU=act,
        KPAIR=pw.scale_form, PREFETCH=cfg.prefetch, num_warps=cfg.num_warps, maxnreg=cfg.maxnreg or None, **pdl())
    return QuantizedRows(out, qw, qd, qs)


def dequantize_packed(pw: PackedWeight, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The whole weight [N, K] in ``dtype`` (bf16 rounding of the exact fp32 values)."""
    out = torch.empty(pw.n, pw.k, device=pw.device, dtype=dtype)
    groups = pw.k // GROUP
    per = 8 if groups % 8 == 0 else 4 if groups % 4 == 0 else 2 if groups % 2 == 0 else 1
    block_n = 32
    grid = (-(-pw.n // block_n), groups // per)
    qk._dequant_kernel[grid](out, *_ptr_args(pw), pw.n, K=pw.k, QTYPE=int(pw.qtype),
                             BLOCK_N=block_n, GROUPS=per, KPAIR=pw.scale_form, num_warps=4)
    return out


def matmul(x: torch.Tensor, pw: PackedWeight, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x @ W.T`` for any number of rows: fused kernel for few rows, dequantize + cuBLAS else.
    The result is in ``out_dtype`` (default: x's dtype)."""
    if isinstance(x, QuantizedRows) or x.shape[0] <= SMALL_M_MAX:
        return quant_matmul(x, pw, out_dtype)
    return F.linear(x.to(torch.bfloat16), dequantize_packed(pw, torch.bfloat16)).to(out_dtype or x.dtype)

