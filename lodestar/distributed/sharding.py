"""Which slice of each weight a tensor-parallel rank holds, and a loader that reads only that.

Megatron-style split of a decoder over ``world`` ranks:

==========================  ==================  =============================================
weight                      split               rank r holds
==========================  ==================  =============================================
q, k, v (and their biases)  column-parallel     its query heads and their KV heads (KV heads
                                                are replicated when there are fewer than ranks)
gate, up                    column-parallel     its MLP hidden units (block-aligned ranges)
attention output, down      row-parallel        the matching input columns; one all-reduce
token embedding, head       vocab-parallel      rows [v0, v1) of the vocabulary
norms, rope tables          replicated
==========================  ==================  =============================================

GGUF rows are independent, so a column-parallel slice is a selection of rows of the
tensor's bytes. A row-parallel slice cuts every row's bytes at block boundaries (32
weights per block for Q4_0/Q4_1/Q5_0/Q5_1/Q8_0, 256 for the K-quants); a cut inside a
block cannot be kept packed, so ``packed`` mode refuses it and the dense modes
dequantize that one tensor and slice the floats.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from torch import nn

from lodestar.distributed.layers import RowParallelLinear, VocabParallelEmbedding, VocabParallelHead
from lodestar.models.weights import HeadSplit, TensorSource, WeightLoader

T = GGMLQuantizationType


class ShardingError(ValueError):
    """The model cannot be split over the requested number of ranks; the message says why."""


@dataclass(frozen=True)
class ShardSpec:
    """One rank of a tensor-parallel group."""

    rank: int
    world: int

    def __post_init__(self) -> None:
        if self.world < 1 or not 0 <= self.rank < self.world:
            raise ValueError(f"ShardSpec(rank={self.rank}, world={self.world}): need 0 <= rank < world")


def even_range(n: int, parts: int, i: int) -> tuple[int, int]:
    """Part ``i`` of ``n`` items cut into ``parts`` contiguous runs whose sizes differ by at most one."""
    base, extra = divmod(n, parts)
    start = i * base + min(i, extra)
    return start, start + base + (1 if i < extra else 0)


def split_heads(n_heads: int, n_kv_heads: int, shard: ShardSpec) -> HeadSplit:
    """Query and KV heads of ``shard``: whole GQA groups per rank, or one replicated KV head
    shared by several ranks when there are fewer KV heads than ranks."""
    world, rank = shard.world, shard.rank
    if n_heads % n_kv_heads:
        raise ShardingError(f"{n_heads} query heads are not a multiple of {n_kv_heads} KV heads")
    group = n_heads // n_kv_heads
    if n_kv_heads >= world:
        kv0, kv1 = even_range(n_kv_heads, world, rank)
        return HeadSplit(kv0 * group, kv1 * group, kv0, kv1)
    if world % n_kv_heads:
        raise ShardingError(
            f"the model has {n_kv_heads} KV heads, which cannot be replicated evenly over {world} ranks; "
            f"use a --tensor-parallel size that divides {n_kv_heads} or is a multiple of it")
    copies = world // n_kv_heads
    if group < copies:
        raise ShardingError(f"the model has {n_heads} query heads, fewer than {world} ranks; "
                            f"use --tensor-parallel {n_heads} or less")
    kv = rank // copies
    q0, q1 = even_range(group, copies, rank % copies)
    return HeadSplit(kv * group + q0, kv * group + q1, kv, kv + 1)


def check_split(n_heads: int, n_kv_heads: int, world: int) -> None:
    """Raise ``ShardingError`` now if the attention heads cannot be split over ``world`` ranks."""
    for rank in range(world):
        split_heads(n_heads, n_kv_heads, ShardSpec(rank, world))


def vocab_range(vocab: int, shard: ShardSpec) -> tuple[int, int, int]:
    """(v0, v1, width): rows [v0, v1) of the vocabulary; every rank's logits are padded to ``width``."""
    width = -(-vocab // shard.world)
    v0 = min(shard.rank * width, vocab)
    v1 = min(v0 + width, vocab)
    if v1 <= v0:
        raise ShardingError(f"a vocabulary of {vocab} tokens cannot be split over {shard.world} ranks")
    return v0, v1, width


def block_size(qtype) -> int:
    """Weights per quantization block (1 for the float types)."""
    return GGML_QUANT_SIZES[T(int(qtype))][0]


class ShardedWeightLoader(WeightLoader):
    """A ``WeightLoader`` that builds rank ``shard.rank``'s slice of every layer.

    Only the slice's bytes are copied out of the checkpoint, so no rank holds the whole
    model. Row-parallel and vocab-parallel layers come wrapped in the modules of
    ``lodestar.distributed.layers``, whose forward runs the collective.
    """

    def __init__(self, source: TensorSource, shard: ShardSpec, mode: str = "packed", on_tensor=None,
                 device: str | torch.device = "cpu") -> None:
        super().__init__(source, mode, on_tensor, device)
        self.shard = shard
        self.world = shard.world

    def attention_split(self, n_heads: int, n_kv_heads: int) -> HeadSplit:
        return split_heads(n_heads, n_kv_heads, self.shard)

    def ffn_split(self, ffn_dim: int, down_name: str) -> tuple[int, int]:
        # Block-aligned units, so that the down projection's columns can stay packed.
        align = block_size(self.tensor(down_name).qtype)
        units = ffn_dim // align if ffn_dim % align == 0 else ffn_dim
        align = align if ffn_dim % align == 0 else 1
        u0, u1 = even_range(units, self.world, self.shard.rank)
        if u1 <= u0:
            raise ShardingError(f"{ffn_dim} MLP units cannot be split over {self.world} ranks")
        return u0 * align, u1 * align

    def row_parallel_linear(self, name: str, cols: tuple[int, int]) -> nn.Module:
        t = self.tensor(name)
        out_features, in_features = t.shape
        c0, c1 = cols
        block = block_size(t.qtype)
        if c0 % block == 0 and c1 % block == 0:
            per_block = t.data.shape[-1] // (in_features // block)
            data = t.data[:, c0 // block * per_block: c1 // block * per_block].contiguous()
            inner = self._make_linear(t.qtype, data, c1 - c0, out_features)
        elif self.mode != "packed":
            # Exact: the dense modes dequantize to fp32 first and round to bf16 afterwards anyway.
            w = t.dequantize().float()[:, c0:c1].contiguous()
            inner = self._make_linear(T.F32, w.view(torch.uint8), c1 - c0, out_features)
        else:
            raise ShardingError(
                f"tensor {name} ({t.qtype.name}, {block} weights per block) would be cut at columns "
                f"{c0}:{c1} of {in_features} for --tensor-parallel {self.world}, inside a quantization "
                f"block; use another --tensor-parallel size, or --dtype bf16 / fp32 (dequantized at load)")
        return RowParallelLinear(inner)

    def embedding(self, name: str) -> nn.Module:
        t = self.tensor(name)
        num, dim = t.shape
        v0, v1, width = vocab_range(num, self.shard)
        if self.cuda:
            from lodestar.layers import cuda_linear
            inner = cuda_linear.make_embedding(t.qtype, t.data[v0:v1], v1 - v0, dim, self.mode, self.device)
        else:
            from lodestar.layers import linear as qlinear
            inner = qlinear.make_embedding(t.qtype, t.data[v0:v1], v1 - v0, dim, self.mode)
        return VocabParallelEmbedding(inner, v0, v1, num, width)

    def head(self, name: str, tied_embedding: nn.Module) -> nn.Module:
        if self.has(name):
            t = self.tensor(name)
            num, dim = t.shape
            v0, v1, width = vocab_range(num, self.shard)
            inner = self._make_linear(t.qtype, t.data[v0:v1], dim, v1 - v0)
        else:
            inner, num, width = tied_embedding.as_linear(), tied_embedding.vocab_size, tied_embedding.width
        return VocabParallelHead(inner, num, width, self.world, all_gather=self.cuda)
