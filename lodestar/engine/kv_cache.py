"""Paged KV storage: a pool of fixed-size blocks shared by all sequences."""
from __future__ import annotations

from collections import deque

import torch


class OutOfBlocksError(RuntimeError):
    """The KV pool has no free block for a request."""


class BlockPool:
    """Hands out KV block ids; blocks return to the pool when their last user frees them."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("BlockPool needs num_blocks >= 1 and block_size >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self.ref_counts = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self, n: int = 1) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocksError(f"KV pool exhausted: need {n} blocks, {len(self._free)} free")
        out = [self._free.popleft() for _ in range(n)]
        for b in out:
            self.ref_counts[b] = 1
        return out

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            if self.ref_counts[b] <= 0:
                raise RuntimeError(f"block {b} freed twice")
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self._free.append(b)


def allocate_kv_tensors(attention_layers, num_blocks: int, block_size: int,
                        dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> int:
    """Give each attention layer its K/V tensors ``[num_blocks * block_size, Hk, D]``.

    ``torch.empty`` leaves pages untouched, so resident memory grows with use, not capacity.
    Returns the bytes reserved.
    """
    total = 0
    for layer in attention_layers:
        shape = (num_blocks * block_size, layer.n_kv_heads, layer.head_dim)
        layer.k_cache = torch.empty(shape, dtype=dtype, device=device)
        layer.v_cache = torch.empty(shape, dtype=dtype, device=device)
        total += 2 * layer.k_cache.numel() * layer.k_cache.element_size()
    return total
