"""Linear layers and embedding tables over GGUF weights.

``QuantizedLinear`` keeps the weight packed and multiplies it with one kernel for every
number of rows M, so that a row's result never depends on the batch it came in
(ARCHITECTURE.md section 4; see ``lodestar.kernels.cpu_quant`` for the packed forms):

==============================  ============================  =========================
weight type                     kernel (every M)              with dense_min_m, M >= it
==============================  ============================  =========================
Q4_0, Q4_1, Q4_K, Q5_0, Q5_1,   int8 x per 32 values, exact   dequantize to bf16,
Q6_K, Q8_0                      integer block dot products    bf16 mm
F32                             fp32 matmul on the bytes      same
F16, BF16, Q2/3/5_K             dequantize tiles, fp32 mm     same
==============================  ============================  =========================

``dense_min_m`` (off by default) sends calls of at least that many rows to
dequantize-then-bf16-matmul; those rows round differently from the kernel's, so a
prompt's logits would then depend on how the scheduler batched it. The exact fp32 types
are batch-dependent anyway in the last bits (MKL's GEMM blocking depends on M).

``make_linear``/``make_embedding`` build the packed modules (``mode="packed"``) or dense
ones holding the weight dequantized at load (``"fp32"``, ``"bf16"``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from gguf.constants import GGMLQuantizationType
from torch import nn

from lodestar.kernels import cpu_quant as cq

T = GGMLQuantizationType

MODES = ("packed", "fp32", "bf16")


def _qtype(qtype: GGMLQuantizationType | int) -> GGMLQuantizationType:
    return GGMLQuantizationType(int(qtype))


class QuantizedLinear(nn.Module):
    """``y = x @ W.T`` with W kept packed; x and y are float32 ``[..., features]``.

    ``data`` is the weight's GGUF bytes, uint8 ``[out_features, bytes_per_row]``. Q4_0,
    Q4_1 and Q4_K are repacked once to int4 (same size); Q8_0, Q5_0, Q5_1 and Q6_K to
    int8 codes (1.125-1.25 bytes per weight); other types keep ``data`` itself.
    ``dense_min_m``: see the module docstring (default: one kernel for every M).
    """

    def __init__(self, qtype: GGMLQuantizationType | int, data: torch.Tensor,
                 in_features: int, out_features: int, dense_min_m: int | None = None) -> None:
        super().__init__()
        qtype = _qtype(qtype)
        self.qtype, self.in_features, self.out_features = qtype, in_features, out_features
        cq.check_bytes(qtype, data, out_features, in_features)
        self.storage = _pack(qtype, data, out_features, in_features)
        if isinstance(self.storage, cq.IntWeight):
            self.path = "native" if self.storage.native else "int"
            self._small, self._large = cq.int_matmul, cq.int_dense_matmul
        else:
            self.path = "fp32" if qtype == T.F32 else "dequant"
            self._small = self._large = self._dequant_matmul
        # Calls with more rows than this take the dense route; by default none do.
        self._max_m = (1 << 62) if dense_min_m is None else dense_min_m - 1

    @property
    def nbytes(self) -> int:
        """Bytes held by the packed weight."""
        s = self.storage
        return s.numel() * s.element_size() if isinstance(s, torch.Tensor) else s.nbytes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or not x.is_contiguous():
            x = x.float().contiguous()
        if x.dim() == 2:
            return (self._small if x.shape[0] <= self._max_m else self._large)(x, self.storage)
        x2 = x.reshape(-1, self.in_features)
        fn = self._small if x2.shape[0] <= self._max_m else self._large
        return fn(x2, self.storage).view(*x.shape[:-1], self.out_features)

    def _dequant_matmul(self, x: torch.Tensor, storage: torch.Tensor) -> torch.Tensor:
        if self.qtype == T.F32:
            return F.linear(x, storage)
        if self.qtype in (T.F16, T.BF16):
            return cq.tiled_matmul(x, self.out_features, self.in_features,
                                   lambda r0, r1: storage[r0:r1].float())
        k = self.in_features
        return cq.tiled_matmul(x, self.out_features, k,
                               lambda r0, r1: cq.dequantize(storage[r0:r1], self.qtype, (r1 - r0, k)))

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of W as float32 ``[len(ids), in_features]``, exactly as gguf."""
        s = self.storage
        if isinstance(s, cq.IntWeight):
            return cq.int_rows(s, ids)
        if self.qtype in cq.FLOAT_TYPES:
            return s.index_select(0, ids).float()
        return cq.dequantize(s.index_select(0, ids), self.qtype, (ids.numel(), self.in_features))

    def extra_repr(self) -> str:
        return (f"{self.qtype.name}, in_features={self.in_features}, out_features={self.out_features}, "
                f"path={self.path}, bytes={self.nbytes}")


def _pack(qtype: GGMLQuantizationType, data: torch.Tensor, n: int, k: int):
    if qtype in cq.INT_TYPES:
        return cq.int_pack(qtype, data, n, k)
    if qtype in cq.FLOAT_TYPES:
        return cq.float_view(qtype, data, n, k)
    return data


class QuantizedEmbedding(nn.Module):
    """Token embedding over GGUF bytes ``[num_embeddings, bytes_per_row]``.

    ``forward(ids)`` dequantizes only the gathered rows, bit-identical to gguf.
    ``as_linear()`` returns the tied output head; the head and the table then share one
    storage (its rows are gguf's, bit for bit) and the GGUF bytes are released.
    """

    def __init__(self, qtype: GGMLQuantizationType | int, data: torch.Tensor,
                 num_embeddings: int, dim: int) -> None:
        super().__init__()
        qtype = _qtype(qtype)
        cq.check_bytes(qtype, data, num_embeddings, dim)
        self.qtype, self.num_embeddings, self.dim = qtype, num_embeddings, dim
        self.data: torch.Tensor | None = data
        self._head: QuantizedLinear | None = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        if self.data is None:
            rows = self._head.rows(flat)
        elif self.qtype in cq.FLOAT_TYPES:
            picked = self.data.index_select(0, flat)
            rows = cq.float_view(self.qtype, picked, flat.numel(), self.dim).float()
        else:
            rows = cq.dequantize(self.data.index_select(0, flat), self.qtype, (flat.numel(), self.dim))
        return rows.view(*ids.shape, self.dim)

    def as_linear(self) -> QuantizedLinear:
        """The same table as a ``[dim -> num_embeddings]`` linear (tied output head)."""
        if self._head is None:
            self._head = QuantizedLinear(self.qtype, self.data, self.dim, self.num_embeddings)
            self.data = None        # every packed form gives gguf's rows
        return self._head

    @property
    def nbytes(self) -> int:
        own = self.data.numel() if self.data is not None else 0
        return own + (self._head.nbytes if self._head is not None else 0)

    def extra_repr(self) -> str:
        return (f"{self.qtype.name}, num_embeddings={self.num_embeddings}, dim={self.dim}, "
                f"tied={self._head is not None}")


class DenseLinear(nn.Module):
    """``y = x @ W.T`` with W dense in fp32 or bf16; x and y are float32."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("weight", weight, persistent=False)
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(self.weight.dtype), self.weight).float()


class DenseEmbedding(nn.Module):
    """Embedding table dense in fp32 or bf16; rows come back float32."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("weight", weight, persistent=False)
        self.num_embeddings, self.dim = weight.shape

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight).float()

    def as_linear(self) -> DenseLinear:
        return DenseLinear(self.weight)


def _dense_weight(qtype: GGMLQuantizationType, data: torch.Tensor, rows: int, cols: int,
                  mode: str) -> torch.Tensor:
    cq.check_bytes(qtype, data, rows, cols)
    if qtype in cq.FLOAT_TYPES:
        w = cq.float_view(qtype, data, rows, cols)
    else:
        w = cq.dequantize(data, qtype, (rows, cols))
    return w.to(torch.bfloat16 if mode == "bf16" else torch.float32).contiguous()


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"unknown weight mode {mode!r}; choose one of {', '.join(MODES)}")


def make_linear(qtype: GGMLQuantizationType | int, data: torch.Tensor, in_features: int,
                out_features: int, mode: str = "packed", dense_min_m: int | None = None) -> nn.Module:
    """A linear layer over GGUF bytes: packed (``QuantizedLinear``) or dense fp32/bf16."""
    _check_mode(mode)
    qtype = _qtype(qtype)
    if mode == "packed":
        return QuantizedLinear(qtype, data, in_features, out_features, dense_min_m)
    return DenseLinear(_dense_weight(qtype, data, out_features, in_features, mode))


def make_embedding(qtype: GGMLQuantizationType | int, data: torch.Tensor, num_embeddings: int,
                   dim: int, mode: str = "packed") -> nn.Module:
    """An embedding table over GGUF bytes: packed (``QuantizedEmbedding``) or dense."""
    _check_mode(mode)
    qtype = _qtype(qtype)
    if mode == "packed":
        return QuantizedEmbedding(qtype, data, num_embeddings, dim)
    return DenseEmbedding(_dense_weight(qtype, data, num_embeddings, dim, mode))
