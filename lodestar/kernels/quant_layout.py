"""The GPU layout of GGUF-quantized weights: ``pack`` (once, at load; same bits) and torch
references of what the kernels compute.

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
                                  [N, K/32];  w = (d*sc) * q - dmin*m; or
                                  in pairs (``pair``): d fp16
                                  [N, K/128] = (d, dmin) a block, sc uint8
                                  [N, K/16] = (sc, m) a group; or as the
                                  file holds them (``block``, 0.5625 bytes a
                                  weight): d int32 [N, K/64] = a block's 16
                                  header bytes, (d, dmin) then the 6-bit
                                  (sc, m) of its 8 groups in 12 bytes
Q5_K   as Q4_K + high: int32      as Q4_K;  q = low | bit << 4                0.703
       [N, K/32]: the 5th bits
       of weights 4j + b and
       16 + 4j + b at bits 8b + j
       and 8b + 4 + j (b, j < 4)
Q6_K   uint8 [N, K/2] (low 4      d fp16 [N, K/256]; sc int8 [N, K/16];       0.820
       bits) + high: int32        w = (d*sc) * (q - 32) per 16 weights
       [N, K/16], 2 bits each:
       weight 4j + b of the 16
       at bits 8b + 2j
=====  =========================  ==========================================  ==============

``QuantizedRows``: bf16 rows and their quantized form (two int8 terms a group, packed four per
int32 word, ``d1`` and the exact half sums) as ``triton_quant.quantize_x`` writes them, made by a
kernel that wrote both at once so that the projection skips its own quantization.

The torch references (``dequantize_packed_ref``, ``quant_matmul_ref``) are what the kernels are
tested against.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from lodestar.kernels import dequant as dq
from lodestar.kernels.launch import SMALL_M_MAX

T = GGMLQuantizationType

GPU_QUANT_TYPES = (T.Q4_0, T.Q4_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K)
GROUP = 32


@dataclass
class QuantizedRows:
    """bf16 rows ``x [M, K]`` and ``quantize_x(x)``, made by a kernel that wrote both at once
    so that the projection skips its own quantization."""

    x: torch.Tensor
    words: torch.Tensor     # int32 [M, K/32, 2, 8]
    d1: torch.Tensor        # fp32 [M, K/32]
    sums: torch.Tensor      # fp32 [M, K/32, 2]

    @property
    def shape(self) -> torch.Size:
        return self.x.shape

    @staticmethod
    def empty(m: int, k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Output buffers (words, d1, sums) for ``m`` rows of ``k`` features."""
        g = k // GROUP
        return (torch.empty(m, g, 2, 8, device=device, dtype=torch.int32),
                torch.empty(m, g, device=device, dtype=torch.float32),
                torch.empty(m, g, 2, device=device, dtype=torch.float32))



def quantizable(rows: int, k: int) -> bool:
    """Rows of ``k`` features that the matrix-vector kernel would quantize (fused producers
    quantize only these)."""
    return 0 < rows <= SMALL_M_MAX and k % GROUP == 0


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
    # int32 arrival counter per output tile of a K-split product (all 0 between launches)
    tile_counters: torch.Tensor | None = None

    @property
    def scale_form(self) -> int:
        """The kernels' ``KPAIR``: 0 for Q4_K / Q5_K scales in four arrays (and every other
        type), 1 in pairs (``d`` holds (d, dmin) and ``sc`` (sc, m) side by side), 2 in blocks
        (``d`` int32 holds each block's 16 header bytes as the file does); ``dmin``, ``sc``
        and ``m`` None where they are not arrays of their own (``KQUANT_SCALE_FORMS``)."""
        if self.qtype not in (T.Q4_K, T.Q5_K) or self.dmin is not None:
            return 0
        return 2 if self.d.dtype == torch.int32 else 1

    @property
    def paired(self) -> bool:
        """Q4_K / Q5_K scales in pairs (``scale_form`` 1)."""
        return self.scale_form == 1

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


# Q5_K's high word of a group: bit p holds the 5th bit of weight Q5K_HIGH_ORDER[p]. Bit 8b + j
# is weight 4j + b, bit 8b + 4 + j weight 16 + 4j + b (b, j < 4): code word j of the group
# (weights 4j .. 4j + 3 in its low nibbles, 16 + 4j .. in its high ones) finds its lanes' 5th
# bits at bit 4 of each byte after one shift, (h << (4 - j)) and (h >> j), and one mask.
Q5K_HIGH_ORDER = tuple(4 * j + b + 16 * hi for b in range(4) for hi in range(2) for j in range(4))


# Q6_K's high word of 16 weights (a group's half): 2-bit field f holds weight Q6K_HIGH_ORDER[f].
# Field 4b + j (bits 8b + 2j) is weight 4j + b: code word j of the half finds its four weights'
# fields at bits 4-5 of each byte after two shifts, (h >> 2j) << 4, and one mask.
Q6K_HIGH_ORDER = tuple(4 * (f % 4) + f // 4 for f in range(16))


def _shift(x: torch.Tensor, *values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.uint8, device=x.device)






# How a Q4_K / Q5_K weight's scales are laid out (``PackedWeight.scale_form``): ``split`` in four
# arrays; ``pair`` a block's (d, dmin) and a group's (sc, m) side by side, one load each;
# ``block`` each block's 16 header bytes as the file holds them (4 bytes fewer a block), the
# 6-bit fields unpacked in the kernel. Same bits from every form; the tiling table picks one
# per shape (``gemv_tiling.kquant_scales``).
KQUANT_SCALE_FORMS = ("split", "pair", "block")


def pack(qtype: GGMLQuantizationType | int, data: torch.Tensor, n: int, k: int,
         scales: str = "split") -> PackedWeight:
    """GGUF bytes ``[n, bytes_per_row]`` (any device) -> ``PackedWeight`` on the same device.
    ``scales``: the Q4_K / Q5_K scale form (``KQUANT_SCALE_FORMS``; other types have one)."""
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
            high = rows(_bits_to_words(bits[..., torch.tensor(Q5K_HIGH_ORDER, device=b.device)], 1))
        form = scales
        if form not in KQUANT_SCALE_FORMS:
            raise ValueError(f"scales={form!r}; use one of {', '.join(KQUANT_SCALE_FORMS)}")
        if form == "block":
            return PackedWeight(qtype, n, k, rows(_pack_nibbles(low)), rows(b[:, 0:16].contiguous().view(torch.int32)),
                                high=high)
        if form == "pair":
            return PackedWeight(qtype, n, k, rows(_pack_nibbles(low)), rows(b[:, 0:4].contiguous().view(torch.float16)),
                                high=high, sc=rows(torch.stack((sc, mn), dim=-1)))
        return PackedWeight(qtype, n, k, rows(_pack_nibbles(low)), rows(_f16(b, 0)), high=high,
                            dmin=rows(_f16(b, 2)), sc=rows(sc), m=rows(mn))
    # Q6_K
    ql, qh = b[:, 0:128], b[:, 128:192]
    lo = ((ql.reshape(nb, 2, 1, 64) >> _shift(b, 0, 4).reshape(1, 1, 2, 1)) & 0x0F).reshape(nb, 256)
    hi = ((qh.reshape(nb, 2, 1, 32) >> _shift(b, 0, 2, 4, 6).reshape(1, 1, 4, 1)) & 0x03).reshape(nb, 16, 16)
    return PackedWeight(qtype, n, k, rows(_pack_nibbles(lo)), rows(_f16(b, 208)),
                        high=rows(_bits_to_words(hi[..., torch.tensor(Q6K_HIGH_ORDER, device=b.device)], 2)),
                        sc=rows(b[:, 192:208].contiguous().view(torch.int8)))




# ------------------------------------------------------------------- torch references

def _unpack_codes(pw: PackedWeight) -> torch.Tensor:
    """Integer codes [N, K] (int32, offsets such as -8 / -32 applied)."""
    n, k = pw.n, pw.k
    if pw.qtype == T.Q8_0:
        return pw.codes.to(torch.int32)
    byte = pw.codes.reshape(n, k // GROUP, 16).to(torch.int32)
    q = torch.cat((byte & 15, byte >> 4), dim=-1)                       # [N, K/32, 32]
    if pw.qtype == T.Q5_K:       # bit p of the group's word: weight Q5K_HIGH_ORDER[p]
        p = torch.argsort(torch.tensor(Q5K_HIGH_ORDER)).to(device=q.device, dtype=torch.int32)   # weight -> bit
        q = q | (((pw.high.reshape(n, -1, 1) >> p) & 1) << 4)
    elif pw.qtype == T.Q6_K:     # field f of a half's word: weight Q6K_HIGH_ORDER[f] (its own inverse)
        f = torch.tensor(Q6K_HIGH_ORDER, device=q.device, dtype=torch.int32)
        bits = (pw.high.reshape(n, -1, 2, 1) >> (2 * f)) & 3            # [N, K/32, 2, 16]
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
        if pw.scale_form == 2:
            head = pw.d.view(torch.uint8).reshape(-1, 16)                     # a block's header bytes
            d, dmin = (head[:, 0:4].contiguous().view(torch.float16).float().reshape(pw.n, -1, 2).unbind(-1))
            sc, m = (t.float().reshape(pw.n, -1) for t in dq._k_scale_min(head[:, 4:16]))
        elif pw.paired:
            d, dmin = pw.d.float()[:, 0::2], pw.d.float()[:, 1::2]
            sc, m = pw.sc.float()[:, 0::2], pw.sc.float()[:, 1::2]
        else:
            d, dmin, sc, m = pw.d.float(), pw.dmin.float(), pw.sc.float(), pw.m.float()
        d = d.repeat_interleave(8, dim=1)
        dmin = dmin.repeat_interleave(8, dim=1)
        return d * sc, -(dmin * m), 32
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


