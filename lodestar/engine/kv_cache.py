"""Paged KV storage: a pool of fixed-size blocks shared by all sequences, with prefix caching.

A block that holds a full ``block_size`` run of tokens gets a content hash chained from
its parent block (``hash(parent, tokens, model fingerprint)``). A new request looks its
prompt's hash chain up and reuses the longest run of cached blocks. Blocks whose last
user finished keep their contents and hash and stay findable until the pool needs them
back; then the least recently used are evicted first.

Empty blocks are handed out in runs of consecutive ids where possible: a sequence that
grows asks for the blocks right after its last one, and a new sequence starts halfway
into the longest run of empty blocks, leaving room for the sequence before it to grow.
A sequence whose blocks are consecutive reads its context on the CPU as one slice of
the KV tensors (``AttentionBatch._plans``) instead of a gather. Only speed depends
on the placement: attention gives the same bits either way.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict

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
        self._empty = np.ones(num_blocks, dtype=bool)          # blocks with no contents
        self._num_empty = num_blocks
        self._evictable: OrderedDict[int, None] = OrderedDict()  # ref 0 but cached, LRU first
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}                      # hash -> block id
        self.on_evict = None                                    # callback(block_id, hash)

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now (empty or evictable)."""
        return self._num_empty + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self, n: int = 1, after: int | None = None) -> list[int]:
        """``n`` blocks with one reference each, consecutive where the empty blocks allow.

        ``after``: the last block the caller already holds (a growing sequence); the
        blocks right after it are taken first while they are empty. Cached blocks are
        evicted (least recently used first) only once no empty block is left.
        """
        if n > self.num_free:
            raise OutOfBlocksError(f"KV pool exhausted: need {n} blocks, {self.num_free} free")
        out: list[int] = []
        if after is not None:
            b = after + 1
            while len(out) < n and b < self.num_blocks and self._empty[b]:
                self._take_empty(b)
                out.append(b)
                b += 1
        while len(out) < n and self._num_empty:
            start, count = self._place(n - len(out))
            for b in range(start, start + count):
                self._take_empty(b)
                out.append(b)
        while len(out) < n:
            b, _ = self._evictable.popitem(last=False)
            self._uncache(b)
            out.append(b)
        for b in out:
            self.ref_counts[b] = 1
        return out

    def _take_empty(self, b: int) -> None:
        self._empty[b] = False
        self._num_empty -= 1

    def _place(self, n: int) -> tuple[int, int]:
        """Where ``n`` blocks for a new run go: (first block, how many fit there, at most n).

        The longest run of empty blocks (the first such); if a held block precedes it, the
        new run starts halfway into the spare room, so that both neighbours can grow.
        """
        edges = np.flatnonzero(np.diff(self._empty, prepend=False, append=False))
        starts, lengths = edges[0::2], edges[1::2] - edges[0::2]
        i = int(np.argmax(lengths))
        start, length = int(starts[i]), int(lengths[i])
        if length > n and start > 0 and self.ref_counts[start - 1] > 0:
            start += (length - n) // 2
        return start, min(n, length)

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
                    self._empty[b] = True
                    self._num_empty += 1

    # -- prefix cache -------------------------------------------------------------
    def register(self, block: int, h: bytes) -> bool:
        """Mark a full block's contents as ``h`` so later requests can reuse it; True if it
        is now the cached copy of ``h``."""
        if not self.enable_prefix_cache or self.block_hashes[block] is not None:
            return False
        if h in self.cached:       # same content computed twice: keep the first copy
            return False
        self.block_hashes[block] = h
        self.cached[h] = block
        return True

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
            self._empty[b] = True
            self._num_empty += 1


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
