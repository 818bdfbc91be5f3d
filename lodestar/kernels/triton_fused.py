"""Fused element-wise kernels for the GPU path, each with its torch reference.

``rms_norm`` [``rms_norm_ref``]
    RMSNorm over the last dim of a [A, B, D] view (row strides free, last dim contiguous),
    optionally adding a residual first: ``r = x + residual`` (rounded to the activation
    dtype, as the unfused add would), ``y = norm(r)``; returns ``y`` (and ``r``). Statistics
    in fp32; the sum of squares is exact (``triton_common._rms_rstd``, shared with the dense
    matrix-vector kernel that can fuse this norm, so both give the same bits). A wide row
    of a small batch is spread over several programs (``SLICE_COLS`` each), every one
    recomputing the scale. ``offset=False``: ``w * y.to(dtype)`` (Llama); ``offset=True``:
    ``(y * w).to(dtype)`` (Gemma, whose ``w`` already holds ``1 + w``). With
    ``quantize=True`` (bf16 [M, D] rows) the same kernel also quantizes its bf16 output for
    the matrix-vector kernel and returns ``triton_quant.QuantizedRows``: the same bits as
    ``quantize_x`` of the output, one launch fewer.
``rope_`` [``rope_ref``]
    Rotate-half rotary embedding applied in place to q ``[T, Hq, D]`` and k ``[T, Hk, D]``
    (views into the fused qkv output are fine) from fp32 cos/sin tables indexed by
    position; the first ``rotary_dim`` dims rotate, the rest pass through. fp32 math,
    one rounding.
``silu_mul`` / ``gelu_tanh_mul`` [``*_ref``]
    ``act(gate) * up`` over [T, F] views (gate and up may be halves of one fused output),
    fp32 math, one rounding (``triton_common._glu_act``); ``quantize=True`` as for ``rms_norm``.
``embedding_rows`` [``F.embedding``]
    The rows of a dense table at a few token ids (a decode step's), copied as they are,
    launched as the decode kernels are (``launch.pdl``), so that it waits in place
    for the kernel before it instead of being launched after it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from lodestar.kernels.launch import pdl, prefetch_launch, triton_enabled
from lodestar.kernels.quant_layout import GROUP, QuantizedRows
from lodestar.kernels.triton_quant import SplitPartials


def _pow2(n: int) -> int:
    return 1 << (int(n) - 1).bit_length()


def _as_3d(x: torch.Tensor) -> torch.Tensor:
    if x.stride(-1) != 1:
        x = x.contiguous()
    return x.unsqueeze(1) if x.dim() == 2 else x


# ------------------------------------------------------------------------- RMSNorm

def _quant_outputs(x: torch.Tensor, quantize: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(words, d1, sums) buffers for a fused quantization of bf16 rows ``x [M, K]``, or
    placeholders (never written) when ``quantize`` is off."""
    if not quantize:
        return x, x, x
    if x.dim() != 2 or x.dtype != torch.bfloat16 or x.shape[-1] % GROUP:
        raise ValueError(f"quantize=True needs bf16 [rows, features] with features a multiple of {GROUP}; "
                         f"got {x.dtype} {tuple(x.shape)}")
    return QuantizedRows.empty(x.shape[0], x.shape[1], x.device)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool = False,
             residual: torch.Tensor | None = None, quantize: bool = False,
             prefetch: list[torch.Tensor] | None = None, launch_next: bool = False):
    """RMSNorm of ``x`` (2-D or 3-D) -> contiguous result in x's dtype; with ``residual``
    returns ``(norm(x + residual), x + residual)``; ``x`` may be ``triton_quant.SplitPartials``
    (fusion ``norm_sum``: the kernel sums them first, as the unfused sum would, in their
    dtype). ``quantize=True`` returns the norm as
    ``QuantizedRows`` (bf16 2-D ``x`` only). ``prefetch``: the next projection's weight
    arrays, for L2 (``launch.prefetch_launch``; same results). ``launch_next``: the
    next kernel may launch before this one waits (``launch.pdl``; same results)."""
    parts, part_stride, dtype = 0, 0, x.dtype
    if isinstance(x, SplitPartials):    # fusion norm_sum: the sum of the K splits first
        parts, part_stride, dtype = x.part.shape[0], x.part[0].numel(), x.dtype
        x = x.part[0]
    shape = x.shape
    x3 = _as_3d(x)
    A, B, D = x3.shape
    out = torch.empty(shape, device=x.device, dtype=dtype)
    res_in = _as_3d(residual) if residual is not None else x3
    res_out = torch.empty(shape, device=x.device, dtype=dtype) if residual is not None else out
    words, d1, sums = _quant_outputs(out, quantize)
    block = _pow2(max(D, GROUP))
    slices = _norm_slices(A * B, D)
    warps = 4 if D <= 2048 else 8
    extra, pf, form = prefetch_launch(prefetch, A * B, slices, 32 * warps)
    _rms_norm_kernel[(A * B + extra, slices)](
        x3, res_in, weight, out, res_out, words, d1, sums, B, x3.stride(0), x3.stride(1), res_in.stride(0),
        res_in.stride(1), eps, A * B, *pf, part_stride, D=D, BLOCK=block, SLICE=SLICE_COLS if slices > 1 else block,
        OFFSET=offset, HAS_RES=residual is not None, QUANT=quantize, PARTS=parts, PF=form, PF_LANES=32 * warps,
        num_warps=warps, **pdl(launch_next))
    y = QuantizedRows(out, words, d1, sums) if quantize else out
    return (y, res_out) if residual is not None else y


# Rows up to which a wide row's norm is spread over programs of SLICE_COLS columns each
# (a power of two, whole 32-element groups). Every program recomputes the whole row's
# scale (cheap, from L2) and normalizes its slice: for one 4096-wide row on the H200 the
# fused norm + quantize took 2.6 us over four programs against 4.6 us in one.
SLICE_ROWS = 8
SLICE_COLS = 1024


def _norm_slices(rows: int, d: int) -> int:
    """Programs per row of ``_rms_norm_kernel``."""
    if rows > SLICE_ROWS or d < 2 * SLICE_COLS:
        return 1
    return -(-d // SLICE_COLS)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool = False,
                 residual: torch.Tensor | None = None):
    r = x if residual is None else (x + residual)
    h = r.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    y = (h * weight).to(x.dtype) if offset else (weight * h.to(x.dtype)).to(x.dtype)
    return y if residual is None else (y, r)


# ---------------------------------------------------------------------------- RoPE

def rope_(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
          rotary_dim: int, v: torch.Tensor | None = None, k_cache: torch.Tensor | None = None,
          v_cache: torch.Tensor | None = None, slots: torch.Tensor | None = None,
          prefetch: list[torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q ``[T, Hq, D]`` and k ``[T, Hk, D]`` in place; ``cos``/``sin`` ``[P, rotary_dim]`` fp32.

    With ``v``, ``k_cache``, ``v_cache`` (``[slots, Hk, D]``) and ``slots [T]`` the same
    kernel also stores the rotated k and v at their KV slots (one launch instead of three).
    ``prefetch`` as for ``rms_norm``.
    """
    T, Hq, D = q.shape
    Hk = k.shape[1]
    if T == 0:
        return q, k
    half = rotary_dim // 2
    store = k_cache is not None
    if store:
        kc, vc, vv, sl = k_cache, v_cache, v, slots
    else:   # never read: STORE_KV is off
        kc, vc, vv, sl = k, k, k, positions
    tail = D - rotary_dim
    P = rope_programs(Hq, Hk)
    hq, hk = Hq // P, Hk // P
    extra, pf, form = prefetch_launch(prefetch, T, P, 128)
    _rope_kernel[(T + extra, P)](q, k, positions, cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                                 cos.stride(0), vv, kc, vc, sl, vv.stride(0), vv.stride(1), kc.stride(0),
                                 kc.stride(1), vc.stride(0), vc.stride(1), T, *pf,
                                 Hq=hq, Hk=hk, HQ_PAD=_pow2(hq), HK_PAD=_pow2(hk), HALF=half, HALF_PAD=_pow2(half),
                                 D=D, D_PAD=_pow2(D), TAIL=tail, TAIL_PAD=_pow2(max(tail, 1)), STORE_KV=store,
                                 PF=form, PF_LANES=128, num_warps=4, **pdl())
    return q, k


def rope_programs(hq: int, hk: int) -> int:
    """Programs per token of ``_rope_kernel``: one per kv head (its k and v heads and its
    share of the q heads) when the q heads divide evenly, else one (faster on the H200)."""
    return hk if hq % hk == 0 else 1


def rope_ref(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             rotary_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 rotate-half reference (returns new tensors)."""
    c = cos[positions].unsqueeze(1)
    s = sin[positions].unsqueeze(1)

    def apply(x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        rot, rest = xf[..., :rotary_dim], xf[..., rotary_dim:]
        x1, x2 = rot.chunk(2, dim=-1)
        rotated = rot * c + torch.cat((-x2, x1), dim=-1) * s
        return torch.cat((rotated, rest), dim=-1).to(x.dtype)

    return apply(q), apply(k)


# ---------------------------------------------------------------------- activations

def _glu(gate: torch.Tensor, up: torch.Tensor, act: int, quantize: bool, prefetch: list[torch.Tensor] | None,
         launch_next: bool = False):
    T, Fd = gate.shape
    if gate.stride(-1) != 1:
        gate = gate.contiguous()
    if up.stride(-1) != 1:
        up = up.contiguous()
    out = torch.empty(T, Fd, device=gate.device, dtype=gate.dtype)
    words, d1, sums = _quant_outputs(out, quantize)
    block = 1024    # a whole number of 32-element groups per program
    blocks = -(-Fd // block)
    extra, pf, form = prefetch_launch(prefetch, T, blocks, 128)
    _glu_kernel[(T + extra, blocks)](gate, up, out, words, d1, sums, gate.stride(0), up.stride(0), Fd, T, *pf,
                                     ACT=act, BLOCK=block, QUANT=quantize, PF=form, PF_LANES=128, num_warps=4, **pdl(launch_next))
    return QuantizedRows(out, words, d1, sums) if quantize else out


def silu_mul(gate: torch.Tensor, up: torch.Tensor, quantize: bool = False,
             prefetch: list[torch.Tensor] | None = None, launch_next: bool = False):
    """``silu(gate) * up`` for [T, F] views (``QuantizedRows`` with ``quantize``; ``prefetch``
    and ``launch_next`` as for ``rms_norm``)."""
    return _glu(gate, up, 0, quantize, prefetch, launch_next)


def gelu_tanh_mul(gate: torch.Tensor, up: torch.Tensor, quantize: bool = False,
                  prefetch: list[torch.Tensor] | None = None, launch_next: bool = False):
    """``gelu_tanh(gate) * up`` for [T, F] views (``QuantizedRows`` with ``quantize``;
    ``prefetch`` and ``launch_next`` as for ``rms_norm``)."""
    return _glu(gate, up, 1, quantize, prefetch, launch_next)


def silu_mul_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return (F.silu(gate.float()) * up.float()).to(gate.dtype)


def gelu_tanh_mul_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return (F.gelu(gate.float(), approximate="tanh") * up.float()).to(gate.dtype)


# ------------------------------------------------------------------------- embedding

EMBED_BLOCK = 1024      # columns a program copies


def embedding_rows(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.embedding(ids, weight)`` for int64 ids (any shape) and a 2-D table whose rows are
    contiguous: the rows copied by one kernel of (ids, ``EMBED_BLOCK`` columns) programs. An
    id outside the table gives a row of zeros (``F.embedding`` raises)."""
    if ids.dtype != torch.int64 or weight.dim() != 2 or weight.stride(1) != 1:
        raise ValueError(f"embedding_rows: int64 ids and a 2-D table with contiguous rows; got {ids.dtype}, "
                         f"{tuple(weight.shape)} strides {weight.stride()}")
    flat = ids.reshape(-1).contiguous()
    v, d = weight.shape
    out = torch.empty(flat.numel(), d, device=weight.device, dtype=weight.dtype)
    if flat.numel():
        _embed_kernel[(flat.numel(), -(-d // EMBED_BLOCK))](flat, weight, out, v, d, weight.stride(0),
                                                            BLOCK=EMBED_BLOCK, num_warps=4, **pdl())
    return out.view(*ids.shape, d)


# --------------------------------------------------------------------------- kernels

if triton_enabled():
    import triton
    import triton.language as tl

    from lodestar.kernels.launch import _pdl_enter, _weight_prefetch
    from lodestar.kernels.triton_common import _glu_act, _quant_store, _residual_chunk, _rms_apply, _rms_rstd

    @triton.jit
    def _norm_store(x, cols, mask, rstd, w, out_ptr, res_out_ptr, words_ptr, d1_ptr, sums_ptr, row, g0, D,
                    BLOCK: tl.constexpr, OFFSET: tl.constexpr, HAS_RES: tl.constexpr, QUANT: tl.constexpr):
        """Write ``x`` (the residual sum) and its norm (weights ``w``, fp32) at ``cols`` (BLOCK
        of them, from column ``32 * g0``) of row ``row``, quantized too with QUANT."""
        if HAS_RES:
            tl.store(res_out_ptr + row * D + cols, x, mask=mask)
        y = _rms_apply(x, rstd, w, OFFSET).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + row * D + cols, y, mask=mask)
        if QUANT:   # from the stored (rounded) values, exactly as quantize_x would read them
            _quant_store(words_ptr, d1_ptr, sums_ptr, y, row, g0, D, BLOCK)

    @triton.jit
    def _summed_chunk(x_ptr, r_ptr, cols, mask, HAS_RES: tl.constexpr, PARTS: tl.constexpr, part_stride,
                      dtype: tl.constexpr):
        """``_residual_chunk`` of x = the sum of PARTS fp32 partials ``part_stride`` apart (added
        in order, then cast to ``dtype``: the bits of ``_split_sum_kernel``); PARTS 0: x as is."""
        if PARTS == 0:
            return _residual_chunk(x_ptr, r_ptr, cols, mask, HAS_RES)
        x = tl.load(x_ptr + cols, mask=mask, other=0.0)
        for s in tl.static_range(1, PARTS):
            x += tl.load(x_ptr + s * part_stride + cols, mask=mask, other=0.0)
        x = x.to(dtype)
        if HAS_RES:
            r = tl.load(r_ptr + cols, mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(dtype)
        return x

    @triton.jit
    def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, res_out_ptr, words_ptr, d1_ptr, sums_ptr,
                         B, sx0, sx1, sr0, sr1, eps, ROWS, a0, n0, c0, a1, n1, c1, a2, n2, c2, part_stride,
                         D: tl.constexpr, BLOCK: tl.constexpr, SLICE: tl.constexpr,
                         OFFSET: tl.constexpr, HAS_RES: tl.constexpr, QUANT: tl.constexpr, PARTS: tl.constexpr,
                         PF: tl.constexpr, PF_LANES: tl.constexpr, PDL: tl.constexpr):
        """Row ``program_id(0)``: the scale from the whole row (``_rms_rstd``, which the dense
        matrix-vector kernel uses when it fuses this norm), then columns ``SLICE *
        program_id(1) ..`` normalized (SLICE == BLOCK: the whole row, kept in registers).
        PF (0: none): rows ``ROWS ..`` of programs are weight prefetchers of that form
        (``triton_quant.prefetch_launch``). PARTS (0: none): x is the first of PARTS fp32 K-split
        partials ``part_stride`` apart, summed first (``_summed_chunk``)."""
        if PF:
            if tl.program_id(0) >= ROWS:
                _weight_prefetch(ROWS, a0, n0, c0, a1, n1, c1, a2, n2, c2, PF_LANES, PF, True, PDL)
            else:
                _rms_norm_row(x_ptr, r_ptr, w_ptr, out_ptr, res_out_ptr, words_ptr, d1_ptr, sums_ptr,
                              B, sx0, sx1, sr0, sr1, eps, part_stride, D, BLOCK, SLICE, OFFSET, HAS_RES, QUANT,
                              PARTS, PDL)
        else:
            _rms_norm_row(x_ptr, r_ptr, w_ptr, out_ptr, res_out_ptr, words_ptr, d1_ptr, sums_ptr,
                          B, sx0, sx1, sr0, sr1, eps, part_stride, D, BLOCK, SLICE, OFFSET, HAS_RES, QUANT,
                          PARTS, PDL)

    @triton.jit
    def _rms_norm_row(x_ptr, r_ptr, w_ptr, out_ptr, res_out_ptr, words_ptr, d1_ptr, sums_ptr,
                      B, sx0, sx1, sr0, sr1, eps, part_stride, D: tl.constexpr, BLOCK: tl.constexpr,
                      SLICE: tl.constexpr, OFFSET: tl.constexpr, HAS_RES: tl.constexpr, QUANT: tl.constexpr,
                      PARTS: tl.constexpr, PDL: tl.constexpr):
        """The norm weights of the program's columns are read before the wait (no kernel of a
        step writes them), then the program's own slice and the whole row together (one round
        trip to L2, not one before the row's scale and one after it)."""
        row = tl.program_id(0)
        cs = tl.program_id(1) * SLICE + tl.arange(0, SLICE)          # this program's columns
        ms = cs < D
        w = tl.load(w_ptr + cs, mask=ms, other=0.0).to(tl.float32)
        _pdl_enter(PDL)
        a = (row // B).to(tl.int64)
        b = (row % B).to(tl.int64)
        x_row = x_ptr + a * sx0 + b * sx1
        r_row = r_ptr + a * sr0 + b * sr1
        dt: tl.constexpr = out_ptr.dtype.element_ty
        if SLICE == BLOCK:
            x = _summed_chunk(x_row, r_row, cs, ms, HAS_RES, PARTS, part_stride, dt)
            rstd = _rms_rstd(x.to(tl.float32), eps, D)
            _norm_store(x, cs, ms, rstd, w, out_ptr, res_out_ptr, words_ptr, d1_ptr, sums_ptr,
                        row.to(tl.int64), 0, D, BLOCK, OFFSET, HAS_RES, QUANT)
        else:
            xs = _summed_chunk(x_row, r_row, cs, ms, HAS_RES, PARTS, part_stride, dt)
            cols = tl.arange(0, BLOCK)
            x = _summed_chunk(x_row, r_row, cols, cols < D, HAS_RES, PARTS, part_stride, dt)
            rstd = _rms_rstd(x.to(tl.float32), eps, D)
            _norm_store(xs, cs, ms, rstd, w, out_ptr, res_out_ptr, words_ptr, d1_ptr, sums_ptr,
                        row.to(tl.int64), tl.program_id(1) * (SLICE // 32), D, SLICE, OFFSET, HAS_RES, QUANT)

    @triton.jit
    def _rope_rows(ptr, pos_cos, pos_sin, t, stride_t, stride_h, H: tl.constexpr, H_PAD: tl.constexpr,
                   HALF: tl.constexpr, HALF_PAD: tl.constexpr, cache_ptr, slot, stride_cs, stride_ch,
                   STORE: tl.constexpr):
        heads = tl.arange(0, H_PAD)
        cols = tl.arange(0, HALF_PAD)
        mask = (heads[:, None] < H) & (cols[None, :] < HALF)
        base = ptr + t.to(tl.int64) * stride_t + heads[:, None] * stride_h + cols[None, :]
        x1 = tl.load(base, mask=mask, other=0.0)
        x2 = tl.load(base + HALF, mask=mask, other=0.0)
        c = tl.load(pos_cos + cols, mask=cols < HALF, other=0.0)[None, :]
        s = tl.load(pos_sin + cols, mask=cols < HALF, other=0.0)[None, :]
        f1 = x1.to(tl.float32)
        f2 = x2.to(tl.float32)
        y1 = (f1 * c - f2 * s).to(x1.dtype)
        y2 = (f2 * c + f1 * s).to(x1.dtype)
        tl.store(base, y1, mask=mask)
        tl.store(base + HALF, y2, mask=mask)
        if STORE:
            cb = cache_ptr + slot * stride_cs + heads[:, None] * stride_ch + cols[None, :]
            tl.store(cb, y1.to(cache_ptr.dtype.element_ty), mask=mask)
            tl.store(cb + HALF, y2.to(cache_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _copy_rows(src_ptr, dst_ptr, t, slot, stride_t, stride_h, stride_cs, stride_ch, col0,
                   H: tl.constexpr, H_PAD: tl.constexpr, N: tl.constexpr, N_PAD: tl.constexpr):
        """dst[slot, h, col0 + j] = src[t, h, col0 + j] for j < N."""
        heads = tl.arange(0, H_PAD)
        cols = col0 + tl.arange(0, N_PAD)
        mask = (heads[:, None] < H) & (cols[None, :] < col0 + N)
        x = tl.load(src_ptr + t.to(tl.int64) * stride_t + heads[:, None] * stride_h + cols[None, :], mask=mask)
        tl.store(dst_ptr + slot * stride_cs + heads[:, None] * stride_ch + cols[None, :],
                 x.to(dst_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _rope_kernel(q_ptr, k_ptr, pos_ptr, cos_ptr, sin_ptr, sq0, sq1, sk0, sk1, s_cos,
                     v_ptr, kc_ptr, vc_ptr, slot_ptr, sv0, sv1, skc0, skc1, svc0, svc1,
                     ROWS, a0, n0, c0, a1, n1, c1, a2, n2, c2,
                     Hq: tl.constexpr, Hk: tl.constexpr, HQ_PAD: tl.constexpr, HK_PAD: tl.constexpr,
                     HALF: tl.constexpr, HALF_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                     TAIL: tl.constexpr, TAIL_PAD: tl.constexpr, STORE_KV: tl.constexpr, PF: tl.constexpr,
                     PF_LANES: tl.constexpr, PDL: tl.constexpr):
        """Token ``program_id(0)``, kv head group ``program_id(1)``; PF as ``_rms_norm_kernel``."""
        if PF:
            if tl.program_id(0) >= ROWS:
                _weight_prefetch(ROWS, a0, n0, c0, a1, n1, c1, a2, n2, c2, PF_LANES, PF, True, PDL)
            else:
                _rope_token(q_ptr, k_ptr, pos_ptr, cos_ptr, sin_ptr, sq0, sq1, sk0, sk1, s_cos,
                            v_ptr, kc_ptr, vc_ptr, slot_ptr, sv0, sv1, skc0, skc1, svc0, svc1,
                            Hq, Hk, HQ_PAD, HK_PAD, HALF, HALF_PAD, D, D_PAD, TAIL, TAIL_PAD, STORE_KV, PDL)
        else:
            _rope_token(q_ptr, k_ptr, pos_ptr, cos_ptr, sin_ptr, sq0, sq1, sk0, sk1, s_cos,
                        v_ptr, kc_ptr, vc_ptr, slot_ptr, sv0, sv1, skc0, skc1, svc0, svc1,
                        Hq, Hk, HQ_PAD, HK_PAD, HALF, HALF_PAD, D, D_PAD, TAIL, TAIL_PAD, STORE_KV, PDL)

    @triton.jit
    def _rope_token(q_ptr, k_ptr, pos_ptr, cos_ptr, sin_ptr, sq0, sq1, sk0, sk1, s_cos,
                    v_ptr, kc_ptr, vc_ptr, slot_ptr, sv0, sv1, skc0, skc1, svc0, svc1,
                    Hq: tl.constexpr, Hk: tl.constexpr, HQ_PAD: tl.constexpr, HK_PAD: tl.constexpr,
                    HALF: tl.constexpr, HALF_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                    TAIL: tl.constexpr, TAIL_PAD: tl.constexpr, STORE_KV: tl.constexpr, PDL: tl.constexpr):
        _pdl_enter(PDL)
        t = tl.program_id(0)
        h = tl.program_id(1)    # this program's share: q heads h * Hq .., k and v heads h * Hk ..
        q_ptr += h * Hq * sq1
        k_ptr += h * Hk * sk1
        v_ptr += h * Hk * sv1
        kc_ptr += h * Hk * skc1
        vc_ptr += h * Hk * svc1
        pos = tl.load(pos_ptr + t).to(tl.int64)
        # cos/sin rows are [cos(f), cos(f)]: the first half serves both halves.
        pc = cos_ptr + pos * s_cos
        ps = sin_ptr + pos * s_cos
        slot = 0
        if STORE_KV:
            slot = tl.load(slot_ptr + t).to(tl.int64)
        _rope_rows(q_ptr, pc, ps, t, sq0, sq1, Hq, HQ_PAD, HALF, HALF_PAD, kc_ptr, slot, skc0, skc1, False)
        _rope_rows(k_ptr, pc, ps, t, sk0, sk1, Hk, HK_PAD, HALF, HALF_PAD, kc_ptr, slot, skc0, skc1, STORE_KV)
        if STORE_KV:
            if TAIL > 0:   # partial rotary: the unrotated end of each k head
                _copy_rows(k_ptr, kc_ptr, t, slot, sk0, sk1, skc0, skc1, 2 * HALF, Hk, HK_PAD, TAIL, TAIL_PAD)
            _copy_rows(v_ptr, vc_ptr, t, slot, sv0, sv1, svc0, svc1, 0, Hk, HK_PAD, D, D_PAD)

    @triton.jit
    def _glu_kernel(g_ptr, u_ptr, out_ptr, words_ptr, d1_ptr, sums_ptr, sg, su, Fd,
                    ROWS, a0, n0, c0, a1, n1, c1, a2, n2, c2,
                    ACT: tl.constexpr, BLOCK: tl.constexpr, QUANT: tl.constexpr, PF: tl.constexpr,
                    PF_LANES: tl.constexpr, PDL: tl.constexpr):
        """Token ``program_id(0)``, columns ``BLOCK * program_id(1) ..``; PF as ``_rms_norm_kernel``."""
        if PF:
            if tl.program_id(0) >= ROWS:
                _weight_prefetch(ROWS, a0, n0, c0, a1, n1, c1, a2, n2, c2, PF_LANES, PF, True, PDL)
            else:
                _glu_block(g_ptr, u_ptr, out_ptr, words_ptr, d1_ptr, sums_ptr, sg, su, Fd, ACT, BLOCK, QUANT, PDL)
        else:
            _glu_block(g_ptr, u_ptr, out_ptr, words_ptr, d1_ptr, sums_ptr, sg, su, Fd, ACT, BLOCK, QUANT, PDL)

    @triton.jit
    def _glu_block(g_ptr, u_ptr, out_ptr, words_ptr, d1_ptr, sums_ptr, sg, su, Fd,
                   ACT: tl.constexpr, BLOCK: tl.constexpr, QUANT: tl.constexpr, PDL: tl.constexpr):
        _pdl_enter(PDL)
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < Fd
        g = tl.load(g_ptr + t * sg + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + t * su + cols, mask=mask, other=0.0).to(tl.float32)
        y = _glu_act(g, u, ACT).to(out_ptr.dtype.element_ty)   # as the dense kernel's GLU prologue
        tl.store(out_ptr + t * Fd + cols, y, mask=mask)
        if QUANT:
            # Fd is a multiple of 32 here: the masked tail holds whole groups only
            _quant_store(words_ptr, d1_ptr, sums_ptr, y, t, tl.program_id(1) * (BLOCK // 32), Fd, BLOCK)

    @triton.jit
    def _embed_kernel(ids_ptr, w_ptr, out_ptr, V, D, stride_w, BLOCK: tl.constexpr, PDL: tl.constexpr):
        """Columns ``program_id(1) * BLOCK ..`` of the table row at id ``program_id(0)``."""
        _pdl_enter(PDL)
        r = tl.program_id(0)
        row = tl.load(ids_ptr + r)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = (row >= 0) & (row < V)
        m = cols < D
        v = tl.load(w_ptr + tl.where(ok, row, 0) * stride_w + cols, mask=tl.where(ok, m, False), other=0)
        tl.store(out_ptr + r.to(tl.int64) * D + cols, v, mask=m)
