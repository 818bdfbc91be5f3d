"""Turn checkpoint tensors into modules: packed quantized, or dequantized at load."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import torch
from torch import nn

from lodestar.layers import cuda_linear
from lodestar.layers import linear as qlinear

WEIGHT_MODES = ("packed", "fp32", "bf16")


class TensorSource(Protocol):
    """What a checkpoint offers: named tensors with qtype, shape, raw data, dequantize()."""

    tensors: dict


@dataclass(frozen=True)
class HeadSplit:
    """The query heads [q0, q1) and KV heads [kv0, kv1) one process computes."""

    q0: int
    q1: int
    kv0: int
    kv1: int

    @property
    def n_heads(self) -> int:
        return self.q1 - self.q0

    @property
    def n_kv_heads(self) -> int:
        return self.kv1 - self.kv0


class WeightLoader:
    """Builds layers from a checkpoint's tensors in one weight mode.

    ``packed`` keeps GGUF blocks packed (QuantizedLinear); ``fp32``/``bf16`` dequantize at
    load. Projections that share an input (q|k|v, gate|up) are fused into one matmul when
    ``fuse`` is set and their types agree; the exact fp32 CPU path keeps them separate so
    each output is computed exactly as the reference computes it.

    On a CUDA ``device`` the layers come from ``lodestar.layers.cuda_linear`` (Triton
    kernels over repacked blocks, or dense bf16/fp32), always fused.

    The tensor-parallel hooks (``attention_split``, ``ffn_split``, ``row_parallel_linear``)
    describe the whole model here; ``lodestar.distributed.ShardedWeightLoader`` overrides
    them to build one rank's slice.
    """

    world = 1   # processes the model is split across

    def __init__(self, source: TensorSource, mode: str = "packed",
                 on_tensor: Callable[[object], None] | None = None,
                 device: str | torch.device = "cpu") -> None:
        if mode not in WEIGHT_MODES:
            raise ValueError(f"weight mode {mode!r}; choose one of {', '.join(WEIGHT_MODES)}")
        self.source = source
        self.mode = mode
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.fuse = mode != "fp32" or self.cuda
        self.stack = True           # projections of one input in several packed types: one CudaQuantStack
        self.on_tensor = on_tensor  # progress hook, called once per tensor read

    def has(self, name: str) -> bool:
        return name in self.source.tensors

    def tensor(self, name: str):
        try:
            t = self.source.tensors[name]
        except KeyError:
            raise KeyError(f"checkpoint has no tensor {name!r}") from None
        if self.on_tensor is not None:
            self.on_tensor(t)
        return t

    def vector(self, name: str) -> torch.Tensor:
        """A small tensor (norm weight, bias) as fp32."""
        return self.tensor(name).dequantize().float().reshape(-1)

    def linear(self, name: str, row_order: torch.Tensor | None = None) -> nn.Module:
        t = self.tensor(name)
        data = t.data if row_order is None else t.data[row_order]
        return self._make_linear(t.qtype, data, t.shape[1], data.shape[0])

    def _make_linear(self, qtype, data: torch.Tensor, in_features: int, out_features: int) -> nn.Module:
        if self.cuda:
            return cuda_linear.make_linear(qtype, data, in_features, out_features, self.mode, self.device)
        return qlinear.make_linear(qtype, data, in_features, out_features, self.mode)

    def linears(self, names: Sequence[str], row_orders: Sequence[torch.Tensor | None] | None = None
                ) -> list[nn.Module] | nn.Module:
        """Several projections of the same input: one fused module if allowed, else a list."""
        row_orders = list(row_orders or [None] * len(names))
        ts = [self.tensor(n) for n in names]
        same_k = len({t.shape[1] for t in ts}) == 1
        if self.cuda and self.fuse and same_k and len({t.qtype for t in ts}) > 1:
            stack = self._stack(ts, row_orders)
            if stack is not None:
                return stack
        if not (self.fuse and same_k and len({t.qtype for t in ts}) == 1):
            return [self.linear(n, r) for n, r in zip(names, row_orders)]
        return self._fused(ts, row_orders)

    def _fused(self, ts: list, row_orders: Sequence[torch.Tensor | None]) -> nn.Module:
        """One module over tensors of one type, their rows one after another."""
        parts = [t.data if r is None else t.data[r] for t, r in zip(ts, row_orders)]
        data = torch.cat([p.reshape(p.shape[0], -1) for p in parts], dim=0)
        return self._make_linear(ts[0].qtype, data, ts[0].shape[1], data.shape[0])

    def _stack(self, ts: list, row_orders: Sequence[torch.Tensor | None]) -> nn.Module | None:
        """Projections of one input in several types (llama.cpp's Q4_K_M holds some layers'
        attn_v in Q6_K beside q and k in Q4_K) as one ``cuda_linear.CudaQuantStack`` on the
        GPU: neighbours of one type fused, every part packed. None (separate projections)
        where a part would not be packed (dense weights, types without a GPU kernel), or
        with ``stack`` off (tests compare the two)."""
        if not self.stack or not all(cuda_linear.packs(t.qtype, self.mode) for t in ts):
            return None
        runs: list[list[int]] = []
        for i, t in enumerate(ts):
            if runs and ts[runs[-1][0]].qtype == t.qtype:
                runs[-1].append(i)
            else:
                runs.append([i])
        return cuda_linear.CudaQuantStack([self._fused([ts[i] for i in run], [row_orders[i] for i in run])
                                           for run in runs])

    def embedding(self, name: str) -> nn.Module:
        t = self.tensor(name)
        num, dim = t.shape
        if self.cuda:
            return cuda_linear.make_embedding(t.qtype, t.data, num, dim, self.mode, self.device)
        return qlinear.make_embedding(t.qtype, t.data, num, dim, self.mode)

    def head(self, name: str, tied_embedding: nn.Module) -> nn.Module:
        """The output projection; tied models reuse the embedding's storage."""
        if self.has(name):
            return self.linear(name)
        return tied_embedding.as_linear()

    # -- tensor parallelism: one process holds every head, row and column --------------
    def attention_split(self, n_heads: int, n_kv_heads: int) -> HeadSplit:
        """The attention heads this process computes."""
        return HeadSplit(0, n_heads, 0, n_kv_heads)

    def ffn_split(self, ffn_dim: int, down_name: str) -> tuple[int, int]:
        """The MLP hidden units [f0, f1) this process computes."""
        return 0, ffn_dim

    def row_parallel_linear(self, name: str, cols: tuple[int, int]) -> nn.Module:
        """A projection whose input is split across processes (attention output, MLP down)."""
        return self.linear(name)


def split_fused(module: nn.Module | list[nn.Module], x: torch.Tensor, sizes: Sequence[int]
                ) -> list[torch.Tensor]:
    """Apply fused (one module) or separate projections; return one output per part."""
    if isinstance(module, (list, nn.ModuleList)):
        return [m(x) for m in module]
    return list(module(x).split(list(sizes), dim=-1))
