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
                                  [N, K/32];  w = (d*sc) * q - dmin*m; or
                                  in pairs (``kquant_scales`` pair): d fp16
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

Kernels (reference in brackets, same module):

``quant_matmul`` (M <= ``SMALL_M_MAX``) [``quant_matmul_ref``]
    ``y = x @ W.T`` as matrix-vector products on integer units. ``quantize_x`` first
    splits each 32-element group of x into two int8 terms, ``x ~ d1*q1 + d2*q2``
    (``d2 = d1/254``; the CPU int8 path's scheme, error at most ``amax/64516`` per
    element, far below bf16's rounding of x itself) packed four per int32 word, and the
    exact fp32 sum of each 16-element half. Then one program per (row of x, block of
    ``block_n`` weight rows, K split) streams its rows in tiles of ``tile_groups`` groups:
    4-bit codes are read as int32 words (8 weights each), unpacked with two masks into
    four byte lanes (plus the 5th/6th bits for Q5_K/Q6_K), and multiplied with the x terms
    by ``dp4a`` (4 multiply-adds per instruction, exact int32). Per group the fp32 result
    is ``scale * (d1*i1 + d2*i2 - bias*sum(x)) + offset*sum(x)``. K splits write fp32
    partials; the last program of an output tile to finish (an atomic counter per tile,
    reset to 0 by that program, so CUDA-graph replays find it zeroed) adds them in split
    order, which is what the separate ``_split_sum_kernel`` (fusion ``split_sum`` off)
    does. An x that a fused kernel already quantized (``QuantizedRows``: RMSNorm,
    gated activation) skips ``quantize_x``; the values are the same bits, since every
    kernel that quantizes uses one function (``_quant_groups``) whose half sums are added
    in a fixed pairwise order. Tiling depends on (N, K) only
    and every row of x goes through the same program whatever M is, so a row's result
    does not depend on which other rows share the batch (batched decode and CUDA-graph
    replay give the same tokens as single-stream decode).

    Word-tile form (``GemvConfig.words``; the rule's choice for ``WORDS_TYPES``: Q4_0, Q4_1,
    Q4_K, Q6_K, Q8_0; Q5_K runs it when a config asks, ``WORDS_CAPABLE``, as the H200 table
    does for the 8B shapes): ``_gemv_words_kernel`` holds a tile as ``[block_n, 4 * tile_groups]`` code words,
    four (one group) per thread in one 16-byte load, so that the x words (one 16-byte load
    per term and half, shared by the thread's rows), the dp4a products and the per-group
    scales all live in the same register layout: no shared-memory shuffle or barrier per
    tile (Nsight Compute on the group-tile kernel: L1 throughput 73-90% from such shuffles,
    DRAM 39-44%). Per group the two x terms combine exactly in int32,
    ``d1*i1 + d2*i2 = d2*(254*i1 + i2)``, one conversion to fp32. The scale and x loads are
    inline PTX (``ld.global.nc`` for the scales, a coherent ``ld.global`` for x, which the
    previous kernel writes) so they keep their users' layout; under the interpreter they
    are plain loads.

    Tiling and loop form (``GemvConfig``, chosen by ``gemv_config`` per weight type and
    shape): ``block_n``, ``tile_groups``, ``split_k``, ``num_warps``, and one of three loop
    variants over the default plain loop: ``prefetch`` (the next tile's codes, scales and x
    are loaded into registers before this tile's math), ``stages`` (Triton's software
    pipelining, ``tl.range(num_stages=...)``) or ``unroll`` (the whole tile loop unrolled).
    Every variant adds the same per-group products in the same order within a program, so
    each is deterministic and batch-invariant; results differ from the default's only by
    fp32 rounding of the tile sums. Selection, first match wins:
    ``LODESTAR_GEMV=block_n,tile_groups,split_k,num_warps[,prefetch,stages,unroll,words]`` (every
    shape); ``LODESTAR_GEMV_TABLE=file.json`` (keys ``Q4_K:6144,4096`` or ``6144,4096``,
    values in that same form; the JSON that ``python -m lodestar.bench.gemv_variants`` prints
    is such a file, holding the fastest config it measured per type and shape); the rule
    (``default_gemv_config``) with ``LODESTAR_GEMV_VARIANT=name`` applied (names in
    ``GEMV_VARIANTS``: ``prefetch``, ``stages2``, ``stages3``, ``unroll``, ``wide32``,
    ``wide32_prefetch`` for the group-tile kernel, ``words*`` for the word-tile kernel).
``dequantize_packed`` [``dequantize_packed_ref``, bit-identical to ``dequant.dequantize``]
    Writes the whole weight as bf16 (or fp32); the large-M (prefill) path dequantizes
    per call into a temporary and runs one cuBLAS matmul (``matmul``).

Decode fusions (``fusions()``, env ``LODESTAR_FUSE``: unset or ``1`` all, ``0`` none, or a
comma list of ``quant``, ``split_sum``, ``residual``, ``dense_norm``, ``attn_rope``,
``attn_reduce``, ``attn_quant``, ``glu_epilogue``, ``qkv_rope``, ``quant_norm``, ``norm_sum``,
``glu_quant``; unset: ``DEFAULT_FUSIONS``) only remove kernel launches; with any of them on or
off the results are the same bits, except ``glu_quant``, whose gate|up tiling
(``glu_gemv_config``) adds each row's products in another order than the plain product's
(``gemv_config``), as any other tiling would.

``import triton`` happens only when CUDA is available or ``TRITON_INTERPRET=1`` (the
interpreter runs the same kernels on CPU tensors, which is how the tests exercise them
without a GPU).
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path

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


def pdl(launch_next: bool = False) -> dict:
    """Launch arguments for programmatic dependent launch (Hopper and later; env
    ``LODESTAR_PDL``, unset or 1: on, 0: off, ``wait``: on, but each kernel lets the next
    one launch only when it ends; read at each call): the decode-path kernels (``PDL``
    constexpr) start with ``griddepcontrol.wait`` (nothing is read or written before the
    previous kernel in the stream has finished; only data no kernel of the step writes,
    such as weights, may be read or prefetched before it) and then let the next kernel
    launch, so its blocks are resident and waiting when this one ends instead of being
    launched then. Results are the same bits either way. Decode attention has its own
    form (``triton_attention.attention_pdl``).

    ``launch_next`` (a small kernel before a projection, ``cuda_linear.launch_early``; with
    PDL on): this kernel lets the next one launch before its own wait (``PDL`` 3), so the
    projection's programs become resident, and load the weights they read before their
    wait, while the kernel before this one is still draining. Still the same bits: the
    projection waits for this kernel, which ends only after its own wait.

    Measured and left out (H200 runs 22-23, 30; same tokens): letting the next
    kernel launch before the wait (8B Q4_0 one-stream decode 503.0 -> 484.8 tok/s, F16 255.1
    -> 247.6); an L2 prefetch of each matrix-vector program's weights before the wait
    (510.9 -> 459.1); ``wait`` for every kernel (8B Q4_K at 1k / 8k context 473.6 / 415.6
    -> 469.1 / 411.1)."""
    global _PDL_DEVICE
    env = os.environ.get("LODESTAR_PDL", "1").strip()
    if env not in ("", "0", "1", "wait"):
        raise ValueError(f"LODESTAR_PDL={env!r}; use 0, 1 or wait")
    if env == "0":
        return _PDL_OFF
    if _PDL_DEVICE is None:     # asked once: this runs at every kernel launch
        _PDL_DEVICE = (torch.cuda.is_available() and not interpreted()
                       and torch.cuda.get_device_capability()[0] >= 9)
    if not _PDL_DEVICE:
        return _PDL_OFF
    if env == "wait":
        return _PDL_WAIT
    return _PDL_FIRST if launch_next else _PDL_ON


_PDL_ON, _PDL_OFF = {"PDL": True, "launch_pdl": True}, {"PDL": False}
_PDL_WAIT = {"PDL": 2, "launch_pdl": True}     # the next kernel launches when this one ends
_PDL_FIRST = {"PDL": 3, "launch_pdl": True}    # the next kernel launches before this one waits
_PDL_DEVICE: bool | None = None


FUSIONS = ("quant", "split_sum", "residual", "dense_norm", "attn_rope", "attn_reduce", "attn_quant",
           "glu_epilogue", "qkv_rope", "quant_norm", "norm_sum", "glu_quant")
# On unless LODESTAR_FUSE says otherwise. attn_rope and attn_reduce are left out: the H200
# measured one-stream decode slower with each (run 20, same tokens, on top of the others:
# attn_rope 8B F16 247.3 -> 245.4 tok/s, 8B Q4_0 500.7 -> 478.2, SmolLM2 F16 1,612 -> 1,556;
# attn_reduce 243.5, 464.7, 1,524).
# attn_quant joined after run 23 (same tokens; 8B Q4_0 503.8 -> 510.9 tok/s, Q4_K
# 500.9 -> 503.7; SmolLM2 F16, whose o projection is dense: 1,667.0 -> 1,666.2).
# Measured and removed (run 34, same tokens): a packed gate|up projection applying SiLU·mul
# and quantizing for down itself, in the last of each 32-unit chunk's programs to finish (an
# atomic counter per chunk, as the K-split sum): 8B Q4_0 517.6 -> 501.8 tok/s, Q4_K 509.1 ->
# 485.6; the barrier and acquire-release atomic at the end of each of the 3,584 programs cost
# more than the activation kernel they replace.
# qkv_rope joined after runs 39 and 41 (same tokens; the attention launch as ``qkv_rope_pdl``):
# 8B Q4_0 515.8 -> 523.3 tok/s, Q4_K 510.2 -> 511.8, Llama-3.2-1B Q4_0 1,730.7 -> 1,742.1 (run
# 41), SmolLM2-135M Q4_0 1,748.8 -> 1,798.5 (run 39).
# quant_norm (the q|k|v kernel computes its RMSNorm and quantizes x in every program's
# prologue) is left out: H200 run 51, same tokens, 8B Q4_0 550.7 -> 530.6 tok/s (the q|k|v
# kernel took 10.3 us a call in the decode chain against 4.5 + 4.1 for the norm and the
# projection apart).
# Measured and removed (runs 62-63, same tokens): the packed down projection computing the
# gated activation of gate|up and quantizing it tile by tile (no activation kernel): 8B Q4_0
# 559.4 -> 542.9 tok/s (521.2 with each tile's code words read before gate and up), Q4_K
# 535.0 -> 501.2 / 504.5; each of down's 896 programs recomputes its slice of the
# activation (every value 128 times), on each tile's critical path.
# norm_sum (a quantized down projection with K splits leaves its partial sums to the next
# RMSNorm: no counters, barrier or acquire-release epilogue in its programs) joined after runs
# 78, 82 and 84 (same tokens; run 84: 8B Q4_K 551.7 -> 557.6 tok/s, Llama-3.2-1B Q4_0 1,832.6
# -> 1,858.7, 8B Q4_0 574.1 -> 573.5, SmolLM2-135M Q4_0, whose products do not split,
# 1,874.2 -> 1,871.7).
# glu_quant (a packed gate|up projection in 64-row programs, 32 gate and 32 up rows, applies
# SiLU·mul and quantizes for down: no activation kernel) acts only on the shapes the tiling
# table lists for it (``glu_gemv_config``: on the H200 the 8B Q4_0 gate|up, run 82, same
# tokens, 573.7 -> 577.6 tok/s; Q4_K and SmolLM2 measured slower).
DEFAULT_FUSIONS = ("quant", "split_sum", "residual", "dense_norm", "attn_quant", "glu_epilogue", "qkv_rope",
                   "norm_sum", "glu_quant")


def fusions() -> frozenset[str]:
    """Decode fusions that are on, from ``LODESTAR_FUSE`` (read at each call, so one process
    can capture or time both paths): unset or ``default`` those of ``DEFAULT_FUSIONS``, ``1``
    all of ``FUSIONS``, ``0`` none, else a comma list of their names. ``quant``: RMSNorm and the gated activation also emit the
    quantized x of the projection they feed; ``split_sum``: K splits are added inside the
    matrix-vector kernel; ``residual``: a block's last residual add runs inside the next
    RMSNorm; ``dense_norm``: a small one-row dense (``triton_dense``) projection computes
    the RMSNorm (with its residual add) that feeds it in its own prologue; ``attn_rope``: one-token
    decode attention rotates q and the new key and stores the new key and value itself
    (no separate RoPE + KV-store kernel); ``attn_reduce``: the last decode-attention program of
    a (sequence, kv head) combines its partials (no separate reduce kernel); ``attn_quant``:
    the decode-attention reduce also emits the quantized x of the output projection (no
    separate x quantization before it);
    ``glu_epilogue``: a one-row dense gate|up projection applies the gated activation to its
    own output (no separate SiLU·mul kernel); ``qkv_rope``: a packed q|k|v projection on the
    word-tile kernel rotates q and k and stores k and v at the token's KV slot itself
    (``quant_matmul(rope=...)``; no separate RoPE + KV-store kernel); ``quant_norm``: a
    packed projection whose tiling holds whole rows in one tile (``norm_prologue_ok``)
    computes the RMSNorm (with its residual add) that feeds it and quantizes it in each
    program's prologue (``quant_matmul`` of a ``triton_dense.PendingNorm``; no norm
    kernel); ``norm_sum``: a packed down projection with K splits leaves its partial
    products to the next RMSNorm, which adds them (``SplitPartials``); ``glu_quant``: a
    packed gate|up projection applies the gated activation to its own output and quantizes
    it for down (``quant_glu``, where ``glu_gemv_config`` gives it a tiling; no activation
    kernel)."""
    env = os.environ.get("LODESTAR_FUSE", "").strip()
    if env in ("", "default"):
        return frozenset(DEFAULT_FUSIONS)
    if env == "1":
        return frozenset(FUSIONS)
    if env == "0":
        return frozenset()
    names = frozenset(n.strip() for n in env.split(",") if n.strip())
    unknown = names - set(FUSIONS)
    if unknown:
        raise ValueError(f"LODESTAR_FUSE names {', '.join(sorted(unknown))}; use 0, 1 or a comma list of "
                         f"{', '.join(FUSIONS)}")
    return names


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
        _split_sum_kernel[(-(-total // 1024),)](self.part, out, total, SPLIT=split, BLOCK=1024, num_warps=4,
                                                **pdl())
        return out


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
        and ``m`` None where they are not arrays of their own (``kquant_scales``)."""
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


KQUANT_SCALE_FORMS = ("split", "pair", "block")


def kquant_scales(qtype: GGMLQuantizationType, n: int, k: int, device: torch.device | None,
                  gpu: str | None = None) -> str:
    """How ``pack`` lays out an [n, k] Q4_K / Q5_K weight's scales (``PackedWeight.scale_form``):
    ``split`` in four arrays (``d``, ``dmin`` [N, K/256], ``sc``, ``m`` [N, K/32]); ``pair``:
    a block's (d, dmin) side by side in ``d`` (fp16 [N, K/128]) and each group's (sc, m) in
    ``sc`` (uint8 [N, K/16]), so that a kernel reads each pair in one load from one address;
    ``block``: each block's 16 header bytes as the file holds them, (d, dmin) and the 6-bit
    (sc, m) of its 8 groups, in ``d`` (int32 [N, K/64]), one 16-byte load a block and 4
    bytes fewer a block than the other two (Q4_K 144 against 148, 2.7%; Q5_K 176 against
    180, 2.2%), the 6-bit fields unpacked in the kernel. Same bits from every form. Env ``LODESTAR_KQUANT_SCALES``:
    a form for every weight, or a comma list of shapes ``NxK`` to pair (the others split);
    unset: the ``SCALES:TYPE:n,k`` entry (a form) of the table ``LODESTAR_GEMV_TABLE``
    names, else of the shipped table for the GPU model ``gpu`` or ``device``'s
    (``table_entry``); else split. Read at each ``pack``. Other types: ``split`` (one form).

    Pairs take fewer instructions (the word-tile loop of the 8B gate|up, 8 rows x 32 groups
    x 1 warp, compiled for sm_90: 447 a tile against 506, 31 loads against 47) but not less
    time everywhere. H200, 8B Q4_K one-stream decode, same tokens: every weight paired
    539.7-541.2 tok/s against 560.3-561.1 split (runs 102-104); per kernel (run 103, chain)
    o 116.9 us a step against 127.2 and gate|up 581.9 against 587.0, but q|k|v 228.8 against
    200.1 and down 408.3 against 350.1. Run 105: o and gate|up paired 561.2 -> 566.3, with
    o in 16 rows x 128 groups x 8 warps too 567.6 (that tiling split 564.4). Run 107: q|k|v
    paired as well, in whole rows of 8 x 128 groups x 2 warps (one tile a program; the RMSNorm
    before it stays a kernel of its own, ``quant_norm`` being off: on, run 112, 578.2 ->
    488.6), 567.95 -> 579.2 (that tiling split 553.4); run 108:
    578.7 against 568.3 for the q|k|v before. Down paired lost in every tiling tried (runs
    102-104, 109). The H200 table pairs o, gate|up and q|k|v. Blocks (runs 163-168, same
    tokens): 8B Q5_K_M with gate|up, o and down in blocks 457.2 / 457.7 -> 462.7 / 462.7
    tok/s against pairs (its q|k|v in blocks too: 461.0), so the table puts those three in
    blocks; 8B Q4_K lost in every placement (gate|up 580.2, down 545.6, o 586.6 against
    586.1-589.7), so its entries stay."""
    if qtype not in (T.Q4_K, T.Q5_K):
        return "split"
    value = os.environ.get("LODESTAR_KQUANT_SCALES", "").strip()
    if value in KQUANT_SCALE_FORMS:
        return value
    if value:
        try:
            shapes = {tuple(int(v) for v in part.strip().split("x")) for part in value.split(",") if part.strip()}
        except ValueError:
            shapes = set()
        if not shapes or any(len(sh) != 2 for sh in shapes):
            raise ValueError(f"LODESTAR_KQUANT_SCALES={value!r}: give pair, split, block or shapes NxK[,NxK...]")
        return "pair" if (n, k) in shapes else "split"
    entry = table_entry(f"SCALES:{T(qtype).name}:{n},{k}", device, gpu)
    return entry if entry in KQUANT_SCALE_FORMS else "split"


def pack(qtype: GGMLQuantizationType | int, data: torch.Tensor, n: int, k: int,
         scales: str | None = None) -> PackedWeight:
    """GGUF bytes ``[n, bytes_per_row]`` (any device) -> ``PackedWeight`` on the same device.
    ``scales``: the Q4_K / Q5_K scale form (``KQUANT_SCALE_FORMS``); None: ``kquant_scales``."""
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
        form = scales if scales is not None else kquant_scales(qtype, n, k, data.device)
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
    # Loop variants (``GEMV_VARIANTS``); the defaults are the plain loop measured in
    # docs/benchmarks.md. None changes a row's arithmetic across rows or batch sizes.
    prefetch: bool = False  # issue tile t+1's loads (codes, scales; x too in the group-tile kernel) before tile t's math
    stages: int = 0         # tl.range(num_stages=stages) for the tile loop; 0: the compiler's choice
    unroll: bool = False    # unroll the whole tile loop, so loads of later tiles can be hoisted
    # the tile as code words (``_gemv_words_kernel``; ``WORDS_TYPES`` only)
    words: bool = False
    # registers a thread at most (ptxas ``.maxnreg``; 0: the compiler's choice). Same bits;
    # it sets how many programs an SM holds at once (``lodestar.bench.kernel_regs``)
    maxnreg: int = 0

    def __post_init__(self) -> None:
        if self.prefetch + (self.stages > 0) + self.unroll > 1:
            raise ValueError(f"{self}: prefetch, stages and unroll are alternative forms of the tile "
                             f"loop; set one of them")
        if self.maxnreg and not 24 <= self.maxnreg <= 255:
            raise ValueError(f"{self}: maxnreg is 0 (the compiler's choice) or 24..255 registers")


# Named loop variants applied over the tiling rule's result (``LODESTAR_GEMV_VARIANT``).
# Each is a set of GemvConfig field overrides; ``default`` is the rule itself.
GEMV_VARIANTS: dict[str, dict[str, int | bool]] = {
    "default": {},
    "prefetch": {"prefetch": True},
    "stages2": {"stages": 2},
    "stages3": {"stages": 3},
    "unroll": {"unroll": True},
    "wide32": {"block_n": 32},                       # x terms loaded once per 32 rows, 8 KB tiles
    "wide32_prefetch": {"block_n": 32, "prefetch": True},
    # the tile held as code words, whole groups per thread (``_gemv_words_kernel``)
    "words": {"words": True, "tile_groups": 32},
    "words_unroll": {"words": True, "tile_groups": 32, "unroll": True},
    "words_prefetch": {"words": True, "tile_groups": 32, "prefetch": True},
    "words_bn8": {"words": True, "tile_groups": 32, "block_n": 8},
    "words_bn32_w8": {"words": True, "tile_groups": 32, "block_n": 32, "num_warps": 8},
    "words_tg16": {"words": True, "tile_groups": 16},
    "words_stages3": {"words": True, "tile_groups": 32, "stages": 3},
}
# Types the tiling rule gives the word-tile kernel. Q6_K and Q8_0 joined after run 18 on the
# H200 (8B shapes, kernel time with the rule's word tiles vs the group-tile kernel: Q6_K
# 1.4-2.0x faster, Q8_0 1.4-1.8x; bench/results/h200-gemv-variants-run18.json).
WORDS_TYPES = (T.Q4_0, T.Q4_1, T.Q4_K, T.Q6_K, T.Q8_0)
# Types the word-tile kernel can run when a config asks for it (the rule picks it for
# WORDS_TYPES only; Q5_K runs it where the tiling table says so: on the H200 the 8B shapes,
# run 117, 8B Q5_K_M 279.8 -> 399.3 tok/s against the rule's group tiles; the rule's own
# word tiling is untimed for Q5_K).
WORDS_CAPABLE = WORDS_TYPES + (T.Q5_K,)

_CONFIGS: dict[tuple, GemvConfig] = {}
# K splits are added until there are this many programs per SM. Tiles of 16 rows x 16 groups
# with 4 warps and this rule are what docs/benchmarks.md measures end to end on the H200;
# the tiling sweep (``lodestar.bench.gpu gemv``) finds single shapes up to ~15% faster with
# other tilings, with no tiling best for every type; ``lodestar.bench.gemv_variants``
# measures the loop variants and writes a table ``LODESTAR_GEMV_TABLE`` reads.
PROGRAMS_PER_SM = 4
_GEMV_ENV = ("LODESTAR_GEMV", "LODESTAR_GEMV_VARIANT", "LODESTAR_GEMV_TABLE")


def parse_gemv_config(text: str) -> GemvConfig:
    """``block_n,tile_groups,split_k,num_warps[,prefetch,stages,unroll,words,maxnreg]`` -> GemvConfig."""
    values = [int(v) for v in text.split(",")]
    if not 4 <= len(values) <= 9:
        raise ValueError(f"GEMV config {text!r}: give block_n,tile_groups,split_k,num_warps"
                         f"[,prefetch,stages,unroll,words,maxnreg] as integers")
    fields = ("prefetch", "stages", "unroll", "words", "maxnreg")
    extra = {f: (v if f in ("stages", "maxnreg") else bool(v)) for f, v in zip(fields, values[4:])}
    return GemvConfig(*values[:4], **extra)


def config_text(cfg: GemvConfig) -> str:
    """The ``parse_gemv_config`` form of ``cfg`` (what ``LODESTAR_GEMV`` and the table hold)."""
    text = f"{cfg.block_n},{cfg.tile_groups},{cfg.split_k},{cfg.num_warps}," \
           f"{int(cfg.prefetch)},{cfg.stages},{int(cfg.unroll)}"
    if cfg.maxnreg:
        return text + f",{int(cfg.words)},{cfg.maxnreg}"
    return text + (",1" if cfg.words else "")


def with_variant(cfg: GemvConfig, name: str) -> GemvConfig:
    """``cfg`` with the loop variant ``name`` of ``GEMV_VARIANTS`` applied."""
    if name not in GEMV_VARIANTS:
        raise ValueError(f"LODESTAR_GEMV_VARIANT={name!r}; use one of {', '.join(GEMV_VARIANTS)}")
    change = GEMV_VARIANTS[name]
    if cfg.words and change and "words" not in change:
        # a loop form of the group-tile kernel, over that kernel's tile width
        cfg = replace(cfg, words=False, tile_groups=min(cfg.tile_groups, 16))
    return replace(cfg, **change)


def _lookup(table: dict, n: int, k: int, qtype: GGMLQuantizationType | None, any_type: bool) -> GemvConfig | None:
    """The entry ``TYPE:n,k`` (with ``any_type``, else ``n,k``) of a tiling table, parsed."""
    text = (qtype is not None and table.get(f"{T(qtype).name}:{n},{k}")) or (any_type and table.get(f"{n},{k}"))
    return parse_gemv_config(text) if text else None


def _table_config(path: str, n: int, k: int, qtype: GGMLQuantizationType | None) -> GemvConfig | None:
    """The entry for ``TYPE:n,k`` (else ``n,k``) in a JSON table ``{"Q4_0:n,k":
    "block_n,tile_groups,..."}``, or its ``table`` member (what ``lodestar.bench.gemv_variants``
    prints), or None."""
    return _lookup(table_file(path), n, k, qtype, any_type=True)


TUNED_TABLE = Path(__file__).with_name("gemv_tuned.json")


def table_file(path: str) -> dict:
    """The entries of a tiling table file: its ``table`` member (what
    ``lodestar.bench.gemv_variants`` prints), or the file itself."""
    with open(path) as f:
        doc = json.load(f)
    return doc.get("table", doc)


def shipped_table(gpu: str) -> dict:
    """One GPU model's entries in the shipped table ``gemv_tuned.json`` ({} for a model it lacks)."""
    return json.loads(TUNED_TABLE.read_text()).get(gpu, {})


def table_entry(key: str, device: torch.device | None, gpu: str | None = None) -> str | None:
    """Entry ``key`` of the tiling table in force: the file env ``LODESTAR_GEMV_TABLE`` names
    (``table_file``), none with ``off``, else the shipped table for the GPU model ``gpu`` (else
    ``device``'s; none off the GPU)."""
    table = os.environ.get("LODESTAR_GEMV_TABLE", "").strip()
    if table == "off":
        return None
    if table:
        return table_file(table).get(key)
    if gpu is None:
        if device is None or device.type != "cuda":
            return None
        gpu = torch.cuda.get_device_name(device)
    return shipped_table(gpu).get(key)


def _tuned_config(n: int, k: int, device: torch.device, qtype: GGMLQuantizationType | None) -> GemvConfig | None:
    """The shipped tiling for ``TYPE:n,k`` on this device model (``gemv_tuned.json``), or None."""
    if device.type != "cuda":
        return None
    return _lookup(shipped_table(torch.cuda.get_device_name(device)), n, k, qtype, any_type=False)


def default_gemv_config(n: int, k: int, device: torch.device,
                        qtype: GGMLQuantizationType | None = None) -> GemvConfig:
    """The tiling rule alone: 16 rows x up to 16 groups (``WORDS_TYPES``: the word-tile kernel,
    up to 32 groups), K split until PROGRAMS_PER_SM programs/SM."""
    groups = k // GROUP
    words = qtype is not None and T(int(qtype)) in WORDS_TYPES
    tile = 32 if words else 16
    while tile > 1 and tile > groups:
        tile //= 2
    block_n = 16
    split = 1
    while (-(-n // block_n) * split < PROGRAMS_PER_SM * _num_sms(device)
           and groups // (split * 2) >= 4 * tile and split < 8):
        split *= 2
    return GemvConfig(block_n, tile, split, 4, words=words)


def gemv_config(n: int, k: int, device: torch.device,
                qtype: GGMLQuantizationType | None = None) -> GemvConfig:
    """Tiling for an [n, k] weight of ``qtype``: a function of (type, n, k) and the device
    only, never of M.

    In order of precedence: ``LODESTAR_GEMV=block_n,tile_groups,split_k,num_warps[,prefetch,
    stages,unroll]`` for every shape; ``LODESTAR_GEMV_TABLE=file.json`` per type and shape
    (keys ``Q4_K:n,k`` or ``n,k``; shapes it lacks fall through); without either (and
    without a variant), the shipped table ``gemv_tuned.json`` for this GPU model
    (``LODESTAR_GEMV_TABLE=off`` skips it); the rule
    (``default_gemv_config``), with ``LODESTAR_GEMV_VARIANT=name`` (a key of ``GEMV_VARIANTS``)
    applied to it.
    """
    env = tuple(os.environ.get(v, "") for v in _GEMV_ENV)
    key = (n, k, device.type, None if qtype is None else int(qtype), env)
    cfg = _CONFIGS.get(key)
    if cfg is None:
        fixed, variant, table = env
        if fixed:
            cfg = parse_gemv_config(fixed)
        elif table == "off" or variant:
            cfg = None
        elif table:
            cfg = _table_config(table, n, k, qtype)
        else:
            cfg = _tuned_config(n, k, device, qtype)
        if cfg is None:
            cfg = with_variant(default_gemv_config(n, k, device, qtype), variant or "default")
        _CONFIGS[key] = cfg
    return cfg


def _ptr_args(pw: PackedWeight) -> list[torch.Tensor]:
    # Absent arrays are replaced by ``d`` (never read: the kernel's QTYPE branch skips them).
    return [pw.codes, pw.high if pw.high is not None else pw.d, pw.d,
            pw.dmin if pw.dmin is not None else pw.d, pw.sc if pw.sc is not None else pw.d,
            pw.m if pw.m is not None else pw.d]


def gemv_early(n: int, k: int, whole_rows: bool = False) -> bool:
    """Whether the word-tile matrix-vector kernel over an [n, k] weight loads its first tile's
    code words before it waits for the previous kernel (under dependent launch its programs
    are resident while that kernel runs, so the first weight read overlaps it; same bits
    either way). Env ``LODESTAR_GEMV_EARLY``: 1 always, 0 never, a comma list of shapes
    ``NxK`` (those weights only, e.g. ``4096x4096,6144x4096``), unset: weights with a side of
    at most ``GEMV_EARLY_MAX_DIM`` (every projection has the model width as a side, so: models
    up to 2,048 wide), and tilings whose program holds whole rows in one tile
    (``whole_rows``: no K split, all of a program's weights read before the wait; read at
    each call).

    H200, same tokens on every side. Run 64, 8B Q4_0 gate|up (8 rows, one warp, 4 tiles a
    program) early too: 559.6 [559.3-559.8] -> 561.4 [561.3-561.6] tok/s. Run 65, every
    tiling without K splits early (gate|up, the head, Q4_K's q|k|v) against this rule: Q4_0
    558.7 -> 560.1, Q4_K 533.6 -> 506.7; not adopted.

    H200, 8B one-stream decode, same tokens on every side. Run 50, whole rows in one tile
    for o (32 rows, 8 warps; 128 programs) and q|k|v (16 rows, 4 warps): Q4_0 shipped tiles
    (K splits) 524.0 tok/s; o whole 536.3, o and q|k|v whole 540.6 (run 49 without the
    early load: o whole 509.7, o and q|k|v (32 rows) whole 498.8); Q4_K o whole 511.8 ->
    515.1.

    H200, one-stream decode, same tokens on every side. Run 36, every weight early against
    none: SmolLM2-135M Q4_0 (width 576) 1,602.5 -> 1,733.4 tok/s, 8B Q4_0 (4,096) 515.6 ->
    499.6, Q4_K 509.2 -> 489.1. Run 37: Llama-3.2-1B Q4_0 (2,048) none 1,611.6, rows of up
    to 2,048 weights (the rule before: all but down) 1,653.4, every weight 1,726.7; 8B Q4_0
    none 517.1, every weight 500.5, q|k|v and o only 515.2, down only 511.1."""
    env = os.environ.get("LODESTAR_GEMV_EARLY", "").strip()
    if env in ("", "0", "1"):
        return env == "1" or (env == "" and (whole_rows or min(n, k) <= GEMV_EARLY_MAX_DIM))
    return (n, k) in _early_shapes(env)


WEIGHT_EVICT_DEFAULT = "none"


def weight_evict(qtype: GGMLQuantizationType, n: int = 0, k: int = 0) -> str:
    """The eviction policy (``tl.load``'s: L1 and an L2 cache hint) of the word-tile kernel's
    code-word loads for an ``n`` x ``k`` weight of ``qtype``: ``evict_first`` where env
    ``LODESTAR_WEIGHT_EVICT`` names it (a comma list of type names, ``TYPE:NxK`` for one
    shape of a type, ``all`` or ``none``; default none; read at each call), else normal.
    Evict-first, the weight stream would leave what else L2 holds (the side prefetch's rows,
    activations, keys and values) in place. Same bits either way.

    H200, one-stream decode, same tokens on every side, with the side prefetch and q|k|v
    launched early. 8B Q4_0 gains: run 70, 575.8 -> 584.0 tok/s; run 71, 582.5 (Q4_0
    weights only) and 583.2 (its Q8_0 head too). 8B Q4_K weights evict-first decode at
    381.4-386.2 against 551.0 (runs 70-71; its Q6_K head alone: 552.0), and Llama-3.2-1B
    Q4_0 loses too (run 76: 1,832.4 -> 1,706.4). Hence off by default. Per shape, with the
    fusion ``glu_quant`` (run 87, 8B Q4_0 579.8 shipped): gate|up 520.8, down 579.7, all
    525.7; all Q4_0 with the plain gate|up tiling 581.7 against 575.7 without (run 89:
    578.9 against 577.1 shipped). Q4_K gate|up 429.0, down 506.8 (557.7); Llama-3.2-1B Q4_0
    down 1,726.6, gate|up 1,846.3 (1,846.7)."""
    env = os.environ.get("LODESTAR_WEIGHT_EVICT", WEIGHT_EVICT_DEFAULT).strip()
    names = _EVICT_NAMES.get(env)
    if names is None:       # parsed once per setting: this runs at every launch
        names = frozenset(e.strip() for e in env.split(",") if e.strip())
        known = {t.name for t in WORDS_CAPABLE}
        if any(e.split(":")[0] not in known or (":" in e and not re.fullmatch(r"\d+x\d+", e.split(":", 1)[1]))
               for e in names - {"all", "none"}):
            raise ValueError(f"LODESTAR_WEIGHT_EVICT={env!r}; use all, none or a comma list of types "
                             f"({', '.join(sorted(known))}) or TYPE:NxK shapes")
        _EVICT_NAMES[env] = names
    name = T(qtype).name
    return "evict_first" if names & {"all", name, f"{name}:{n}x{k}"} else ""


_EVICT_NAMES: dict[str, frozenset[str]] = {}


def _early_shapes(text: str) -> frozenset[tuple[int, int]]:
    """``NxK[,NxK...]`` of ``LODESTAR_GEMV_EARLY`` as (n, k) pairs."""
    shapes = _EARLY_SHAPES.get(text)
    if shapes is None:
        try:
            shapes = frozenset(tuple(int(v) for v in part.lower().split("x")) for part in text.split(",")
                               if part.strip())
        except ValueError:
            shapes = frozenset({(0, 0, 0)})
        if not shapes or any(len(s) != 2 for s in shapes):
            raise ValueError(f"LODESTAR_GEMV_EARLY={text!r}; use 0, 1 or a comma list of weight shapes NxK "
                             f"(unset: weights with a side of at most 2,048)")
        _EARLY_SHAPES[text] = shapes
    return shapes


_EARLY_SHAPES: dict[str, frozenset] = {}
GEMV_EARLY_MAX_DIM = 2048


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
    _quant_x_kernel[(M, -(-G // gb))](x, words, d1, sums, x.stride(0), G, GB=gb, num_warps=4, **pdl())
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


def graph_buffers(cache: dict, device: torch.device, need: int, minimum: int, size_of, make, what: str):
    """The newest of ``cache[device]``'s buffers, first adding one of ``make(n)`` with n =
    max(need, minimum, twice the newest's ``size_of``) when it holds fewer than ``need``.
    Older buffers stay alive (a CUDA graph captured with one keeps its addresses); adding
    one during a capture is an error, so an eager call before capturing must reserve it."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    bufs = cache.setdefault(device, [])
    if not bufs or size_of(bufs[-1]) < need:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"{what}: {need} needed inside a CUDA-graph capture; reserve them before capturing")
        bufs.append(make(max(need, minimum, 2 * size_of(bufs[-1]) if bufs else 0), device))
    return bufs[-1]


# ------------------------------------------------------------------- weight prefetch

# A decode step's small kernels (RMSNorm, RoPE + KV store, gated activation) read a few
# KB and leave HBM idle; with a prefetch they also ask L2 for the weights of the
# projection that runs next (whole, when they fit in ``weight_prefetch_limit()``). The
# asks come from extra programs of that kernel (about one per SM, so that no SM issues
# them all), which touch no data of any kernel and, unless ``prefetch_waits()`` is off,
# first wait for the previous kernel to end. Each range is asked for in one of three
# forms (``weight_prefetch_form``): ``bulk``, one ``cp.async.bulk.prefetch.L2`` per lane
# (the range split evenly over all lanes); ``line`` / ``sector``, ``prefetch.global.L2``
# of every 128 / 32 bytes, all lanes of all programs covering the range's first bytes
# first. Nothing is written, so the results are the same bits with or without it.
#
# Measured on the H200 (runs 31-33, same tokens, one-stream decode): SmolLM2-135M F16,
# whose projections are 0.7-3.5 MB, 1,654 -> 1,688 tok/s (line form, after the wait); the
# 8B files only lose, whatever the form, size or site: Q4_0 517.5 -> 485.1 / 454.8 /
# 437.0 tok/s asking for the first 16 / 32 / 64 MB of each projection (Q4_K 509.9 ->
# 465.7 / 434.6 / 418.8; F16 258.5 -> 252.1 / 241.9 / 226.4); at 32 MB one site at a time,
# Q4_0 517.0 -> 506.7 (q|k|v), 509.0 (o), 500.1 (gate|up), 489.4 (down). The small kernel
# ends only when its asks are served, so the stream starts no sooner and the projection
# after it waits; launched without the wait (``LODESTAR_WEIGHT_PREFETCH_EARLY=1``) the
# asks compete with the previous projection's own stream (Q4_0 16 MB: 491.6 line, 494.9
# sector, 500.9 bulk). Hence the default: projections of up to 4 MiB only, which no 8B
# projection is (run 34, same tokens, off -> default: SmolLM2 F16 1,661.5 -> 1,714.8 tok/s;
# 8B Q4_0 517.0 / 517.6, Q4_K 509.9 / 509.1, F16 256.3 / 256.2). Asked by decode attention
# instead (before its wait; at 8B it launches when the q|k|v kernel ends, so nothing else
# streams then): o's weights whole, then gate|up's first bytes, up to 10 / 24 / 40 MiB (run 42,
# same tokens): Q4_0 522.3 -> 513.0 / 508.9 / 500.9 tok/s, Q4_K 512.4 -> 506.1 / 506.0 / 506.5
# (removed): the asks occupy the SMs' load paths that the latency-bound kernels use.
PREFETCH_RANGES = 3             # the largest arrays of a projection (codes, then scales)
WEIGHT_PREFETCH_DEFAULT_MB = "4"
PREFETCH_FORMS = {"bulk": 1, "line": 128, "sector": 32}     # the kernels' PF constexpr
WEIGHT_PREFETCH_DEFAULT_FORM = "line"
_NO_PREFETCH = (0,) * (3 * PREFETCH_RANGES)
_PREFETCH_ARGS: dict[tuple, tuple[int, ...]] = {}


def _env_mib(name: str, default: str) -> int:
    """Env ``name`` (MiB, a number >= 0; unset: ``default``) in bytes."""
    env = os.environ.get(name, default).strip() or "0"
    try:
        mib = float(env)
    except ValueError:
        mib = -1.0
    if mib < 0:
        raise ValueError(f"{name}={env!r}; give MiB (a number >= 0, 0: off)")
    return int(mib * (1 << 20))


def weight_prefetch_limit() -> int:
    """The largest projection (all its weight arrays, bytes) whose weights the small kernel
    before it in a decode step asks L2 for (env ``LODESTAR_WEIGHT_PREFETCH`` in MiB, default
    4, ``0`` off; read at each call)."""
    return _env_mib("LODESTAR_WEIGHT_PREFETCH", WEIGHT_PREFETCH_DEFAULT_MB)


def weight_prefetch_form() -> int:
    """The prefetch instruction form (env ``LODESTAR_WEIGHT_PREFETCH_FORM``: ``bulk``,
    ``line`` or ``sector``) as the kernels' ``PF`` value (``PREFETCH_FORMS``)."""
    env = os.environ.get("LODESTAR_WEIGHT_PREFETCH_FORM", WEIGHT_PREFETCH_DEFAULT_FORM).strip()
    if env not in PREFETCH_FORMS:
        raise ValueError(f"LODESTAR_WEIGHT_PREFETCH_FORM={env!r}; use one of {', '.join(PREFETCH_FORMS)}")
    return PREFETCH_FORMS[env]


def prefetch_waits() -> bool:
    """Whether the prefetching programs first wait for the previous kernel to end (env
    ``LODESTAR_WEIGHT_PREFETCH_EARLY``: unset or 0, they wait; 1, they start at once, while
    the previous kernel may still be streaming its own weights)."""
    env = os.environ.get("LODESTAR_WEIGHT_PREFETCH_EARLY", "0").strip() or "0"
    if env not in ("0", "1"):
        raise ValueError(f"LODESTAR_WEIGHT_PREFETCH_EARLY={env!r}; use 0 or 1")
    return env == "0"


def prefetch_plan(ranges: list[tuple[int, int]], limit: int, sms: int, programs_per_row: int, lanes: int,
                  form: int = 1) -> tuple[int, ...]:
    """``prefetch_launch``'s arithmetic: ``(extra rows, address, bytes, step, ...)`` for the
    largest PREFETCH_RANGES of ``ranges`` ((address, bytes) each, one projection's arrays),
    whole, when all of ``ranges`` together are at most ``limit`` bytes (else nothing: all
    0), over about ``sms`` programs of ``lanes`` lanes (whole rows of ``programs_per_row``).
    ``step``: bytes a lane asks for in one bulk prefetch (``form`` 1), else the prefetches
    of ``form`` bytes each lane issues. Bytes and chunks are multiples of 16; unaligned
    ranges are left out; unused slots are 0."""
    extra = -(-sms // programs_per_row)
    slots = extra * programs_per_row * lanes
    flat: list[int] = []
    if sum(n for _, n in ranges) <= limit:
        for addr, size in sorted(ranges, key=lambda r: -r[1])[:PREFETCH_RANGES]:
            n = size // 16 * 16
            if addr % 16 or n == 0:
                continue
            step = (-(-n // slots) + 15) // 16 * 16 if form == 1 else -(-n // (slots * form))
            flat += [addr, n, step]
    return (extra,) + tuple(flat + [0] * (3 * PREFETCH_RANGES - len(flat)))


def prefetch_launch(arrays: list[torch.Tensor] | None, rows: int, programs_per_row: int, lanes: int,
                    ) -> tuple[int, tuple[int, ...], int]:
    """(extra rows of programs, their kernel arguments, the ``PF`` constexpr: 0 for none) for
    a kernel whose grid is ``(rows,
    programs_per_row)`` with ``lanes`` threads a program to prefetch ``arrays`` (the next
    projection's, ``cuda_linear.prefetch_arrays``) if they fit in ``weight_prefetch_limit()``
    bytes. No prefetch (0 rows) without arrays, on the CPU or the interpreter, for more
    rows than the matrix-vector kernel takes, or for arrays over the limit."""
    if not arrays or interpreted() or rows > SMALL_M_MAX or not arrays[0].is_cuda:
        return 0, _NO_PREFETCH, 0
    limit = weight_prefetch_limit()
    if limit <= 0:
        return 0, _NO_PREFETCH, 0
    form = weight_prefetch_form()
    ranges = tuple((a.data_ptr(), a.numel() * a.element_size()) for a in arrays)
    key = (ranges, limit, programs_per_row, lanes, form)
    args = _PREFETCH_ARGS.get(key)
    if args is None:
        if len(_PREFETCH_ARGS) >= 4096:     # models loaded and dropped in one process
            _PREFETCH_ARGS.clear()
        args = _PREFETCH_ARGS[key] = prefetch_plan(list(ranges), limit, _num_sms(arrays[0].device),
                                                   programs_per_row, lanes, form)
    return (args[0], args[1:], form) if any(args[1:]) else (0, _NO_PREFETCH, 0)


# A decode step's small kernels between two projections leave HBM mostly idle. The side
# prefetch asks L2 for the first bytes of a later projection's weights from a kernel of
# its own on a second stream (``side_prefetch``), forked from the step's stream after an
# earlier kernel and joined at the step's end: unlike the prefetching programs of a small
# kernel (above), nothing on the step's own path waits for its asks to be served.
SIDE_PREFETCH_PROGRAMS = 32
SIDE_PREFETCH_LANES = 128
SIDE_PREFETCH_DEFAULT_MB = "16"


def side_prefetch_limit() -> int:
    """Bytes of a quantized gate|up projection's weights (its arrays' first bytes, in the same
    proportion each) that the side prefetch asks L2 for while the attention block runs
    (forked after the q|k|v kernel): env ``LODESTAR_SIDE_PREFETCH`` in MiB, default 16, 0
    off; read at each call. Only for projections the small kernel before them does not
    prefetch whole (over ``weight_prefetch_limit()``).

    H200, 8B one-stream decode, same tokens on every side. Run 69: Q4_0 560.1 -> 570.1 /
    570.0 / 563.8 / 545.6 tok/s at 8 / 16 / 24 / 32 MiB (with q|k|v, down and the head
    launched early, ``cuda_linear.launch_early``: 564.8 -> 576.0 at 16; Q4_K 535.2 -> 551.0
    at 16); run 71, with the weight stream
    evict-first (``weight_evict``): 12 / 16 / 20 MiB 583.9 / 582.5 / 580.9. Tried and left
    out: down's first bytes too, forked before gate|up (run 73: 591.2 -> 587.7 / 581.6 /
    568.0 at 4 / 8 / 16 MiB; Q4_K 556.2 -> 547.4 at 8), gate|up's last rows instead of its
    first (run 74: Q4_0 588.8 -> 590.1, Q4_K 555.7 -> 536.0), the fork before q|k|v (576.4,
    Q4_K 538.4), an evict-last hint on the prefetch (run 72: 582.2 against ~581 without).
    Shipped with q|k|v launched early (run 77, against neither): Q4_0 560.5 -> 575.2, Q4_K
    534.4 -> 551.2; Llama-3.2-1B Q4_0 (run 76) 1,828.9 -> 1,832.4. Run 143, 8B Q4_K against
    580.2: off 547.9, forked after decode attention's partial kernel 548.3, after the
    attention 559.0. Run 145: the o projection's first 2 / 4 / 9 MiB asked for too, before
    gate|up's, 554.7 / 561.4 / 562.4 against 579.0 / 580.0. Run 146: the kernel in 4 / 1 / 128
    programs instead of ``SIDE_PREFETCH_PROGRAMS`` (32) 561.9 / 399.8 / 576.0 against 580.4."""
    return _env_mib("LODESTAR_SIDE_PREFETCH", SIDE_PREFETCH_DEFAULT_MB)


def head_ranges(arrays: list[torch.Tensor], limit: int) -> list[tuple[int, int]]:
    """(address, bytes) of the first ``limit`` bytes of ``arrays`` taken together, the same
    fraction of each (row-major weights: the first rows), 16-byte multiples, the
    ``PREFETCH_RANGES`` largest arrays only; unaligned arrays are left out."""
    sizes = [a.numel() * a.element_size() for a in arrays]
    total = sum(sizes)
    if total == 0 or limit <= 0:
        return []
    frac = min(1.0, limit / total)
    out = []
    for a, n in sorted(zip(arrays, sizes), key=lambda t: -t[1])[:PREFETCH_RANGES]:
        take = int(n * frac) // 16 * 16
        if take and a.data_ptr() % 16 == 0:
            out.append((a.data_ptr(), take))
    return out


def side_prefetch(arrays: list[torch.Tensor] | None, limit: int | None = None) -> None:
    """Launch, on the current stream, one kernel of ``SIDE_PREFETCH_PROGRAMS`` programs that
    asks L2 for the first ``limit`` bytes (default ``side_prefetch_limit()``) of ``arrays``
    (``cp.async.bulk.prefetch``, each lane a contiguous chunk); nothing is read into
    registers or written. No-op without arrays, with the limit 0, or in the interpreter."""
    limit = side_prefetch_limit() if limit is None else limit
    if not arrays or limit <= 0 or interpreted() or not arrays[0].is_cuda:
        return
    ranges = head_ranges(arrays, limit)
    lanes = SIDE_PREFETCH_PROGRAMS * SIDE_PREFETCH_LANES
    flat: list[int] = []
    for addr, n in ranges:
        flat += [addr, n, (-(-n // lanes) + 15) // 16 * 16]
    flat += [0] * (3 * PREFETCH_RANGES - len(flat))
    _side_prefetch_kernel[(SIDE_PREFETCH_PROGRAMS, 1)](*flat, LANES=SIDE_PREFETCH_LANES, num_warps=4)


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


def rope_epilogue_ok(pw: PackedWeight, rows: int, head_dim: int, n_q: int, n_k: int,
                     config: GemvConfig | None = None, n_out: int | None = None) -> bool:
    """Whether ``quant_matmul(rope=...)`` can run for ``rows`` tokens over ``pw``: the word-tile
    kernel, tiles of whole rotation pairs (an even ``block_n`` dividing the head dim), a
    q|k|v output of ``n_q + 2 * n_k`` columns (``n_out``: the stack's whose part ``pw`` is;
    default ``pw.n``)."""
    n_out = pw.n if n_out is None else n_out
    if not 0 < rows <= SMALL_M_MAX or pw.k % GROUP or n_out != n_q + 2 * n_k or n_q % head_dim or n_k % head_dim:
        return False
    cfg = config or gemv_config(pw.n, pw.k, pw.device, pw.qtype)
    return (cfg.words and pw.qtype in WORDS_CAPABLE and cfg.block_n % 2 == 0 and head_dim % cfg.block_n == 0)


def qkv_rope_pdl(k: int = 0) -> str:
    """How a q|k|v kernel that rotates and stores (``qkv_rope``) over rows of ``k`` weights lets
    the next kernel (decode attention) launch, env ``LODESTAR_QKV_ROPE_PDL``: ``1`` as
    ``pdl()``, as soon as its programs have started; ``wait``: when it ends; unset: ``1``
    for models up to ``QKV_ROPE_EARLY_LAUNCH_MAX_K`` wide, else ``wait``.

    H200, one-stream decode, same tokens; without ``qkv_rope`` / with it, ``1`` / ``wait``.
    Run 41 (x loaded coherently, see ``_ld_x``): 8B Q4_0 515.8 / - / 523.3 tok/s, Q4_K
    510.2 / - / 511.8, Llama-3.2-1B Q4_0 1,730.7 / - / 1,742.1, SmolLM2-135M Q4_0 1,747.3 / -
    / 1,733.9. Run 39: ``1`` 8B Q4_0 516.1, Q4_K 506.1, 1B 1,725.1, SmolLM2 1,798.5 against
    516.4, 510.0, 1,725.4, 1,748.8 without (run 39's ``wait`` figures for the two models
    whose first tile loads early read x before the wait, ``_ld_x``, so they are not
    quoted). Fewer attention programs (``LODESTAR_ATTN_PROGRAMS_PER_SM=1``) were no
    substitute for ``wait`` (8B Q4_0 516.6)."""
    env = os.environ.get("LODESTAR_QKV_ROPE_PDL", "").strip()
    if env == "":
        return "1" if 0 < k <= QKV_ROPE_EARLY_LAUNCH_MAX_K else "wait"
    if env not in ("1", "wait"):
        raise ValueError(f"LODESTAR_QKV_ROPE_PDL={env!r}; use 1 or wait")
    return env


QKV_ROPE_EARLY_LAUNCH_MAX_K = 1024


def norm_prologue_ok(pw: PackedWeight, rows: int, config: GemvConfig | None = None) -> bool:
    """Whether ``quant_matmul`` of a ``triton_dense.PendingNorm`` over ``pw`` computes the norm
    inside the word-tile kernel for ``rows`` rows: each program holds whole rows in one tile
    (no K split, ``tile_groups * 32 == k``, a power of two), whole row blocks, a type with
    16-weight half groups (not Q8_0)."""
    if not 0 < rows <= SMALL_M_MAX or pw.qtype not in WORDS_CAPABLE or pw.qtype == T.Q8_0:
        return False
    cfg = config or gemv_config(pw.n, pw.k, pw.device, pw.qtype)
    return (cfg.words and whole_rows(cfg, pw.k) and cfg.tile_groups * GROUP == pw.k and pw.k & (pw.k - 1) == 0
            and pw.n % cfg.block_n == 0)


def whole_rows(cfg: GemvConfig, k: int) -> bool:
    """A program of ``cfg`` holds whole rows of ``k`` weights in one tile (no K split)."""
    return cfg.split_k == 1 and k // GROUP <= cfg.tile_groups


def loads_all_before_wait(pw: PackedWeight, rows: int) -> bool:
    """Whether ``quant_matmul`` over ``pw`` for ``rows`` rows runs the word-tile kernel with
    every weight of a program read before its wait (whole rows in one tile, loaded early):
    the kernel before it then lets it launch before its own wait
    (``cuda_linear.launch_early``)."""
    if not 0 < rows <= SMALL_M_MAX or pw.qtype not in WORDS_CAPABLE:
        return False
    cfg = gemv_config(pw.n, pw.k, pw.device, pw.qtype)
    return cfg.words and whole_rows(cfg, pw.k) and gemv_early(pw.n, pw.k, True)


def quant_matmul(x, pw: PackedWeight, out_dtype: torch.dtype | None = None,
                 config: GemvConfig | None = None, rope: RopeStore | None = None,
                 defer_sum: bool = False, out: torch.Tensor | None = None,
                 row0: int = 0) -> torch.Tensor | SplitPartials:
    """``x [M, K] @ W.T`` for M <= SMALL_M_MAX with the Triton matrix-vector kernel; bf16 in, out_dtype out.

    ``x`` may come quantized already (``QuantizedRows``), or be a ``triton_dense.PendingNorm``
    (bf16): computed and quantized in the kernel's prologue when ``norm_prologue_ok``, else
    by the norm kernel first; the same bits either way. ``config`` replaces
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
    from lodestar.kernels.triton_dense import PendingNorm
    norm = None
    if isinstance(x, PendingNorm):
        if x.x.dim() == 2 and x.x.dtype == torch.bfloat16 and norm_prologue_ok(pw, x.x.shape[0], config):
            norm = x
        else:
            x = x.materialize()
    M, K = x.shape
    if K != pw.k:
        raise ValueError(f"x has {K} features, weight expects {pw.k}")
    if norm is not None and out is not None:
        raise ValueError("quant_matmul(out=...) takes x quantized or bf16, not a pending norm")
    if norm is not None:
        out_dtype = out_dtype or norm.x.dtype
        words = norm.x      # never read: the kernel quantizes the norm itself
        d1 = sums = norm.weight
    elif isinstance(x, QuantizedRows):
        out_dtype = out_dtype or x.x.dtype
        words, d1, sums = x.words, x.d1, x.sums
    else:
        out_dtype = out_dtype or x.dtype
        words, d1, sums = quantize_x(x.to(torch.bfloat16).contiguous())
    device = words.device
    cfg = config or gemv_config(pw.n, pw.k, device, pw.qtype)
    if norm is not None:
        nr = norm.residual if norm.residual is not None else norm.x
        norm_c = dict(nx_ptr=norm.x, nr_ptr=nr, nw_ptr=norm.weight, h_ptr=norm.h, eps=norm.eps, NORM=True,
                      NORM_RES=norm.residual is not None)
    else:
        norm_c = {}
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
    fused_sum = cfg.split_k > 1 and "split_sum" in fusions() and not defer_sum
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
        if rope is not None and launch["PDL"] is True and qkv_rope_pdl(pw.k) == "wait":
            launch = _PDL_WAIT
        _gemv_words_kernel[grid](words, d1, sums, part, out, counters, codes, *_ptr_args(pw)[1:], row0 + pw.n,
                                 n_out, M * n_out, *rope_args, K=pw.k, QTYPE=int(pw.qtype), BLOCK_N=cfg.block_n,
                                 TG=cfg.tile_groups, GROUPS_PER_SPLIT=per_split, SPLIT=cfg.split_k,
                                 LAST_SUMS=fused_sum, ASM=not interpreted(), STAGES=cfg.stages, UNROLL=cfg.unroll,
                                 EVEN=even,
                                 EARLY=gemv_early(pw.n, pw.k, whole_rows(cfg, pw.k)), **rope_c,
                                 **norm_c, EVICT=weight_evict(pw.qtype, pw.n, pw.k), KPAIR=pw.scale_form,
                                 PREFETCH=cfg.prefetch, PID0=row0 // cfg.block_n, num_warps=cfg.num_warps,
                                 maxnreg=cfg.maxnreg or None, **launch)
    else:
        _gemv_kernel[grid](words, d1, sums, part, out, counters, codes, *_ptr_args(pw)[1:], pw.n, pw.n, M * pw.n,
                           K=pw.k, QTYPE=int(pw.qtype), BLOCK_N=cfg.block_n, TG=cfg.tile_groups,
                           GROUPS_PER_SPLIT=per_split, SPLIT=cfg.split_k, LAST_SUMS=fused_sum,
                           ASM=not interpreted(), PREFETCH=cfg.prefetch, STAGES=cfg.stages, UNROLL=cfg.unroll,
                           KPAIR=pw.scale_form, num_warps=cfg.num_warps, maxnreg=cfg.maxnreg or None, **pdl())
    if defer_sum:
        return SplitPartials(part, out_dtype)
    if cfg.split_k > 1 and not fused_sum:
        if n_out == pw.n:
            SplitPartials(part, out_dtype).materialize(out)
        else:   # a part of a stack: its own columns only
            cols = slice(row0, row0 + pw.n)
            out[:, cols] = SplitPartials(part[:, :, cols].contiguous(), out_dtype).materialize()
    return out


_GLU_CONFIGS: dict[tuple, GemvConfig | None] = {}


def glu_gemv_config(pw: PackedWeight) -> GemvConfig | None:
    """Tiling of a gate|up product that applies the gated activation itself (fusion
    ``glu_quant``), or None where that product does not: env ``LODESTAR_GLU_GEMV``, a tiling
    in ``LODESTAR_GEMV``'s form for every gate|up weight, or ``off``; unset: the
    ``GLU:TYPE:n,k`` entry (``glu_entry``) of the table ``LODESTAR_GEMV_TABLE`` names (``off``:
    none), else of the shipped table for this GPU model (``gemv_tuned.json``); else None. The
    tile is cut to the row's groups. Read at each call.

    H200, 8B one-stream decode, same tokens (run 82): Q4_0 573.7 -> 577.6 tok/s in 64 rows x
    16 groups x 4 warps (the table's entry), 544.8 in 64 x 32 groups, 577.2 in 128 x 16 x 8
    warps, 510.9 in 64 x 16 x 2 warps; Q4_K 551.3 -> 484.7 in 64 x 16 x 4 (64-row Q4_K tiles
    stream slowly: 497-511 tok/s for the plain product in such tiles, run 81); SmolLM2-135M
    Q4_0 1,873.9 -> 1,840.8. So only the 8B Q4_0 gate|up has an entry. Runs 93-94: that
    tiling capped at 128 registers a thread (4 programs an SM: the 448 programs in one wave)
    578.7 -> 585.7 tok/s, at 120 575.6; with down in one wave too, 599.8. Its tile loop
    unrolled as well (runs 97-98): 601.2 -> 602.9, 596.9 -> 601.9. The table's entry now
    has both, the cap and the unrolled loop."""
    env = os.environ.get("LODESTAR_GLU_GEMV", "").strip()
    table = os.environ.get("LODESTAR_GEMV_TABLE", "").strip()
    key = (pw.n, pw.k, int(pw.qtype), pw.device.type, env, table)
    if key in _GLU_CONFIGS:
        return _GLU_CONFIGS[key]
    if env == "off" or (not env and table == "off"):
        cfg = None
    elif env:
        cfg = parse_gemv_config(env)
    else:
        text = table_entry(f"GLU:{T(pw.qtype).name}:{pw.n},{pw.k}", pw.device)
        cfg = parse_gemv_config(text) if text else None
    if cfg is not None:
        tile = cfg.tile_groups
        while tile > 1 and tile > pw.k // GROUP:
            tile //= 2
        cfg = replace(cfg, tile_groups=tile)
    _GLU_CONFIGS[key] = cfg
    return cfg


def glu_entry(table: dict, n: int, k: int, qtype: GGMLQuantizationType) -> GemvConfig | None:
    """The ``GLU:TYPE:n,k`` entry of one GPU model's tiling table, parsed, or None."""
    text = table.get(f"GLU:{T(qtype).name}:{n},{k}")
    return parse_gemv_config(text) if text else None


def glu_epilogue_ok(pw: PackedWeight, rows: int, ffn: int, config: GemvConfig | None = None) -> bool:
    """Whether ``quant_glu`` runs ``rows`` rows over ``pw`` as a gate|up weight of 2 * ``ffn``
    rows (gate rows, then up rows; ``ffn`` a multiple of 32): a word-tile type with a tiling
    (``config``, else ``glu_gemv_config``) without K splits whose programs hold whole 32-unit
    groups of both halves, or a whole fraction of one (1, 2, 4, 8 or 16 units of each half:
    the group's last program quantizes it, ``_glu_quant_store``), at most ``SMALL_M_MAX``
    rows."""
    if not 0 < rows <= SMALL_M_MAX or pw.qtype not in WORDS_CAPABLE or pw.n != 2 * ffn or ffn % GROUP:
        return False
    cfg = config or glu_gemv_config(pw)
    if cfg is None:
        return False
    half = cfg.block_n // 2
    return cfg.words and cfg.split_k == 1 and half > 0 and (half % GROUP == 0 or GROUP % half == 0) and ffn % half == 0


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
    _gemv_words_kernel[(M, pw.n // cfg.block_n, 1)](
        words, d1, sums, out, out, counters, pw.codes.view(torch.int32), *_ptr_args(pw)[1:], pw.n, ffn, 0,
        *(d1,) * 6, *(0,) * 5, K=pw.k, QTYPE=int(pw.qtype), BLOCK_N=cfg.block_n, TG=cfg.tile_groups,
        GROUPS_PER_SPLIT=groups, SPLIT=1, LAST_SUMS=False, ASM=not interpreted(), STAGES=cfg.stages,
        UNROLL=cfg.unroll, EVEN=even, EARLY=gemv_early(pw.n, pw.k, whole_rows(cfg, pw.k)), ROPE=False, NQ=0,
        NK=0, HD=0, EVICT=weight_evict(pw.qtype, pw.n, pw.k), qw_ptr=qw, qd_ptr=qd, qs_ptr=qs, F=ffn, GLU=act,
        KPAIR=pw.scale_form, PREFETCH=cfg.prefetch, num_warps=cfg.num_warps, maxnreg=cfg.maxnreg or None, **pdl())
    return QuantizedRows(out, qw, qd, qs)


def dequantize_packed(pw: PackedWeight, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The whole weight [N, K] in ``dtype`` (bf16 rounding of the exact fp32 values)."""
    out = torch.empty(pw.n, pw.k, device=pw.device, dtype=dtype)
    groups = pw.k // GROUP
    per = 8 if groups % 8 == 0 else 4 if groups % 4 == 0 else 2 if groups % 2 == 0 else 1
    block_n = 32
    grid = (-(-pw.n // block_n), groups // per)
    _dequant_kernel[grid](out, *_ptr_args(pw), pw.n, K=pw.k, QTYPE=int(pw.qtype),
                          BLOCK_N=block_n, GROUPS=per, KPAIR=pw.scale_form, num_warps=4)
    return out


def matmul(x: torch.Tensor, pw: PackedWeight, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x @ W.T`` for any number of rows: fused kernel for few rows, dequantize + cuBLAS else.
    The result is in ``out_dtype`` (default: x's dtype)."""
    if isinstance(x, QuantizedRows) or x.shape[0] <= SMALL_M_MAX:
        return quant_matmul(x, pw, out_dtype)
    return F.linear(x.to(torch.bfloat16), dequantize_packed(pw, torch.bfloat16)).to(out_dtype or x.dtype)


# --------------------------------------------------------------------------- kernels

if triton_enabled():
    import triton
    import triton.language as tl

    from lodestar.kernels.triton_dense import _glu_act, _pdl_enter, _residual_chunk, _rms_apply, _rms_rstd

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
            if QTYPE == 13:  # Q5_K: weights h and 16 + h at bits 8 (h % 4) + h // 4 and that + 4
                w = tl.load(high_ptr + rows * (K // 32) + g, mask=mask_n, other=0)
                bit = (8 * (h % 4) + h // 4)[None, :]
                qa = qa | (((w[:, None] >> bit) & 1) << 4)
                qb = qb | (((w[:, None] >> (bit + 4)) & 1) << 4)
            if QTYPE == 14:  # Q6_K: weight h of each half at bits 8 (h % 4) + 2 (h // 4) of its word
                w0 = tl.load(high_ptr + rows * (K // 16) + 2 * g, mask=mask_n, other=0)
                w1 = tl.load(high_ptr + rows * (K // 16) + 2 * g + 1, mask=mask_n, other=0)
                pos = (8 * (h % 4) + 2 * (h // 4))[None, :]
                qa = (qa | (((w0[:, None] >> pos) & 3) << 4)) - 32
                qb = (qb | (((w1[:, None] >> pos) & 3) << 4)) - 32
        return qa, qb

    @triton.jit
    def _group_scales(d_ptr, dmin_ptr, sc_ptr, m_ptr, rows, mask_n, g, K: tl.constexpr, QTYPE: tl.constexpr,
                      KPAIR: tl.constexpr = False):
        """(scale of weights 0..15, scale of 16..31, offset) fp32 [BN] of group ``g``.

        w = scale * q + offset for Q4_1, scale * q - offset for Q4_K/Q5_K, scale * q otherwise.
        KPAIR: Q4_K/Q5_K scale form (``PackedWeight.scale_form``).
        """
        if QTYPE == 14:  # Q6_K: one scale per 16 weights
            d = tl.load(d_ptr + rows * (K // 256) + g // 8, mask=mask_n, other=0).to(tl.float32)
            sa = tl.load(sc_ptr + rows * (K // 16) + 2 * g, mask=mask_n, other=0).to(tl.float32)
            sb = tl.load(sc_ptr + rows * (K // 16) + 2 * g + 1, mask=mask_n, other=0).to(tl.float32)
            scale_a = d * sa
            scale_b = d * sb
            offset = d * 0.0
        elif QTYPE == 12 or QTYPE == 13:  # Q4_K, Q5_K
            blk = rows * (K // 256) + g // 8
            grp = rows * (K // 32) + g
            if KPAIR == 2:
                d, dmin, sc, mn = _block_scales(d_ptr, blk, g % 8, mask_n)
            elif KPAIR == 1:
                d = tl.load(d_ptr + 2 * blk, mask=mask_n, other=0).to(tl.float32)
                dmin = tl.load(d_ptr + 2 * blk + 1, mask=mask_n, other=0).to(tl.float32)
                sc = tl.load(sc_ptr + 2 * grp, mask=mask_n, other=0).to(tl.float32)
                mn = tl.load(sc_ptr + 2 * grp + 1, mask=mask_n, other=0).to(tl.float32)
            else:
                d = tl.load(d_ptr + blk, mask=mask_n, other=0).to(tl.float32)
                dmin = tl.load(dmin_ptr + blk, mask=mask_n, other=0).to(tl.float32)
                sc = tl.load(sc_ptr + grp, mask=mask_n, other=0).to(tl.float32)
                mn = tl.load(m_ptr + grp, mask=mask_n, other=0).to(tl.float32)
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
    def _dp4a(a, b, c, ASM: tl.constexpr):
        """``c + sum of the four signed byte products of a and b`` (int32 tensors)."""
        if ASM:
            return tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                             dtype=tl.int32, is_pure=True, pack=1)
        r = c
        for j in tl.static_range(4):
            r += ((a << (24 - 8 * j)) >> 24) * ((b << (24 - 8 * j)) >> 24)
        return r

    @triton.jit
    def _quant_groups(x, GB: tl.constexpr):
        """fp32 ``x [GB, 32]`` (one 32-element group a row) -> (term 1 words [GB, 8], term 2
        words [GB, 8], d1 [GB], sum of elements 0..15 [GB], sum of 16..31 [GB]).

        Element-wise steps and an exact max and integer packing, then half sums in a fixed
        pairwise order (adjacent pairs, then pairs of pairs...), so the bits do not depend on
        the register layout of whichever kernel calls this."""
        amax = tl.max(tl.abs(x), axis=1)                                   # [GB]
        d1 = amax / 127.0
        inv = tl.where(amax > 0, 127.0 / tl.where(amax > 0, amax, 1.0), 0.0)
        q1 = tl.floor(x * inv[:, None] + 0.5)
        rest = x - q1 * d1[:, None]
        q2 = tl.minimum(tl.maximum(tl.floor(rest * (inv * 254.0)[:, None] + 0.5), -127.0), 127.0)
        shift = (tl.arange(0, 4) * 8)[None, None, :]
        # bytes never overlap, so the integer sums are exact ORs
        w1 = tl.sum(tl.reshape(q1.to(tl.int32) & 255, (GB, 8, 4)) << shift, axis=2)
        w2 = tl.sum(tl.reshape(q2.to(tl.int32) & 255, (GB, 8, 4)) << shift, axis=2)
        a, b = tl.split(tl.reshape(x, (GB, 16, 2)))
        s16 = a + b
        a, b = tl.split(tl.reshape(s16, (GB, 8, 2)))
        s8 = a + b
        a, b = tl.split(tl.reshape(s8, (GB, 4, 2)))
        s4 = a + b
        a, b = tl.split(tl.reshape(s4, (GB, 2, 2)))
        s2 = a + b                                                         # [GB, 2]: the two halves
        sa, sb = tl.split(s2)
        return w1, w2, d1, sa, sb

    @triton.jit
    def _store_quant_groups(words_ptr, d1_ptr, sums_ptr, row, mask_g, w1, w2, d1, sa, sb):
        """Store ``_quant_groups``' output for groups ``row`` (flat index m * G + g) [GB]."""
        wo = row[:, None] * 16 + tl.arange(0, 8)[None, :]
        tl.store(words_ptr + wo, w1, mask=mask_g[:, None])
        tl.store(words_ptr + wo + 8, w2, mask=mask_g[:, None])
        tl.store(d1_ptr + row, d1, mask=mask_g)
        tl.store(sums_ptr + row * 2, sa, mask=mask_g)
        tl.store(sums_ptr + row * 2 + 1, sb, mask=mask_g)

    @triton.jit
    def _quant_x_kernel(x_ptr, words_ptr, d1_ptr, sums_ptr, stride_xm, G, GB: tl.constexpr, PDL: tl.constexpr):
        """One row of x, GB groups of 32: two int8 terms packed in words, d1, half sums."""
        _pdl_enter(PDL)
        pid_m = tl.program_id(0)
        g = tl.program_id(1) * GB + tl.arange(0, GB)                       # [GB]
        mask_g = g < G
        offs = g[:, None] * 32 + tl.arange(0, 32)[None, :]                  # [GB, 32]
        x = tl.load(x_ptr + pid_m.to(tl.int64) * stride_xm + offs, mask=mask_g[:, None], other=0.0
                    ).to(tl.float32)
        w1, w2, d1, sa, sb = _quant_groups(x, GB)
        _store_quant_groups(words_ptr, d1_ptr, sums_ptr, pid_m.to(tl.int64) * G + g, mask_g, w1, w2, d1, sa, sb)

    @triton.jit
    def _q5k_lo(h, j):
        """The 5th bits of code word j's low-nibble lane (weights 4j .. 4j + 3) from a Q5_K
        group's high word ``h`` (``Q5K_HIGH_ORDER``: bits 8b + j), at bit 4 of bytes 0..3."""
        return (h << (4 - j)) & 0x10101010

    @triton.jit
    def _q5k_hi(h, j):
        """The same for its high-nibble lane (weights 16 + 4j ..: bits 8b + 4 + j)."""
        return (h >> j) & 0x10101010

    @triton.jit
    def _q6k_lane(h, j):
        """The high 2 bits of code word j's four weights (4j .. 4j + 3 of a half) from a Q6_K
        half's word ``h`` (``Q6K_HIGH_ORDER``: bits 8b + 2j), at bits 4-5 of bytes 0..3. The
        arithmetic shift's copies of bit 31 end up above bit 31 or at bits 30-31, which the
        mask clears."""
        return ((h >> (2 * j)) << 4) & 0x30303030

    @triton.jit
    def _code_words(codes_ptr, rows, g, mask2, i4, K: tl.constexpr, QTYPE: tl.constexpr):
        """Code words of groups ``g`` for ``rows``: ([BN, TG, 4], [BN, TG, 4]); Q8_0: the two
        halves' int8 words, 4-bit types: the group's 4 words (and a dummy second)."""
        mask3 = mask2[:, :, None]
        if QTYPE == 8:
            base = codes_ptr + rows[:, None, None] * (K // 4) + (g[:, None] * 8 + i4[None, :])[None, :, :]
            return tl.load(base, mask=mask3, other=0), tl.load(base + 4, mask=mask3, other=0)
        word = tl.load(codes_ptr + rows[:, None, None] * (K // 8) + (g[:, None] * 4 + i4[None, :])[None, :, :],
                       mask=mask3, other=0)
        return word, word

    @triton.jit
    def _tile_loads(xw_ptr, d1_ptr, xsum_ptr, codes_ptr, high_ptr, d_ptr, dmin_ptr, sc_ptr, m_ptr,
                    pid_m, rows, mask_n, g, mask_g, K: tl.constexpr, QTYPE: tl.constexpr, KPAIR: tl.constexpr = False):
        """Everything one tile of groups ``g`` reads, as loaded (no arithmetic), so that a
        caller can issue it ahead of the math: (code words lo, hi [BN, TG, 4], high bits h0,
        h1 [BN, TG], scales s0..s3 [BN, TG], x words x1a, x1b, x2a, x2b [TG, 4], d1, half sums
        xsa, xsb [TG]). Places a type has no use for repeat a loaded value (never read).

        Scales: Q4_0/Q8_0 (d, -, -, -), Q4_1 (d, m, -, -), Q4_K/Q5_K (d, dmin, sc, m; KPAIR:
        the scale form, ``PackedWeight.scale_form``; blocks are unpacked here), Q6_K (d, sc of weights 0..15,
        sc of 16..31, -)."""
        G: tl.constexpr = K // 32
        i4 = tl.arange(0, 4)
        mask2 = mask_n[:, None] & mask_g[None, :]                  # [BN, TG]
        r2 = rows[:, None]
        g2 = g[None, :]
        lo, hi = _code_words(codes_ptr, rows, g, mask2, i4, K, QTYPE)
        if QTYPE == 14:  # Q6_K: two high words and two scales per group
            h0 = tl.load(high_ptr + r2 * (K // 16) + 2 * g2, mask=mask2, other=0)
            h1 = tl.load(high_ptr + r2 * (K // 16) + 2 * g2 + 1, mask=mask2, other=0)
            s0 = tl.load(d_ptr + r2 * (K // 256) + g2 // 8, mask=mask2, other=0)
            s1 = tl.load(sc_ptr + r2 * (K // 16) + 2 * g2, mask=mask2, other=0)
            s2 = tl.load(sc_ptr + r2 * (K // 16) + 2 * g2 + 1, mask=mask2, other=0)
            s3 = s0
        elif QTYPE == 12 or QTYPE == 13:  # Q4_K, Q5_K
            if KPAIR == 2:     # unpacked here: fp32 (d, dmin, sc, m)
                s0, s1, s2, s3 = _block_scales(d_ptr, r2 * (K // 256) + g2 // 8, g2 % 8, mask2)
            elif KPAIR == 1:
                s0 = tl.load(d_ptr + 2 * (r2 * (K // 256) + g2 // 8), mask=mask2, other=0)
                s1 = tl.load(d_ptr + 2 * (r2 * (K // 256) + g2 // 8) + 1, mask=mask2, other=0)
                s2 = tl.load(sc_ptr + 2 * (r2 * (K // 32) + g2), mask=mask2, other=0)
                s3 = tl.load(sc_ptr + 2 * (r2 * (K // 32) + g2) + 1, mask=mask2, other=0)
            else:
                s0 = tl.load(d_ptr + r2 * (K // 256) + g2 // 8, mask=mask2, other=0)
                s1 = tl.load(dmin_ptr + r2 * (K // 256) + g2 // 8, mask=mask2, other=0)
                s2 = tl.load(sc_ptr + r2 * (K // 32) + g2, mask=mask2, other=0)
                s3 = tl.load(m_ptr + r2 * (K // 32) + g2, mask=mask2, other=0)
            if QTYPE == 13:  # the group's high word (Q5K_HIGH_ORDER)
                h0 = tl.load(high_ptr + r2 * (K // 32) + g2, mask=mask2, other=0)
            else:
                h0 = s2
            h1 = h0
        else:  # Q4_0, Q4_1, Q8_0: one scale per 32 weights
            s0 = tl.load(d_ptr + r2 * (K // 32) + g2, mask=mask2, other=0)
            if QTYPE == 3:
                s1 = tl.load(m_ptr + r2 * (K // 32) + g2, mask=mask2, other=0)
            else:
                s1 = s0
            s2 = s0
            s3 = s0
            h0 = s0
            h1 = s0
        xrow = pid_m.to(tl.int64) * G + g
        xo = xrow[:, None] * 16 + i4[None, :]
        x1a = tl.load(xw_ptr + xo, mask=mask_g[:, None], other=0)
        x1b = tl.load(xw_ptr + xo + 4, mask=mask_g[:, None], other=0)
        x2a = tl.load(xw_ptr + xo + 8, mask=mask_g[:, None], other=0)
        x2b = tl.load(xw_ptr + xo + 12, mask=mask_g[:, None], other=0)
        d1 = tl.load(d1_ptr + xrow, mask=mask_g, other=0.0)
        xsa = tl.load(xsum_ptr + xrow * 2, mask=mask_g, other=0.0)
        xsb = tl.load(xsum_ptr + xrow * 2 + 1, mask=mask_g, other=0.0)
        return lo, hi, h0, h1, s0, s1, s2, s3, x1a, x1b, x2a, x2b, d1, xsa, xsb

    @triton.jit
    def _tile_acc(acc, tile, QTYPE: tl.constexpr, ASM: tl.constexpr):
        """``acc [BN, TG]`` plus one tile's per-group products (``tile``: ``_tile_loads``' output):
        integer dot products of the codes with both x terms (dp4a), then
        ``scale * (d1*i1 + d2*i2 - bias*sum(x)) + offset * sum(x)`` in fp32."""
        lo_w, hi_w, h0, h1, s0, s1, s2, s3, x1a, x1b, x2a, x2b, d1, xsa, xsb = tile
        i4 = tl.arange(0, 4)
        zero3 = tl.zeros_like(lo_w)
        # x is the same for every row: broadcast [TG, 4] -> [BN, TG, 4]
        x1a = x1a[None, :, :] + zero3
        x1b = x1b[None, :, :] + zero3
        x2a = x2a[None, :, :] + zero3
        x2b = x2b[None, :, :] + zero3
        d1 = d1[None, :]
        d2 = d1 / 254.0
        xsa = xsa[None, :]
        xsb = xsb[None, :]
        # codes: int32 words [BN, TG, 4], bytes = weights 4i..4i+3 of each half
        if QTYPE == 8:
            lo = lo_w
            hi = hi_w
        else:           # 4-bit codes: low nibbles weights 0..15, high 16..31
            lo = lo_w & 0x0F0F0F0F
            hi = (lo_w >> 4) & 0x0F0F0F0F
            if QTYPE == 13:  # Q5_K: word j's lanes' 5th bits (Q5K_HIGH_ORDER) to bit 4 of each byte
                lo = lo | _q5k_lo(h0[:, :, None], i4[None, None, :])
                hi = hi | _q5k_hi(h0[:, :, None], i4[None, None, :])
            if QTYPE == 14:  # Q6_K: two words per group, 2 bits per weight
                lo = lo | _q6k_lane(h0[:, :, None], i4[None, None, :])
                hi = hi | _q6k_lane(h1[:, :, None], i4[None, None, :])
        if QTYPE == 14:  # two scales per group: keep the halves apart
            ia1 = tl.sum(_dp4a(lo, x1a, zero3, ASM), axis=2)
            ia2 = tl.sum(_dp4a(lo, x2a, zero3, ASM), axis=2)
            ib1 = tl.sum(_dp4a(hi, x1b, zero3, ASM), axis=2)
            ib2 = tl.sum(_dp4a(hi, x2b, zero3, ASM), axis=2)
            dot_a = d1 * ia1.to(tl.float32) + d2 * ia2.to(tl.float32) - 32.0 * xsa
            dot_b = d1 * ib1.to(tl.float32) + d2 * ib2.to(tl.float32) - 32.0 * xsb
            d = s0.to(tl.float32)
            acc += (d * s1.to(tl.float32)) * dot_a + (d * s2.to(tl.float32)) * dot_b
        else:
            i1 = tl.sum(_dp4a(hi, x1b, _dp4a(lo, x1a, zero3, ASM), ASM), axis=2)
            i2 = tl.sum(_dp4a(hi, x2b, _dp4a(lo, x2a, zero3, ASM), ASM), axis=2)
            dot = d1 * i1.to(tl.float32) + d2 * i2.to(tl.float32)
            xs = xsa + xsb
            if QTYPE == 12 or QTYPE == 13:  # Q4_K, Q5_K: w = (d*sc) * q - dmin*m
                acc += ((s0.to(tl.float32) * s2.to(tl.float32)) * dot
                        - (s1.to(tl.float32) * s3.to(tl.float32)) * xs)
            else:  # Q4_0, Q4_1, Q8_0: one scale per 32 weights
                scale = s0.to(tl.float32)
                if QTYPE == 2:    # Q4_0: w = d * (q - 8)
                    acc += scale * (dot - 8.0 * xs)
                elif QTYPE == 3:  # Q4_1: w = d * q + m
                    acc += scale * dot + s1.to(tl.float32) * xs
                else:
                    acc += scale * dot
        return acc

    @triton.jit
    def _store_rows(y, part_ptr, out_ptr, count_ptr, pid_m, pid_n, pid_s, offs_n, mask_n, stride_om, stride_split,
                    SPLIT: tl.constexpr, LAST_SUMS: tl.constexpr, ROPE: tl.constexpr = False, rc=0, rs=0,
                    slot=0, kc_ptr=0, vc_ptr=0, skc0=0, skc1=0, svc0=0, svc1=0,
                    NQ: tl.constexpr = 0, NK: tl.constexpr = 0, HD: tl.constexpr = 0, PID0: tl.constexpr = 0):
        """Store a program's row sums ``y [BN]``: into ``out`` (one split), else into its split's
        fp32 partials; with LAST_SUMS the last of the tile's SPLIT programs to arrive adds the
        partials in split order into ``out`` and puts the tile's counter back to 0. ROPE: the
        final sums go through ``_rope_store`` (rows in ``_rope_rows`` order; ``rc``, ``rs``,
        ``slot`` from ``_rope_inputs``)."""
        row_offs = pid_m.to(tl.int64) * stride_om + offs_n
        if SPLIT == 1:
            if ROPE:
                _rope_store(y, out_ptr, pid_m, pid_n, stride_om, rc, rs, slot, kc_ptr, vc_ptr, skc0, skc1, svc0, svc1,
                            NQ, NK, HD)
            else:
                tl.store(out_ptr + row_offs, y.to(out_ptr.dtype.element_ty), mask=mask_n)
        else:
            tl.store(part_ptr + pid_s * stride_split + row_offs, y, mask=mask_n)
            if LAST_SUMS:
                # Every thread's partial is stored before the counter moves (barrier, then a
                # release); the last arrival reads the others' partials from L2 after its acquire.
                tl.debug_barrier()
                tile = pid_m * tl.num_programs(1) + pid_n - PID0
                arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
                if arrived == SPLIT - 1:
                    tl.debug_barrier()
                    total = tl.load(part_ptr + row_offs, mask=mask_n, other=0.0, cache_modifier=".cg")
                    for s in tl.static_range(1, SPLIT):
                        total += tl.load(part_ptr + s * stride_split + row_offs, mask=mask_n, other=0.0,
                                         cache_modifier=".cg")
                    if ROPE:
                        _rope_store(total, out_ptr, pid_m, pid_n, stride_om, rc, rs, slot, kc_ptr, vc_ptr, skc0, skc1,
                                    svc0, svc1, NQ, NK, HD)
                    else:
                        tl.store(out_ptr + row_offs, total.to(out_ptr.dtype.element_ty), mask=mask_n)
                    tl.atomic_xchg(count_ptr + tile, 0, sem="relaxed", scope="gpu")

    @triton.jit
    def _rope_rows(pid_n, BLOCK_N: tl.constexpr, HD: tl.constexpr):
        """Rows of q|k|v program ``pid_n`` under the fusion ``qkv_rope``: BLOCK_N/2 dims of one
        head and their rotate-half partners (``d``, then ``d + HD/2``), so that the program that
        writes the tile holds both halves of every rotation it applies."""
        H2: tl.constexpr = BLOCK_N // 2
        n0 = pid_n * BLOCK_N
        i = tl.arange(0, BLOCK_N)
        return (n0 // HD) * HD + (n0 % HD) // 2 + (i % H2) + (i // H2) * (HD // 2)

    @triton.jit
    def _rope_inputs(pid_m, pid_n, pos_ptr, slot_ptr, cos_ptr, sin_ptr, s_cos, BLOCK_N: tl.constexpr,
                     HD: tl.constexpr):
        """cos and sin [BLOCK_N / 2] of program ``pid_n``'s dims at token ``pid_m``'s position,
        and the token's KV slot, loaded as the program starts, before it waits for the previous
        kernel: positions and slots are step inputs (the model runner copies them in before the
        step's first kernel, as decode attention's block tables), and their latency then hides
        behind that wait instead of adding two dependent reads to the program's end (H200 run
        37, reading them at the end: 8B Q4_K one-stream decode 509.5 -> 498.6 tok/s)."""
        H2: tl.constexpr = BLOCK_N // 2
        d0 = (pid_n * BLOCK_N % HD) // 2
        pos = tl.load(pos_ptr + pid_m).to(tl.int64)
        j = tl.arange(0, H2)
        return (tl.load(cos_ptr + pos * s_cos + d0 + j), tl.load(sin_ptr + pos * s_cos + d0 + j),
                tl.load(slot_ptr + pid_m).to(tl.int64))

    @triton.jit
    def _rope_store(y, out_ptr, pid_m, pid_n, stride_om, c, s, slot, kc_ptr, vc_ptr, skc0, skc1, svc0, svc1,
                    NQ: tl.constexpr, NK: tl.constexpr, HD: tl.constexpr):
        """Final sums ``y [BN]`` of a q|k|v tile in ``_rope_rows`` order, rounded to ``out``'s
        dtype; q and k rows rotated by ``c``, ``s`` (``_rope_inputs``) with the bits of
        ``triton_fused._rope_rows`` (``fma(f1, c, -(f2 * s))``, ``fma(f2, c, f1 * s)``, written
        out as ``triton_attention._rope_cols`` does), written to ``out``; k and v rows also
        stored at ``slot`` of the caches ``[slots, heads, HD]``."""
        BN: tl.constexpr = y.shape[0]
        H2: tl.constexpr = BN // 2
        yb = y.to(out_ptr.dtype.element_ty)
        a, b = tl.split(tl.permute(tl.reshape(yb, (2, H2)), (1, 0)))     # dims d0 + j, d0 + HD/2 + j
        n0 = pid_n * BN
        d0 = (n0 % HD) // 2
        j = tl.arange(0, H2)
        row = pid_m.to(tl.int64) * stride_om + (n0 // HD) * HD + d0 + j
        if n0 < NQ + NK:
            af = a.to(tl.float32)
            bf = b.to(tl.float32)
            a = tl.fma(af, c, (bf * s) * -1.0).to(yb.dtype)
            b = tl.fma(bf, c, af * s).to(yb.dtype)
        tl.store(out_ptr + row, a)
        tl.store(out_ptr + row + HD // 2, b)
        if n0 >= NQ:
            if n0 < NQ + NK:
                dst = kc_ptr + slot * skc0 + ((n0 - NQ) // HD) * skc1 + d0 + j
                tl.store(dst, a.to(kc_ptr.dtype.element_ty))
                tl.store(dst + HD // 2, b.to(kc_ptr.dtype.element_ty))
            else:
                dst = vc_ptr + slot * svc0 + ((n0 - NQ - NK) // HD) * svc1 + d0 + j
                tl.store(dst, a.to(vc_ptr.dtype.element_ty))
                tl.store(dst + HD // 2, b.to(vc_ptr.dtype.element_ty))

    @triton.jit
    def _gemv_kernel(xw_ptr, d1_ptr, xsum_ptr, part_ptr, out_ptr, count_ptr, codes_ptr, high_ptr, d_ptr,
                     dmin_ptr, sc_ptr, m_ptr, N, stride_om, stride_split,
                     K: tl.constexpr, QTYPE: tl.constexpr, BLOCK_N: tl.constexpr, TG: tl.constexpr,
                     GROUPS_PER_SPLIT: tl.constexpr, SPLIT: tl.constexpr, LAST_SUMS: tl.constexpr,
                     ASM: tl.constexpr, PREFETCH: tl.constexpr, STAGES: tl.constexpr, UNROLL: tl.constexpr,
                     PDL: tl.constexpr, KPAIR: tl.constexpr = False):
        """One row of x (quantized by ``_quant_groups``) against BLOCK_N weight rows over one
        K split, tile by tile (``_tile_loads`` then ``_tile_acc``); the loop is plain, or with
        PREFETCH holds the next tile's loads in registers while this tile's math runs, or is
        pipelined by Triton (STAGES > 0), or fully unrolled (UNROLL). Every form adds the same
        per-group products into ``acc`` in the same tile order.

        SPLIT == 1 stores to ``out``; else each program stores its fp32 partial in
        ``part[pid_s]``, and with LAST_SUMS the last of the tile's SPLIT programs to arrive
        adds ``part[0] + part[1] + ...`` in that order into ``out`` (as ``_split_sum_kernel``)
        and puts the tile's counter back to 0.
        """
        _pdl_enter(PDL)
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_s = tl.program_id(2)
        G: tl.constexpr = K // 32
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        rows = offs_n.to(tl.int64)
        tg = tl.arange(0, TG)
        acc = tl.zeros((BLOCK_N, TG), dtype=tl.float32)
        g_start = pid_s * GROUPS_PER_SPLIT
        if PREFETCH:
            # tile t+1's loads go out before tile t's math; past the last tile they are all masked
            nxt = _tile_loads(xw_ptr, d1_ptr, xsum_ptr, codes_ptr, high_ptr, d_ptr, dmin_ptr, sc_ptr, m_ptr,
                              pid_m, rows, mask_n, g_start + tg, (g_start + tg < G) & (tg < GROUPS_PER_SPLIT),
                              K, QTYPE, KPAIR)
            for t in range(0, GROUPS_PER_SPLIT, TG):
                cur = nxt
                g = g_start + t + TG + tg
                nxt = _tile_loads(xw_ptr, d1_ptr, xsum_ptr, codes_ptr, high_ptr, d_ptr, dmin_ptr, sc_ptr, m_ptr,
                                  pid_m, rows, mask_n, g, (g < G) & (t + TG + tg < GROUPS_PER_SPLIT), K, QTYPE,
                                  KPAIR)
                acc = _tile_acc(acc, cur, QTYPE, ASM)
        elif UNROLL:
            for t in tl.static_range(0, GROUPS_PER_SPLIT, TG):
                g = g_start + t + tg
                acc = _tile_acc(acc, _tile_loads(xw_ptr, d1_ptr, xsum_ptr, codes_ptr, high_ptr, d_ptr, dmin_ptr,
                                                 sc_ptr, m_ptr, pid_m, rows, mask_n, g,
                                                 (g < G) & (t + tg < GROUPS_PER_SPLIT), K, QTYPE, KPAIR), QTYPE, ASM)
        elif STAGES > 0:
            for t in tl.range(0, GROUPS_PER_SPLIT, TG, num_stages=STAGES):
                g = g_start + t + tg
                acc = _tile_acc(acc, _tile_loads(xw_ptr, d1_ptr, xsum_ptr, codes_ptr, high_ptr, d_ptr, dmin_ptr,
                                                 sc_ptr, m_ptr, pid_m, rows, mask_n, g,
                                                 (g < G) & (t + tg < GROUPS_PER_SPLIT), K, QTYPE, KPAIR), QTYPE, ASM)
        else:
            for t in range(0, GROUPS_PER_SPLIT, TG):
                g = g_start + t + tg
                acc = _tile_acc(acc, _tile_loads(xw_ptr, d1_ptr, xsum_ptr, codes_ptr, high_ptr, d_ptr, dmin_ptr,
                                                 sc_ptr, m_ptr, pid_m, rows, mask_n, g,
                                                 (g < G) & (t + tg < GROUPS_PER_SPLIT), K, QTYPE, KPAIR), QTYPE, ASM)
        _store_rows(tl.sum(acc, axis=1), part_ptr, out_ptr, count_ptr, pid_m, pid_n, pid_s, offs_n, mask_n,
                    stride_om, stride_split, SPLIT, LAST_SUMS)

    @triton.jit
    def _words_codes(codes_ptr, rows, mask_n, g0, t, GROUPS_PER_SPLIT: tl.constexpr, K: tl.constexpr,
                     QTYPE: tl.constexpr, TG: tl.constexpr, EVEN: tl.constexpr, EVICT: tl.constexpr = ""):
        """The code words ``_words_tile`` reads for the tile of groups ``g0 ..`` (weights only:
        a caller may load them before it waits for the previous kernel). EVICT: the loads'
        L2 eviction policy (``weight_evict``)."""
        G: tl.constexpr = K // 32
        WPG: tl.constexpr = 8 if QTYPE == 8 else 4
        TW: tl.constexpr = TG * WPG
        c = tl.arange(0, TW)
        gl = c // WPG
        offs_w = rows[:, None] * (G * WPG) + (g0 * WPG + c)[None, :]            # [BN, TW] word index
        if EVEN:
            return tl.load(codes_ptr + offs_w, eviction_policy=EVICT)
        mask_c = (g0 + gl < G) & (t + gl < GROUPS_PER_SPLIT)
        return tl.load(codes_ptr + offs_w, mask=mask_n[:, None] & mask_c[None, :], other=0,
                       eviction_policy=EVICT)

    @triton.jit
    def _words_tile(xw_ptr, d1_ptr, xsum_ptr, codes_ptr, high_ptr, d_ptr, dmin_ptr, sc_ptr, m_ptr,
                    pid_m, rows, mask_n, g0, t, GROUPS_PER_SPLIT: tl.constexpr, K: tl.constexpr,
                    QTYPE: tl.constexpr, TG: tl.constexpr, ASM: tl.constexpr, EVEN: tl.constexpr,
                    GIVEN: tl.constexpr = False, w_given=0, XGIVEN: tl.constexpr = False, xw1=0, xw2=0,
                    xd1=0, xsa_given=0, xsb_given=0, EVICT: tl.constexpr = "", KPAIR: tl.constexpr = False,
                    SGIVEN: tl.constexpr = False, s0_given=0, s1_given=0, s2_given=0, s3_given=0):
        """One tile of TG groups starting at group ``g0`` for ``rows``, as a [BN, HG] fp32 array of
        products (HG = TG, or 2*TG half groups of 16 weights for Q8_0, whose groups span 8
        words). The tile is held as [BN, TG*WPG] code words (WPG words a group, each thread
        holding four consecutive words), so x words, code words and their integer dot
        products share one register layout; the two x terms combine exactly in int32
        (``254*i1 + i2``, then one conversion: ``d1*i1 + d2*i2 = d2*(254*i1 + i2)``). Q5_K
        and Q6_K merge their high bits into the 4-bit codes per word, as ``_tile_acc`` does;
        Q6_K keeps the two 16-weight halves (low and high nibbles) apart for their scales.
        GIVEN: the code words are ``w_given`` (``_words_codes``, loaded earlier). XGIVEN (EVEN,
        one tile of the row's every group, not Q8_0): x is ``_quant_groups``' output for the
        row, computed by the caller (``xw1``, ``xw2`` [TG, 8] words, ``xd1``, ``xsa_given``,
        ``xsb_given`` [TG]), not loaded. KPAIR (Q4_K, Q5_K): the scales in pairs
        (``PackedWeight.paired``), each pair one load (``_ld_f16x2``, ``_ld_u8x2``). SGIVEN: the
        scales are ``s0_given`` .. ``s3_given`` (``_words_scales``, loaded earlier)."""
        G: tl.constexpr = K // 32
        WPG: tl.constexpr = 8 if QTYPE == 8 else 4
        TW: tl.constexpr = TG * WPG
        HG: tl.constexpr = TW // 4
        BN: tl.constexpr = rows.shape[0]
        c = tl.arange(0, TW)
        j = c % WPG
        gl = c // WPG
        mask_c = (g0 + gl < G) & (t + gl < GROUPS_PER_SPLIT)                   # [TW]
        if GIVEN:
            w = w_given
        else:
            w = _words_codes(codes_ptr, rows, mask_n, g0, t, GROUPS_PER_SPLIT, K, QTYPE, TG, EVEN, EVICT)
        xrow = (pid_m.to(tl.int64) * G + g0 + gl) * 16                        # [TW]
        # 4 words in a row; masked groups point at the buffer's first words (never past its end)
        if EVEN:
            xj = tl.max_contiguous(tl.multiple_of(xrow + j, 4), 4)
        else:
            xj = tl.max_contiguous(tl.multiple_of(tl.where(mask_c, xrow + j, j), 4), 4)
        zero = tl.zeros_like(w)
        if QTYPE == 8:      # int8 codes: words 0..3 weights 0..15, words 4..7 weights 16..31
            x1 = _ld_x(xw_ptr + xj, mask_c, ASM, EVEN)
            x2 = _ld_x(xw_ptr + xj + 8, mask_c, ASM, EVEN)
            i1 = _dp4a(w, x1[None, :] + zero, zero, ASM)
            i2 = _dp4a(w, x2[None, :] + zero, zero, ASM)
        else:
            if XGIVEN:      # word j of a group's first / second 16 weights: words j / 4 + j of a term
                x1a, x1b = tl.split(tl.permute(tl.reshape(xw1, (TG, 2, 4)), (0, 2, 1)))
                x2a, x2b = tl.split(tl.permute(tl.reshape(xw2, (TG, 2, 4)), (0, 2, 1)))
                x1a = tl.reshape(x1a, (TW,))
                x1b = tl.reshape(x1b, (TW,))
                x2a = tl.reshape(x2a, (TW,))
                x2b = tl.reshape(x2b, (TW,))
            else:
                x1a = _ld_x(xw_ptr + xj, mask_c, ASM, EVEN)
                x1b = _ld_x(xw_ptr + xj + 4, mask_c, ASM, EVEN)
                x2a = _ld_x(xw_ptr + xj + 8, mask_c, ASM, EVEN)
                x2b = _ld_x(xw_ptr + xj + 12, mask_c, ASM, EVEN)
            lo = w & 0x0F0F0F0F
            hi = (w >> 4) & 0x0F0F0F0F
            if QTYPE == 13 or QTYPE == 14:   # the group's high-bit word(s), read once per code word
                hidx = rows[:, None] * (G * (QTYPE - 12)) + ((g0 + gl) * (QTYPE - 12))[None, :]
                if not EVEN:
                    hidx = tl.where(mask_n[:, None] & mask_c[None, :], hidx, 0)
                if QTYPE == 13:  # Q5_K: word j's lanes' 5th bits (Q5K_HIGH_ORDER) to bit 4 of each byte
                    hb = _ld_i32(high_ptr + hidx, ASM)
                    lo = lo | _q5k_lo(hb, j[None, :])
                    hi = hi | _q5k_hi(hb, j[None, :])
                else:            # Q6_K: two words a group, 2 bits a weight
                    lo = lo | _q6k_lane(_ld_i32(high_ptr + hidx, ASM), j[None, :])
                    hi = hi | _q6k_lane(_ld_i32(high_ptr + hidx + 1, ASM), j[None, :])
            if QTYPE == 14:
                i1 = _dp4a(lo, x1a[None, :] + zero, zero, ASM)
                i2 = _dp4a(lo, x2a[None, :] + zero, zero, ASM)
                i1b = _dp4a(hi, x1b[None, :] + zero, zero, ASM)
                i2b = _dp4a(hi, x2b[None, :] + zero, zero, ASM)
                vb = tl.sum(tl.reshape(i1b * 254 + i2b, (BN, HG, 4)), axis=2)
            else:
                i1 = _dp4a(hi, x1b[None, :] + zero, _dp4a(lo, x1a[None, :] + zero, zero, ASM), ASM)
                i2 = _dp4a(hi, x2b[None, :] + zero, _dp4a(lo, x2a[None, :] + zero, zero, ASM), ASM)
        v = tl.sum(tl.reshape(i1 * 254 + i2, (BN, HG, 4)), axis=2)            # [BN, HG] exact
        gidx, gm, xm, gg = _words_gidx(rows, mask_n, g0, t, GROUPS_PER_SPLIT, K, QTYPE, TG, EVEN)
        xg = pid_m.to(tl.int64) * G + g0 + gg
        if XGIVEN:
            d1 = xd1
            xsa = xsa_given
            xsb = xsb_given
        elif EVEN:
            d1 = tl.load(d1_ptr + xg)
            xsa = tl.load(xsum_ptr + xg * 2)
            xsb = tl.load(xsum_ptr + xg * 2 + 1)
        else:
            d1 = tl.load(d1_ptr + xg, mask=xm, other=0.0)
            xsa = tl.load(xsum_ptr + xg * 2, mask=xm, other=0.0)
            xsb = tl.load(xsum_ptr + xg * 2 + 1, mask=xm, other=0.0)
        d2 = (d1 / 254.0)[None, :]
        f = v.to(tl.float32) * d2
        xs = (xsa + xsb)[None, :]
        if SGIVEN:
            s0, s1, s2, s3 = s0_given, s1_given, s2_given, s3_given
        else:
            s0, s1, s2, s3 = _words_scales(d_ptr, dmin_ptr, sc_ptr, m_ptr, gidx, QTYPE, ASM, KPAIR, g0 + gg)
        if QTYPE == 12 or QTYPE == 13:   # Q4_K, Q5_K: w = (d*sc) * q - dmin*m
            r = (s0 * s2) * f - (s1 * s3) * xs
        elif QTYPE == 14:                # Q6_K: w = (d*sc) * (q - 32) per 16 weights
            fb = vb.to(tl.float32) * d2
            r = (s0 * s1) * (f - 32.0 * xsa[None, :]) + (s0 * s2) * (fb - 32.0 * xsb[None, :])
        elif QTYPE == 2:
            r = s0 * (f - 8.0 * xs)
        elif QTYPE == 3:
            r = s0 * f + s1 * xs
        else:
            r = s0 * f
        return r if EVEN else tl.where(gm, r, 0.0)

    @triton.jit
    def _words_gidx(rows, mask_n, g0, t, GROUPS_PER_SPLIT: tl.constexpr, K: tl.constexpr, QTYPE: tl.constexpr,
                    TG: tl.constexpr, EVEN: tl.constexpr):
        """Scale indexes of the tile of groups ``g0 ..`` (``_words_tile``'s [BN, HG] layout):
        (``rows * G + group``, 0 where masked unless EVEN; that mask; the groups' mask [HG];
        the group of each of the HG columns)."""
        G: tl.constexpr = K // 32
        HG: tl.constexpr = TG * 2 if QTYPE == 8 else TG
        hg = tl.arange(0, HG)
        if QTYPE == 8:
            gg = hg // 2                                                       # group of each half
        else:
            gg = hg
        xm = (g0 + gg < G) & (t + gg < GROUPS_PER_SPLIT)
        gm = mask_n[:, None] & xm[None, :]
        gidx = rows[:, None] * G + (g0 + gg)[None, :]                          # rows * G + g
        if not EVEN:
            gidx = tl.where(gm, gidx, 0)
        return gidx, gm, xm, gg

    @triton.jit
    def _block_scales(d_ptr, blk, j, mask):
        """fp32 (d, dmin, sc, m) of group ``j`` (0..7) of Q4_K / Q5_K blocks ``blk`` from scales
        in blocks (``PackedWeight.scale_form`` 2: four int32 words a block, (d, dmin) fp16 in
        the first, then the file's 12 bytes q[0..11] of 6-bit fields: group j < 4 has sc =
        q[j] & 63 and m = q[j + 4] & 63; group 4 + i has sc = (q[8 + i] & 15) | (q[i] >> 6) << 4
        and m = (q[8 + i] >> 4) | (q[4 + i] >> 6) << 4). ``mask``: None, or where to load."""
        p = d_ptr + 4 * blk
        if mask is None:
            w0 = tl.load(p)
            w1 = tl.load(p + 1)
            w2 = tl.load(p + 2)
            w3 = tl.load(p + 3)
        else:
            w0 = tl.load(p, mask=mask, other=0)
            w1 = tl.load(p + 1, mask=mask, other=0)
            w2 = tl.load(p + 2, mask=mask, other=0)
            w3 = tl.load(p + 3, mask=mask, other=0)
        d = (w0 & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        dmin = ((w0 >> 16) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        px = (j % 4) * 8
        first = j < 4
        sc = tl.where(first, (w1 >> px) & 63, ((w3 >> px) & 15) | (((w1 >> (px + 6)) & 3) << 4))
        m = tl.where(first, (w2 >> px) & 63, ((w3 >> (px + 4)) & 15) | (((w2 >> (px + 6)) & 3) << 4))
        return d, dmin, sc.to(tl.float32), m.to(tl.float32)

    @triton.jit
    def _ld_block_scales(ptr, j):
        """``_block_scales`` as inline assembly: one 16-byte read-only load of the block's
        words at ``ptr`` (16-byte aligned), then per field one byte permute, which puts the
        byte of the 4 low bits in byte 0 (q[j] / q[j + 4] for j < 4, q[8 + i] for j = 4 + i)
        and that of the 2 high bits in byte 1 (q[i] / q[4 + i]), and shifts and masks that
        keep bits 0-5 of byte 0 (j < 4) or bits 0-3 (sc; m: 4-7) of byte 0 and bits 6-7 of
        byte 1 (j = 4 + i). The values keep the register layout of ``j`` (no shared-memory
        shuffle)."""
        sel = j | ((j % 4) << 4)                 # prmt: byte j of (w1|w2, w3), byte j % 4 of w1|w2
        low = tl.where(j < 4, 63, 15)            # bits taken from byte 0; the rest from byte 1
        shift = (j // 4) * 4                     # m of j = 4 + i: the high nibble of q[8 + i]
        return tl.inline_asm_elementwise(
            "{ .reg .b32 w0, w1, w2, w3, r, t; .reg .b16 h0, h1;"
            " ld.global.nc.v4.b32 {w0, w1, w2, w3}, [$4];"
            " mov.b32 {h0, h1}, w0; cvt.f32.f16 $0, h0; cvt.f32.f16 $1, h1;"
            " prmt.b32 r, w1, w3, $5; shr.u32 t, r, 10; lop3.b32 r, r, t, $6, 0xE4; and.b32 r, r, 63;"
            " cvt.rn.f32.s32 $2, r;"
            " prmt.b32 r, w2, w3, $5; shr.u32 t, r, 10; shr.u32 r, r, $7; lop3.b32 r, r, t, $6, 0xE4;"
            " and.b32 r, r, 63; cvt.rn.f32.s32 $3, r; }",
            "=r,=r,=r,=r,l,r,r,r", [ptr, sel, low, shift], dtype=(tl.float32, tl.float32, tl.float32, tl.float32),
            is_pure=True, pack=1)

    @triton.jit
    def _words_scales(d_ptr, dmin_ptr, sc_ptr, m_ptr, gidx, QTYPE: tl.constexpr, ASM: tl.constexpr,
                      KPAIR: tl.constexpr, gcol=0):
        """The scales ``_words_tile`` multiplies a tile's products by, fp32 [BN, HG] at ``gidx``
        (``_words_gidx``): Q4_K / Q5_K (d, dmin, sc, m), Q6_K (d, sc of weights 0..15, sc of
        16..31, -), Q4_1 (d, m, -, -), Q4_0 / Q8_0 (d, -, -, -); a place a type has no use
        for repeats a loaded value (never read). ``gcol`` [HG]: the tile's groups (read for
        Q4_K / Q5_K scales in blocks, KPAIR 2: a group's place in its block)."""
        if QTYPE == 12 or QTYPE == 13:
            if KPAIR == 2:
                j = tl.broadcast_to((gcol % 8)[None, :], gidx.shape)
                if ASM:
                    sd, sdm, sc, mm = _ld_block_scales(d_ptr + 4 * (gidx // 8), j)
                else:
                    sd, sdm, sc, mm = _block_scales(d_ptr, gidx // 8, j, None)
            elif KPAIR == 1:
                sd, sdm = _ld_f16x2(d_ptr + 2 * (gidx // 8), ASM)
                sc, mm = _ld_u8x2(sc_ptr + 2 * gidx, ASM)
            else:
                sd = _ld_f16(d_ptr + gidx // 8, ASM)
                sdm = _ld_f16(dmin_ptr + gidx // 8, ASM)
                sc = _ld_u8(sc_ptr + gidx, ASM)
                mm = _ld_u8(m_ptr + gidx, ASM)
            return sd, sdm, sc, mm
        elif QTYPE == 14:
            sd = _ld_f16(d_ptr + gidx // 8, ASM)
            sc0 = _ld_s8(sc_ptr + 2 * gidx, ASM)
            sc1 = _ld_s8(sc_ptr + 2 * gidx + 1, ASM)
            return sd, sc0, sc1, sd
        else:
            scale = _ld_f16(d_ptr + gidx, ASM)
            if QTYPE == 3:
                return scale, _ld_f16(m_ptr + gidx, ASM), scale, scale
            return scale, scale, scale, scale

    @triton.jit
    def _ld_x(ptr, mask, ASM: tl.constexpr, EVEN: tl.constexpr):
        """int32 x words at ``ptr`` (0 where masked; masked pointers must still be readable), four
        consecutive words per 16-byte load. As inline assembly the load keeps the register
        layout of its users (each thread holds whole groups), with no shared-memory shuffle.
        A coherent load, not ``ld.global.nc`` as the weights' scales: x is the previous
        kernel's output, and ptxas moves read-only (``.nc``) loads above
        ``griddepcontrol.wait`` (seen with the first tile loaded early and no
        ``launch_dependents`` after the wait: x read before the kernel that writes it ended)."""
        if ASM:
            v = tl.inline_asm_elementwise("ld.global.v4.b32 {$0, $1, $2, $3}, [$4];",
                                          "=r,=r,=r,=r,l,l,l,l", [ptr], dtype=tl.int32, is_pure=True, pack=4)
            return v if EVEN else tl.where(mask, v, 0)
        return tl.load(ptr) if EVEN else tl.load(ptr, mask=mask, other=0)

    @triton.jit
    def _ld_f16(ptr, ASM: tl.constexpr):
        """fp32 value of the fp16 at each of ``ptr`` (read-only path). As inline assembly the load
        keeps its operand's register layout (no shared-memory shuffle to a load layout)."""
        if ASM:
            return tl.inline_asm_elementwise("ld.global.nc.b16 $0, [$1];", "=h,l", [ptr], dtype=tl.float16,
                                             is_pure=True, pack=1).to(tl.float32)
        return tl.load(ptr).to(tl.float32)

    @triton.jit
    def _ld_f16x2(ptr, ASM: tl.constexpr):
        """fp32 values of the fp16 pair at each of ``ptr`` (4-byte aligned), one load (as
        ``_ld_f16``)."""
        if ASM:
            return tl.inline_asm_elementwise(
                "{ .reg .b16 a, b; ld.global.nc.v2.b16 {a, b}, [$2]; cvt.f32.f16 $0, a; cvt.f32.f16 $1, b; }",
                "=r,=r,l", [ptr], dtype=(tl.float32, tl.float32), is_pure=True, pack=1)
        return tl.load(ptr).to(tl.float32), tl.load(ptr + 1).to(tl.float32)

    @triton.jit
    def _ld_u8x2(ptr, ASM: tl.constexpr):
        """fp32 values of the uint8 pair at each of ``ptr`` (2-byte aligned), one load (as
        ``_ld_f16``)."""
        if ASM:     # int32 out, converted as signed (I2FP; cvt.rn.f32.u32 is the slower I2F.U32)
            a, b = tl.inline_asm_elementwise(
                "{ .reg .b32 t; ld.global.nc.u16 t, [$2]; and.b32 $0, t, 255; shr.u32 $1, t, 8; }",
                "=r,=r,l", [ptr], dtype=(tl.int32, tl.int32), is_pure=True, pack=1)
            return a.to(tl.float32), b.to(tl.float32)
        return tl.load(ptr).to(tl.float32), tl.load(ptr + 1).to(tl.float32)

    @triton.jit
    def _ld_i32(ptr, ASM: tl.constexpr):
        """The int32 at each of ``ptr`` (as ``_ld_f16``)."""
        if ASM:
            return tl.inline_asm_elementwise("ld.global.nc.b32 $0, [$1];", "=r,l", [ptr], dtype=tl.int32,
                                             is_pure=True, pack=1)
        return tl.load(ptr)

    @triton.jit
    def _ld_s8(ptr, ASM: tl.constexpr):
        """fp32 value of the int8 at each of ``ptr`` (as ``_ld_f16``)."""
        if ASM:
            return tl.inline_asm_elementwise("ld.global.nc.s8 $0, [$1];", "=r,l", [ptr], dtype=tl.int32,
                                             is_pure=True, pack=1).to(tl.float32)
        return tl.load(ptr).to(tl.float32)

    @triton.jit
    def _ld_u8(ptr, ASM: tl.constexpr):
        """fp32 value of the uint8 at each of ``ptr`` (as ``_ld_f16``)."""
        if ASM:
            return tl.inline_asm_elementwise("ld.global.nc.u8 $0, [$1];", "=r,l", [ptr], dtype=tl.int32,
                                             is_pure=True, pack=1).to(tl.float32)
        return tl.load(ptr).to(tl.float32)

    @triton.jit
    def _gemv_words_kernel(xw_ptr, d1_ptr, xsum_ptr, part_ptr, out_ptr, count_ptr, codes_ptr, high_ptr, d_ptr,
                           dmin_ptr, sc_ptr, m_ptr, N, stride_om, stride_split,
                           pos_ptr, slot_ptr, cos_ptr, sin_ptr, kc_ptr, vc_ptr, s_cos, skc0, skc1, svc0, svc1,
                           K: tl.constexpr, QTYPE: tl.constexpr, BLOCK_N: tl.constexpr, TG: tl.constexpr,
                           GROUPS_PER_SPLIT: tl.constexpr, SPLIT: tl.constexpr, LAST_SUMS: tl.constexpr,
                           ASM: tl.constexpr, STAGES: tl.constexpr, UNROLL: tl.constexpr, EVEN: tl.constexpr,
                           EARLY: tl.constexpr, ROPE: tl.constexpr, NQ: tl.constexpr, NK: tl.constexpr,
                           HD: tl.constexpr, PDL: tl.constexpr, nx_ptr=None, nr_ptr=None, nw_ptr=None,
                           h_ptr=None, eps=0.0, NORM: tl.constexpr = False, NORM_RES: tl.constexpr = False,
                           EVICT: tl.constexpr = "", qw_ptr=None, qd_ptr=None, qs_ptr=None, F=0,
                           GLU: tl.constexpr = -1, KPAIR: tl.constexpr = False, PREFETCH: tl.constexpr = False,
                           PID0: tl.constexpr = 0):
        """``_gemv_kernel``'s product with the tile held as code words (``_words_tile``). EVEN: no
        partial row block or tile (every mask is true, so none is applied). EARLY: the first
        tile's code words are loaded before the wait for the previous kernel (weights only).
        ROPE (fusion ``qkv_rope``; a q|k|v weight of NQ + 2 * NK rows, heads of HD): program
        rows in ``_rope_rows`` order, final sums through ``_rope_store``. NORM (fusion
        ``quant_norm``; ``norm_prologue_ok``: one tile of whole rows, EVEN): x is the RMSNorm
        of row ``nx`` (plus ``nr`` with NORM_RES; programs of row block 0 write that sum to
        ``h``) with fp32 weights ``nw``, quantized as ``quantize_x`` does, all in this
        program; the norm weights are read before the wait. GLU (fusion ``glu_quant``; the
        activation, ``triton_dense.SILU`` / ``GELU_TANH``; -1: off): a gate|up weight of
        2 * F rows, program rows in ``_glu_rows`` order, final sums through
        ``_glu_quant_store`` (the gated activation [M, F] into ``out`` and its quantized
        form into ``qw``, ``qd``, ``qs``). KPAIR: Q4_K / Q5_K scales in pairs
        (``PackedWeight.paired``). PREFETCH: the tile loop loads the next tile's code words and
        scales before this tile's math (``GemvConfig.prefetch``; the same products in the same
        order). PID0: this weight is a part of a stack whose output rows start at row block PID0
        (``quant_matmul(out=, row0=)``): program ``pid_n`` computes output rows of block
        ``pid_n + PID0`` from the weight's rows ``PID0 * BLOCK_N`` lower, and N is the end of its
        rows in ``out``."""
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1) + PID0
        pid_s = tl.program_id(2)
        if ROPE:
            offs_n = _rope_rows(pid_n, BLOCK_N, HD)
        elif GLU >= 0:
            offs_n = _glu_rows(pid_n, BLOCK_N, F)
        else:
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        rows = (offs_n - PID0 * BLOCK_N).to(tl.int64)
        HG: tl.constexpr = TG * 2 if QTYPE == 8 else TG
        acc = tl.zeros((BLOCK_N, HG), dtype=tl.float32)
        g_start = pid_s * GROUPS_PER_SPLIT
        FIRST: tl.constexpr = TG if EARLY or NORM else 0      # tiles before it: done before the loop
        rc = 0.0
        rs = 0.0
        slot = 0
        if ROPE:    # step inputs (copied in before the step's first kernel) and the tables: before the wait
            rc, rs, slot = _rope_inputs(pid_m, pid_n, pos_ptr, slot_ptr, cos_ptr, sin_ptr, s_cos, BLOCK_N, HD)
        if NORM:
            kc = tl.arange(0, K)
            nw = tl.load(nw_ptr + kc).to(tl.float32)
            w0 = _words_codes(codes_ptr, rows, mask_n, g_start, 0, GROUPS_PER_SPLIT, K, QTYPE, TG, EVEN, EVICT)
            _pdl_enter(PDL)
            xr = _residual_chunk(nx_ptr + pid_m.to(tl.int64) * K, nr_ptr + pid_m.to(tl.int64) * K, kc, kc < K,
                                 NORM_RES)
            rstd = _rms_rstd(xr.to(tl.float32), eps, K)
            if NORM_RES:
                if pid_n == 0:
                    tl.store(h_ptr + pid_m.to(tl.int64) * K + kc, xr)
            y = _rms_apply(xr, rstd, nw, False)
            xw1, xw2, xd1, xsa, xsb = _quant_groups(tl.reshape(y.to(tl.float32), (K // 32, 32)), K // 32)
            acc += _words_tile(xw_ptr, d1_ptr, xsum_ptr, codes_ptr, high_ptr, d_ptr, dmin_ptr, sc_ptr, m_ptr,
                               pid_m, rows, mask_n, g_start, 0, GROUPS_PER_SPLIT, K, QTYPE, TG, ASM, EVEN, True, w0,
                               True, xw1, xw2, xd1, xsa, xsb, EVICT, KPAIR)
        elif EARLY:
            w0 = _words_codes(codes_ptr, rows, mask_n, g_start, 0, GROUPS_PER_SPLIT, K, QTYPE, TG, EVEN, EVICT)
            _pdl_enter(PDL)
            acc += _words_tile(xw_ptr, d1_ptr, xsum_ptr, codes_ptr, high_ptr, d_ptr, dmin_ptr, sc_ptr, m_ptr,
                               pid_m, rows, mask_n, g_start, 0, GROUPS_PER_SPLIT, K, QTYPE, TG, ASM, EVEN, True, w0,
                               EVICT=EVICT, KPAIR=KPAIR)
        else:
            _pdl_enter(PDL)
        if FIRST >= GROUPS_PER_SPLIT:
            pass    # one tile, done above (with NORM, x is not in words: the loop must not be compiled)
        elif PREFETCH:
            # tile t+1's code words and scales are loaded before tile t's math; the last pass
            # loads its own tile again (in range, never used)
            LAST: tl.constexpr = (GROUPS_PER_SPLIT - 1) // TG * TG
            wn = _words_codes(codes_ptr, rows, mask_n, g_start + FIRST, FIRST, GROUPS_PER_SPLIT, K, QTYPE, TG, EVEN,
                              EVICT)
            gn, _gm, _xm, gg = _words_gidx(rows, mask_n, g_start + FIRST, FIRST, GROUPS_PER_SPLIT, K, QTYPE, TG, EVEN)
            s0n, s1n, s2n, s3n = _words_scales(d_ptr, dmin_ptr, sc_ptr, m_ptr, gn, QTYPE, ASM, KPAIR,
                                               g_start + FIRST + gg)
            for t in range(FIRST, GROUPS_PER_SPLIT, TG):
                w, s0, s1, s2, s3 = wn, s0n, s1n, s2n, s3n
                tn = tl.minimum(t + TG, LAST)
                wn = _words_codes(codes_ptr, rows, mask_n, g_start + tn, tn, GROUPS_PER_SPLIT, K, QTYPE, TG, EVEN,
                                  EVICT)
                gn, _gm, _xm, gg = _words_gidx(rows, mask_n, g_start + tn, tn, GROUPS_PER_SPLIT, K, QTYPE, TG, EVEN)
                s0n, s1n, s2n, s3n = _words_scales(d_ptr, dmin_ptr, sc_ptr, m_ptr, gn, QTYPE, ASM, KPAIR,
                                                   g_start + tn + gg)
                acc += _words_tile(xw_ptr, d1_ptr, xsum_ptr, codes_ptr, high_ptr, d_ptr, dmin_ptr, sc_ptr, m_ptr,
                                   pid_m, rows, mask_n, g_start + t, t, GROUPS_PER_SPLIT, K, QTYPE, TG, ASM, EVEN,
                                   True, w, EVICT=EVICT, KPAIR=KPAIR, SGIVEN=True, s0_given=s0, s1_given=s1,
                                   s2_given=s2, s3_given=s3)
        elif UNROLL:
            for t in tl.static_range(FIRST, GROUPS_PER_SPLIT, TG):
                acc += _words_tile(xw_ptr, d1_ptr, xsum_ptr, codes_ptr, high_ptr, d_ptr, dmin_ptr, sc_ptr, m_ptr,
                                   pid_m, rows, mask_n, g_start + t, t, GROUPS_PER_SPLIT, K, QTYPE, TG, ASM, EVEN,
                                   EVICT=EVICT, KPAIR=KPAIR)
        elif STAGES > 0:
            for t in tl.range(FIRST, GROUPS_PER_SPLIT, TG, num_stages=STAGES):
                acc += _words_tile(xw_ptr, d1_ptr, xsum_ptr, codes_ptr, high_ptr, d_ptr, dmin_ptr, sc_ptr, m_ptr,
                                   pid_m, rows, mask_n, g_start + t, t, GROUPS_PER_SPLIT, K, QTYPE, TG, ASM, EVEN,
                                   EVICT=EVICT, KPAIR=KPAIR)
        else:
            for t in range(FIRST, GROUPS_PER_SPLIT, TG):
                acc += _words_tile(xw_ptr, d1_ptr, xsum_ptr, codes_ptr, high_ptr, d_ptr, dmin_ptr, sc_ptr, m_ptr,
                                   pid_m, rows, mask_n, g_start + t, t, GROUPS_PER_SPLIT, K, QTYPE, TG, ASM, EVEN,
                                   EVICT=EVICT, KPAIR=KPAIR)
        if GLU >= 0:
            _glu_quant_store(tl.sum(acc, axis=1), out_ptr, qw_ptr, qd_ptr, qs_ptr, pid_m, pid_n, F, GLU, count_ptr)
        else:
            _store_rows(tl.sum(acc, axis=1), part_ptr, out_ptr, count_ptr, pid_m, pid_n, pid_s, offs_n, mask_n,
                        stride_om, stride_split, SPLIT, LAST_SUMS, ROPE, rc, rs, slot, kc_ptr, vc_ptr, skc0, skc1,
                        svc0, svc1, NQ, NK, HD, PID0)

    @triton.jit
    def _glu_rows(pid_n, BLOCK_N: tl.constexpr, F):
        """Rows of gate|up program ``pid_n`` under the fusion ``glu_quant``: BLOCK_N/2 gate rows
        and the up rows of the same units (``F`` rows further), so the program holds both
        factors of every activation value it writes, whole 32-value groups of them."""
        H2: tl.constexpr = BLOCK_N // 2
        i = tl.arange(0, BLOCK_N)
        return pid_n * H2 + (i % H2) + (i // H2) * F

    @triton.jit
    def _glu_quant_store(y, out_ptr, qw_ptr, qd_ptr, qs_ptr, pid_m, pid_n, F, ACT: tl.constexpr, count_ptr):
        """Final sums ``y [BN]`` of a gate|up tile in ``_glu_rows`` order: each rounded to
        ``out``'s dtype as the product's output would be, then ``act(gate) * up`` rounded
        again and quantized, the bits of ``triton_fused._glu_block`` with QUANT over that
        output (units ``pid_n * BN/2 ..`` of row ``pid_m``; F a multiple of BN/2 and of 32).
        A program of fewer than 32 units (BN/2 < 32) stores its activation values, then
        counts itself in its group's arrival counter (``count``: one int32 per row and
        32-unit group, 0 between launches); the last of the group's 32 / (BN/2) programs to
        arrive reads the group's 32 values back from L2 and quantizes them (the same values,
        so the same bits), then puts the counter back to 0 (as ``_store_rows``' LAST_SUMS)."""
        BN: tl.constexpr = y.shape[0]
        H2: tl.constexpr = BN // 2
        yb = y.to(out_ptr.dtype.element_ty)
        g, u = tl.split(tl.permute(tl.reshape(yb, (2, H2)), (1, 0)))
        a = _glu_act(g.to(tl.float32), u.to(tl.float32), ACT).to(out_ptr.dtype.element_ty)
        row = pid_m.to(tl.int64) * F
        tl.store(out_ptr + row + pid_n * H2 + tl.arange(0, H2), a)
        if H2 >= 32:
            GB: tl.constexpr = H2 // 32
            w1, w2, d1, sa, sb = _quant_groups(tl.reshape(a.to(tl.float32), (GB, 32)), GB)
            grp = pid_m.to(tl.int64) * (F // 32) + pid_n * GB + tl.arange(0, GB)
            _store_quant_groups(qw_ptr, qd_ptr, qs_ptr, grp, grp >= 0, w1, w2, d1, sa, sb)
        else:
            PER: tl.constexpr = 32 // H2            # programs of one 32-unit group
            # every thread's values are stored before the counter moves (barrier, then a
            # release); the last arrival reads the others' values from L2 after its acquire
            tl.debug_barrier()
            gi = pid_m.to(tl.int64) * (F // 32) + pid_n // PER
            arrived = tl.atomic_add(count_ptr + gi, 1, sem="acq_rel", scope="gpu")
            if arrived == PER - 1:
                v = tl.load(out_ptr + row + (pid_n // PER) * 32 + tl.arange(0, 32), cache_modifier=".cg")
                w1, w2, d1, sa, sb = _quant_groups(tl.reshape(v.to(tl.float32), (1, 32)), 1)
                grp = gi + tl.arange(0, 1)
                _store_quant_groups(qw_ptr, qd_ptr, qs_ptr, grp, grp >= 0, w1, w2, d1, sa, sb)
                tl.atomic_xchg(count_ptr + gi, 0, sem="relaxed", scope="gpu")

    @triton.jit
    def _prefetch_l2(ptrs):
        """Ask L2 for the 32-byte sectors holding ``ptrs`` (readable addresses); nothing is
        loaded into registers."""
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                                  is_pure=False, pack=1)

    @triton.jit
    def _bulk_prefetch(addr, nbytes, chunk, lane):
        """Ask L2 for bytes ``[lane * chunk, (lane + 1) * chunk)`` (clipped to ``nbytes``) from
        the address ``addr`` (an integer; 16-byte aligned, chunk a multiple of 16), one
        ``cp.async.bulk.prefetch`` a lane; lanes past the end ask nothing."""
        off = lane.to(tl.int64) * chunk
        size = tl.minimum(tl.maximum(nbytes - off, 0), chunk).to(tl.int32)
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r", [addr + off, size], dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def _line_prefetch(addr, nbytes, iters, lane, lanes, STRIDE: tl.constexpr):
        """``prefetch.global.L2`` of the ``STRIDE``-byte pieces ``(j * lanes + lane) * STRIDE``
        (j < iters) of ``nbytes`` from ``addr``: every lane's first piece, then the second..."""
        for j in range(iters):
            off = (lane.to(tl.int64) + j * lanes) * STRIDE
            ok = off < nbytes
            tl.inline_asm_elementwise(
                "{ .reg .pred p; setp.ne.s32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
                "=r,l,r", [addr + tl.where(ok, off, 0), ok.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def _weight_prefetch(ROWS, a0, n0, c0, a1, n1, c1, a2, n2, c2, LANES: tl.constexpr, FORM: tl.constexpr,
                         WAIT: tl.constexpr, PDL: tl.constexpr):
        """A prefetching program of a 2-D grid whose rows ``ROWS ..`` prefetch
        (``prefetch_launch``): its share of up to three ranges (address, bytes, step each;
        bytes 0: none) in the form ``FORM`` (``PREFETCH_FORMS``), after the previous kernel
        ended with ``WAIT``."""
        i = (tl.program_id(0) - ROWS) * tl.num_programs(1) + tl.program_id(1)
        programs = (tl.num_programs(0) - ROWS) * tl.num_programs(1)
        if WAIT:
            _pdl_enter(PDL)
        lane = i * LANES + tl.arange(0, LANES)
        if FORM == 1:
            _bulk_prefetch(a0, n0, c0, lane)
            _bulk_prefetch(a1, n1, c1, lane)
            _bulk_prefetch(a2, n2, c2, lane)
        else:
            _line_prefetch(a0, n0, c0, lane, programs * LANES, FORM)
            _line_prefetch(a1, n1, c1, lane, programs * LANES, FORM)
            _line_prefetch(a2, n2, c2, lane, programs * LANES, FORM)

    @triton.jit
    def _side_prefetch_kernel(a0, n0, c0, a1, n1, c1, a2, n2, c2, LANES: tl.constexpr):
        """``side_prefetch``: bulk L2 prefetches of up to three ranges, no wait."""
        _weight_prefetch(0, a0, n0, c0, a1, n1, c1, a2, n2, c2, LANES, 1, False, False)

    @triton.jit
    def _split_sum_kernel(part_ptr, out_ptr, total, SPLIT: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        """out = part[0] + part[1] + ... in that order (fp32), cast to out's dtype."""
        _pdl_enter(PDL)
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < total
        acc = tl.load(part_ptr + offs, mask=mask, other=0.0)
        for s in tl.static_range(1, SPLIT):
            acc += tl.load(part_ptr + s * total + offs, mask=mask, other=0.0)
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _dequant_kernel(out_ptr, codes_ptr, high_ptr, d_ptr, dmin_ptr, sc_ptr, m_ptr, N,
                        K: tl.constexpr, QTYPE: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr,
                        KPAIR: tl.constexpr = False):
        pid_n = tl.program_id(0)
        pid_g = tl.program_id(1)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        rows = offs_n.to(tl.int64)
        h = tl.arange(0, 16)
        for u in tl.static_range(GROUPS):
            g = pid_g * GROUPS + u
            qa, qb = _group_codes(codes_ptr, high_ptr, rows, mask_n, g, K, QTYPE)
            scale_a, scale_b, offset = _group_scales(d_ptr, dmin_ptr, sc_ptr, m_ptr, rows, mask_n, g, K, QTYPE, KPAIR)
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
