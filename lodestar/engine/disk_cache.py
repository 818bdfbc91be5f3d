"""Disk tier for KV: content-addressed checkpoint files of computed prefixes.

A checkpoint holds the K/V of every layer for the first ``n`` tokens of a conversation
(``n`` a multiple of the block size). Its name is derived from the model file's SHA-256,
the weight mode and the hash chain of those tokens, so a restarted engine finds the
longest checkpoint matching a new prompt with one set lookup per block. Every file
carries a header (format version, model fingerprint, token ids, shapes, payload
checksum); a file that fails any check is deleted and the prefix recomputed.

Writes happen on a background thread from a copy of the blocks, so the engine keeps
stepping. The folder is kept under a size cap by deleting least recently used files.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

MAGIC = b"LDSTRKV\n"
VERSION = 1

log = logging.getLogger("lodestar.disk_kv")


@dataclass(frozen=True)
class KVLayout:
    """What every checkpoint of this engine must match."""

    model_sha256: str
    mode: str
    dtype: str
    block_size: int
    shapes: tuple[tuple[int, int], ...]    # (kv_heads, head_dim) per layer

    @property
    def prefix(self) -> str:
        return f"{self.model_sha256[:16]}-{self.mode}"


class DiskKVCache:
    def __init__(self, directory: str | Path, layout: KVLayout, max_bytes: int = 4 << 30,
                 min_tokens: int = 256) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.layout = layout
        self.max_bytes = max_bytes
        self.min_tokens = min_tokens
        self.stats = {"read_tokens": 0, "write_tokens": 0, "rejected": 0, "files_written": 0}
        self._known: set[str] = {p.name for p in self.dir.glob(f"{layout.prefix}-*.kv")}
        self._queue: queue.Queue = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="lodestar-kv-writer", daemon=True)
        self._writer.start()

    def _name(self, chain_hash: bytes) -> str:
        return f"{self.layout.prefix}-{chain_hash.hex()}.kv"

    def has(self, chain_hash: bytes) -> bool:
        return self._name(chain_hash) in self._known

    def find(self, hashes: list[bytes]) -> int:
        """Number of leading blocks of ``hashes`` covered by the longest checkpoint (0 if none)."""
        for n in range(len(hashes), 0, -1):
            if self._name(hashes[n - 1]) in self._known:
                return n
        return 0

    # -- read -----------------------------------------------------------------------
    def load(self, chain_hash: bytes, tokens: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """Per-layer (K, V) ``[len(tokens), Hk, D]`` for exactly these tokens, or None.

        A file that cannot be read for any reason (corrupt, truncated, a header of the
        wrong shape, for another model or other tokens) is deleted and the caller
        recomputes the prefix: a damaged cache must never stop the engine.
        """
        path = self.dir / self._name(chain_hash)
        try:
            with open(path, "rb") as f:
                data = f.read()
            kv = self._decode(data, tokens)
        except Exception as e:  # noqa: BLE001 - whatever is wrong with the file, recompute
            self._reject(path, f"{type(e).__name__}: {e}")
            return None
        now = time.time()
        try:
            os.utime(path, (now, now))   # LRU by mtime
        except OSError:
            pass
        self.stats["read_tokens"] += len(tokens)
        return kv

    def _decode(self, data: bytes, tokens: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if data[: len(MAGIC)] != MAGIC:
            raise ValueError("bad magic")
        (hlen,) = struct.unpack_from("<I", data, len(MAGIC))
        start = len(MAGIC) + 4
        header = json.loads(data[start:start + hlen])
        if not isinstance(header, dict):
            raise ValueError(f"header is a JSON {type(header).__name__}, not an object")
        payload = memoryview(data)[start + hlen:]
        lay = self.layout
        if header["version"] != VERSION:
            raise ValueError(f"format version {header['version']}")
        if (header["model_sha256"], header["mode"], header["dtype"], header["block_size"]) != (
                lay.model_sha256, lay.mode, lay.dtype, lay.block_size):
            raise ValueError("checkpoint is for another model, mode or dtype")
        shapes = header["shapes"]
        if not isinstance(shapes, list) or not all(isinstance(s, list) for s in shapes) \
                or [tuple(s) for s in shapes] != list(lay.shapes):
            raise ValueError("layer shapes differ")
        if header["tokens"] != list(tokens):
            raise ValueError("token ids differ")
        if len(payload) != header["payload_bytes"]:
            raise ValueError(f"truncated: {len(payload)} of {header['payload_bytes']} payload bytes")
        if hashlib.blake2b(payload, digest_size=16).hexdigest() != header["checksum"]:
            raise ValueError("checksum mismatch")
        dtype = getattr(torch, lay.dtype)
        flat = torch.frombuffer(bytearray(payload), dtype=dtype)
        out, off, n = [], 0, len(tokens)
        for kvh, hd in lay.shapes:
            size = n * kvh * hd
            k = flat[off:off + size].view(n, kvh, hd)
            v = flat[off + size:off + 2 * size].view(n, kvh, hd)
            out.append((k, v))
            off += 2 * size
        return out

    def _reject(self, path: Path, why: str) -> None:
        log.warning("disk KV checkpoint %s is unusable (%s); deleted, the prefix will be recomputed", path.name, why)
        self.stats["rejected"] += 1
        self._known.discard(path.name)
        try:
            path.unlink()
        except OSError:
            pass

    # -- write ----------------------------------------------------------------------
    def save(self, chain_hash: bytes, tokens: list[int], kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Queue a checkpoint; ``kv`` must be tensors the caller will not modify (copies)."""
        name = self._name(chain_hash)
        if name in self._known:
            return
        self._known.add(name)
        self._queue.put((name, list(tokens), kv))

    def flush(self, timeout: float = 60.0) -> None:
        """Wait until every queued checkpoint is on disk."""
        done = threading.Event()
        self._queue.put(done)
        done.wait(timeout)

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            if isinstance(item, threading.Event):
                item.set()
                continue
            name, tokens, kv = item
            try:
                self._write(name, tokens, kv)
            except Exception as e:  # noqa: BLE001 - a failed write only loses a cache entry
                log.warning("disk KV checkpoint %s was not written (%s: %s)", name, type(e).__name__, e)
                self._known.discard(name)

    def _write(self, name: str, tokens: list[int], kv) -> None:
        payload = b"".join(t.contiguous().numpy().tobytes() for pair in kv for t in pair)
        lay = self.layout
        header = json.dumps({
            "version": VERSION, "model_sha256": lay.model_sha256, "mode": lay.mode, "dtype": lay.dtype,
            "block_size": lay.block_size, "shapes": [list(s) for s in lay.shapes], "tokens": tokens,
            "payload_bytes": len(payload), "checksum": hashlib.blake2b(payload, digest_size=16).hexdigest(),
        }).encode()
        tmp = self.dir / (name + ".tmp")
        with open(tmp, "wb") as f:
            f.write(MAGIC + struct.pack("<I", len(header)) + header + payload)
        os.replace(tmp, self.dir / name)
        self.stats["write_tokens"] += len(tokens)
        self.stats["files_written"] += 1
        self._enforce_cap()

    def _enforce_cap(self) -> None:
        files = []
        for p in self.dir.glob("*.kv"):
            try:
                st = p.stat()
            except OSError:
                continue
            files.append((st.st_mtime, st.st_size, p))
        total = sum(s for _, s, _ in files)
        for _, size, p in sorted(files, key=lambda f: f[0]):
            if total <= self.max_bytes:
                break
            try:
                p.unlink()
            except OSError:
                continue
            self._known.discard(p.name)
            total -= size
