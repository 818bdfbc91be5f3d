"""GGUF model files: memory-mapped tensors, plain-Python metadata and a typed config.

Parsing is ``gguf.GGUFReader`` (llama.cpp's gguf-py) with two changes made by
subclassing: every read is bounds-checked, so a truncated or corrupt file fails with a
clear error instead of yielding short arrays, and metadata arrays are decoded in one
pass (the stock reader builds one numpy view per element, which takes seconds for a
262k-token vocabulary).

Every failure — missing file, foreign or corrupt bytes, unsupported version or tensor
type, missing metadata — is a ``GGUFError`` whose message names the file.
"""
from __future__ import annotations

import difflib
import math
import struct
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.constants import GGML_QUANT_SIZES, GGUF_MAGIC

from lodestar.formats.config import ModelConfig
from lodestar.kernels import dequant

SUPPORTED_VERSIONS = (2, 3)
MAX_DIMS = 4  # GGML_MAX_DIMS

# Largest accepted value of each hyper-parameter: far above any released model, low enough
# that a corrupt value fails here, not as a huge allocation or a billion-step loop.
METADATA_LIMITS: dict[str, int] = {
    "block_count": 4096,
    "embedding_length": 1 << 17,
    "feed_forward_length": 1 << 20,
    "attention.head_count": 4096,
    "attention.head_count_kv": 4096,
    "attention.key_length": 4096,
    "attention.value_length": 4096,
    "rope.dimension_count": 4096,
    "context_length": 1 << 24,
    "attention.sliding_window": 1 << 24,
    "vocab_size": 1 << 22,
}


class GGUFError(Exception):
    """A GGUF file that cannot be used; the message names the file and the fix."""


class _FileError(Exception):
    """Raised inside the reader; re-raised as GGUFError with the file name prepended."""


@dataclass(eq=False)  # identity equality: comparing tensor fields is ambiguous
class GGUFTensor:
    """One tensor of a GGUF file, its bytes mapped from disk (not copied).

    ``shape`` is in torch order (rows first, the reverse of the GGUF dims). ``data`` is
    a uint8 view of the tensor's bytes shaped [*shape[:-1], bytes_per_row]; a 1-D
    tensor is one row, [1, bytes]. The mapping is copy-on-write: writing into ``data``
    never changes the file.
    """

    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]
    data: torch.Tensor
    n_bytes: int
    offset: int  # absolute byte offset in the file

    @property
    def n_elements(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def dequantize(self) -> torch.Tensor:
        """float32 tensor of ``shape``. F32 tensors come back as a view of ``data``."""
        return dequant.dequantize(self.data, self.qtype, self.shape)


class _Reader(GGUFReader):
    """GGUFReader with bounds-checked reads and one-pass metadata arrays."""

    def __init__(self, path: Path):
        self._arrays: dict[int, Any] = {}  # value offset -> decoded array
        super().__init__(path, mode="c")   # copy-on-write: torch views stay writable

    def _get(self, offset, dtype, count=1, override_order=None):
        need = int(count) * np.dtype(dtype).itemsize
        if int(offset) + need > len(self.data):
            raise _FileError(
                f"truncated or corrupt: needs {need} bytes at offset {int(offset)}, "
                f"file has {len(self.data)} bytes"
            )
        return super()._get(offset, dtype, count, override_order)

    def _get_field_parts(self, orig_offs, raw_type):
        try:
            GGUFValueType(int(raw_type))
        except ValueError:
            raise _FileError(
                f"corrupt: metadata value at offset {orig_offs} has unknown type {int(raw_type)}"
            ) from None
        if raw_type != GGUFValueType.ARRAY:
            return super()._get_field_parts(orig_offs, raw_type)
        value, size = self._read_array(orig_offs)
        self._arrays[orig_offs] = value
        item_type = GGUFValueType(int(self._get(orig_offs, np.uint32)[0]))  # checked by _read_array
        return size, [self._get(orig_offs, np.uint8, size)], [0], [GGUFValueType.ARRAY, item_type]

    def _read_array(self, offs: int) -> tuple[Any, int]:
        """Array value at ``offs`` -> (numpy array | list, bytes consumed)."""
        raw_itype = int(self._get(offs, np.uint32)[0])
        n = int(self._get(offs + 4, np.uint64)[0])
        pos = offs + 12
        try:
            itype = GGUFValueType(raw_itype)
        except ValueError:
            raise _FileError(f"corrupt: metadata array at offset {offs} has unknown element type {raw_itype}") from None
        np_type = self.gguf_scalar_to_np.get(itype)
        if np_type is not None:
            values = self._get(pos, np_type, n)
            return values, 12 + int(values.nbytes)
        if n > (len(self.data) - pos) // 8:
            raise _FileError(
                f"truncated or corrupt: metadata array at offset {offs} claims {n} elements, "
                f"more than the {len(self.data) - pos} bytes left in the file can hold"
            )
        if itype == GGUFValueType.STRING:
            strings, end = self._read_strings(pos, n)
            return strings, end - offs
        if itype == GGUFValueType.ARRAY:
            out = []
            for _ in range(n):
                value, size = self._read_array(pos)
                out.append(value.tolist() if isinstance(value, np.ndarray) else value)
                pos += size
            return out, pos - offs
        raise _FileError(f"corrupt: metadata array at offset {offs} has element type {itype.name}")

    def _read_strings(self, pos: int, n: int) -> tuple[list[str], int]:
        buf = memoryview(self.data)
        end = len(buf)
        unpack = struct.Struct("<Q").unpack_from
        out = []
        append = out.append
        for _ in range(n):
            if pos + 8 > end:
                raise _FileError(f"truncated or corrupt: string at offset {pos} runs past the end of the file")
            (length,) = unpack(buf, pos)
            pos += 8
            if length > end - pos:
                raise _FileError(
                    f"truncated or corrupt: string of {length} bytes at offset {pos} runs past the end of the file"
                )
            append(str(buf[pos:pos + length], "utf-8"))
            pos += length
        return out, pos

    def _build_tensors(self, start_offs, fields):
        # Validate what the stock reader would turn into an obscure numpy error.
        size = len(self.data)
        spans: list[tuple[int, int, str]] = []
        seen: set[str] = set()
        for field in fields:
            _name_len, name_data, n_dims, dims, raw_dtype, offset_tensor = field.parts
            name = str(bytes(name_data), "utf-8")
            if name in seen:
                raise _FileError(f"tensor name {name} appears twice in the header")
            seen.add(name)
            if int(n_dims[0]) < 1 or int(n_dims[0]) > MAX_DIMS:
                raise _FileError(f"tensor {name} has {int(n_dims[0])} dimensions; GGUF allows 1..{MAX_DIMS}")
            dims_l = [int(d) for d in dims]
            if any(d < 1 or d >= 1 << 40 for d in dims_l):
                raise _FileError(f"tensor {name} has invalid dimensions {dims_l}")
            raw = int(raw_dtype[0])
            try:
                qtype = GGMLQuantizationType(raw)
            except ValueError:
                raise _FileError(
                    f"tensor {name} has unknown type id {raw}; supported: {dequant.supported_names()}"
                ) from None
            if qtype not in dequant.SUPPORTED_TYPES:
                raise _FileError(
                    f"tensor {name} has type {qtype.name}; supported: {dequant.supported_names()}"
                )
            block, type_size = GGML_QUANT_SIZES[qtype]
            if dims_l[0] % block:
                raise _FileError(
                    f"tensor {name} of type {qtype.name} has row length {dims_l[0]}, "
                    f"not a multiple of the block size {block}"
                )
            n_elements = 1
            for d in dims_l:
                n_elements *= d
            n_bytes = n_elements // block * type_size
            offset = int(start_offs) + int(offset_tensor[0])
            if int(offset_tensor[0]) % self.alignment:
                raise _FileError(
                    f"tensor {name} data offset {int(offset_tensor[0])} is not aligned to {self.alignment}"
                )
            if offset + n_bytes > size:
                raise _FileError(
                    f"truncated: tensor {name} needs bytes {offset}..{offset + n_bytes}, "
                    f"file has {size} bytes"
                )
            spans.append((offset, offset + n_bytes, name))
        _check_spans(spans, size, int(start_offs), int(self.alignment), len(fields))
        super()._build_tensors(start_offs, fields)


def _check_spans(spans: list[tuple[int, int, str]], size: int, start: int, alignment: int, n_tensors: int) -> None:
    """Tensor data regions must not overlap, and must reach the end of the file.

    Writers (gguf-py, llama.cpp) place tensors one after another, each padded to the
    alignment, so overlapping regions mean corrupt offsets, and a gap of a whole alignment
    unit or more at the end means the header lists fewer tensors than were written (the
    data section then starts too early and every tensor reads shifted bytes).
    """
    if not spans:
        return
    spans = sorted(spans)
    for (s0, e0, a), (s1, e1, b) in zip(spans, spans[1:]):
        if s1 < e0:
            raise _FileError(
                f"tensor {b} (bytes {s1}..{e1}) overlaps tensor {a} (bytes {s0}..{e0}): "
                "the tensor offsets, shapes or types in the header are corrupt"
            )
    end = max(e for _, e, _ in spans)
    if size - end >= max(alignment, 1):
        raise _FileError(
            f"{size - end} bytes follow the last tensor's data (bytes {start}..{end} hold the "
            f"{n_tensors} tensors the header lists): the header's tensor count is wrong or the file "
            "has trailing garbage"
        )


def _check_header(path: Path) -> None:
    """Magic, version and counts, checked before parsing for clear messages."""
    with open(path, "rb") as f:
        head = f.read(24)
    size = path.stat().st_size
    if head[:4] != struct.pack("<I", GGUF_MAGIC):
        raise _FileError(f"not a GGUF file (starts with {head[:4]!r}, expected b'GGUF')")
    if len(head) < 24:
        raise _FileError(f"truncated: {size} bytes, too short for a GGUF header")
    version, n_tensors, n_kv = struct.unpack("<IQQ", head[4:24])
    if version not in SUPPORTED_VERSIONS:
        hint = " (big-endian files are not supported)" if version & 0xFFFF == 0 else ""
        raise _FileError(
            f"unsupported GGUF version {version}{hint}; supported versions: "
            f"{', '.join(map(str, SUPPORTED_VERSIONS))}"
        )
    # A tensor entry takes at least 8+4+8+4+8 bytes, a key/value at least 8+4+1.
    if n_tensors > size // 32 or n_kv > size // 13:
        raise _FileError(f"corrupt header: claims {n_tensors} tensors and {n_kv} metadata keys in {size} bytes")


def _field_value(reader: _Reader, field) -> Any:
    kind = field.types[0]
    if kind == GGUFValueType.ARRAY:
        value_offset = field.offset + sum(int(p.nbytes) for p in field.parts[:3])
        value = reader._arrays[value_offset]
        return value.tolist() if isinstance(value, np.ndarray) else value
    if kind == GGUFValueType.STRING:
        return str(bytes(field.parts[-1]), "utf-8")
    return field.parts[-1][0].item()


@contextmanager
def _one_line_errors(path: Path):
    """Whatever reading ``path`` raises, as one GGUFError naming the file."""
    try:
        yield
    except GGUFError:
        raise
    except _FileError as e:
        raise GGUFError(f"{path}: {e}") from None
    except OSError as e:
        raise GGUFError(f"{path}: cannot read: {e.strerror or e}") from e
    except UnicodeDecodeError as e:
        raise GGUFError(f"{path}: corrupt: invalid UTF-8 in a name or string ({e})") from e
    except Exception as e:  # numpy/struct/recursion errors from corrupt bytes
        raise GGUFError(f"{path}: corrupt GGUF file ({type(e).__name__}: {e})") from e


def read_metadata(path: str | Path, wanted=lambda key: True) -> dict[str, Any]:
    """The metadata fields of a GGUF file whose keys ``wanted`` accepts, as plain Python values
    (GGUFFile's forms), without building a model config: any architecture's file reads."""
    path = Path(path)
    with _one_line_errors(path):
        if not path.is_file():
            raise _FileError("no such file" if not path.exists() else "not a regular file")
        _check_header(path)
        reader = _Reader(path)
        return {key: _field_value(reader, field) for key, field in reader.fields.items()
                if not key.startswith("GGUF.") and wanted(key)}


class GGUFFile:
    """A memory-mapped GGUF v2/v3 file.

    ``metadata`` holds plain Python values; ``tensors`` maps names to ``GGUFTensor``
    views of the mapped bytes; ``config`` is the model configuration read from the
    metadata. Use as a context manager or call ``close()``; tensors already handed
    out stay valid after closing.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        with _one_line_errors(self.path):
            self._open()

    def _open(self) -> None:
        if not self.path.exists():
            raise _FileError("no such file")
        if not self.path.is_file():
            raise _FileError("not a regular file")
        _check_header(self.path)
        reader = _Reader(self.path)
        self._reader: _Reader | None = reader
        self.version: int = int(reader.fields["GGUF.version"].parts[0][0])
        self.metadata: dict[str, Any] = {
            key: _field_value(reader, field)
            for key, field in reader.fields.items()
            if not key.startswith("GGUF.")
        }
        # The stored type of each metadata value (arrays: ARRAY, then the element type).
        self.metadata_types: dict[str, tuple[GGUFValueType, ...]] = {
            key: tuple(GGUFValueType(int(t)) for t in field.types)
            for key, field in reader.fields.items()
            if not key.startswith("GGUF.")
        }
        self.alignment: int = int(reader.alignment)
        self.data_offset: int = int(reader.data_offset)   # where the tensor data section starts
        self.tensors: dict[str, GGUFTensor] = {}
        base = torch.from_numpy(reader.data)  # one zero-copy view of the whole mapping
        for t in reader.tensors:
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            qtype = GGMLQuantizationType(t.tensor_type)
            row = dequant.row_bytes(qtype, shape[-1])
            lead = shape[:-1] if len(shape) > 1 else (1,)
            data = base[t.data_offset:t.data_offset + t.n_bytes].view(*lead, row)
            self.tensors[t.name] = GGUFTensor(t.name, qtype, shape, data, int(t.n_bytes), int(t.data_offset))
        self.config: ModelConfig = _config(self.metadata, self.tensors, self.path)

    def tensor(self, name: str) -> GGUFTensor:
        """The tensor called ``name``; GGUFError naming near matches when absent."""
        try:
            return self.tensors[name]
        except KeyError:
            pass
        near = difflib.get_close_matches(name, list(self.tensors), n=3, cutoff=0.8)
        hint = f"; similar: {', '.join(near)}" if near else f"; the file has {len(self.tensors)} tensors"
        raise GGUFError(f"{self.path}: no tensor named {name}{hint}") from None

    def close(self) -> None:
        # The mapping itself lives until the last tensor view is released.
        self._reader = None

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"GGUFFile({str(self.path)!r}, v{self.version}, {self.config.arch}, {len(self.tensors)} tensors)"


# --------------------------------------------------------------------- config

def _short(value: Any) -> str:
    """repr of a metadata value for a one-line message (long arrays cut)."""
    if isinstance(value, list) and len(value) > 8:
        return f"[{', '.join(map(repr, value[:8]))}, ... ({len(value)} values)]"
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


def _rope_scale(meta: dict, arch: str, number, fail) -> float:
    """The linear rope scaling factor (1.0: none). Other kinds (YaRN, LongRoPE) change every
    position's angles: a file that asks for one is refused rather than computed wrong."""
    kind = meta.get(f"{arch}.rope.scaling.type")
    if kind is None or kind == "none":
        return number("rope.scale_linear", float, 1.0)       # the older key for the same factor
    factor = number("rope.scaling.factor", float, 1.0)
    if kind == "linear" or factor == 1.0:
        return factor if kind == "linear" else 1.0
    raise fail(f"{arch}.rope.scaling.type is {kind!r} (factor {factor}): only linear rope scaling is supported, "
               "and positions would be computed wrong")


def _config(meta: dict[str, Any], tensors: dict[str, GGUFTensor], path: Path) -> ModelConfig:
    def fail(msg: str) -> GGUFError:
        return GGUFError(f"{path}: {msg}")

    arch = meta.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        raise fail("missing metadata key general.architecture (not a model file?)")
    extra: dict[str, Any] = {k[len(arch) + 1:]: v for k, v in meta.items() if k.startswith(arch + ".")}

    def number(suffix: str, kind: type, default: Any = None, *, required: bool = False, positive: bool = True):
        key = f"{arch}.{suffix}"
        if key not in meta:
            if required:
                raise fail(f"missing metadata key {key}, required for {arch} models")
            return default
        value = meta[key]
        if isinstance(value, list) and value and kind is int:
            # Per-layer values (e.g. head counts): the common fields take the largest.
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
                raise fail(f"metadata key {key} has per-layer values {_short(value)}, expected ints")
            extra[f"{suffix}_per_layer"] = value
            value = max(value)
        numeric = (int,) if kind is int else (int, float)
        if isinstance(value, bool) or not isinstance(value, numeric):
            raise fail(f"metadata key {key} has value {_short(value)}, expected {kind.__name__}")
        if not (value > 0 or (value == 0 and not positive)):  # also rejects NaN
            sign = "positive" if positive else "non-negative"
            raise fail(f"metadata key {key} has value {value!r}, expected a {sign} number")
        if not math.isfinite(value):
            raise fail(f"metadata key {key} has value {value!r}, expected a finite number")
        limit = METADATA_LIMITS.get(suffix)
        if limit is not None and value > limit:
            raise fail(f"metadata key {key} has value {value!r}, expected at most {limit}")
        return kind(value)

    n_layers = number("block_count", int, required=True)
    d_model = number("embedding_length", int, required=True)
    n_heads = number("attention.head_count", int, required=True)
    n_kv_heads = number("attention.head_count_kv", int, n_heads)
    head_dim = number("attention.key_length", int)
    if head_dim is None:
        if d_model % n_heads:
            raise fail(f"{arch}.embedding_length {d_model} is not divisible by "
                       f"{arch}.attention.head_count {n_heads} and {arch}.attention.key_length is missing")
        head_dim = d_model // n_heads
    v_head_dim = number("attention.value_length", int, head_dim)
    ffn_dim = number("feed_forward_length", int, required=True)
    context_length = number("context_length", int, required=True)
    rms_eps = number("attention.layer_norm_rms_epsilon", float)
    if rms_eps is None:
        rms_eps = number("attention.layer_norm_epsilon", float)
    if rms_eps is None:
        raise fail(f"missing metadata key {arch}.attention.layer_norm_rms_epsilon, required for {arch} models")
    if rms_eps >= 1:
        raise fail(f"metadata key {arch}.attention.layer_norm_rms_epsilon has value {rms_eps!r}, "
                   "expected a small positive number (below 1)")
    rope_theta = number("rope.freq_base", float, 10000.0)
    rope_dim = number("rope.dimension_count", int, head_dim)
    rope_scale = _rope_scale(meta, arch, number, fail)
    sliding_window = number("attention.sliding_window", int, positive=False) or None  # 0: no window

    vocab_size = number("vocab_size", int)
    tokens = meta.get("tokenizer.ggml.tokens")
    if vocab_size is not None and isinstance(tokens, list) and len(tokens) != vocab_size:
        raise fail(f"tokenizer.ggml.tokens has {len(tokens)} entries but {arch}.vocab_size is {vocab_size}: "
                   "the vocabulary is truncated or the key is wrong")
    if vocab_size is None:
        if isinstance(tokens, list) and tokens:
            vocab_size = len(tokens)
        elif "token_embd.weight" in tensors:
            vocab_size = tensors["token_embd.weight"].shape[0]
        else:
            raise fail(f"missing metadata key {arch}.vocab_size and no tokenizer.ggml.tokens to count")

    file_type = meta.get("general.file_type")
    name = meta.get("general.name")
    return ModelConfig(
        arch=arch,
        name=name if isinstance(name, str) and name else path.stem,
        n_layers=n_layers,
        d_model=d_model,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        v_head_dim=v_head_dim,
        ffn_dim=ffn_dim,
        vocab_size=vocab_size,
        context_length=context_length,
        rms_eps=rms_eps,
        rope_theta=rope_theta,
        rope_dim=rope_dim,
        rope_scale=rope_scale,
        sliding_window=sliding_window,
        tie_embeddings="output.weight" not in tensors,
        file_type=file_type if isinstance(file_type, int) and not isinstance(file_type, bool) else None,
        extra=extra,
    )
