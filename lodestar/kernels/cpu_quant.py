"""CPU matrix products over GGUF-quantized weights, in pure PyTorch.

Three packed forms, each a plain dataclass of tensors plus pure functions over it:

``Int4Weight`` (Q4_0, Q4_1, Q4_K)
    The 4-bit codes repacked into torch's CPU int4 layout, with one bf16
    (scale, zero) pair per 32 weights, so that ``w = (q - 8) * scale + zero``:
    Q4_0 ``scale = d, zero = 0``; Q4_1 ``scale = d, zero = m + 8d``;
    Q4_K ``scale = d*sc, zero = 8*d*sc - dmin*m`` per 32-weight sub-block.
    Same size as the GGUF bytes (0.625 bytes per weight). Multiplied by
    ``aten._weight_int4pack_mm_for_cpu`` (bf16 activations, fp32 accumulation, bf16
    out); large M can instead dequantize to bf16 for one dense bf16 matmul.
    Rounding: scale and zero to bf16, x to bf16, the output to bf16.

``Int8Weight`` (Q8_0, Q5_0, Q5_1 in 32-weight sub-blocks; Q6_K in 16-weight ones)
    Signed int8 codes regrouped as ``[K/gs, N, gs]`` with fp32 sub-block scales (and
    Q5_1's mins) ``[K/gs, N]``: 1.125 bytes per weight (1.25 for Q6_K) against the
    GGUF blocks' 1.0625 (Q8_0), 0.69 (Q5_0), 0.75 (Q5_1), 0.82 (Q6_K). x is split per
    sub-block into two int8 terms, ``x ~ d1*q1 + d2*q2`` (``d1 = amax/127``, the
    remainder at ``d2 = d1/254``); one ``torch._int_mm`` per sub-block column gives
    exact int32 partials for both, summed scaled by ``d_w * d_x`` in fp32. Large M can
    instead dequantize to bf16 for one dense bf16 matmul. Rows dequantize
    bit-identically to gguf (``scale * q (+ min)`` in fp32), so the same storage serves
    as an embedding table.
    Rounding: x off by at most ``amax/64516`` per element (about 2e-5 normwise on
    Gaussian data; one int8 term, as llama.cpp's Q8_0 dot products use, gives 5e-3).

Raw bytes (F32, F16, BF16, Q2_K, Q3_K, Q5_K)
    Kept as loaded (zero-copy over the file mmap) and dequantized to fp32 a tile of rows
    at a time for an fp32 matmul: exact up to fp32 summation order.

The int4 and int8 kernels give each row the same bits whatever M and the other rows
are (tested). Dequantize-then-bf16-matmul rounds differently from the kernels, so
switching between the two by M would let batching change results; fp32 GEMM (MKL)
rows depend on M through its blocking (gemv for one row, other kernels above 3).

``lodestar.kernels.dequant.dequantize`` does the generic dequantization; while that
module is absent the numpy reference ``gguf.quants.dequantize`` stands in.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

T = GGMLQuantizationType

INT4_TYPES = (T.Q4_0, T.Q4_1, T.Q4_K)
INT8_TYPES = (T.Q8_0, T.Q5_0, T.Q5_1, T.Q6_K)
FLOAT_TYPES = (T.F32, T.F16, T.BF16)
SUPPORTED_TYPES = (
    T.F32, T.F16, T.BF16,
    T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0,
    T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K,
)

# Packed int4 weights are padded and tiled by 64 output channels: a multiple of the block
# of torch's CPU int4 layout on every instruction set (see int4_layout_block).
INT4_BLOCK_N = 64
GROUP = 32
# Row tiles for dequantize-then-matmul keep the temporary weight near 4 MiB of fp32.
TILE_ELEMENTS = 1 << 20

_INT4_MM = torch.ops.aten._weight_int4pack_mm_for_cpu.default

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
# Int4: Q4_0, Q4_1, Q4_K -> torch's CPU int4 layout.


@dataclass
class Int4Weight:
    """4-bit codes in ``aten._convert_weight_to_int4pack_for_cpu`` layout.

    ``packed`` is uint8 ``[n_pad, k/2]``; ``scales_zeros`` is bf16 ``[k/32, n_pad, 2]``.
    Rows ``n..n_pad`` (padding to a multiple of 64) have zero scale and zero.
    """

    packed: torch.Tensor
    scales_zeros: torch.Tensor
    n: int
    k: int

    @property
    def nbytes(self) -> int:
        return self.packed.numel() + self.scales_zeros.numel() * 2


def _int4_codes_scales(qtype: GGMLQuantizationType, data: torch.Tensor, n: int, k: int):
    """Codes uint8 ``[n, k]`` in 0..15 and fp32 ``(scale, zero)`` ``[n, k/32]`` each."""
    if qtype == T.Q4_0:
        b = data.view(n, k // 32, 18)
        d = _f16(b, 0)
        return _nibbles32(b[..., 2:]).view(n, k), d, torch.zeros_like(d)
    if qtype == T.Q4_1:
        b = data.view(n, k // 32, 20)
        d, m = _f16(b, 0), _f16(b, 2)
        return _nibbles32(b[..., 4:]).view(n, k), d, m + 8 * d
    if qtype == T.Q4_K:
        b = data.view(n, k // 256, 144)
        d, dmin = _f16(b, 0).unsqueeze(-1), _f16(b, 2).unsqueeze(-1)
        sc, mn = _k_scale_min(b[..., 4:16])
        scale = d * sc.float()                       # [n, k/256, 8], as gguf: d * sc
        minimum = dmin * mn.float()
        qs = b[..., 16:].reshape(n, k // 256, 4, 32)  # 4 chunks of 32 bytes = 64 codes
        codes = torch.stack([qs & 0x0F, qs >> 4], dim=3)  # low nibbles: sub-block 2j
        return codes.reshape(n, k), scale.reshape(n, -1), (8 * scale - minimum).reshape(n, -1)
    raise ValueError(f"{qtype.name} has no int4 form")


def _k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K 12-byte fields -> eight 6-bit scales and eight 6-bit mins."""
    s = scales.reshape(*scales.shape[:-1], 3, 4)
    d, m, md = s[..., 0, :], s[..., 1, :], s[..., 2, :]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def int4_pack(qtype: GGMLQuantizationType, data: torch.Tensor, n: int, k: int) -> Int4Weight:
    """Repack Q4_0/Q4_1/Q4_K bytes ``[n, row_bytes]`` into an ``Int4Weight``."""
    check_bytes(qtype, data, n, k)
    n_pad = -(-n // INT4_BLOCK_N) * INT4_BLOCK_N
    rows_per_chunk = max(INT4_BLOCK_N, (TILE_ELEMENTS // k) // INT4_BLOCK_N * INT4_BLOCK_N)
    packed = torch.empty(n_pad, k // 2, dtype=torch.uint8)
    scales_zeros = torch.zeros(k // GROUP, n_pad, 2, dtype=torch.bfloat16)
    for r0 in range(0, n_pad, rows_per_chunk):
        r1 = min(n_pad, r0 + rows_per_chunk)
        codes = torch.full((r1 - r0, k), 8, dtype=torch.int32)
        real = max(0, min(n, r1) - r0)
        if real:
            q, scale, zero = _int4_codes_scales(qtype, data[r0:r0 + real], real, k)
            codes[:real] = q
            scales_zeros[:, r0:r0 + real, 0] = scale.t()
            scales_zeros[:, r0:r0 + real, 1] = zero.t()
        packed[r0:r1] = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    return Int4Weight(packed, scales_zeros, n, k)


def int4_matmul(x: torch.Tensor, w: Int4Weight) -> torch.Tensor:
    """fp32 ``x [M, k] @ W.T`` through torch's int4 kernel (bf16 in, bf16 out)."""
    y = _INT4_MM(x.to(torch.bfloat16), w.packed, GROUP, w.scales_zeros)
    if y.shape[1] != w.n:
        y = y[:, : w.n]
    return y.float()


@functools.cache
def int4_layout_block() -> int:
    """Output channels in one block of torch's CPU int4 layout on this machine.

    torch packs ``B`` channels per block as ``[k, B/2]`` bytes, byte j holding channel j
    in its low nibble and channel j + B/2 in its high nibble, with ``B`` set by the
    kernels it dispatches to: 64 with AVX-512, 32 with AVX2 or none. Read it off one
    packed probe rather than guess.
    """
    codes = torch.zeros(INT4_BLOCK_N, 2 * GROUP, dtype=torch.int32)
    codes[16, 0] = 1                                   # channel 16, first column
    flat = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1).reshape(-1)
    if int(flat[16]) == 0x01:
        return 64                                      # low nibble of byte 16
    if int(flat[0]) == 0x10:
        return 32                                      # high nibble of byte 0
    raise RuntimeError("torch's CPU int4 weight layout is neither of the known ones (64- or 32-channel "
                       f"blocks); this torch ({torch.__version__}) is not supported on the packed CPU path")


def int4_dequant_t(w: Int4Weight, r0: int = 0, r1: int | None = None,
                   dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Rows ``r0:r1`` of W (``r0`` a multiple of 64) as ``[k, r1-r0]`` in ``dtype``.

    Reads torch's CPU int4 layout (``int4_layout_block``) straight from the nibbles.
    Values are ``q * scale + (zero - 8 * scale)`` in fp32 (the kernel's
    ``(q - 8) * scale + zero`` up to fp32 rounding), cast once to ``dtype``.
    """
    r1 = w.n if r1 is None else r1
    blk = int4_layout_block()
    half_blk = blk // 2
    b0, b1 = r0 // blk, -(-r1 // blk)
    nb, k, g = b1 - b0, w.k, w.k // GROUP
    blocks = w.packed[b0 * blk:b1 * blk].view(nb, k, half_blk)
    sz = w.scales_zeros[:, b0 * blk:b1 * blk].float()                # [g, nb*blk, 2]
    scale = sz[..., 0]
    offset = (sz[..., 1] - 8 * scale).view(g, 1, nb, 2, half_blk)
    scale = scale.view(g, 1, nb, 2, half_blk)
    out = torch.empty(g, GROUP, nb, 2, half_blk, dtype=dtype)        # = [k, nb*blk]
    for half, codes in enumerate((blocks & 0x0F, blocks >> 4)):
        codes = codes.permute(1, 0, 2).view(g, GROUP, nb, half_blk)
        torch.addcmul(offset[:, :, :, half], codes, scale[:, :, :, half], out=out[:, :, :, half])
    out = out.view(k, nb * blk)
    return out if nb * blk == r1 - r0 else out[:, : r1 - r0]


def int4_dense_matmul(x: torch.Tensor, w: Int4Weight) -> torch.Tensor:
    """fp32 ``x [M, k] @ W.T`` by dequantizing W to bf16 (tiles of rows) and bf16 matmul."""
    xb = x.to(torch.bfloat16)
    step = max(INT4_BLOCK_N, (TILE_ELEMENTS // w.k) // INT4_BLOCK_N * INT4_BLOCK_N)
    if step >= w.n:
        return torch.mm(xb, int4_dequant_t(w)).float()
    out = torch.empty(x.shape[0], w.n, dtype=torch.float32)
    for r0 in range(0, w.n, step):
        r1 = min(w.n, r0 + step)
        out[:, r0:r1] = torch.mm(xb, int4_dequant_t(w, r0, r1))
    return out


# ---------------------------------------------------------------------------------------
# Int8: Q8_0, Q5_0, Q5_1, Q6_K -> int8 codes grouped by sub-block.


@dataclass
class Int8Weight:
    """Codes int8 ``[k/gs, n, gs]``, scales fp32 ``[k/gs, n]``, optional mins (same shape).

    ``w = scale * (codes + offset)`` (``+ min`` where the format has one), gs the
    sub-block size. Q5_1's codes 0..31 are stored centred (offset 16) so that the int8
    product carries the small centred part and the min term the large common one.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    n: int
    k: int
    offset: int = 0

    def centred_mins(self) -> torch.Tensor:
        """``min + offset * scale``: the constant term once the codes are centred."""
        return self.mins + self.offset * self.scales if self.offset else self.mins

    @property
    def group(self) -> int:
        return self.codes.shape[2]

    @property
    def nbytes(self) -> int:
        extra = 0 if self.mins is None else self.mins.numel() * 4
        return self.codes.numel() + self.scales.numel() * 4 + extra


def _q5_codes(qh: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    """Q5_0/Q5_1 ``qh[4]`` (bit j = 5th bit of element j) and ``qs[16]`` -> 32 codes 0..31."""
    high = qh.contiguous().view(torch.int32)                       # [..., 1], little-endian
    bits = (high >> torch.arange(32, dtype=torch.int32)) & 1       # [..., 32]
    return (_nibbles32(qs).to(torch.int32) | (bits << 4)).to(torch.int8)


def _int8_parts(qtype: GGMLQuantizationType, data: torch.Tensor, n: int, k: int):
    """Bytes -> codes int8 ``[n, k/gs, gs]``, scales fp32 ``[n, k/gs]``, mins or None.

    Scales are formed as gguf forms them (``d``, or ``d * sc`` in fp32 for Q6_K), so
    ``scale * q (+ min)`` reproduces gguf's dequantization bit for bit.
    """
    if qtype == T.Q8_0:
        b = data.view(n, k // 32, 34)
        return b[..., 2:].view(torch.int8), _f16(b, 0), None
    if qtype == T.Q5_0:
        b = data.view(n, k // 32, 22)
        return _q5_codes(b[..., 2:6], b[..., 6:]) - 16, _f16(b, 0), None
    if qtype == T.Q5_1:
        b = data.view(n, k // 32, 24)
        return _q5_codes(b[..., 4:8], b[..., 8:]), _f16(b, 0), _f16(b, 2)
    if qtype == T.Q6_K:
        nb = k // 256
        b = data.view(n, nb, 210)
        ql = b[..., :128].reshape(n, nb, 2, 1, 64)
        ql = torch.cat([ql & 0x0F, ql >> 4], dim=3).reshape(n, nb, 2, 4, 32)
        qh = b[..., 128:192].reshape(n, nb, 2, 1, 32)
        qh = torch.cat([(qh >> s) & 0x03 for s in (0, 2, 4, 6)], dim=3)
        codes = (ql | (qh << 4)).view(torch.int8) - 32                 # [n, nb, 2, 4, 32]
        sc = b[..., 192:208].contiguous().view(torch.int8).float()    # [n, nb, 16]
        scales = _f16(b, 208).unsqueeze(-1) * sc
        return codes.reshape(n, k // 16, 16), scales.reshape(n, k // 16), None
    raise ValueError(f"{qtype.name} has no int8 form")


def int8_pack(qtype: GGMLQuantizationType, data: torch.Tensor, n: int, k: int) -> Int8Weight:
    """Repack Q8_0/Q5_0/Q5_1/Q6_K bytes ``[n, row_bytes]`` into an ``Int8Weight``."""
    check_bytes(qtype, data, n, k)
    gs = 16 if qtype == T.Q6_K else 32
    g = k // gs
    codes = torch.empty(g, n, gs, dtype=torch.int8)
    scales = torch.empty(g, n, dtype=torch.float32)
    mins = torch.empty(g, n, dtype=torch.float32) if qtype == T.Q5_1 else None
    offset = 16 if qtype == T.Q5_1 else 0
    step = max(1, TILE_ELEMENTS // k)
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        q, scale, minimum = _int8_parts(qtype, data[r0:r1], r1 - r0, k)
        codes[:, r0:r1] = (q - offset).transpose(0, 1)
        scales[:, r0:r1] = scale.t()
        if mins is not None:
            mins[:, r0:r1] = minimum.t()
    return Int8Weight(codes, scales, mins, n, k, offset)


def quantize_rows_q8(x: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``[M, k]`` -> int8 codes ``[k/group, 2M, group]`` and fp32 scales ``[2, M, k/group]``.

    Two int8 terms per block: ``x ~ d1*q1 + d2*q2`` with ``d1 = amax/127``,
    ``q1 = round(x/d1)``, and the remainder ``x - d1*q1`` (at most ``d1/2``) quantized
    again with ``d2 = d1/254``. Rows ``0..M-1`` of the codes hold q1, rows ``M..2M-1``
    q2, so one ``_int_mm`` serves both; ``|x - d1*q1 - d2*q2| <= amax/64516`` (plus fp32
    rounding), well inside bf16's relative 2**-9 for all but tiny elements.
    """
    m, k = x.shape
    xb = x.view(m, k // group, group)
    amax = xb.abs().amax(dim=-1, keepdim=True)
    d1 = amax / 127.0
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q1 = torch.round(xb * inv)
    rest = xb - q1 * d1
    q2 = torch.round(rest * (inv * 254.0)).clamp_(-127, 127)
    codes = torch.cat([q1, q2], dim=0).to(torch.int8)          # [2M, k/group, group]
    scales = torch.stack([d1, d1 / 254.0]).squeeze(-1)        # [2, M, k/group]
    return codes.transpose(0, 1).contiguous(), scales


def int8_matmul(x: torch.Tensor, w: Int8Weight) -> torch.Tensor:
    """fp32 ``x [M, k] @ W.T`` with int8 x int8 -> int32 products per sub-block.

    x is split into two int8 terms (see ``quantize_rows_q8``); one ``_int_mm`` per
    sub-block column gives exact int32 partials for both, each scaled by ``d_w * d_x``
    and added in fp32, sub-block by sub-block, with elementwise operations only, so a
    row's result is bit-identical whatever M and the other rows are (a batch changes
    nothing). The min term, where present, is ``min[g] * sum(x over g)`` added the
    same way.
    """
    gs = w.group
    g = w.k // gs
    m = x.shape[0]
    qx, dx = quantize_rows_q8(x, gs)                           # [g, 2M, gs], [2, M, g]
    hi, lo = dx[0].t().unsqueeze(-1), dx[1].t().unsqueeze(-1)  # [g, M, 1] each
    acc = torch.zeros(m, w.n, dtype=torch.float32)
    part = torch.empty(2 * m, w.n, dtype=torch.int32)
    for j in range(g):
        torch._int_mm(qx[j], w.codes[j].t(), out=part)
        acc.addcmul_(part[:m], w.scales[j] * hi[j])
        acc.addcmul_(part[m:], w.scales[j] * lo[j])
    if w.mins is not None:
        # Elementwise, not a matmul: BLAS blocking would make rows depend on M.
        xsum = x.view(m, g, gs).sum(-1).t().unsqueeze(-1)      # [g, M, 1]
        mins = w.centred_mins()
        for j in range(g):
            acc.addcmul_(xsum[j], mins[j])
    return acc


def int8_rows(w: Int8Weight, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` of W as fp32 ``[len(ids), k]``, bit-identical to gguf."""
    codes = w.codes.index_select(1, ids).float()
    if w.offset:
        codes += w.offset                                      # integers: exact
    rows = codes * w.scales.index_select(1, ids).unsqueeze(-1)
    if w.mins is not None:
        rows = rows + w.mins.index_select(1, ids).unsqueeze(-1)
    return rows.transpose(0, 1).reshape(ids.numel(), w.k)


def int8_dequant_t(w: Int8Weight, r0: int = 0, r1: int | None = None,
                   dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Rows ``r0:r1`` of W as ``[k, r1-r0]`` in ``dtype`` (computed in fp32, then cast)."""
    r1 = w.n if r1 is None else r1
    g, gs = w.k // w.group, w.group
    codes = w.codes[:, r0:r1].permute(0, 2, 1)
    scales = w.scales[:, r0:r1].unsqueeze(1)
    out = torch.empty(g, gs, r1 - r0, dtype=dtype)
    if w.mins is None:
        torch.mul(codes, scales, out=out)
    else:
        torch.addcmul(w.centred_mins()[:, r0:r1].unsqueeze(1), codes, scales, out=out)
    return out.view(w.k, r1 - r0)


def int8_dense_matmul(x: torch.Tensor, w: Int8Weight) -> torch.Tensor:
    """fp32 ``x [M, k] @ W.T`` by dequantizing tiles of W to bf16 and bf16 matmul."""
    xb = x.to(torch.bfloat16)
    step = max(64, TILE_ELEMENTS // w.k)
    if step >= w.n:
        return torch.mm(xb, int8_dequant_t(w)).float()
    out = torch.empty(x.shape[0], w.n, dtype=torch.float32)
    for r0 in range(0, w.n, step):
        r1 = min(w.n, r0 + step)
        out[:, r0:r1] = torch.mm(xb, int8_dequant_t(w, r0, r1))
    return out
