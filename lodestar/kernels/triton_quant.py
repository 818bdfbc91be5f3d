"""GPU matrix products over GGUF-quantized weights: a repacked layout, Triton kernels and
their torch references.

Layout (``PackedWeight``), made once at load by ``pack`` from the GGUF bytes, same bits:
every row is cut into 32-weight groups; 4-bit codes of group ``g`` sit in 16 bytes where
byte ``i`` holds weight ``i`` (low nibble) and weight ``16 + i`` (high nibble), which is
Q4_0's own order; scales live in their own arrays so every load is aligned.

=====  =========================  ==========================================  ==============
type   codes                      scales                                      bytes/weight
=====  =========================  ==========================================  ==============
Q4_0   uint8 [N, K/2]             d fp16 [N, K/32];  w = d * (q - 8)          0.5625
Q4_1   uint8 [N, K/2]             d, m fp16 [N, K/32];  w = d * q + m         0.625
Q8_0   int8 [N, K]                d fp16 [N, K/32];  w = d * q                1.0625
Q4_K   uint8 [N, K/2]             d, dmin fp16 [N, K/256]; sc, m uint8        0.578
                                  [N, K/32];  w = (d*sc) * q - dmin*m
Q5_K   as Q4_K + high: int32      as Q4_K;  q = low | bit << 4                0.703
       [N, K/32], bit e = 5th
       bit of weight e
Q6_K   uint8 [N, K/2] (low 4      d fp16 [N, K/256]; sc int8 [N, K/16];       0.820
       bits) + high: int32        w = (d*sc) * (q - 32) per 16 weights
       [N, K/16], 2 bits each
=====  =========================  ==========================================  ==============

Kernels (reference in brackets, same module):

``quant_matmul`` (M <= ``SMALL_M_MAX``) [``quant_matmul_ref``]
    ``y = x @ W.T`` as matrix-vector products on the CUDA cores, one program per (row of
    x, block of ``block_n`` weight rows, K split). A program streams its weight rows in
    tiles of ``tile_groups`` 32-weight groups (16 contiguous bytes per group and row for
    the 4-bit types, so every load is a full 16-byte vector), turns codes into floats
    with the 2**23 bit trick (no conversion instructions), forms each weight in fp32 as
    ``q * scale + offset`` (the group's scale and offset, formed as the reference forms
    them) and accumulates ``x * w`` elementwise; one reduction at the end. K splits write
    fp32 partials that a second kernel adds in a fixed order. Rounding: x to bf16, the
    weight's fp32 product (exact for Q4_0/Q4_1/Q8_0 codes times fp16 scales) and fp32
    summation order, which depends on (N, K) alone. Every row of x goes through the same
    program whatever M is, so a row's result does not depend on which other rows share the
    batch (batched decode and CUDA-graph replay give the same tokens as single-stream
    decode). Rows of x beyond the first re-read the weight tile from L2.
``dequantize_packed`` [``dequantize_packed_ref``, bit-identical to ``dequant.dequantize``]
    Writes the whole weight as bf16 (or fp32); the large-M (prefill) path dequantizes
    per call into a temporary and runs one cuBLAS matmul (``matmul``).

``import triton`` happens only when CUDA is available or ``TRITON_INTERPRET=1`` (the
interpreter runs the same kernels on CPU tensors, which is how the tests exercise them
without a GPU).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from lodestar.kernels import dequant as dq

T = GGMLQuantizationType

GPU_QUANT_TYPES = (T.Q4_0, T.Q4_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K)
# Rows handled by the fused small-M kernel; more rows dequantize to bf16 for one cuBLAS matmul.
SMALL_M_MAX = 64
GROUP = 32


def triton_enabled() -> bool:
    """Triton kernels can run: a CUDA device, or the CPU interpreter (TRITON_INTERPRET=1)."""
    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


def interpreted() -> bool:
    """Kernels run in Triton's CPU interpreter (no CUDA device)."""
    return os.environ.get("TRITON_INTERPRET") == "1" and not torch.cuda.is_available()


@dataclass
class PackedWeight:
    """A quantized [N, K] weight in the GPU layout described in the module docstring."""

    qtype: GGMLQuantizationType
    n: int
    k: int
    codes: torch.Tensor
    d: torch.Tensor
    high: torch.Tensor | None = None
    dmin: torch.Tensor | None = None
    sc: torch.Tensor | None = None
    m: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in
                   (self.codes, self.d, self.high, self.dmin, self.sc, self.m) if t is not None)

    @property
    def device(self) -> torch.device:
        return self.codes.device


# ----------------------------------------------------------------------------- packing

def _f16(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """fp16 field at byte ``offset`` of each block, as fp16 [n_blocks]."""
    return blocks[:, offset:offset + 2].contiguous().view(torch.float16).reshape(-1)


def _pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[..., 32 * g] codes 0..15 in weight order -> [..., 16 * g] bytes (weight i low, 16+i high)."""
    c = codes.reshape(-1, GROUP)
    return (c[:, :16] | (c[:, 16:] << 4)).to(torch.uint8)


def _bits_to_words(bits: torch.Tensor, width: int) -> torch.Tensor:
    """[..., 32 // width] fields of ``width`` bits -> int32 words (field e at bit width*e)."""
    n = bits.shape[-1]
    shifts = torch.arange(n, device=bits.device, dtype=torch.int64) * width
    w = (bits.to(torch.int64) << shifts).sum(-1)
    w = torch.where(w >= 2**31, w - 2**32, w)
    return w.to(torch.int32)


def _shift(x: torch.Tensor, *values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.uint8, device=x.device)


def pack(qtype: GGMLQuantizationType | int, data: torch.Tensor, n: int, k: int) -> PackedWeight:
    """GGUF bytes ``[n, bytes_per_row]`` (any device) -> ``PackedWeight`` on the same device."""
    qtype = T(int(qtype))
    if qtype not in GPU_QUANT_TYPES:
        raise ValueError(f"no GPU kernel for {qtype.name}; kernels exist for "
                         f"{', '.join(t.name for t in GPU_QUANT_TYPES)}")
    block, size = GGML_QUANT_SIZES[qtype]
    if k % block:
        raise ValueError(f"{qtype.name} row of {k} weights is not a multiple of the block size {block}")
    b = data.reshape(-1).view(torch.uint8).reshape(n * (k // block), size)
    rows = lambda t: t.reshape(n, -1).contiguous()  # noqa: E731
    if qtype == T.Q4_0:
        return PackedWeight(qtype, n, k, rows(b[:, 2:18]), rows(_f16(b, 0)))
    if qtype == T.Q4_1:
        return PackedWeight(qtype, n, k, rows(b[:, 4:20]), rows(_f16(b, 0)), m=rows(_f16(b, 2)))
    if qtype == T.Q8_0:
        return PackedWeight(qtype, n, k, rows(b[:, 2:34].contiguous().view(torch.int8)), rows(_f16(b, 0)))
    nb = b.shape[0]
    if qtype in (T.Q4_K, T.Q5_K):
        sc, mn = dq._k_scale_min(b[:, 4:16])
        qs = b[:, 16:144] if qtype == T.Q4_K else b[:, 48:176]
        low = ((qs.reshape(nb, 4, 1, 32) >> _shift(b, 0, 4).reshape(1, 1, 2, 1)) & 0x0F).reshape(nb, 256)
        high = None
        if qtype == T.Q5_K:
            qh = b[:, 16:48]
            bits = ((qh.reshape(nb, 1, 32) >> _shift(b, *range(8)).reshape(1, 8, 1)) & 1)   # [nb, 8, 32]
            high = rows(_bits_to_words(bits, 1))
        return PackedWeight(qtype, n, k, rows(_pack_nibbles(low)), rows(_f16(b, 0)), high=high,
                            dmin=rows(_f16(b, 2)), sc=rows(sc), m=rows(mn))
    # Q6_K
    ql, qh = b[:, 0:128], b[:, 128:192]
    lo = ((ql.reshape(nb, 2, 1, 64) >> _shift(b, 0, 4).reshape(1, 1, 2, 1)) & 0x0F).reshape(nb, 256)
    hi = ((qh.reshape(nb, 2, 1, 32) >> _shift(b, 0, 2, 4, 6).reshape(1, 1, 4, 1)) & 0x03).reshape(nb, 16, 16)
    return PackedWeight(qtype, n, k, rows(_pack_nibbles(lo)), rows(_f16(b, 208)),
                        high=rows(_bits_to_words(hi, 2)), sc=rows(b[:, 192:208].contiguous().view(torch.int8)))


# ------------------------------------------------------------------- torch references

def _unpack_codes(pw: PackedWeight) -> torch.Tensor:
    """Integer codes [N, K] (int32, offsets such as -8 / -32 applied)."""
    n, k = pw.n, pw.k
    if pw.qtype == T.Q8_0:
        return pw.codes.to(torch.int32)
    byte = pw.codes.reshape(n, k // GROUP, 16).to(torch.int32)
    q = torch.cat((byte & 15, byte >> 4), dim=-1)                       # [N, K/32, 32]
    if pw.qtype == T.Q5_K:
        e = torch.arange(32, device=q.device, dtype=torch.int32)
        q = q | (((pw.high.reshape(n, -1, 1) >> e) & 1) << 4)
    elif pw.qtype == T.Q6_K:
        e = torch.arange(16, device=q.device, dtype=torch.int32)
        bits = (pw.high.reshape(n, -1, 2, 1) >> (2 * e)) & 3            # [N, K/32, 2, 16]
        q = (q | (bits.reshape(n, -1, 32) << 4)) - 32
    elif pw.qtype == T.Q4_0:
        q = q - 8
    return q.reshape(n, k)


def _scales_ref(pw: PackedWeight) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """(scale, offset or None, weights per scale) in fp32, as the reference forms them."""
    if pw.qtype in (T.Q4_0, T.Q8_0):
        return pw.d.float(), None, 32
    if pw.qtype == T.Q4_1:
        return pw.d.float(), pw.m.float(), 32
    if pw.qtype in (T.Q4_K, T.Q5_K):
        d = pw.d.float().repeat_interleave(8, dim=1)
        dmin = pw.dmin.float().repeat_interleave(8, dim=1)
        return d * pw.sc.float(), -(dmin * pw.m.float()), 32
    d = pw.d.float().repeat_interleave(16, dim=1)
    return d * pw.sc.float(), None, 16


def dequantize_packed_ref(pw: PackedWeight) -> torch.Tensor:
    """fp32 [N, K], bit-identical to ``dequant.dequantize`` of the original bytes."""
    q = _unpack_codes(pw).float()
    scale, offset, gs = _scales_ref(pw)
    w = q.reshape(pw.n, -1, gs) * scale.unsqueeze(-1)
    if offset is not None:
        w = w + offset.unsqueeze(-1)
    return w.reshape(pw.n, pw.k)


def quant_matmul_ref(x: torch.Tensor, pw: PackedWeight) -> torch.Tensor:
    """``x @ W.T`` in fp32 from the exact weights, returned in x's dtype."""
    return F.linear(x.float(), dequantize_packed_ref(pw)).to(x.dtype)


# ------------------------------------------------------------------------- dispatch

def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


@dataclass(frozen=True)
class GemvConfig:
    block_n: int        # weight rows per program
    tile_groups: int    # 32-weight groups per loaded tile (a power of two)
    split_k: int        # programs along K per row block
    num_warps: int


_CONFIGS: dict[tuple, GemvConfig] = {}
# K splits are added until there are this many programs per SM (measured on the H200 over
# Llama-3.1-8B shapes: about 4 programs of 16 rows x 512 weights per SM streamed best).
PROGRAMS_PER_SM = 4
# Subtracted from the codes as they become floats: w = (q - bias) * scale.
_CODE_BIAS = {T.Q4_0: 8.0, T.Q6_K: 32.0}


def gemv_config(n: int, k: int, device: torch.device) -> GemvConfig:
    """Tiling for an [n, k] weight: a function of (n, k) and the device only, never of M.

    ``LODESTAR_GEMV=block_n,tile_groups,split_k,num_warps`` overrides it (for tuning).
    """
    key = (n, k, device.type)
    cfg = _CONFIGS.get(key)
    if cfg is None:
        env = os.environ.get("LODESTAR_GEMV")
        if env:
            cfg = GemvConfig(*(int(v) for v in env.split(",")))
        else:
            groups = k // GROUP
            tile = 16
            while tile > 1 and tile > groups:
                tile //= 2
            block_n = 16
            target = PROGRAMS_PER_SM * _num_sms(device)
            split = 1
            while -(-n // block_n) * split < target and groups // (split * 2) >= 4 * tile and split < 8:
                split *= 2
            cfg = GemvConfig(block_n, tile, split, 4)
        _CONFIGS[key] = cfg
    return cfg


def _ptr_args(pw: PackedWeight) -> list[torch.Tensor]:
    # Absent arrays are replaced by ``d`` (never read: the kernel's QTYPE branch skips them).
    return [pw.codes, pw.high if pw.high is not None else pw.d, pw.d,
            pw.dmin if pw.dmin is not None else pw.d, pw.sc if pw.sc is not None else pw.d,
            pw.m if pw.m is not None else pw.d]


def quant_matmul(x: torch.Tensor, pw: PackedWeight, out_dtype: torch.dtype | None = None,
                 config: GemvConfig | None = None) -> torch.Tensor:
    """``x [M, K] @ W.T`` for M <= SMALL_M_MAX with the Triton matrix-vector kernel; bf16 in, out_dtype out.

    ``config`` replaces ``gemv_config(N, K)`` (tests and tuning)."""
    M, K = x.shape
    if K != pw.k:
        raise ValueError(f"x has {K} features, weight expects {pw.k}")
    out_dtype = out_dtype or x.dtype
    x = x.to(torch.bfloat16).contiguous()
    cfg = config or gemv_config(pw.n, pw.k, x.device)
    groups = pw.k // GROUP
    per_split = -(-groups // cfg.split_k)
    grid = (M, -(-pw.n // cfg.block_n), cfg.split_k)
    out = torch.empty(M, pw.n, device=x.device, dtype=out_dtype)
    part = out if cfg.split_k == 1 else torch.empty(cfg.split_k, M, pw.n, device=x.device, dtype=torch.float32)
    _gemv_kernel[grid](x, part, *_ptr_args(pw), pw.n, x.stride(0), pw.n, M * pw.n,
                       K=pw.k, QTYPE=int(pw.qtype), BLOCK_N=cfg.block_n, TG=cfg.tile_groups,
                       GROUPS_PER_SPLIT=per_split, CODE_BIAS=_CODE_BIAS.get(pw.qtype, 0.0),
                       num_warps=cfg.num_warps)
    if cfg.split_k > 1:
        total = M * pw.n
        _split_sum_kernel[(-(-total // 1024),)](part, out, total, SPLIT=cfg.split_k, BLOCK=1024, num_warps=4)
    return out


def dequantize_packed(pw: PackedWeight, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The whole weight [N, K] in ``dtype`` (bf16 rounding of the exact fp32 values)."""
    out = torch.empty(pw.n, pw.k, device=pw.device, dtype=dtype)
    groups = pw.k // GROUP
    per = 8 if groups % 8 == 0 else 4 if groups % 4 == 0 else 2 if groups % 2 == 0 else 1
    block_n = 32
    grid = (-(-pw.n // block_n), groups // per)
    _dequant_kernel[grid](out, *_ptr_args(pw), pw.n, K=pw.k, QTYPE=int(pw.qtype),
                          BLOCK_N=block_n, GROUPS=per, num_warps=4)
    return out


def matmul(x: torch.Tensor, pw: PackedWeight) -> torch.Tensor:
    """``x @ W.T`` for any number of rows: fused kernel for few rows, dequantize + cuBLAS else."""
    if x.shape[0] <= SMALL_M_MAX:
        return quant_matmul(x, pw)
    return F.linear(x.to(torch.bfloat16), dequantize_packed(pw, torch.bfloat16)).to(x.dtype)


# --------------------------------------------------------------------------- kernels

if triton_enabled():
    import triton
    import triton.language as tl

    @triton.jit
    def _group_codes(codes_ptr, high_ptr, rows, mask_n, g, K: tl.constexpr, QTYPE: tl.constexpr):
        """Integer codes of group ``g`` for ``rows``: (weights 0..15, weights 16..31), int32 [BN, 16]."""
        h = tl.arange(0, 16)
        if QTYPE == 8:  # Q8_0
            base = codes_ptr + rows[:, None] * K + g * 32 + h[None, :]
            qa = tl.load(base, mask=mask_n[:, None], other=0).to(tl.int32)
            qb = tl.load(base + 16, mask=mask_n[:, None], other=0).to(tl.int32)
        else:
            byte = tl.load(codes_ptr + rows[:, None] * (K // 2) + g * 16 + h[None, :],
                           mask=mask_n[:, None], other=0).to(tl.int32)
            qa = byte & 15
            qb = byte >> 4
            if QTYPE == 2:  # Q4_0
                qa = qa - 8
                qb = qb - 8
            if QTYPE == 13:  # Q5_K
                w = tl.load(high_ptr + rows * (K // 32) + g, mask=mask_n, other=0)
                qa = qa | (((w[:, None] >> h[None, :]) & 1) << 4)
                qb = qb | (((w[:, None] >> (h[None, :] + 16)) & 1) << 4)
            if QTYPE == 14:  # Q6_K
                w0 = tl.load(high_ptr + rows * (K // 16) + 2 * g, mask=mask_n, other=0)
                w1 = tl.load(high_ptr + rows * (K // 16) + 2 * g + 1, mask=mask_n, other=0)
                qa = (qa | (((w0[:, None] >> (2 * h[None, :])) & 3) << 4)) - 32
                qb = (qb | (((w1[:, None] >> (2 * h[None, :])) & 3) << 4)) - 32
        return qa, qb

    @triton.jit
    def _group_scales(d_ptr, dmin_ptr, sc_ptr, m_ptr, rows, mask_n, g, K: tl.constexpr, QTYPE: tl.constexpr):
        """(scale of weights 0..15, scale of 16..31, offset) fp32 [BN] of group ``g``.

        w = scale * q + offset for Q4_1, scale * q - offset for Q4_K/Q5_K, scale * q otherwise.
        """
        if QTYPE == 14:  # Q6_K: one scale per 16 weights
            d = tl.load(d_ptr + rows * (K // 256) + g // 8, mask=mask_n, other=0).to(tl.float32)
            sa = tl.load(sc_ptr + rows * (K // 16) + 2 * g, mask=mask_n, other=0).to(tl.float32)
            sb = tl.load(sc_ptr + rows * (K // 16) + 2 * g + 1, mask=mask_n, other=0).to(tl.float32)
            scale_a = d * sa
            scale_b = d * sb
            offset = d * 0.0
        elif QTYPE == 12 or QTYPE == 13:  # Q4_K, Q5_K
            d = tl.load(d_ptr + rows * (K // 256) + g // 8, mask=mask_n, other=0).to(tl.float32)
            dmin = tl.load(dmin_ptr + rows * (K // 256) + g // 8, mask=mask_n, other=0).to(tl.float32)
            sc = tl.load(sc_ptr + rows * (K // 32) + g, mask=mask_n, other=0).to(tl.float32)
            mn = tl.load(m_ptr + rows * (K // 32) + g, mask=mask_n, other=0).to(tl.float32)
            scale_a = d * sc
            scale_b = scale_a
            offset = dmin * mn              # subtracted (as the reference does)
        else:  # Q4_0, Q4_1, Q8_0
            scale_a = tl.load(d_ptr + rows * (K // 32) + g, mask=mask_n, other=0).to(tl.float32)
            scale_b = scale_a
            if QTYPE == 3:
                offset = tl.load(m_ptr + rows * (K // 32) + g, mask=mask_n, other=0).to(tl.float32)
            else:
                offset = scale_a * 0.0
        return scale_a, scale_b, offset

    @triton.jit
    def _as_float(v, bias: tl.constexpr):
        """Small non-negative int32 ``v`` (< 2**22) -> float32 ``v - bias``, without a
        conversion instruction: ``v | 0x4B000000`` is the float 2**23 + v."""
        return (v | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + bias)

    @triton.jit
    def _gemv_kernel(x_ptr, out_ptr, codes_ptr, high_ptr, d_ptr, dmin_ptr, sc_ptr, m_ptr,
                     N, stride_xm, stride_om, stride_split,
                     K: tl.constexpr, QTYPE: tl.constexpr, BLOCK_N: tl.constexpr, TG: tl.constexpr,
                     GROUPS_PER_SPLIT: tl.constexpr, CODE_BIAS: tl.constexpr):
        """One row of x against BLOCK_N weight rows over one K split.

        Per tile of TG groups: codes -> floats, ``w = q * scale + offset`` (fp32, per
        group), ``acc += x * w`` elementwise; a single reduction at the end.
        """
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_s = tl.program_id(2)
        G: tl.constexpr = K // 32
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        rows = offs_n.to(tl.int64)
        h = tl.arange(0, 16)
        tg = tl.arange(0, TG)
        x_row = x_ptr + pid_m.to(tl.int64) * stride_xm
        acc = tl.zeros((BLOCK_N, TG, 16), dtype=tl.float32)
        g_start = pid_s * GROUPS_PER_SPLIT
        for t in range(0, GROUPS_PER_SPLIT, TG):
            g = g_start + t + tg                                    # [TG]
            mask_g = (g < G) & (t + tg < GROUPS_PER_SPLIT)
            mask2 = mask_n[:, None] & mask_g[None, :]              # [BN, TG]
            mask3 = mask2[:, :, None]
            xo = g[:, None] * 32 + h[None, :]                      # [TG, 16]
            xa = tl.load(x_row + xo, mask=mask_g[:, None], other=0.0).to(tl.float32)[None, :, :]
            xb = tl.load(x_row + xo + 16, mask=mask_g[:, None], other=0.0).to(tl.float32)[None, :, :]
            # per-group scale and offset, [BN, TG, 1]: w = q * scale + offset
            if QTYPE == 14:  # Q6_K: one scale per 16 weights
                d = tl.load(d_ptr + rows[:, None] * (K // 256) + g[None, :] // 8, mask=mask2, other=0).to(tl.float32)
                sa = tl.load(sc_ptr + rows[:, None] * (K // 16) + 2 * g[None, :], mask=mask2, other=0).to(tl.float32)
                sb = tl.load(sc_ptr + rows[:, None] * (K // 16) + 2 * g[None, :] + 1, mask=mask2, other=0).to(tl.float32)
                scale_a = (d * sa)[:, :, None]
                scale_b = (d * sb)[:, :, None]
                offset = tl.zeros((BLOCK_N, TG, 1), dtype=tl.float32)
            elif QTYPE == 12 or QTYPE == 13:  # Q4_K, Q5_K: w = (d*sc) * q - dmin*m
                d = tl.load(d_ptr + rows[:, None] * (K // 256) + g[None, :] // 8, mask=mask2, other=0).to(tl.float32)
                dmin = tl.load(dmin_ptr + rows[:, None] * (K // 256) + g[None, :] // 8, mask=mask2, other=0).to(tl.float32)
                sc = tl.load(sc_ptr + rows[:, None] * (K // 32) + g[None, :], mask=mask2, other=0).to(tl.float32)
                mn = tl.load(m_ptr + rows[:, None] * (K // 32) + g[None, :], mask=mask2, other=0).to(tl.float32)
                scale_a = (d * sc)[:, :, None]
                scale_b = scale_a
                offset = -(dmin * mn)[:, :, None]
            else:  # Q4_0, Q4_1, Q8_0: one scale per 32 weights
                scale_a = tl.load(d_ptr + rows[:, None] * (K // 32) + g[None, :], mask=mask2, other=0).to(tl.float32)[:, :, None]
                scale_b = scale_a
                if QTYPE == 3:  # Q4_1: w = d * q + m
                    offset = tl.load(m_ptr + rows[:, None] * (K // 32) + g[None, :], mask=mask2, other=0).to(tl.float32)[:, :, None]
                else:
                    offset = tl.zeros((BLOCK_N, TG, 1), dtype=tl.float32)
            # codes as floats, [BN, TG, 16] for weights 0..15 (a) and 16..31 (b) of each group
            if QTYPE == 8:  # Q8_0: int8 codes [N, K]; signed, so biased by 2**22 first
                base = codes_ptr + rows[:, None, None] * K + xo[None, :, :]
                qa = _as_float(tl.load(base, mask=mask3, other=0).to(tl.int32) + 4194304, 4194304.0)
                qb = _as_float(tl.load(base + 16, mask=mask3, other=0).to(tl.int32) + 4194304, 4194304.0)
            else:
                byte = tl.load(codes_ptr + rows[:, None, None] * (K // 2) + (g[:, None] * 16 + h[None, :])[None, :, :],
                               mask=mask3, other=0).to(tl.int32)
                ia = byte & 15
                ib = byte >> 4
                if QTYPE == 13:  # Q5_K: bit e of the group's word is the 5th bit of weight e
                    w = tl.load(high_ptr + rows[:, None] * (K // 32) + g[None, :], mask=mask2, other=0)[:, :, None]
                    ia = ia | (((w >> h[None, None, :]) & 1) << 4)
                    ib = ib | (((w >> (h[None, None, :] + 16)) & 1) << 4)
                if QTYPE == 14:  # Q6_K: two words per group, 2 bits per weight
                    w0 = tl.load(high_ptr + rows[:, None] * (K // 16) + 2 * g[None, :], mask=mask2, other=0)[:, :, None]
                    w1 = tl.load(high_ptr + rows[:, None] * (K // 16) + 2 * g[None, :] + 1, mask=mask2, other=0)[:, :, None]
                    ia = ia | (((w0 >> (2 * h[None, None, :])) & 3) << 4)
                    ib = ib | (((w1 >> (2 * h[None, None, :])) & 3) << 4)
                qa = _as_float(ia, CODE_BIAS)                       # Q4_0: q - 8, Q6_K: q - 32
                qb = _as_float(ib, CODE_BIAS)
            acc += xa * (qa * scale_a + offset)
            acc += xb * (qb * scale_b + offset)
        y = tl.sum(tl.sum(acc, axis=2), axis=1)                     # [BN]
        out_ptrs = out_ptr + pid_s * stride_split + pid_m.to(tl.int64) * stride_om + offs_n
        tl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=mask_n)

    @triton.jit
    def _split_sum_kernel(part_ptr, out_ptr, total, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
        """out = part[0] + part[1] + ... in that order (fp32), cast to out's dtype."""
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < total
        acc = tl.load(part_ptr + offs, mask=mask, other=0.0)
        for s in tl.static_range(1, SPLIT):
            acc += tl.load(part_ptr + s * total + offs, mask=mask, other=0.0)
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _dequant_kernel(out_ptr, codes_ptr, high_ptr, d_ptr, dmin_ptr, sc_ptr, m_ptr, N,
                        K: tl.constexpr, QTYPE: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr):
        pid_n = tl.program_id(0)
        pid_g = tl.program_id(1)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        rows = offs_n.to(tl.int64)
        h = tl.arange(0, 16)
        for u in tl.static_range(GROUPS):
            g = pid_g * GROUPS + u
            qa, qb = _group_codes(codes_ptr, high_ptr, rows, mask_n, g, K, QTYPE)
            scale_a, scale_b, offset = _group_scales(d_ptr, dmin_ptr, sc_ptr, m_ptr, rows, mask_n, g, K, QTYPE)
            wa = qa.to(tl.float32) * scale_a[:, None]
            wb = qb.to(tl.float32) * scale_b[:, None]
            if QTYPE == 3:
                wa = wa + offset[:, None]
                wb = wb + offset[:, None]
            if QTYPE == 12 or QTYPE == 13:
                wa = wa - offset[:, None]
                wb = wb - offset[:, None]
            ptrs = out_ptr + rows[:, None] * K + g * 32 + h[None, :]
            tl.store(ptrs, wa.to(out_ptr.dtype.element_ty), mask=mask_n[:, None])
            tl.store(ptrs + 16, wb.to(out_ptr.dtype.element_ty), mask=mask_n[:, None])
