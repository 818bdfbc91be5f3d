"""Linear layers and embedding tables on a CUDA device.

Activations are bf16 (``packed``/``bf16`` weight modes) or fp32 (``fp32`` mode).

==================================  ===============================================
weight type (mode ``packed``)       module
==================================  ===============================================
Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K  ``CudaQuantLinear``: GGUF blocks repacked once
                                    (same bits, ``triton_quant.PackedWeight``); up to
                                    64 rows run the fused Triton kernel (x may come
                                    quantized already: ``QuantizedRows`` from a fused
                                    RMSNorm or activation), more rows dequantize to
                                    bf16 and run one cuBLAS matmul
F16, BF16, F32                      ``CudaDenseLinear`` over a bf16 copy (one bf16
                                    row runs the Triton matrix-vector kernel, which
                                    may compute x itself: ``PendingNorm`` from
                                    ``triton_dense``; a gate|up
                                    projection may apply the gated activation to
                                    its own output: ``forward_glu``)
Q5_0, Q5_1, Q2_K, Q3_K              ``CudaDenseLinear`` dequantized to bf16 at load
==================================  ===============================================

Projections of one input packed in several types (q|k|v of a llama.cpp Q4_K_M file, whose
attn_v is Q6_K in half the layers) form one ``CudaQuantStack``: neighbours of one type
fused, the input quantized once, and each part's kernel writing its columns of one output
(and, with ``qkv_rope``, rotating and storing its own rows).

Modes ``bf16`` / ``fp32`` dequantize every weight at load (dense cuBLAS matmuls).
Embedding tables are dense (bf16 or fp32) so a lookup is a plain gather; a tied head in
``packed`` mode is a ``CudaQuantLinear`` over the same GGUF bytes, since the head is read
in full every step and its bytes are what decode speed pays for.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from gguf.constants import GGMLQuantizationType
from torch import nn

# kernel modules import without Triton; their kernels run only on CUDA
from lodestar.kernels import dequant as dq
from lodestar.kernels import gemv_tiling as gt
from lodestar.kernels import triton_dense as _td
from lodestar.kernels import triton_quant as tq
from lodestar.kernels.launch import SMALL_M_MAX, side_prefetch
from lodestar.kernels.policy import active
from lodestar.kernels.quant_layout import GPU_QUANT_TYPES, GROUP, QuantizedRows, pack
from lodestar.kernels.triton_fused import embedding_rows, gelu_tanh_mul, silu_mul

T = GGMLQuantizationType
FLOAT_TYPES = (T.F32, T.F16, T.BF16)


def compute_dtype(mode: str) -> torch.dtype:
    """Activation (and KV) dtype on the GPU for a weight mode."""
    return torch.float32 if mode == "fp32" else torch.bfloat16


def dense_weight(qtype: GGMLQuantizationType, data: torch.Tensor, rows: int, cols: int,
                 dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """GGUF bytes -> dense [rows, cols] ``dtype`` on ``device`` (dequantized on the device when it can)."""
    qtype = T(int(qtype))
    if qtype in FLOAT_TYPES:
        raw = data.to(device).reshape(-1)
        view = {T.F32: torch.float32, T.F16: torch.float16, T.BF16: torch.bfloat16}[qtype]
        return raw.view(view).reshape(rows, cols).to(dtype).contiguous()
    if qtype in GPU_QUANT_TYPES and device.type == "cuda":
        return tq.dequantize_packed(pack(qtype, data.to(device), rows, cols, gt.kquant_scales(qtype, rows, cols, device)),
                                    dtype)
    return dq.dequantize(data.cpu(), qtype, (rows, cols)).to(device=device, dtype=dtype)


class CudaQuantLinear(nn.Module):
    """``y = x @ W.T`` with W packed for the Triton kernels; y in x's dtype."""

    def __init__(self, qtype: GGMLQuantizationType | int, data: torch.Tensor, in_features: int,
                 out_features: int, device: torch.device) -> None:
        super().__init__()
        self.qtype = T(int(qtype))
        self.in_features, self.out_features = in_features, out_features
        self.weight = pack(self.qtype, data.to(device), out_features, in_features,
                           gt.kquant_scales(self.qtype, out_features, in_features, device))
        tq.reserve_tile_counters(self.weight)       # before any CUDA-graph capture
        self.out_dtype: torch.dtype | None = None   # None: x's dtype; the head sets float32

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes

    def forward(self, x) -> torch.Tensor:
        """``x``: a tensor [..., in_features], ``QuantizedRows`` [rows, in_features], or a
        ``triton_dense.PendingNorm`` (computed first)."""
        if isinstance(x, QuantizedRows):
            return tq.quant_matmul(x, self.weight, self.out_dtype)
        if isinstance(x, _td.PendingNorm):
            x = x.materialize()
        x2 = x.reshape(-1, self.in_features)
        y = tq.matmul(x2, self.weight, self.out_dtype)
        return y.view(*x.shape[:-1], self.out_features)

    def forward_partials(self, x):
        """``forward`` of ``QuantizedRows``, leaving the sum of a K-split tiling's partial products
        to the kernel that reads them (``triton_quant.SplitPartials``; fusion ``norm_sum``);
        a tiling without K splits returns the product itself."""
        if isinstance(x, QuantizedRows):
            return tq.quant_matmul(x, self.weight, self.out_dtype, defer_sum=True)
        return self.forward(x)

    def forward_glu_quant(self, x, ffn: int, act: int):
        """This gate|up projection (gate rows, then up rows, ``ffn`` each) with the gated
        activation (``triton_dense.SILU`` / ``GELU_TANH``) applied to its output and quantized
        for the next projection in the same kernel (``triton_quant.quant_glu``): a
        ``QuantizedRows`` of [rows, ffn]. Only where ``gemv_tiling.glu_epilogue_ok``."""
        return tq.quant_glu(x, self.weight, ffn, act)

    def rope_store(self, x, positions: torch.Tensor, slots: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, n_q: int, n_k: int, head_dim: int):
        """A ``triton_quant.RopeStore`` with which ``forward_rope`` runs rows like ``x`` (this being a
        q|k|v projection of ``n_q + 2 * n_k`` rows, heads of ``head_dim``, in the caches' dtype),
        or None when the kernel cannot (fusion ``qkv_rope`` off, another tiling, too many rows)."""
        if (not _rope_inputs_ok(x, k_cache, v_cache, self.out_dtype)
                or not gt.rope_epilogue_ok(self.weight, x.shape[0], head_dim, n_q, n_k)):
            return None
        return tq.RopeStore(positions, slots, cos, sin, k_cache, v_cache, n_q, n_k, head_dim)

    def forward_rope(self, x, rope) -> torch.Tensor:
        """``forward`` whose kernel also rotates q and k and stores k and v (``rope``, from
        ``rope_store``); returns the whole q|k|v output [rows, out_features]."""
        return tq.quant_matmul(x, self.weight, self.out_dtype, rope=rope)

    def extra_repr(self) -> str:
        return f"{self.qtype.name}, in_features={self.in_features}, out_features={self.out_features}, cuda"


def _rope_inputs_ok(x, k_cache: torch.Tensor, v_cache: torch.Tensor, out_dtype: torch.dtype | None) -> bool:
    """The fusion ``qkv_rope`` is on and rows ``x`` (a tensor or ``QuantizedRows``) can feed a
    q|k|v kernel that stores into these caches: 2-D, in the caches' dtype, as the output."""
    dtype = x.x.dtype if isinstance(x, QuantizedRows) else x.dtype
    return ("qkv_rope" in active().fusions and len(x.shape) == 2 and k_cache.dtype == dtype
            and v_cache.dtype == dtype and out_dtype in (None, dtype))


class CudaQuantStack(nn.Module):
    """Packed projections of one input, of different weight types, as one projection whose
    output holds theirs side by side (``parts``, in order). Up to 64 rows quantize x once
    (or take it quantized: ``QuantizedRows``) and each part's kernel writes its columns of one
    output (``triton_quant.quant_matmul(out=, row0=)``); more rows, or a part whose tiling
    cannot write at its offset, run the parts apart and concatenate. The same bits as the
    parts apart either way."""

    def __init__(self, parts: list[CudaQuantLinear]) -> None:
        super().__init__()
        if len({p.in_features for p in parts}) != 1 or not all(isinstance(p, CudaQuantLinear) for p in parts):
            raise ValueError("a stack takes packed projections of one input width")
        self.parts = nn.ModuleList(parts)
        self.in_features = parts[0].in_features
        self.row0s = [sum(p.out_features for p in parts[:i]) for i in range(len(parts))]
        self.out_features = sum(p.out_features for p in parts)
        self.out_dtype: torch.dtype | None = None

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def _writes_in_place(self, rows: int) -> bool:
        """Each part's kernel can write its columns of one output for ``rows`` rows."""
        if not 0 < rows <= SMALL_M_MAX or self.in_features % GROUP:
            return False
        for p, r0 in zip(self.parts, self.row0s):
            cfg = gt.gemv_config(p.weight.n, p.weight.k, p.weight.device, p.weight.qtype)
            if not (cfg.words and p.weight.qtype in gt.WORDS_CAPABLE and r0 % cfg.block_n == 0):
                return False
        return True

    def _quantized(self, x):
        """``x`` as ``QuantizedRows`` when the parts can write in place, else None."""
        if isinstance(x, _td.PendingNorm):
            x = x.materialize()
        if isinstance(x, QuantizedRows):
            return x if self._writes_in_place(x.shape[0]) else None
        if x.dim() != 2 or x.dtype != torch.bfloat16 or not self._writes_in_place(x.shape[0]):
            return None
        return QuantizedRows(x, *tq.quantize_x(x.contiguous()))

    def forward(self, x) -> torch.Tensor:
        """As ``CudaQuantLinear.forward``: a tensor [..., in_features], ``QuantizedRows`` or a
        ``triton_dense.PendingNorm``."""
        xq = self._quantized(x)
        if xq is None:
            if isinstance(x, _td.PendingNorm):
                x = x.materialize()
            return torch.cat([p(x) for p in self.parts], dim=-1)
        return self._run(xq)

    def rope_store(self, x, positions: torch.Tensor, slots: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, n_q: int, n_k: int, head_dim: int):
        """``CudaQuantLinear.rope_store`` for a q|k|v stack: a ``triton_quant.RopeStore`` when
        every part's kernel can rotate and store its rows, else None."""
        if (not _rope_inputs_ok(x, k_cache, v_cache, self.out_dtype) or not self._writes_in_place(x.shape[0])
                or not all(gt.rope_epilogue_ok(p.weight, x.shape[0], head_dim, n_q, n_k, n_out=self.out_features)
                           for p in self.parts)):
            return None
        return tq.RopeStore(positions, slots, cos, sin, k_cache, v_cache, n_q, n_k, head_dim)

    def forward_rope(self, x, rope) -> torch.Tensor:
        """``forward`` whose kernels also rotate q and k and store k and v (``rope``, from
        ``rope_store``); the whole q|k|v output [rows, out_features]."""
        xq = self._quantized(x)
        if xq is None:
            raise ValueError("CudaQuantStack.forward_rope: rows the parts cannot write in place (see rope_store)")
        return self._run(xq, rope)

    def _run(self, xq, rope=None) -> torch.Tensor:
        """Each part's kernel over ``QuantizedRows`` writing its columns of one output."""
        out = torch.empty(xq.shape[0], self.out_features, device=xq.x.device, dtype=self.out_dtype or xq.x.dtype)
        for p, r0 in zip(self.parts, self.row0s):
            tq.quant_matmul(xq, p.weight, out.dtype, out=out, row0=r0, rope=rope)
        return out

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, cuda"


_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}
_SIDE_PENDING: set[torch.device] = set()


def weight_arrays(module: object) -> list[torch.Tensor] | None:
    """The GPU weight arrays of a projection (``CudaQuantLinear``: codes and scales;
    ``CudaDenseLinear``: the matrix; a stack or a list of projections: all of theirs, in
    order), for a kernel before it to ask L2 for; None for anything else."""
    if isinstance(module, (list, nn.ModuleList)):
        arrays = [a for m in module for a in (weight_arrays(m) or [])]
        return arrays or None
    if isinstance(module, CudaQuantLinear):
        w = module.weight
        return [t for t in (w.codes, w.d, w.high, w.dmin, w.sc, w.m) if t is not None]
    if isinstance(module, CudaQuantStack):
        return weight_arrays(list(module.parts))
    if isinstance(module, CudaDenseLinear):
        return [module.weight]
    return None


def fork_side_prefetch(arrays: list[torch.Tensor]) -> None:
    """Ask L2 for the first bytes of ``arrays`` (``launch.side_prefetch``) from a second stream
    forked from the current one here, so that no kernel of the current stream waits for it;
    ``join_side_prefetch`` joins it back (required before a CUDA-graph capture ends)."""
    dev = arrays[0].device
    side = _SIDE_STREAMS.get(dev)
    if side is None:
        side = _SIDE_STREAMS[dev] = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        side_prefetch(arrays)
    _SIDE_PENDING.add(dev)


def join_side_prefetch() -> None:
    """Make the current stream wait for every side prefetch forked since the last join."""
    for dev in list(_SIDE_PENDING):
        torch.cuda.current_stream(dev).wait_stream(_SIDE_STREAMS[dev])
        _SIDE_PENDING.discard(dev)


class CudaDenseLinear(nn.Module):
    """``y = x @ W.T`` with W dense (bf16 or fp32); y in x's dtype. ``x`` may also be a
    ``triton_dense.PendingNorm``, computed inside the matrix-vector kernel
    when it runs (else materialized first). A gate|up projection (gate rows, then as many
    up rows) also has ``forward_glu``: ``act(gate) * up`` in one kernel for one row."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("weight", weight, persistent=False)
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.gemv_config = _td.config_for(self.out_features, self.in_features, weight.device)

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()

    def runs_gemv(self, x: torch.Tensor) -> bool:
        """Rows like ``x`` go through the Triton matrix-vector kernel (one-row bf16 decode:
        cuBLAS's costs ~2x on small matrices)."""
        return (x.is_cuda and x.dtype == self.weight.dtype == torch.bfloat16
                and x.numel() <= _td.MAX_ROWS * x.shape[-1] and _td.enabled())

    def forward(self, x) -> torch.Tensor:
        if isinstance(x, _td.PendingNorm):
            if x.x.dim() == 2 and self.runs_gemv(x.x):
                return _td.dense_gemv(x, self.weight, config=self.gemv_config)
            x = x.materialize()
        if x.dtype == self.weight.dtype:
            if self.runs_gemv(x):
                x2 = x.reshape(-1, self.in_features)
                y = _td.dense_gemv(x2, self.weight, config=self.gemv_config)
                return y.view(*x.shape[:-1], self.out_features)
            return F.linear(x, self.weight)
        return F.linear(x.to(self.weight.dtype), self.weight).to(x.dtype)

    def fuses_glu(self, x) -> bool:
        """``forward_glu`` runs rows like ``x`` (tensor or ``PendingNorm``) as one kernel:
        the weight is small (``triton_dense.FUSE_MAX_WEIGHT``), the rows go through the
        matrix-vector kernel (``runs_gemv``) and its tiling for this weight can apply the
        activation (``triton_dense.glu_epilogue_fits``: one K split). Large weights keep the
        separate activation kernel (slower fused on the H200)."""
        if isinstance(x, _td.PendingNorm):
            if x.x.dim() != 2:
                return False
            x = x.x
        elif not isinstance(x, torch.Tensor):
            return False
        return (self.weight.numel() <= _td.FUSE_MAX_WEIGHT and self.runs_gemv(x)
                and _td.glu_epilogue_fits(self.gemv_config, self.out_features, self.in_features))

    def forward_glu(self, x, act: int = _td.SILU) -> torch.Tensor:
        """``act(gate) * up`` (``act``: ``triton_dense.SILU`` / ``GELU_TANH``) of this
        projection's output halves ``gate | up``, for ``x`` a tensor or a ``PendingNorm``.
        One kernel (``triton_dense.dense_gemv_glu``) when ``fuses_glu(x)``, else the
        projection then the activation kernel: the same bits either way."""
        if self.fuses_glu(x):
            if isinstance(x, _td.PendingNorm):
                return _td.dense_gemv_glu(x, self.weight, act, self.gemv_config)
            y = _td.dense_gemv_glu(x.reshape(-1, self.in_features), self.weight, act, self.gemv_config)
            return y.view(*x.shape[:-1], self.out_features // 2)
        gate, up = self(x).split(self.out_features // 2, dim=-1)
        return (silu_mul if act == _td.SILU else gelu_tanh_mul)(gate, up)


# Token ids (a decode step's) whose rows ``CudaEmbedding`` copies with its own kernel.
EMBED_KERNEL_MAX_IDS = 64


class CudaEmbedding(nn.Module):
    """Dense embedding table on the device; rows come back in the table's dtype."""

    def __init__(self, qtype: GGMLQuantizationType | int, data: torch.Tensor, num_embeddings: int, dim: int,
                 mode: str, device: torch.device) -> None:
        super().__init__()
        self.qtype = T(int(qtype))
        self.num_embeddings, self.dim, self.mode, self.device = num_embeddings, dim, mode, device
        self.register_buffer("weight", dense_weight(self.qtype, data, num_embeddings, dim, compute_dtype(mode), device),
                             persistent=False)
        # The bytes, kept only until the tied head (if any) is built from them.
        self._data = data if mode == "packed" and self.qtype in GPU_QUANT_TYPES else None
        self._head: nn.Module | None = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.is_cuda and ids.dtype == torch.int64 and ids.numel() <= EMBED_KERNEL_MAX_IDS:
            return embedding_rows(ids, self.weight)
        return F.embedding(ids, self.weight)

    def as_linear(self) -> nn.Module:
        if self._head is None:
            if self._data is not None:
                self._head = CudaQuantLinear(self.qtype, self._data, self.dim, self.num_embeddings, self.device)
            else:
                self._head = CudaDenseLinear(self.weight)
        self._data = None
        return self._head

    def release_bytes(self) -> None:
        """Drop the GGUF bytes once it is known that no tied head needs them."""
        self._data = None


def packs(qtype: GGMLQuantizationType | int, mode: str) -> bool:
    """Whether ``make_linear`` keeps a weight of ``qtype`` packed (a ``CudaQuantLinear``)."""
    return mode == "packed" and T(int(qtype)) in GPU_QUANT_TYPES


def make_linear(qtype: GGMLQuantizationType | int, data: torch.Tensor, in_features: int, out_features: int,
                mode: str, device: torch.device) -> nn.Module:
    """A linear layer over GGUF bytes on a CUDA device (see the module table)."""
    qtype = T(int(qtype))
    if packs(qtype, mode):
        return CudaQuantLinear(qtype, data, in_features, out_features, device)
    return CudaDenseLinear(dense_weight(qtype, data, out_features, in_features, compute_dtype(mode), device))


def make_embedding(qtype: GGMLQuantizationType | int, data: torch.Tensor, num_embeddings: int, dim: int,
                   mode: str, device: torch.device) -> nn.Module:
    return CudaEmbedding(qtype, data, num_embeddings, dim, mode, device)
