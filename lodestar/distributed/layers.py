"""Layers whose forward runs one collective over the default process group.

The collectives stay inside the model's forward and never read a tensor's value on the
host, so a CUDA graph that captures the forward captures them too.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lodestar.distributed.allreduce import all_reduce


class RowParallelLinear(nn.Module):
    """A projection over this rank's slice of the input features; the partial outputs of
    all ranks are summed (all-reduce), so every rank ends with the full output."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.site: int | None = None   # this layer's slice of the symmetric buffer (allreduce.setup)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce(self.inner(x), self.site)


class VocabParallelEmbedding(nn.Module):
    """Rows [v0, v1) of the token table; ids outside them give zeros, and the all-reduce
    fills each row from the rank that holds it (adding zeros is exact)."""

    def __init__(self, inner: nn.Module, v0: int, v1: int, vocab_size: int, width: int) -> None:
        super().__init__()
        self.inner = inner
        self.v0, self.v1, self.vocab_size, self.width = v0, v1, vocab_size, width
        self.site: int | None = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.v0
        outside = (local < 0) | (local >= self.v1 - self.v0)
        rows = self.inner(local.clamp(0, self.v1 - self.v0 - 1))
        rows = rows.masked_fill(outside.unsqueeze(-1), 0)
        return all_reduce(rows, self.site)

    def as_linear(self) -> nn.Module:
        """This rank's rows as a linear layer (a tied head's slice)."""
        return self.inner.as_linear()

    def extra_repr(self) -> str:
        return f"rows {self.v0}:{self.v1} of {self.vocab_size}"


class VocabParallelHead(nn.Module):
    """The output head over this rank's vocabulary rows.

    Every rank computes its ``[R, width]`` slice of the logits (the last one padded). With
    ``all_gather`` (NCCL) every rank gets the full ``[R, vocab]`` logits; otherwise (gloo)
    the slices are gathered on rank 0 only, and the other ranks get their own slice back.
    """

    def __init__(self, inner: nn.Module, vocab_size: int, width: int, world: int, all_gather: bool) -> None:
        super().__init__()
        self.inner = inner
        self.vocab_size, self.width, self.world, self.all_gather = vocab_size, width, world, all_gather

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.inner(x)
        if y.shape[-1] < self.width:
            y = F.pad(y, (0, self.width - y.shape[-1]))
        y = y.contiguous()
        if self.all_gather:
            parts = torch.empty((self.world, *y.shape), dtype=y.dtype, device=y.device)
            dist.all_gather_into_tensor(parts, y)
        elif dist.get_rank() == 0:
            parts = [torch.empty_like(y) for _ in range(self.world)]
            dist.gather(y, parts, dst=0)
            parts = torch.stack(parts)
        else:
            dist.gather(y, None, dst=0)
            return y
        # [world, R, width] -> [R, world * width] -> the real vocabulary
        return parts.movedim(0, -2).reshape(*y.shape[:-1], self.world * self.width)[..., :self.vocab_size]

    def extra_repr(self) -> str:
        return f"vocab={self.vocab_size}, width={self.width}, world={self.world}"
