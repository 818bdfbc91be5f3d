"""Paged KV storage: a pool of fixed-size blocks shared by all sequences, with prefix caching.

A block that holds a full ``block_size`` run of tokens gets a content hash chained from
its parent block (``hash(parent, tokens, model fingerprint)``). A new request looks its
prompt's hash chain up and reuses the longest run of cached blocks. Blocks whose last
user finished keep their contents and hash and stay findable until the pool needs them
back; then the least recently used are evicted first.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict, deque

import numpy as np
import torch


class OutOfBlocksError(RuntimeError):
    """The KV pool has no free block for a request."""


def block_hash(parent: bytes | None, tokens: list[int], fingerprint: str) -> bytes:
    """Stable content hash of one full block (same value across processes and restarts)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or fingerprint.encode())
    h.update(np.asarray(tokens, dtype=np.int64).tobytes())
    return h.digest()


def prefix_hashes(tokens: list[int], block_size: int, fingerprint: str, limit: int | None = None) -> list[bytes]:
    """Hash chain of the full blocks of ``tokens`` (at most ``limit`` blocks)."""
    n = len(tokens) // block_size
    if limit is not None:
        n = min(n, limit)
    out, parent = [], None
    for i in range(n):
        parent = block_hash(parent, tokens[i * block_size:(i + 1) * block_size], fingerprint)
        out.append(parent)
    return out


class BlockPool:
    """Hands out KV block ids with reference counts and a prefix cache."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_cache: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("BlockPool needs num_blocks >= 1 and block_size >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_cache = enable_prefix_cache
        self._free: deque[int] = deque(range(num_blocks))      # empty blocks
        self._evictable: OrderedDict[int, None] = OrderedDict()  # ref 0 but cached, LRU first
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}                      # hash -> block id
        self.on_evict = None                                    # callback(block_id, hash)

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now (empty or evictable)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self, n: int = 1) -> list[int]:
        if n > self.num_free:
            raise OutOfBlocksError(f"KV pool exhausted: need {n} blocks, {self.num_free} free")
        out = []
        for _ in range(n):
            if self._free:
                b = self._free.popleft()
            else:
                b, _ = self._evictable.popitem(last=False)
                self._uncache(b)
            self.ref_counts[b] = 1
            out.append(b)
        return out

    def _uncache(self, b: int) -> None:
        h = self.block_hashes[b]
        if h is not None:
            if self.on_evict is not None:
                self.on_evict(b, h)
            if self.cached.get(h) == b:
                del self.cached[h]
            self.block_hashes[b] = None

    def free(self, blocks: list[int]) -> None:
        # Tail blocks first so that a chain is evicted from its end, keeping prefixes longest.
        for b in reversed(blocks):
            if self.ref_counts[b] <= 0:
                raise RuntimeError(f"block {b} freed twice")
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                if self.block_hashes[b] is not None:
                    self._evictable[b] = None
                else:
                    self._free.append(b)

    # -- prefix cache -------------------------------------------------------------
    def register(self, block: int, h: bytes) -> None:
        """Mark a full block's contents as ``h`` so later requests can reuse it."""
        if not self.enable_prefix_cache or self.block_hashes[block] is not None:
            return
        if h in self.cached:       # same content computed twice: keep the first copy
            return
        self.block_hashes[block] = h
        self.cached[h] = block

    def lookup(self, hashes: list[bytes]) -> list[int]:
        """Longest run of cached blocks for a hash chain; takes a reference on each."""
        if not self.enable_prefix_cache:
            return []
        hit = []
        for h in hashes:
            b = self.cached.get(h)
            if b is None:
                break
            hit.append(b)
        for b in hit:
            if self.ref_counts[b] == 0:
                self._evictable.pop(b, None)
            self.ref_counts[b] += 1
        return hit

    def reset_cache(self) -> None:
        """Forget every cached block that no sequence uses."""
        for b in list(self._evictable):
            self._evictable.pop(b)
            self._uncache(b)
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
