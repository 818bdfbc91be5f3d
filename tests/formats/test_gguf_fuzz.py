"""Corrupted GGUF files either open or raise GGUFError naming the file: never another
exception, never a hang."""
from __future__ import annotations

import contextlib
import random
import signal
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from lodestar.formats.gguf import GGUFError, GGUFFile

SECONDS_PER_CASE = 5


def build_file(path: Path) -> Path:
    """A small model file with every kind of metadata value and several tensor types."""
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(path, "llama")
    w.add_string("general.name", "fuzz")
    w.add_uint32("llama.block_count", 1)
    w.add_uint32("llama.embedding_length", 64)
    w.add_uint32("llama.feed_forward_length", 256)
    w.add_uint32("llama.attention.head_count", 4)
    w.add_uint32("llama.attention.head_count_kv", 2)
    w.add_uint32("llama.context_length", 128)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_float32("llama.rope.freq_base", 10000.0)
    w.add_bool("tokenizer.ggml.add_bos_token", True)
    w.add_array("tokenizer.ggml.tokens", ["<s>", "</s>", "a", "b", "ab", "\u00e9"])
    w.add_array("tokenizer.ggml.scores", [0.0, 0.0, -1.0, -2.0, -3.0, -4.0])
    w.add_array("tokenizer.ggml.token_type", [3, 3, 1, 1, 1, 1])
    w.add_array("test.nested", [[1, 2], [3]])
    w.add_tensor("token_embd.weight", gguf.quants.quantize(rng.standard_normal((6, 64)).astype(np.float32), T.Q8_0),
                 raw_dtype=T.Q8_0)
    w.add_tensor("blk.0.attn_norm.weight", np.ones(64, dtype=np.float32))
    w.add_tensor("blk.0.attn_q.weight", gguf.quants.quantize(rng.standard_normal((64, 64)).astype(np.float32), T.Q4_0),
                 raw_dtype=T.Q4_0)
    w.add_tensor("blk.0.attn_k.weight", rng.standard_normal((32, 64)).astype(np.float16))
    k_quant = rng.integers(0, 256, (4, 144), dtype=np.uint8)
    k_quant[:, :4] = np.array([0.01, 0.001], dtype=np.float16).view(np.uint8)
    w.add_tensor("blk.0.ffn_up.weight", k_quant, raw_dtype=T.Q4_K)
    w.add_tensor("blk.0.ffn_down.weight", rng.integers(0, 256, (64, 210), dtype=np.uint8), raw_dtype=T.Q6_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@contextlib.contextmanager
def time_limit(seconds: int, what: str):
    def on_alarm(signum, frame):
        raise TimeoutError(f"{what} took more than {seconds} s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def open_fully(path: Path) -> None:
    """Open and touch everything a loader would: metadata, config, every tensor."""
    with GGUFFile(path) as f:
        assert f.config.n_layers >= 1
        for name in f.metadata:
            repr(f.metadata[name])
        for t in f.tensors.values():
            assert tuple(t.dequantize().shape) == t.shape


def outcome(path: Path, what: str) -> str:
    """'ok' or 'error'; any other exception or a hang fails the test."""
    with time_limit(SECONDS_PER_CASE, what):
        try:
            open_fully(path)
        except GGUFError as e:
            assert str(e).startswith(f"{path}: "), f"{what}: message does not name the file: {e}"
            return "error"
    return "ok"


def header_int_fields(path: Path) -> list[tuple[int, int, int]]:
    """(offset, size, value) of every integer count/length/type/dimension/offset field."""
    reader = gguf.GGUFReader(path)
    base = reader.data.ctypes.data
    parts = [p for field in reader.fields.values() for p in field.parts]
    parts += [p for t in reader.tensors for p in t.field.parts]
    out = []
    for p in parts:
        if p.dtype.kind == "u" and p.dtype.itemsize in (4, 8) and p.size == 1:
            out.append((p.ctypes.data - base, p.dtype.itemsize, int(p[0])))
    return sorted(set(out))


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> tuple[bytes, int, int]:
    """(file bytes, start of tensor data, end of the last tensor's data)."""
    path = build_file(tmp_path_factory.mktemp("fuzz") / "clean.gguf")
    assert outcome(path, "clean file") == "ok"
    reader = gguf.GGUFReader(path)
    end = max(t.data_offset + t.n_bytes for t in reader.tensors)
    return path.read_bytes(), reader.data_offset, end


def run_cases(tmp_path: Path, cases) -> dict[str, int]:
    counts = {"ok": 0, "error": 0}
    path = tmp_path / "mutant.gguf"
    for what, blob in cases:
        path.write_bytes(blob)
        counts[outcome(path, what)] += 1
    return counts


def test_byte_flips_in_header(tmp_path, clean):
    data, data_start, _ = clean
    rng = random.Random(1234)
    cases = []
    for i in range(200):
        blob = bytearray(data)
        for _ in range(rng.choice((1, 1, 2, 4))):
            pos = rng.randrange(data_start)
            blob[pos] ^= rng.randrange(1, 256)
        cases.append((f"flip case {i}", bytes(blob)))
    counts = run_cases(tmp_path, cases)
    assert counts["error"] > 20, counts  # the mutations do reach the parser


def test_ff_overwrites_in_header(tmp_path, clean):
    data, data_start, _ = clean
    rng = random.Random(99)
    cases = []
    for i in range(100):
        pos = rng.randrange(data_start)
        n = rng.randrange(1, 9)
        cases.append((f"0xFF case {i} at {pos}", data[:pos] + b"\xff" * n + data[pos + n:]))
    counts = run_cases(tmp_path, cases)
    assert counts["error"] > 20, counts


def test_truncations_always_fail(tmp_path, clean):
    data, _, end = clean
    rng = random.Random(7)
    cuts = sorted({0, 3, 4, 8, 23, 24, end - 1, *(rng.randrange(end) for _ in range(100))})
    counts = run_cases(tmp_path, [(f"cut at {n}", data[:n]) for n in cuts])
    assert counts == {"ok": 0, "error": len(cuts)}


def test_inflated_count_fields(tmp_path, clean):
    data, _, _ = clean
    probe = tmp_path / "probe.gguf"
    probe.write_bytes(data)
    fields = header_int_fields(probe)
    assert len(fields) > 40
    cases = []
    for offset, size, value in fields:
        top = (1 << (8 * size)) - 1
        for new in {value + 1, value * 2 + 1, 1 << 31, top >> 1, top}:
            if new <= top and new != value:
                blob = data[:offset] + new.to_bytes(size, "little") + data[offset + size:]
                cases.append((f"field at {offset}: {value} -> {new}", blob))
    counts = run_cases(tmp_path, cases)
    assert counts["error"] > len(cases) // 2, counts


def test_flips_in_tensor_data_still_open(tmp_path, clean):
    data, data_start, _ = clean
    rng = random.Random(5)
    cases = []
    for i in range(30):
        blob = bytearray(data)
        for _ in range(8):
            blob[rng.randrange(data_start, len(data))] = rng.randrange(256)
        cases.append((f"data case {i}", bytes(blob)))
    assert run_cases(tmp_path, cases) == {"ok": 30, "error": 0}
