"""Dequantization of GGUF tensor bytes to float32, in plain torch.

Every routine reproduces the arithmetic of ``gguf.quants.dequantize`` (llama.cpp's
numpy reference) operation for operation, so results are bit-identical: fp16 scales are
widened to fp32 first, sub-block scales are formed as ``d * sc`` in fp32, and each
weight is ``scale * q`` followed by ``+ m`` (Q4_1, Q5_1) or ``- m`` (K-quants), two
separately rounded operations, never a fused multiply-add.

Bytes go through in chunks of blocks (``CHUNK_ELEMENTS`` outputs at a time) written
into one preallocated output, so peak memory is the fp32 result plus a few chunk-sized
temporaries.

Block layouts (bytes, in order) follow ggml-common.h:

=====  =====  ======  ===================================================================
type   elems  bytes   layout
=====  =====  ======  ===================================================================
Q4_0     32     18    d:f16, qs[16] (low nibbles = elements 0..15, high = 16..31)
Q4_1     32     20    d:f16, m:f16, qs[16]
Q5_0     32     22    d:f16, qh[4] (bit j = 5th bit of element j), qs[16]
Q5_1     32     24    d:f16, m:f16, qh[4], qs[16]
Q8_0     32     34    d:f16, qs[32]:int8
Q2_K    256     84    scales[16] (lo nibble scale, hi nibble min), qs[64], d:f16, dmin:f16
Q3_K    256    110    hmask[32], qs[64], scales[12] (16 x 6-bit), d:f16
Q4_K    256    144    d:f16, dmin:f16, scales[12] (8 x 6-bit scale + 8 x 6-bit min), qs[128]
Q5_K    256    176    d:f16, dmin:f16, scales[12], qh[32], qs[128]
Q6_K    256    210    ql[128], qh[64], scales[16]:int8, d:f16
=====  =====  ======  ===================================================================
"""
from __future__ import annotations

from typing import Callable

import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

T = GGMLQuantizationType

SUPPORTED_TYPES: tuple[GGMLQuantizationType, ...] = (
    T.F32, T.F16, T.BF16,
    T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0,
    T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K,
)

# Outputs produced per chunk: 4 MiB of fp32 keeps temporaries small and cache-friendly.
CHUNK_ELEMENTS = 1 << 20


def _qtype(qtype: GGMLQuantizationType | int) -> GGMLQuantizationType:
    try:
        qt = GGMLQuantizationType(int(qtype))
    except ValueError:
        raise ValueError(f"unknown GGML type id {int(qtype)}") from None
    if qt not in SUPPORTED_TYPES:
        raise ValueError(f"type {qt.name} is not supported; supported: {supported_names()}")
    return qt


def supported_names() -> str:
    """Comma-separated names of the supported types, for error messages."""
    return ", ".join(t.name for t in SUPPORTED_TYPES)


def block_info(qtype: GGMLQuantizationType | int) -> tuple[int, int]:
    """(elements per block, bytes per block) of a GGML type."""
    qt = GGMLQuantizationType(int(qtype))
    return GGML_QUANT_SIZES[qt]


def row_bytes(qtype: GGMLQuantizationType | int, n_cols: int) -> int:
    """Bytes in one row of ``n_cols`` elements; ``n_cols`` must be a whole number of blocks."""
    block, size = block_info(qtype)
    if n_cols % block:
        name = GGMLQuantizationType(int(qtype)).name
        raise ValueError(f"row of {n_cols} elements is not a multiple of the {name} block size {block}")
    return n_cols // block * size


# ---------------------------------------------------------------------------- helpers

def half_to_float(h: torch.Tensor) -> torch.Tensor:
    """fp16 -> fp32 with NaN payloads kept as numpy keeps them.

    torch's conversion quiets signalling NaNs (and some paths canonicalise them);
    those elements are rebuilt from their bits: sign | exponent 0xFF | mantissa << 13.
    """
    out = h.to(torch.float32)
    nan = out.isnan()
    if bool(nan.any()):
        bits = h[nan].view(torch.int16).to(torch.int32) & 0xFFFF
        fixed = ((bits & 0x8000) << 16) | 0x7F800000 | ((bits & 0x03FF) << 13)
        out[nan] = fixed.view(torch.float32)
    return out


def _f16(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """fp16 at byte ``offset`` of every block, widened to fp32: shape [n, 1]."""
    return half_to_float(blocks[:, offset:offset + 2].contiguous().view(torch.float16))


def _shifts(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.uint8)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[n, 16] packed bytes -> [n, 32] codes: low nibbles first, then high nibbles."""
    return torch.cat((qs & 0x0F, qs >> 4), dim=1)


def _high_bits(qh: torch.Tensor) -> torch.Tensor:
    """[n, 4] little-endian 32-bit masks -> [n, 32] bits (bit j of the mask is element j)."""
    return ((qh.unsqueeze(-1) >> _shifts(*range(8))) & 1).reshape(qh.shape[0], 32)


def _k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K 12-byte scale field -> (sc, m), each [n, 8] uint8 in 0..63."""
    s = scales.reshape(-1, 3, 4)
    d, m, m_d = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat((d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)), dim=1)
    mn = torch.cat((m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)), dim=1)
    return sc, mn


# ------------------------------------------------------- per-type block decoders
# Each takes ``blocks`` [n, bytes_per_block] uint8 and returns pieces whose combination
# (in the order the reference uses) gives the weights.

def _q4_0_parts(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """codes int8 [n, 32] in -8..7, d fp32 [n, 1]; w = d * codes."""
    return _nibbles(b[:, 2:18]).to(torch.int8) - 8, _f16(b, 0)


def _q4_1_parts(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """codes uint8 [n, 32] in 0..15, d, m fp32 [n, 1]; w = d * codes + m."""
    return _nibbles(b[:, 4:20]), _f16(b, 0), _f16(b, 2)


def _q5_codes(qh: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    return _nibbles(qs) | (_high_bits(qh) << 4)


def _q8_0_parts(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """codes int8 [n, 32], d fp32 [n, 1]; w = codes * d."""
    return b[:, 2:34].view(torch.int8), _f16(b, 0)


def _q4_k_parts(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """codes uint8 [n, 8, 32] in 0..15, scale = d*sc and min = dmin*m fp32 [n, 8, 1];
    w = scale * codes - min."""
    n = b.shape[0]
    sc, mn = _k_scale_min(b[:, 4:16])
    scale = (_f16(b, 0) * sc.to(torch.float32)).reshape(n, 8, 1)
    minimum = (_f16(b, 2) * mn.to(torch.float32)).reshape(n, 8, 1)
    codes = ((b[:, 16:144].reshape(n, 4, 1, 32) >> _shifts(0, 4).reshape(1, 1, 2, 1)) & 0x0F).reshape(n, 8, 32)
    return codes, scale, minimum


# --------------------------------------------------------------- chunk kernels
# ``out`` is the [n, block_size] fp32 slice the chunk writes into.

def _deq_q4_0(b: torch.Tensor, out: torch.Tensor) -> None:
    codes, d = _q4_0_parts(b)
    torch.mul(d, codes, out=out)


def _deq_q4_1(b: torch.Tensor, out: torch.Tensor) -> None:
    codes, d, m = _q4_1_parts(b)
    torch.mul(d, codes, out=out)
    out.add_(m)


def _deq_q5_0(b: torch.Tensor, out: torch.Tensor) -> None:
    d = _f16(b, 0)
    q = _q5_codes(b[:, 2:6], b[:, 6:22]).to(torch.int8) - 16
    torch.mul(d, q, out=out)


def _deq_q5_1(b: torch.Tensor, out: torch.Tensor) -> None:
    d, m = _f16(b, 0), _f16(b, 2)
    q = _q5_codes(b[:, 4:8], b[:, 8:24])
    torch.mul(d, q, out=out)
    out.add_(m)


def _deq_q8_0(b: torch.Tensor, out: torch.Tensor) -> None:
    codes, d = _q8_0_parts(b)
    torch.mul(codes, d, out=out)


def _deq_q2_k(b: torch.Tensor, out: torch.Tensor) -> None:
    n = b.shape[0]
    scales, qs = b[:, 0:16], b[:, 16:80]
    d, dmin = _f16(b, 80), _f16(b, 82)
    dl = (d * (scales & 0x0F).to(torch.float32)).reshape(n, 16, 1)
    ml = (dmin * (scales >> 4).to(torch.float32)).reshape(n, 16, 1)
    q = ((qs.reshape(n, 2, 1, 32) >> _shifts(0, 2, 4, 6).reshape(1, 1, 4, 1)) & 3).reshape(n, 16, 16)
    o = out.view(n, 16, 16)
    torch.mul(dl, q, out=o)
    o.sub_(ml)


def _deq_q3_k(b: torch.Tensor, out: torch.Tensor) -> None:
    n = b.shape[0]
    hmask, qs, scales = b[:, 0:32], b[:, 32:96], b[:, 96:108]
    d = _f16(b, 108)
    lo = (scales[:, 0:8].reshape(n, 1, 8) >> _shifts(0, 4).reshape(1, 2, 1)).reshape(n, 16)
    hi = (scales[:, 8:12].reshape(n, 1, 4) >> _shifts(0, 2, 4, 6).reshape(1, 4, 1)).reshape(n, 16)
    sc = ((lo & 0x0F) | ((hi & 0x03) << 4)).to(torch.int8) - 32
    dl = (d * sc.to(torch.float32)).reshape(n, 16, 1)
    ql = ((qs.reshape(n, 2, 1, 32) >> _shifts(0, 2, 4, 6).reshape(1, 1, 4, 1)).reshape(n, 16, 16)) & 3
    qh = ((hmask.reshape(n, 1, 1, 32) >> _shifts(*range(8)).reshape(1, 1, 8, 1)).reshape(n, 16, 16)) & 1
    q = ql.to(torch.int8) - ((qh ^ 1) << 2).to(torch.int8)   # the offset applies when the bit is 0
    torch.mul(dl, q, out=out.view(n, 16, 16))


def _deq_q4_k(b: torch.Tensor, out: torch.Tensor) -> None:
    n = b.shape[0]
    codes, scale, minimum = _q4_k_parts(b)
    o = out.view(n, 8, 32)
    torch.mul(scale, codes, out=o)
    o.sub_(minimum)


def _deq_q5_k(b: torch.Tensor, out: torch.Tensor) -> None:
    n = b.shape[0]
    sc, mn = _k_scale_min(b[:, 4:16])
    scale = (_f16(b, 0) * sc.to(torch.float32)).reshape(n, 8, 1)
    minimum = (_f16(b, 2) * mn.to(torch.float32)).reshape(n, 8, 1)
    qh, qs = b[:, 16:48], b[:, 48:176]
    ql = ((qs.reshape(n, 4, 1, 32) >> _shifts(0, 4).reshape(1, 1, 2, 1)) & 0x0F).reshape(n, 8, 32)
    hb = ((qh.reshape(n, 1, 1, 32) >> _shifts(*range(8)).reshape(1, 1, 8, 1)) & 1).reshape(n, 8, 32)
    o = out.view(n, 8, 32)
    torch.mul(scale, ql | (hb << 4), out=o)
    o.sub_(minimum)


def _deq_q6_k(b: torch.Tensor, out: torch.Tensor) -> None:
    n = b.shape[0]
    ql, qh = b[:, 0:128], b[:, 128:192]
    scales = b[:, 192:208].view(torch.int8)
    d = (_f16(b, 208) * scales.to(torch.float32)).reshape(n, 16, 1)
    lo = ((ql.reshape(n, 2, 1, 64) >> _shifts(0, 4).reshape(1, 1, 2, 1)) & 0x0F).reshape(n, 8, 32)
    hi = ((qh.reshape(n, 2, 1, 32) >> _shifts(0, 2, 4, 6).reshape(1, 1, 4, 1)) & 0x03).reshape(n, 8, 32)
    q = ((lo | (hi << 4)).to(torch.int8) - 32).reshape(n, 16, 16)
    torch.mul(d, q, out=out.view(n, 16, 16))


_BLOCK_KERNELS: dict[GGMLQuantizationType, Callable[[torch.Tensor, torch.Tensor], None]] = {
    T.Q4_0: _deq_q4_0, T.Q4_1: _deq_q4_1, T.Q5_0: _deq_q5_0, T.Q5_1: _deq_q5_1,
    T.Q8_0: _deq_q8_0, T.Q2_K: _deq_q2_k, T.Q3_K: _deq_q3_k, T.Q4_K: _deq_q4_k,
    T.Q5_K: _deq_q5_k, T.Q6_K: _deq_q6_k,
}


# ---------------------------------------------------------------------- public

def _flat_bytes(data: torch.Tensor, qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> torch.Tensor:
    """Validate ``data`` against ``shape`` and return it as a flat uint8 tensor."""
    shape = tuple(int(s) for s in shape)
    if not shape or any(s < 0 for s in shape):
        raise ValueError(f"invalid tensor shape {shape}")
    if data.dtype != torch.uint8:
        if not data.is_contiguous():
            raise ValueError(f"expected contiguous uint8 bytes, got a non-contiguous {data.dtype} tensor")
        data = data.reshape(-1).view(torch.uint8)
    data = data.reshape(-1)
    expected = row_bytes(qtype, shape[-1]) * _prod(shape[:-1])
    if data.numel() != expected:
        raise ValueError(
            f"{qtype.name} tensor of shape {shape} needs {expected} bytes, got {data.numel()}"
        )
    return data


def _prod(dims: tuple[int, ...]) -> int:
    n = 1
    for s in dims:
        n *= s
    return n


def dequantize(data: torch.Tensor, qtype: GGMLQuantizationType | int, shape: tuple[int, ...]) -> torch.Tensor:
    """Raw GGUF tensor bytes -> float32 tensor of ``shape`` (torch order: rows first).

    ``data`` holds the tensor's bytes contiguously (any shape, usually
    [rows, bytes_per_row] or flat). F32 data is returned as a view over ``data``
    (no copy); every other type gets a new tensor.
    """
    qt = _qtype(qtype)
    shape = tuple(int(s) for s in shape)
    flat = _flat_bytes(data, qt, shape)
    if qt == T.F32:
        return flat.view(torch.float32).reshape(shape)
    if qt == T.F16:
        return half_to_float(flat.view(torch.float16)).reshape(shape)
    if qt == T.BF16:
        # bf16 is the top half of an fp32 bit pattern.
        return (flat.view(torch.int16).to(torch.int32) << 16).view(torch.float32).reshape(shape)
    block, size = GGML_QUANT_SIZES[qt]
    blocks = flat.view(-1, size)
    n_blocks = blocks.shape[0]
    out = torch.empty(n_blocks, block, dtype=torch.float32)
    kernel = _BLOCK_KERNELS[qt]
    step = max(1, CHUNK_ELEMENTS // block)
    for start in range(0, n_blocks, step):
        kernel(blocks[start:start + step], out[start:start + step])
    return out.reshape(shape)


# ------------------------------------------------ unpacked forms for packed matmuls
# All helpers take the tensor's bytes and its torch-order ``shape`` (..., cols) and
# return per-32-element groups: codes [..., cols // 32, 32] and per-group fp32 tensors
# [..., cols // 32]. Weights are ``scales[..., None] * codes (+ offsets[..., None])``,
# which is bit-identical to ``dequantize``.

def _blocks(data: torch.Tensor, qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> torch.Tensor:
    return _flat_bytes(data, qtype, shape).view(-1, GGML_QUANT_SIZES[qtype][1])


def unpack_q4_0(data: torch.Tensor, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_0 -> (codes int8 in -8..7, scales fp32); w = scales * codes."""
    shape = tuple(int(s) for s in shape)
    blocks = _blocks(data, T.Q4_0, shape)
    codes, d = _q4_0_parts(blocks)
    lead = (*shape[:-1], shape[-1] // 32)
    return codes.reshape(*lead, 32), d.reshape(lead)


def unpack_q4_1(data: torch.Tensor, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_1 -> (codes uint8 in 0..15, scales fp32, offsets fp32); w = scales * codes + offsets."""
    shape = tuple(int(s) for s in shape)
    blocks = _blocks(data, T.Q4_1, shape)
    codes, d, m = _q4_1_parts(blocks)
    lead = (*shape[:-1], shape[-1] // 32)
    return codes.reshape(*lead, 32), d.reshape(lead), m.reshape(lead)


def unpack_q8_0(data: torch.Tensor, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 -> (codes int8, a view of ``data``; scales fp32); w = scales * codes."""
    shape = tuple(int(s) for s in shape)
    blocks = _blocks(data, T.Q8_0, shape)
    codes, d = _q8_0_parts(blocks)
    lead = (*shape[:-1], shape[-1] // 32)
    return codes.reshape(*lead, 32), d.reshape(lead)


def unpack_q4_k(data: torch.Tensor, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_K -> (codes uint8 in 0..15, scales fp32, offsets fp32) per 32-element sub-block.

    ``scales`` is ``d * sc`` and ``offsets`` is ``-(dmin * m)`` as the reference computes
    them; ``scales * codes + offsets`` equals its ``d * q - dm`` exactly (IEEE subtraction
    is addition of the negation).
    """
    shape = tuple(int(s) for s in shape)
    blocks = _blocks(data, T.Q4_K, shape)
    codes, scale, minimum = _q4_k_parts(blocks)
    lead = (*shape[:-1], shape[-1] // 32)
    return codes.reshape(*lead, 32), scale.reshape(lead), (-minimum).reshape(lead)
