"""``lodestar bench gguf-fuzz``: mutated copies of a GGUF model file, and what loading each does.

Each mutation rewrites one copy of the source file with one defect and loads it the way
the command line does (open, validate, tokenizer, model, the chat template, two greedy
tokens from a short prompt: so NaN weights are reached too). Every copy must either work
(``ok``) or fail with a one-line error of the kind the command line prints with exit
code 2 (``error``). Any other exception, or a multi-line message, is a ``crash``; a copy
that takes longer than the time limit is a ``hang``.

Mutation ``i`` of seed ``s`` is always the same file: ``mutate(Source(path), s, i)``
rebuilds it to reproduce a failure. The kinds (``KINDS``):

- header structure: a tensor renamed or removed, a wrong tensor or key count, a tensor's
  shape, type or data offset changed;
- metadata: a key removed, duplicated, stored with another type, or set to an absurd
  value (``rope.dimension_count=1``, ``block_count=10**9``, NaN epsilon ...), the
  architecture changed;
- tokenizer: merges corrupted, token / type / score arrays truncated or out of range,
  special token ids out of range, a chat template that does not compile;
- data: NaN or infinite values written into a tensor (float values or block scales),
  random bytes over a tensor;
- bytes: random flips in the header, the file truncated.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import random
import shutil
import signal
import struct
import tempfile
import threading
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType
from gguf.constants import GGML_QUANT_SIZES, GGUF_MAGIC

from lodestar.formats.gguf import GGUFFile

V = GGUFValueType
Q = GGMLQuantizationType

_SCALAR_FORMATS = {
    V.UINT8: "<B", V.INT8: "<b", V.UINT16: "<H", V.INT16: "<h", V.UINT32: "<I", V.INT32: "<i",
    V.FLOAT32: "<f", V.BOOL: "<?", V.UINT64: "<Q", V.INT64: "<q", V.FLOAT64: "<d",
}
_NUMPY_TYPES = {
    V.UINT8: np.uint8, V.INT8: np.int8, V.UINT16: np.uint16, V.INT16: np.int16, V.UINT32: np.uint32,
    V.INT32: np.int32, V.FLOAT32: np.float32, V.BOOL: np.bool_, V.UINT64: np.uint64, V.INT64: np.int64,
    V.FLOAT64: np.float64,
}
_INT_RANGES = {
    V.UINT8: (0, 1 << 8), V.INT8: (-(1 << 7), 1 << 7), V.UINT16: (0, 1 << 16), V.INT16: (-(1 << 15), 1 << 15),
    V.UINT32: (0, 1 << 32), V.INT32: (-(1 << 31), 1 << 31), V.UINT64: (0, 1 << 64), V.INT64: (-(1 << 63), 1 << 63),
}


# ------------------------------------------------------------------ the file as plain data

@dataclass(frozen=True)
class KV:
    key: str
    types: tuple[GGUFValueType, ...]    # arrays: ARRAY, then the element type
    value: Any


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]               # GGUF order: the row length first
    qtype: int
    offset: int                         # from the start of the data section


@dataclass(frozen=True)
class Layout:
    """Everything before the tensor data; the counts default to the real ones."""

    version: int
    kvs: tuple[KV, ...]
    tensors: tuple[TensorInfo, ...]
    alignment: int
    n_tensors: int | None = None
    n_kv: int | None = None

    def kv(self, key: str) -> KV | None:
        return next((kv for kv in self.kvs if kv.key == key), None)

    def set_kv(self, key: str, new: KV | None) -> Layout:
        """``key`` replaced by ``new`` (appended when absent; removed when ``new`` is None)."""
        kvs = [kv for kv in self.kvs if kv.key != key] if new is None else \
            [new if kv.key == key else kv for kv in self.kvs]
        if new is not None and self.kv(key) is None:
            kvs.append(new)
        return replace(self, kvs=tuple(kvs))

    def set_tensor(self, index: int, new: TensorInfo | None) -> Layout:
        tensors = list(self.tensors)
        if new is None:
            del tensors[index]
        else:
            tensors[index] = new
        return replace(self, tensors=tuple(tensors))


@dataclass(frozen=True)
class Mutant:
    """One mutated copy: a header layout plus edits applied to the written bytes."""

    kind: str
    description: str
    layout: Layout
    data_edits: tuple[tuple[int, bytes], ...] = ()      # (offset in the data section, bytes)
    header_flips: tuple[tuple[float, int], ...] = ()    # (position as a fraction of the header, xor mask)
    keep_fraction: float | None = None                  # truncate the file to this fraction


def _string(text: str) -> bytes:
    raw = text.encode("utf-8")
    return struct.pack("<Q", len(raw)) + raw


def _infer_types(value: Any) -> tuple[GGUFValueType, ...]:
    if isinstance(value, bool):
        return (V.BOOL,)
    if isinstance(value, int):
        for t in (V.UINT32, V.INT32, V.UINT64, V.INT64):
            lo, hi = _INT_RANGES[t]
            if lo <= value < hi:
                return (t,)
        raise ValueError(f"integer {value} does not fit 64 bits")
    if isinstance(value, float):
        return (V.FLOAT32,)
    if isinstance(value, str):
        return (V.STRING,)
    if isinstance(value, list):
        return (V.ARRAY,) + (_infer_types(value[0]) if value else (V.UINT8,))
    raise TypeError(f"no GGUF type for {type(value).__name__}")


def encode_value(types: tuple[GGUFValueType, ...], value: Any) -> bytes:
    """A metadata value as GGUF stores it (without the leading type tag)."""
    kind = types[0]
    if kind == V.STRING:
        return _string(value)
    if kind == V.ARRAY:
        item = types[1] if len(types) > 1 else V.UINT8
        if item == V.STRING:
            body = b"".join(_string(v) for v in value)
        elif item == V.ARRAY:   # each element: its own element type, count and items
            body = b"".join(encode_value(_infer_types(v), v) for v in value)
        else:
            body = np.asarray(value, dtype=_NUMPY_TYPES[item]).tobytes()
        return struct.pack("<IQ", item, len(value)) + body
    return struct.pack(_SCALAR_FORMATS[kind], value)


class Source:
    """A parsed model file to mutate: its header as plain values and its tensor data bytes."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        with GGUFFile(self.path) as g:
            kvs = tuple(KV(k, g.metadata_types[k], g.metadata[k]) for k in g.metadata)
            tensors = tuple(TensorInfo(t.name, tuple(reversed(t.shape)), int(t.qtype), t.offset - g.data_offset)
                            for t in g.tensors.values())
            self.layout = Layout(g.version, kvs, tensors, g.alignment)
            self.arch: str = g.config.arch
            self.n_layers: int = g.config.n_layers
            data_offset = g.data_offset
        self.data = np.memmap(self.path, mode="r", offset=data_offset)
        self._encoded: dict[int, bytes] = {}    # id(KV) of the source's own entries -> bytes

    def _encode_kv(self, kv: KV) -> bytes:
        own = self._encoded.get(id(kv))
        if own is not None:
            return own
        raw = _string(kv.key) + struct.pack("<I", kv.types[0]) + encode_value(kv.types, kv.value)
        if any(kv is k for k in self.layout.kvs):
            self._encoded[id(kv)] = raw
        return raw

    def header(self, layout: Layout) -> bytes:
        n_tensors = len(layout.tensors) if layout.n_tensors is None else layout.n_tensors
        n_kv = len(layout.kvs) if layout.n_kv is None else layout.n_kv
        parts = [struct.pack("<IIQQ", GGUF_MAGIC, layout.version, n_tensors, n_kv)]
        parts += [self._encode_kv(kv) for kv in layout.kvs]
        for t in layout.tensors:
            parts.append(_string(t.name) + struct.pack(f"<I{len(t.dims)}QIQ", len(t.dims), *t.dims, t.qtype, t.offset))
        return b"".join(parts)

    def write(self, mutant: Mutant, path: str | Path) -> None:
        header = bytearray(self.header(mutant.layout))
        for where, mask in mutant.header_flips:
            pos = min(int(where * len(header)), len(header) - 1)
            header[pos] ^= mask
        pad = -len(header) % self.layout.alignment
        data_start = len(header) + pad
        with open(path, "wb") as f:
            f.write(header)
            f.write(b"\0" * pad)
            f.write(memoryview(self.data))
            for offset, blob in mutant.data_edits:
                f.seek(data_start + offset)
                f.write(blob)
            if mutant.keep_fraction is not None:
                f.truncate(int(mutant.keep_fraction * (data_start + len(self.data))))


def shrink(source: str | Path | Source, path: str | Path, n_layers: int) -> Path:
    """A copy of ``source`` with only its first ``n_layers`` blocks: the same vocabulary,
    embedding, tensor types and metadata, a model that loads and runs in a fraction of the
    time (a quick source for many mutations)."""
    src = source if isinstance(source, Source) else Source(source)
    align = src.layout.alignment
    kept, pos = [], 0
    for t in src.layout.tensors:
        if t.name.startswith("blk.") and int(t.name.split(".")[1]) >= n_layers:
            continue
        kept.append((replace(t, offset=pos), t.offset))
        pos += -(-_tensor_bytes(t) // align) * align
    key = f"{src.arch}.block_count"
    layout = replace(src.layout.set_kv(key, replace(src.layout.kv(key), value=n_layers)),
                     tensors=tuple(t for t, _ in kept))
    header = src.header(layout)
    path = Path(path)
    with open(path, "wb") as f:
        f.write(header + b"\0" * (-len(header) % align))
        for t, old in kept:
            n = _tensor_bytes(t)
            f.write(memoryview(src.data[old:old + n]))
            f.write(b"\0" * (-n % align))
    return path


# ------------------------------------------------------------------ mutations

_ABSURD_INTS = (0, 1, 2, 3, 7, 1000, 10 ** 9, (1 << 31) - 1, (1 << 32) - 1, (1 << 63) - 1, -1, -(1 << 31))
_ABSURD_FLOATS = (math.nan, math.inf, -math.inf, 0.0, -1.0, 1e30, 1e-30, 1.0, 65504.0)
_HYPERPARAMETERS = ("block_count", "embedding_length", "feed_forward_length", "attention.head_count",
                    "attention.head_count_kv", "attention.key_length", "attention.value_length",
                    "rope.dimension_count", "context_length", "vocab_size", "attention.sliding_window",
                    "attention.layer_norm_rms_epsilon", "rope.freq_base")
_NAN_BYTES = {Q.F32: (np.float32, (math.nan, math.inf, -math.inf)),
              Q.F16: (np.float16, (math.nan, math.inf, -math.inf)),
              Q.BF16: (None, (0x7FC0, 0x7F80, 0xFF80))}


def _pick(rng: random.Random, items):
    items = list(items)
    return items[rng.randrange(len(items))]


def _tensor_renamed(rng: random.Random, src: Source) -> Mutant:
    layout = src.layout
    i = rng.randrange(len(layout.tensors))
    t = layout.tensors[i]
    how = _pick(rng, ("typo", "block", "duplicate", "case", "prefix"))
    if how == "typo":
        at = rng.randrange(len(t.name))
        name = t.name[:at] + _pick(rng, "qxz_.0") + t.name[at:]
    elif how == "block" and t.name.startswith("blk."):
        rest = t.name.split(".", 2)[2]
        name = f"blk.{_pick(rng, (src.n_layers, src.n_layers + 3, 10 ** 6, rng.randrange(src.n_layers)))}.{rest}"
    elif how == "duplicate":
        name = layout.tensors[rng.randrange(len(layout.tensors))].name
    elif how == "case":
        name = t.name.upper()
    else:
        name = "model." + t.name
    return Mutant("tensor_renamed", f"tensor {t.name} renamed to {name}", layout.set_tensor(i, replace(t, name=name)))


def _tensor_removed(rng: random.Random, src: Source) -> Mutant:
    i = rng.randrange(len(src.layout.tensors))
    return Mutant("tensor_removed", f"tensor {src.layout.tensors[i].name} removed from the header",
                  src.layout.set_tensor(i, None))


def _header_counts(rng: random.Random, src: Source) -> Mutant:
    layout = src.layout
    n_t, n_kv = len(layout.tensors), len(layout.kvs)
    if rng.random() < 0.7:
        new = max(0, n_t + _pick(rng, (-1, 1, -2, 2, -n_t // 2, n_t, 10 ** 6, -n_t)))
        return Mutant("header_counts", f"header tensor count {n_t} -> {new}", replace(layout, n_tensors=new))
    new = max(0, n_kv + _pick(rng, (-1, 1, -3, 5, 10 ** 6)))
    return Mutant("header_counts", f"header key count {n_kv} -> {new}", replace(layout, n_kv=new))


def _shape_changed(rng: random.Random, src: Source) -> Mutant:
    layout = src.layout
    i = rng.randrange(len(layout.tensors))
    t = layout.tensors[i]
    dims = list(t.dims)
    j = rng.randrange(len(dims))
    how = _pick(rng, ("double", "halve", "swap", "one", "add_dim", "drop_dim", "value"))
    if how == "double":
        dims[j] *= 2
    elif how == "halve":
        dims[j] = max(1, dims[j] // 2)
    elif how == "swap" and len(dims) > 1:
        dims.reverse()
    elif how == "one":
        dims[j] = 1
    elif how == "add_dim":
        dims.append(_pick(rng, (1, 2)))
    elif how == "drop_dim" and len(dims) > 1:
        dims.pop()
    else:
        block = GGML_QUANT_SIZES[Q(t.qtype)][0]
        dims[j] = _pick(rng, (block, block * 3, 32 * rng.randint(1, 64), 1 << 31, dims[j] + block))
    return Mutant("shape_changed", f"tensor {t.name} dims {list(t.dims)} -> {dims}",
                  layout.set_tensor(i, replace(t, dims=tuple(dims))))


def _type_changed(rng: random.Random, src: Source) -> Mutant:
    layout = src.layout
    i = rng.randrange(len(layout.tensors))
    t = layout.tensors[i]
    known = [q.value for q in Q if q.value != t.qtype]
    new = _pick(rng, known + [99, 1 << 20])
    name = Q(new).name if new in known else str(new)
    return Mutant("type_changed", f"tensor {t.name} type {Q(t.qtype).name} -> {name}",
                  layout.set_tensor(i, replace(t, qtype=new)))


def _offset_changed(rng: random.Random, src: Source) -> Mutant:
    layout = src.layout
    i = rng.randrange(len(layout.tensors))
    t = layout.tensors[i]
    align, size = layout.alignment, len(src.data)
    how = _pick(rng, ("other", "shift", "unaligned", "random", "past_end"))
    if how == "other":
        new = layout.tensors[rng.randrange(len(layout.tensors))].offset
    elif how == "shift":
        new = max(0, t.offset + align * _pick(rng, (-2, -1, 1, 2, 64)))
    elif how == "unaligned":
        new = t.offset + rng.randrange(1, align)
    elif how == "random":
        new = rng.randrange(0, size) // align * align
    else:
        new = size * 2 // align * align
    return Mutant("offset_changed", f"tensor {t.name} data offset {t.offset} -> {new}",
                  layout.set_tensor(i, replace(t, offset=new)))


def _important_keys(src: Source) -> list[str]:
    return [kv.key for kv in src.layout.kvs
            if kv.key.startswith((src.arch + ".", "tokenizer.")) or kv.key == "general.architecture"]


def _key_removed(rng: random.Random, src: Source) -> Mutant:
    keys = _important_keys(src) if rng.random() < 0.8 else [kv.key for kv in src.layout.kvs]
    key = _pick(rng, keys)
    if rng.random() < 0.2:   # the same key twice
        kv = src.layout.kv(key)
        layout = replace(src.layout, kvs=src.layout.kvs + (kv,))
        return Mutant("key_removed", f"metadata key {key} stored twice", layout)
    return Mutant("key_removed", f"metadata key {key} removed", src.layout.set_kv(key, None))


def _retyped(rng: random.Random, kv: KV) -> KV:
    value, kind = kv.value, kv.types[0]
    if kind == V.ARRAY:
        item = kv.types[1] if len(kv.types) > 1 else V.UINT8
        how = _pick(rng, ("count", "string", "items"))
        if how == "count":
            return KV(kv.key, (V.UINT32,), len(value))
        if how == "string":
            return KV(kv.key, (V.STRING,), "not an array")
        if item == V.STRING:
            return KV(kv.key, (V.ARRAY, V.UINT32), [len(v) for v in value])
        if item in (V.FLOAT32, V.FLOAT64):
            return KV(kv.key, (V.ARRAY, V.INT32), [int(v) if math.isfinite(v) else 0 for v in value])
        return KV(kv.key, (V.ARRAY, V.STRING), [str(v) for v in value])
    if kind == V.STRING:
        return _pick(rng, (KV(kv.key, (V.UINT32,), len(value)), KV(kv.key, (V.ARRAY, V.STRING), [value]),
                           KV(kv.key, (V.BOOL,), True)))
    if kind in (V.FLOAT32, V.FLOAT64):
        finite = value if math.isfinite(value) else 0.0
        return _pick(rng, (KV(kv.key, (V.STRING,), repr(value)), KV(kv.key, (V.UINT32,), int(abs(finite)) % (1 << 32)),
                           KV(kv.key, (V.ARRAY, V.FLOAT32), [value])))
    number = int(value)
    return _pick(rng, (KV(kv.key, (V.STRING,), str(value)), KV(kv.key, (V.FLOAT32,), float(number)),
                       KV(kv.key, (V.BOOL,), bool(number)), KV(kv.key, (V.ARRAY, V.INT32), [number % (1 << 31)]),
                       KV(kv.key, (V.INT8,), max(-128, min(127, number))), KV(kv.key, (V.UINT64,), abs(number))))


def _key_retyped(rng: random.Random, src: Source) -> Mutant:
    key = _pick(rng, _important_keys(src))
    kv = src.layout.kv(key)
    new = _retyped(rng, kv)
    return Mutant("key_retyped", f"metadata key {key} {kv.types[0].name} -> {'/'.join(t.name for t in new.types)}",
                  src.layout.set_kv(key, new))


def _key_absurd(rng: random.Random, src: Source) -> Mutant:
    a = src.arch
    special = rng.random()
    if special < 0.15:
        key, value = f"{a}.rope.dimension_count", 1
    elif special < 0.3:
        key, value = f"{a}.block_count", _pick(rng, (10 ** 9, 10 ** 6, 4096, src.n_layers + 1, src.n_layers - 1))
    elif special < 0.35:
        key, value = "general.alignment", _pick(rng, (0, 3, 64, 1 << 20))
    else:
        present = src.layout.kv(f"{a}.vocab_size") is not None
        key = f"{a}.{_pick(rng, [h for h in _HYPERPARAMETERS if h != 'vocab_size' or present])}"
        old = src.layout.kv(key)
        if key.endswith(("epsilon", "freq_base")):
            value = _pick(rng, _ABSURD_FLOATS)
        else:
            base = old.value if old is not None and isinstance(old.value, int) else 64
            value = _pick(rng, _ABSURD_INTS + (base + 1, base - 1, base * 2, base // 2))
    types = (V.UINT32,) if key == "general.alignment" else _infer_types(value)
    return Mutant("key_absurd", f"metadata key {key} = {value!r}", src.layout.set_kv(key, KV(key, types, value)))


def _arch_changed(rng: random.Random, src: Source) -> Mutant:
    new = _pick(rng, [a for a in ("llama", "gemma3", "qwen2", "qwen3", "mistral", "mamba", "", "LLAMA")
                      if a != src.arch])
    layout = src.layout.set_kv("general.architecture", KV("general.architecture", (V.STRING,), new))
    if rng.random() < 0.5 and new:   # the hyper-parameters follow, so the file parses as the other family
        layout = replace(layout, kvs=tuple(
            replace(kv, key=new + kv.key[len(src.arch):]) if kv.key.startswith(src.arch + ".") else kv
            for kv in layout.kvs))
        return Mutant("arch_changed", f"architecture {src.arch} -> {new}, keys renamed", layout)
    return Mutant("arch_changed", f"architecture {src.arch} -> {new!r}", layout)


def _merges_corrupted(rng: random.Random, src: Source) -> Mutant:
    kv = src.layout.kv("tokenizer.ggml.merges")
    if kv is None:   # a vocabulary built from scores: corrupt those instead
        kv = src.layout.kv("tokenizer.ggml.scores")
        scores = list(kv.value)
        how = _pick(rng, ("truncate", "nan", "strings"))
        if how == "truncate":
            return Mutant("merges_corrupted", "tokenizer.ggml.scores truncated by one",
                          src.layout.set_kv(kv.key, replace(kv, value=scores[:-1])))
        if how == "nan":
            for _ in range(100):
                scores[rng.randrange(len(scores))] = math.nan
            return Mutant("merges_corrupted", "100 tokenizer.ggml.scores set to NaN",
                          src.layout.set_kv(kv.key, replace(kv, value=scores)))
        return Mutant("merges_corrupted", "tokenizer.ggml.scores stored as strings",
                      src.layout.set_kv(kv.key, KV(kv.key, (V.ARRAY, V.STRING), [str(s) for s in scores])))
    merges = list(kv.value)
    how = _pick(rng, ("garbage", "unknown", "shuffle", "truncate", "empty"))
    if how == "garbage":
        for _ in range(rng.randint(1, 5)):
            merges[rng.randrange(len(merges))] = _pick(rng, ("", "a", "a b c", " x", "x ", "  ", "\u0120"))
        desc = "garbage entries in tokenizer.ggml.merges"
    elif how == "unknown":
        merges[rng.randrange(len(merges))] = "\u0120zzqx \u0120qqzx"
        desc = "a merge of tokens outside the vocabulary"
    elif how == "shuffle":
        rng.shuffle(merges)
        desc = "tokenizer.ggml.merges shuffled"
    elif how == "truncate":
        merges = merges[:rng.randrange(len(merges))]
        desc = f"tokenizer.ggml.merges truncated to {len(merges)}"
    else:
        merges = []
        desc = "tokenizer.ggml.merges emptied"
    return Mutant("merges_corrupted", desc, src.layout.set_kv(kv.key, replace(kv, value=merges)))


def _tokens_corrupted(rng: random.Random, src: Source) -> Mutant:
    layout = src.layout
    how = _pick(rng, ("tokens_short", "tokens_half", "tokens_empty", "types_short", "types_range", "duplicate",
                      "long_token"))
    tokens = layout.kv("tokenizer.ggml.tokens")
    types = layout.kv("tokenizer.ggml.token_type")
    if how.startswith("types") and types is not None:
        values = list(types.value)
        if how == "types_short":
            values = values[:-rng.randint(1, 10)]
        else:
            values[rng.randrange(len(values))] = _pick(rng, (7, 99, -1, 1 << 20))
            types = replace(types, types=(V.ARRAY, V.INT32))
        return Mutant("tokens_corrupted", f"tokenizer.ggml.token_type: {how}",
                      layout.set_kv(types.key, replace(types, value=values)))
    values = list(tokens.value)
    if how == "tokens_short":
        values = values[:-1]
    elif how == "tokens_half" or how.startswith("types"):
        values = values[:len(values) // 2]
    elif how == "tokens_empty":
        values = []
    elif how == "duplicate":
        values[rng.randrange(len(values))] = values[rng.randrange(len(values))]
    else:
        values[rng.randrange(len(values))] = "x" * 100_000
    return Mutant("tokens_corrupted", f"tokenizer.ggml.tokens: {how} ({len(tokens.value)} -> {len(values)})",
                  layout.set_kv(tokens.key, replace(tokens, value=values)))


def _special_ids(rng: random.Random, src: Source) -> Mutant:
    n = len(src.layout.kv("tokenizer.ggml.tokens").value)
    key = f"tokenizer.ggml.{_pick(rng, ('bos', 'eos', 'unknown', 'padding', 'eot'))}_token_id"
    value = _pick(rng, (n, n + 100, (1 << 32) - 1, -1, "2"))
    return Mutant("special_ids", f"{key} = {value!r}", src.layout.set_kv(key, KV(key, _infer_types(value), value)))


def _chat_template(rng: random.Random, src: Source) -> Mutant:
    key = "tokenizer.chat_template"
    old = src.layout.kv(key)
    text = old.value if old is not None else "{{ messages[0]['content'] }}"
    new = _pick(rng, (text[:len(text) // 2], "{% for %}", "{{ unclosed", "{% if x %}no end", "",
                      "{{ raise_exception('template refuses') }}", "{{ messages[99]['content'] }}",
                      text.replace("{%", "{", 1)))
    return Mutant("chat_template", f"tokenizer.chat_template = {new[:40]!r}",
                  src.layout.set_kv(key, KV(key, (V.STRING,), new)))


def _nonfinite_bytes(rng: random.Random, t: TensorInfo, n_bytes: int) -> list[tuple[int, bytes]]:
    """Edits writing NaN/inf into ``t``: float values, or the fp16 scales of some blocks."""
    from lodestar.engine.faults import SCALE_OFFSETS
    qtype = Q(t.qtype)
    if qtype in _NAN_BYTES:
        dtype, values = _NAN_BYTES[qtype]
        width = 4 if qtype == Q.F32 else 2
        count = n_bytes // width
        start = rng.randrange(count)
        n = min(count - start, rng.randint(1, 64))
        value = _pick(rng, values)
        blob = (np.full(n, value, dtype=dtype).tobytes() if dtype is not None
                else np.full(n, value, dtype=np.uint16).tobytes())
        return [(t.offset + start * width, blob)]
    size = GGML_QUANT_SIZES[qtype][1]
    scale = _pick(rng, (0x7E00, 0x7C00, 0xFC00))     # fp16 NaN, +inf, -inf
    edits = []
    for _ in range(rng.randint(1, 8)):
        block = rng.randrange(n_bytes // size)
        off = _pick(rng, SCALE_OFFSETS[qtype])
        edits.append((t.offset + block * size + off, struct.pack("<H", scale)))
    return edits


def _tensor_bytes(t: TensorInfo) -> int:
    block, size = GGML_QUANT_SIZES[Q(t.qtype)]
    n = 1
    for d in t.dims:
        n *= d
    return n // block * size


def _data_nonfinite(rng: random.Random, src: Source) -> Mutant:
    t = _pick(rng, src.layout.tensors)
    edits = _nonfinite_bytes(rng, t, _tensor_bytes(t))
    return Mutant("data_nonfinite", f"NaN/inf written into tensor {t.name} ({Q(t.qtype).name}, {len(edits)} edits)",
                  src.layout, data_edits=tuple(edits))


def _data_garbage(rng: random.Random, src: Source) -> Mutant:
    t = _pick(rng, src.layout.tensors)
    n_bytes = _tensor_bytes(t)
    n = min(n_bytes, rng.randint(1, 4096))
    start = rng.randrange(n_bytes - n + 1)
    blob = bytes(rng.randrange(256) for _ in range(n))
    return Mutant("data_garbage", f"{n} random bytes over tensor {t.name} at {start}", src.layout,
                  data_edits=((t.offset + start, blob),))


def _header_flips(rng: random.Random, src: Source) -> Mutant:
    flips = tuple((rng.random(), rng.randrange(1, 256)) for _ in range(rng.choice((1, 1, 2, 4))))
    return Mutant("header_flips", f"{len(flips)} header bytes flipped", src.layout, header_flips=flips)


def _truncated(rng: random.Random, src: Source) -> Mutant:
    keep = rng.random() * (0.03 if rng.random() < 0.5 else 1.0)
    return Mutant("truncated", f"file cut to {keep:.4f} of its length", src.layout, keep_fraction=keep)


MUTATIONS: dict[str, Callable[[random.Random, Source], Mutant]] = {
    "tensor_renamed": _tensor_renamed, "tensor_removed": _tensor_removed, "header_counts": _header_counts,
    "shape_changed": _shape_changed, "type_changed": _type_changed, "offset_changed": _offset_changed,
    "key_removed": _key_removed, "key_retyped": _key_retyped, "key_absurd": _key_absurd,
    "arch_changed": _arch_changed, "merges_corrupted": _merges_corrupted, "tokens_corrupted": _tokens_corrupted,
    "special_ids": _special_ids, "chat_template": _chat_template, "data_nonfinite": _data_nonfinite,
    "data_garbage": _data_garbage, "header_flips": _header_flips, "truncated": _truncated,
}
KINDS = tuple(MUTATIONS)


def mutate(src: Source, seed: int, index: int, kind: str | None = None) -> Mutant:
    """Mutation ``index`` of ``seed`` (the kinds in turn, details drawn from the pair)."""
    rng = random.Random(f"{seed}:{index}")
    return MUTATIONS[kind or KINDS[index % len(KINDS)]](rng, src)


# ------------------------------------------------------------------ loading and classifying

@dataclass
class Outcome:
    result: str             # ok | error | crash | hang
    message: str = ""       # the one-line error, or the exception and where it was raised
    error_type: str = ""
    seconds: float = 0.0


class _TimeLimit(BaseException):
    """Raised by the alarm; a BaseException so that no ``except Exception`` swallows it."""


@contextlib.contextmanager
def _time_limit(seconds: float) -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield      # signals reach only the main thread; run without a limit
        return

    def on_alarm(signum, frame):
        raise _TimeLimit()

    previous = signal.signal(signal.SIGALRM, on_alarm)
    t0 = time.monotonic()
    outer, interval = signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer:   # an alarm set outside (pytest-timeout's): give it back what is left of it
            signal.setitimer(signal.ITIMER_REAL, max(outer - (time.monotonic() - t0), 1e-3), interval)


def load_and_run(path: str | Path) -> None:
    """What ``lodestar generate`` does with a model file, kept small: load it on the CPU
    (validation, tokenizer, model), render the chat template, and generate two greedy
    tokens from a short prompt."""
    from lodestar.cli import prompt_ids
    from lodestar.engine.llm_engine import EngineConfig, LLMEngine
    from lodestar.engine.loader import load_model
    from lodestar.engine.sampling import SamplingParams
    loaded = load_model(str(path), mode="packed", progress=False, device="cpu", tensor_parallel=1)
    try:
        engine = LLMEngine(loaded, EngineConfig(kv_tokens=256, max_num_batched_tokens=256, enable_prefix_cache=False,
                                                cuda_graphs=False))
        prompt_ids(engine, "Hi", raw=False, system=None)     # the chat template renders
        ids = engine.tokenizer.encode("Hi")[:2] or [0]       # a short raw prompt keeps the forward cheap
        engine.generate([ids], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    finally:
        loaded.close()


def classify(path: str | Path, timeout_s: float = 30.0) -> Outcome:
    """Load ``path`` as the command line would and say how it went."""
    from lodestar.cli import user_errors
    t0 = time.perf_counter()
    try:
        with _time_limit(timeout_s):
            load_and_run(path)
    except _TimeLimit:
        return Outcome("hang", f"no result within {timeout_s:g} s", "", time.perf_counter() - t0)
    except user_errors() as e:
        message = str(e)
        result = "error" if message and "\n" not in message else "crash"
        return Outcome(result, message, type(e).__name__, time.perf_counter() - t0)
    except Exception as e:  # noqa: BLE001 - any other exception is the finding
        frame = traceback.extract_tb(e.__traceback__)[-1]
        where = f"{Path(frame.filename).name}:{frame.lineno} in {frame.name}"
        return Outcome("crash", f"{type(e).__name__}: {' '.join(str(e).split())[:300]} ({where})",
                       type(e).__name__, time.perf_counter() - t0)
    return Outcome("ok", "", "", time.perf_counter() - t0)


@dataclass
class Case:
    index: int
    kind: str
    description: str
    outcome: Outcome


@dataclass
class Report:
    source: str
    seed: int
    cases: list[Case] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def counts(self) -> Counter:
        return Counter(c.outcome.result for c in self.cases)

    def failures(self) -> list[Case]:
        return [c for c in self.cases if c.outcome.result in ("crash", "hang")]

    def as_dict(self) -> dict:
        by_kind: dict[str, Counter] = {}
        for c in self.cases:
            by_kind.setdefault(c.kind, Counter())[c.outcome.result] += 1
        return {"source": self.source, "seed": self.seed, "count": len(self.cases), "seconds": round(self.seconds, 1),
                "counts": dict(self.counts), "by_kind": {k: dict(v) for k, v in by_kind.items()},
                "failures": [{"index": c.index, "kind": c.kind, "mutation": c.description,
                              "result": c.outcome.result, "message": c.outcome.message} for c in self.failures()]}


def scratch_dir() -> str | None:
    """/dev/shm when it exists (mutants are whole model files: write them to memory)."""
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else None


def run(source: str | Path | Source, count: int, seed: int = 0, workdir: str | Path | None = None,
        timeout_s: float = 30.0, progress: bool = False, keep: str | Path | None = None,
        kinds: tuple[str, ...] | None = None) -> Report:
    """Write and classify ``count`` mutations of ``source``, one file at a time."""
    from tqdm import tqdm
    src = source if isinstance(source, Source) else Source(source)
    report = Report(str(src.path), seed)
    t0 = time.perf_counter()
    own = workdir is None
    folder = Path(tempfile.mkdtemp(prefix="lodestar-fuzz-", dir=scratch_dir()) if own else workdir)
    try:
        with tqdm(total=count, unit="file", desc="gguf-fuzz", disable=not progress) as bar:
            for i in range(count):
                kind = kinds[i % len(kinds)] if kinds else None
                mutant = mutate(src, seed, i, kind)
                path = folder / f"mutant-{seed}-{i}.gguf"
                src.write(mutant, path)
                outcome = classify(path, timeout_s)
                report.cases.append(Case(i, mutant.kind, mutant.description, outcome))
                if keep is not None and outcome.result in ("crash", "hang"):
                    Path(keep).mkdir(parents=True, exist_ok=True)
                    shutil.copy(path, Path(keep) / path.name)
                path.unlink()
                if i % 16 == 15:
                    gc.collect()    # mapped mutants stay in memory until their views are freed
                bar.update(1)
                bar.set_postfix(report.counts, refresh=False)
    finally:
        if own:
            shutil.rmtree(folder, ignore_errors=True)
    report.seconds = time.perf_counter() - t0
    return report


def main(a: argparse.Namespace) -> int:
    import torch

    from lodestar.bench.common import device_info, git_commit
    from lodestar.formats.catalog import file_sha256, resolve_model_path
    torch.set_num_threads(a.threads)
    source = resolve_model_path(a.model)
    report = run(source, a.count, a.seed, timeout_s=a.timeout, progress=True, keep=a.keep)
    data = report.as_dict()
    counts = data["counts"]
    print(f"{source.name}: {len(report.cases)} mutations (seed {a.seed}) in {report.seconds:.0f} s: "
          + ", ".join(f"{counts.get(k, 0)} {k}" for k in ("ok", "error", "crash", "hang")))
    for kind, c in sorted(data["by_kind"].items()):
        print(f"  {kind:18s} " + "  ".join(f"{k} {c.get(k, 0):3d}" for k in ("ok", "error", "crash", "hang")))
    for f in data["failures"]:
        print(f"  {f['result'].upper()} #{f['index']} {f['kind']}: {f['mutation']}: {f['message']}")
    if a.json:
        data.update(sha256=file_sha256(source), commit=git_commit(), device=device_info())
        a.json.write_text(json.dumps(data, indent=1))
    return 1 if report.failures() else 0
