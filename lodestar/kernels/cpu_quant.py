"""CPU matrix products over GGUF-quantized weights.

Two packed forms:

``IntWeight`` (Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q6_K, Q8_0)
    Each weight is ``scale * (u - offset) (+ min)`` with integer codes ``u`` and fp32
    scales (and mins) per block of 32 weights (16 for Q6_K), formed as gguf forms them, so
    rows dequantize bit-identically to gguf and one storage serves as an embedding table
    too. x is quantized per 32 values to 15-bit integers held as two int8 digits (``quantize_x``);
    block by block the integer dot products are exact and the float steps are elementwise
    in a fixed order (``int_matmul``). So a row's result never depends on M or on the other
    rows (batch invariance, ARCHITECTURE.md section 4), and the two layouts give the same
    bits: the compiled kernels' (``lodestar.kernels._native``: 16-row tiles, 4-bit codes
    two to a byte, AVX-512 VNNI, AVX2 or portable C chosen at run time) and the pure-torch
    one used when the extension is not built (one ``torch._int_mm`` per block column;
    correct but several times slower). Bytes per weight in the native layout: Q4_0 0.625,
    Q4_1/Q4_K 0.75, Q5_0/Q8_0 1.125, Q5_1/Q6_K 1.25 (the GGUF blocks: 0.56, 0.63/0.56, 0.69/1.06,
    0.75/0.82); the torch form keeps 4-bit codes a byte each.
    Rounding: x to a 15-bit integer per block (error up to amax/64768 per element, as two
    int8 digits); fp32 after that.

Raw bytes (F32, F16, BF16, Q2_K, Q3_K, Q5_K)
    Kept as loaded (zero-copy over the file mmap) and dequantized to fp32 a tile of rows
    at a time for an fp32 matmul: exact up to fp32 summation order, which for MKL's GEMM
    depends on M through its blocking.

``lodestar.kernels.dequant.dequantize`` does the generic dequantization; while that
module is absent the numpy reference ``gguf.quants.dequantize`` stands in.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from lodestar.kernels import native as _native

T = GGMLQuantizationType

FLOAT_TYPES = (T.F32, T.F16, T.BF16)
SUPPORTED_TYPES = (
    T.F32, T.F16, T.BF16,
    T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0,
    T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K,
)

# Row tiles for dequantize-then-matmul keep the temporary weight near 4 MiB of fp32.
TILE_ELEMENTS = 1 << 20

try:
    from lodestar.kernels.dequant import dequantize as _dequantize_torch
except ImportError:  # the torch dequantizer is optional; the numpy reference is exact too
    _dequantize_torch = None


def dequantize(data: torch.Tensor, qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> torch.Tensor:
    """Raw GGUF bytes ``[rows, bytes_per_row]`` -> float32 ``shape``, bit-identical to gguf."""
    if _dequantize_torch is not None:
        return _dequantize_torch(data, qtype, shape)
    from gguf.quants import dequantize as np_dequantize

    arr = data.contiguous().numpy()
    if qtype == T.F32:
        arr = arr.view(np.float32)
    elif qtype == T.F16:
        arr = arr.view(np.float16)
    return torch.from_numpy(np.ascontiguousarray(np_dequantize(arr, qtype))).reshape(shape)


def row_bytes(qtype: GGMLQuantizationType, n_cols: int) -> int:
    block, size = GGML_QUANT_SIZES[qtype]
    if n_cols % block:
        raise ValueError(f"row length {n_cols} is not a multiple of the {qtype.name} block size {block}")
    return n_cols // block * size


def check_bytes(qtype: GGMLQuantizationType, data: torch.Tensor, rows: int, cols: int) -> None:
    """Raise a ValueError unless ``data`` is uint8 ``[rows, bytes per row of cols]``."""
    if qtype not in SUPPORTED_TYPES:
        names = ", ".join(t.name for t in SUPPORTED_TYPES)
        raise ValueError(f"weight type {qtype.name} is not supported on the CPU; supported: {names}")
    want = (rows, row_bytes(qtype, cols))
    if data.dtype != torch.uint8 or tuple(data.shape) != want:
        raise ValueError(
            f"{qtype.name} weight of {rows}x{cols} needs uint8 bytes of shape {list(want)}, "
            f"got {data.dtype} {list(data.shape)}"
        )


def _f16(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The fp16 field at byte ``offset`` of every block, widened to fp32 (exact)."""
    return blocks[..., offset:offset + 2].contiguous().view(torch.float16).squeeze(-1).float()


def _nibbles32(qs: torch.Tensor) -> torch.Tensor:
    """``[..., 16]`` bytes -> ``[..., 32]`` codes: low nibbles are 0..15, high 16..31."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


# ---------------------------------------------------------------------------------------
# Float weights: views over the bytes, converted a tile at a time.


def float_view(qtype: GGMLQuantizationType, data: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """F32/F16/BF16 bytes as a ``[n, k]`` tensor of that dtype (zero-copy)."""
    dtype = {T.F32: torch.float32, T.F16: torch.float16, T.BF16: torch.bfloat16}[qtype]
    return data.contiguous().view(dtype).view(n, k)


def tiled_matmul(x: torch.Tensor, n: int, k: int, tile_weight) -> torch.Tensor:
    """``x [M, k] @ W.T`` where ``tile_weight(r0, r1)`` returns rows ``r0:r1`` of W.

    The weight arrives a tile at a time, so only one tile is ever materialized.
    """
    step = max(64, TILE_ELEMENTS // k)
    if step >= n:
        w = tile_weight(0, n)
        return torch.nn.functional.linear(x.to(w.dtype), w).float()
    out = torch.empty(x.shape[0], n, dtype=torch.float32)
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        w = tile_weight(r0, r1)
        out[:, r0:r1] = torch.nn.functional.linear(x.to(w.dtype), w)
    return out



# ---------------------------------------------------------------------------------------
# Integer types: Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q6_K, Q8_0 as codes, scales and mins.


def _k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K 12-byte fields -> eight 6-bit scales and eight 6-bit mins."""
    s = scales.reshape(*scales.shape[:-1], 3, 4)
    d, m, md = s[..., 0, :], s[..., 1, :], s[..., 2, :]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _q5_codes(qh: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    """Q5_0/Q5_1 ``qh[4]`` (bit j = 5th bit of element j) and ``qs[16]`` -> 32 codes 0..31."""
    high = qh.contiguous().view(torch.int32)                       # [..., 1], little-endian
    bits = (high >> torch.arange(32, dtype=torch.int32)) & 1       # [..., 32]
    return (_nibbles32(qs).to(torch.int32) | (bits << 4)).to(torch.uint8)


@dataclass(frozen=True)
class IntFormat:
    """How a type's weights become integers: ``w = scale * (u - offset) (+ min)``."""

    group: int          # weights per scale (and min)
    code_bits: int      # codes are 0 .. 2**code_bits - 1
    offset: int
    has_min: bool


INT_FORMATS = {
    T.Q4_0: IntFormat(32, 4, 8, False),
    T.Q4_1: IntFormat(32, 4, 0, True),
    T.Q4_K: IntFormat(32, 4, 0, True),
    T.Q5_0: IntFormat(32, 5, 16, False),
    T.Q5_1: IntFormat(32, 5, 0, True),
    T.Q6_K: IntFormat(16, 6, 32, False),
    T.Q8_0: IntFormat(32, 8, 128, False),
}
INT_TYPES = tuple(INT_FORMATS)


def int_parts(qtype: GGMLQuantizationType, data: torch.Tensor, n: int, k: int):
    """GGUF bytes ``[n, row_bytes]`` -> codes uint8 ``[n, k]``, scales fp32 ``[n, k/group]``,
    mins fp32 (or None). Scales and mins are formed as gguf forms them (``d``, ``d * sc``,
    ``-(dmin * m)`` in fp32), so ``scale * (u - offset) + min`` is gguf's dequantization,
    bit for bit."""
    if qtype == T.Q4_0:
        b = data.view(n, k // 32, 18)
        return _nibbles32(b[..., 2:]).reshape(n, k), _f16(b, 0), None
    if qtype == T.Q4_1:
        b = data.view(n, k // 32, 20)
        return _nibbles32(b[..., 4:]).reshape(n, k), _f16(b, 0), _f16(b, 2)
    if qtype == T.Q4_K:
        b = data.view(n, k // 256, 144)
        d, dmin = _f16(b, 0).unsqueeze(-1), _f16(b, 2).unsqueeze(-1)
        sc, mn = _k_scale_min(b[..., 4:16])
        qs = b[..., 16:].reshape(n, k // 256, 4, 32)   # 4 chunks of 32 bytes = 64 codes
        codes = torch.stack([qs & 0x0F, qs >> 4], dim=3)  # low nibbles: sub-block 2j
        return codes.reshape(n, k), (d * sc.float()).reshape(n, -1), (-(dmin * mn.float())).reshape(n, -1)
    if qtype == T.Q5_0:
        b = data.view(n, k // 32, 22)
        return _q5_codes(b[..., 2:6], b[..., 6:]).reshape(n, k), _f16(b, 0), None
    if qtype == T.Q5_1:
        b = data.view(n, k // 32, 24)
        return _q5_codes(b[..., 4:8], b[..., 8:]).reshape(n, k), _f16(b, 0), _f16(b, 2)
    if qtype == T.Q8_0:
        b = data.view(n, k // 32, 34)
        codes = (b[..., 2:].view(torch.int8).to(torch.int16) + 128).to(torch.uint8)
        return codes.reshape(n, k), _f16(b, 0), None
    if qtype == T.Q6_K:
        nb = k // 256
        b = data.view(n, nb, 210)
        ql = b[..., :128].reshape(n, nb, 2, 1, 64)
        ql = torch.cat([ql & 0x0F, ql >> 4], dim=3).reshape(n, nb, 2, 4, 32)
        qh = b[..., 128:192].reshape(n, nb, 2, 1, 32)
        qh = torch.cat([(qh >> s) & 0x03 for s in (0, 2, 4, 6)], dim=3)
        sc = b[..., 192:208].contiguous().view(torch.int8).float()     # [n, nb, 16]
        return (ql | (qh << 4)).reshape(n, k), (_f16(b, 208).unsqueeze(-1) * sc).reshape(n, k // 16), None
    raise ValueError(f"{qtype.name} has no integer form")


@dataclass
class IntWeight:
    """A packed integer weight ``[n, k]`` in one of two layouts with the same results.

    ``native`` (the compiled kernels, ``lodestar.kernels._native``): codes uint8 in tiles of
    16 rows, ``[tiles, k/group, 16*group*bits/8]`` (``bits`` 4 for 4-bit codes, two to a
    byte, else 8), scales and mins ``[tiles, k/group, 16]``, fp16 for the types whose blocks
    hold them so (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0), fp32 for the K-quants; see native/qmatmul.h.
    ``torch``: codes int8 ``[k/group, n, group]`` holding ``u - offset``, scales and mins
    fp32 ``[k/group, n]``.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    n: int
    k: int
    fmt: IntFormat
    native: bool

    @property
    def bits(self) -> int:
        return 4 if self.native and self.fmt.code_bits == 4 else 8

    @property
    def half(self) -> bool:
        """Scales and mins are fp16 (widened exactly where they are used)."""
        return self.scales.dtype == torch.float16

    @property
    def nbytes(self) -> int:
        extra = 0 if self.mins is None else self.mins.numel() * self.mins.element_size()
        return self.codes.numel() + self.scales.numel() * self.scales.element_size() + extra


def int_pack(qtype: GGMLQuantizationType, data: torch.Tensor, n: int, k: int,
             native: bool | None = None) -> IntWeight:
    """Repack GGUF bytes ``[n, row_bytes]`` of an integer type into an ``IntWeight``
    (``native``: the compiled kernels' layout; None: that layout when they are built)."""
    check_bytes(qtype, data, n, k)
    fmt = INT_FORMATS[qtype]
    native = _native.available() if native is None else native
    if native:
        return _pack_native(qtype, data, n, k, fmt)
    gs, g = fmt.group, k // fmt.group
    codes = torch.empty(g, n, gs, dtype=torch.int8)
    scales = torch.empty(g, n, dtype=torch.float32)
    mins = torch.empty(g, n, dtype=torch.float32) if fmt.has_min else None
    step = max(1, TILE_ELEMENTS // k)
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        u, scale, minimum = int_parts(qtype, data[r0:r1], r1 - r0, k)
        codes[:, r0:r1] = (u.view(r1 - r0, g, gs).to(torch.int16) - fmt.offset).to(torch.int8).transpose(0, 1)
        scales[:, r0:r1] = scale.t()
        if mins is not None:
            mins[:, r0:r1] = minimum.t()
    return IntWeight(codes, scales, mins, n, k, fmt, native=False)


def _pack_native(qtype, data: torch.Tensor, n: int, k: int, fmt: IntFormat) -> IntWeight:
    """The tile layout (native/qmatmul.h), packed by native/pack.c from the GGUF bytes with
    the scales and mins ``int_parts`` forms (``int_rows`` reads them back bit-exact)."""
    rows, gs = _native.TILE_ROWS, fmt.group
    g, tiles = k // gs, -(-n // rows)
    blk = rows * gs // 2 if fmt.code_bits == 4 else rows * gs
    codes = torch.empty(tiles, g, blk, dtype=torch.uint8)
    dtype = torch.float16 if _native._ext.half_scales(int(qtype)) else torch.float32
    scales = torch.empty(tiles, g, rows, dtype=dtype)
    mins = torch.empty(tiles, g, rows, dtype=dtype) if fmt.has_min else None
    data = data.contiguous()
    _native._ext.pack(int(qtype), data.data_ptr(), n, k, codes.data_ptr(), scales.data_ptr(),
                      0 if mins is None else mins.data_ptr())
    return IntWeight(codes, scales, mins, n, k, fmt, native=True)


XLEVELS = 32384.0   # x's integers per 32 values: |Q| <= 254*127 + 126


def quantize_x(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 ``x [M, k]`` -> the int8 digits ``q1, q2`` ``[M, k]`` of ``Q = 254*q1 + q2``,
    ``d_x`` fp32 ``[M, k/32]``, sums of Q per 16 values int32 ``[M, k/16]`` and
    ``d_x * sum(Q)`` per 32 values fp32 ``[M, k/32]``. Per 32 values ``d_x = amax/XLEVELS``
    and ``Q = round(x * (XLEVELS/amax))`` (half to even), so ``|x - d_x*Q| <= amax/64768``;
    two byte-wide dot products per weight give ``sum(u*Q)`` exactly. The native kernels
    quantize with the same operations, so to the same bits."""
    m, k = x.shape
    xb = x.view(m, k // 32, 32)
    amax = xb.abs().amax(dim=-1)
    d = amax / XLEVELS
    inv = torch.where(amax > 0, torch.full_like(amax, XLEVELS).div_(amax), torch.zeros_like(amax))
    big = torch.round(xb * inv.unsqueeze(-1)).clamp_(-XLEVELS, XLEVELS).to(torch.int32)
    hi = torch.div(big + 127, 254, rounding_mode="floor")
    lo = big - 254 * hi
    sums = big.view(m, k // 16, 16).sum(-1, dtype=torch.int32)
    sx = d * sums.view(m, k // 32, 2).sum(-1).float()
    return hi.to(torch.int8).view(m, k), lo.to(torch.int8).view(m, k), d, sums, sx


def int_matmul(x: torch.Tensor, w: IntWeight) -> torch.Tensor:
    """fp32 ``x [M, k] @ W.T`` over integer dot products, one block of weights at a time.

    x is quantized per 32 values to integers Q (``quantize_x``); for each block j in order,
    with every product rounded once: ``acc = acc + float(sum((u - offset) * Q)) * (scale *
    d_x)``, then ``acc = acc + min * (d_x * sum(Q))`` where the type has mins. The integer
    sums are exact and the float steps elementwise, so a row's result has the same bits
    whatever M and the other rows are, and the native kernels give the same bits.
    """
    m = x.shape[0]
    if w.native:
        out = torch.empty(m, w.n, dtype=torch.float32)
        mins = 0 if w.mins is None else w.mins.data_ptr()
        _native._ext.matmul(x.data_ptr(), m, w.k, out.data_ptr(), w.n, w.codes.data_ptr(), w.scales.data_ptr(), mins,
                            int(w.half), w.fmt.group, w.bits, w.fmt.code_bits, w.fmt.offset)
        return out
    gs = w.fmt.group
    q1, q2, dx, _, sx = quantize_x(x)
    digits = torch.cat([q1, q2])                                  # [2M, k]: one _int_mm for both
    acc = torch.zeros(m, w.n, dtype=torch.float32)
    part = torch.empty(2 * m, w.n, dtype=torch.int32)
    for j in range(w.k // gs):
        xj = j * gs // 32
        torch._int_mm(digits[:, j * gs:(j + 1) * gs].contiguous(), w.codes[j].t(), out=part)
        isum = part[:m] * 254 + part[m:]                          # exact: |sum(u*Q)| < 2**31
        acc += isum.float() * (w.scales[j] * dx[:, xj:xj + 1])
        if w.mins is not None:
            acc += w.mins[j] * sx[:, xj:xj + 1]
    return acc


def int_rows(w: IntWeight, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` of W as fp32 ``[len(ids), k]``, bit-identical to gguf's dequantization."""
    gs, g = w.fmt.group, w.k // w.fmt.group
    ids = ids.reshape(-1).long()
    if w.native:
        rows = _native.TILE_ROWS
        tile, r = ids // rows, ids % rows
        sel = w.codes.index_select(0, tile)                       # [L, g, blk]
        lanes = torch.arange(len(ids))
        if w.bits == 4:
            b = sel.view(len(ids), g, gs // 8, rows, 4)[lanes, :, :, r]         # [L, g, gs/8, 4]
            u = torch.stack([b & 0x0F, b >> 4], dim=3).reshape(len(ids), g, gs)
        else:
            u = sel.view(len(ids), g, gs // 4, rows, 4)[lanes, :, :, r].reshape(len(ids), g, gs)
        q = u.float() - w.fmt.offset
        scales = w.scales.index_select(0, tile)[lanes, :, r].float()         # [L, g]; fp16 widens exactly
        mins = None if w.mins is None else w.mins.index_select(0, tile)[lanes, :, r].float()
    else:
        q = w.codes.index_select(1, ids).transpose(0, 1).float()             # [L, g, gs]
        scales = w.scales.index_select(1, ids).t()
        mins = None if w.mins is None else w.mins.index_select(1, ids).t()
    out = q * scales.unsqueeze(-1)
    if mins is not None:
        out = out + mins.unsqueeze(-1)
    return out.reshape(len(ids), w.k)


def int_dense_matmul(x: torch.Tensor, w: IntWeight) -> torch.Tensor:
    """fp32 ``x [M, k] @ W.T`` by dequantizing tiles of W to bf16 and a bf16 matmul (rows
    then round differently from ``int_matmul``: see ``QuantizedLinear``'s ``dense_min_m``)."""
    xb = x.to(torch.bfloat16)
    step = max(64, TILE_ELEMENTS // w.k)
    out = torch.empty(x.shape[0], w.n, dtype=torch.float32)
    for r0 in range(0, w.n, step):
        r1 = min(w.n, r0 + step)
        out[:, r0:r1] = torch.mm(xb, int_rows(w, torch.arange(r0, r1)).to(torch.bfloat16).t())
    return out
