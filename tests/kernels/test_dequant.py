"""Dequantization is bit-identical to gguf-py's numpy reference for every supported type."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants as ref_quants
from gguf.constants import GGML_QUANT_SIZES

from lodestar.formats.gguf import GGUFFile
from lodestar.kernels import dequant
from lodestar.kernels.dequant import SUPPORTED_TYPES, block_info, dequantize

QUANT_TYPES = [t for t in SUPPORTED_TYPES if GGML_QUANT_SIZES[t][0] > 1]

# Byte offsets of the fp16 super-scales inside one block.
F16_SCALE_OFFSETS = {
    T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q8_0: (0,),
    T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,),
}


def reference(raw: np.ndarray, qtype: T) -> np.ndarray:
    """gguf-py's dequantization of [rows, bytes_per_row] uint8 bytes."""
    if qtype == T.F32:
        return raw.view(np.float32)
    if qtype == T.F16:
        return ref_quants.dequantize(raw.view(np.float16), qtype)
    with np.errstate(all="ignore"):
        return ref_quants.dequantize(raw, qtype)


def bits(x: torch.Tensor | np.ndarray) -> torch.Tensor:
    if isinstance(x, np.ndarray):
        x = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
    return x.contiguous().view(torch.int32)


def assert_bit_identical(got: torch.Tensor, want: np.ndarray) -> None:
    assert got.dtype == torch.float32
    assert tuple(got.shape) == want.shape
    diff = bits(got) != bits(want)
    assert not bool(diff.any()), f"{int(diff.sum())} of {diff.numel()} values differ"


def random_blocks(qtype: T, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random bytes with finite fp16 scales (normal, subnormal and zero values)."""
    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // block * size), dtype=np.uint8)
    blocks = raw.reshape(-1, size)
    for off in F16_SCALE_OFFSETS.get(qtype, ()):
        scales = (rng.standard_normal(blocks.shape[0]) * rng.choice([1e-6, 1e-3, 0.1, 10.0], blocks.shape[0]))
        scales[:: 7] = 0.0
        blocks[:, off:off + 2] = scales.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return raw


@pytest.mark.parametrize("qtype", QUANT_TYPES, ids=lambda t: t.name)
def test_random_blocks_match_reference_across_chunks(qtype, monkeypatch):
    block, _ = block_info(qtype)
    # Three blocks per chunk: exercises chunk boundaries and a partial last chunk.
    monkeypatch.setattr(dequant, "CHUNK_ELEMENTS", 3 * block)
    raw = random_blocks(qtype, rows=5, cols=block * 4, seed=int(qtype))
    got = dequantize(torch.from_numpy(raw), qtype, (5, block * 4))
    assert_bit_identical(got, reference(raw, qtype))


@pytest.mark.parametrize("qtype", QUANT_TYPES, ids=lambda t: t.name)
def test_random_blocks_3d_and_flat_input(qtype):
    block, _ = block_info(qtype)
    shape = (2, 3, block * 2)
    raw = random_blocks(qtype, rows=6, cols=block * 2, seed=100 + int(qtype))
    got = dequantize(torch.from_numpy(raw.reshape(-1)), int(qtype), shape)
    assert_bit_identical(got, reference(raw, qtype).reshape(shape))


@pytest.mark.parametrize("qtype", QUANT_TYPES, ids=lambda t: t.name)
def test_arbitrary_bytes_match_reference_up_to_nan_payload(qtype):
    # Fully random bytes include Inf/NaN scales. When two NaNs meet in one operation the
    # surviving payload depends on the compiled operand order, so NaN compares as NaN.
    block, _ = block_info(qtype)
    rng = np.random.default_rng(7 + int(qtype))
    _, size = block_info(qtype)
    raw = rng.integers(0, 256, (16, 8 * size), dtype=np.uint8)
    got = dequantize(torch.from_numpy(raw), qtype, (16, 8 * block))
    want = torch.from_numpy(reference(raw, qtype))
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    assert torch.equal(bits(got)[~nan], bits(want)[~nan])


@pytest.mark.parametrize("qtype", [T.F16, T.BF16], ids=lambda t: t.name)
def test_every_16_bit_pattern_is_bit_exact(qtype):
    # All 65536 patterns, NaN payloads and subnormals included.
    raw = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.uint8).reshape(4, -1)
    got = dequantize(torch.from_numpy(raw), qtype, (4, (1 << 16) // 4))
    assert_bit_identical(got, reference(raw, qtype))


def test_f32_is_a_view_of_the_bytes():
    values = np.linspace(-3, 3, 64, dtype=np.float32)
    raw = torch.from_numpy(values.view(np.uint8).reshape(2, -1).copy())
    got = dequantize(raw, T.F32, (2, 32))
    assert torch.equal(got.reshape(-1), torch.from_numpy(values))
    assert got.data_ptr() == raw.data_ptr()


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.BF16, T.F16], ids=lambda t: t.name)
def test_gguf_quantized_weights_round_trip(qtype):
    rng = np.random.default_rng(3)
    weights = (rng.standard_normal((8, 256)) * 0.02).astype(np.float32)
    packed = ref_quants.quantize(weights, qtype)
    raw = np.ascontiguousarray(packed).view(np.uint8)
    got = dequantize(torch.from_numpy(raw), qtype, weights.shape)
    assert_bit_identical(got, reference(raw, qtype))
    # And it decodes to the weights: within half a step, or one step where Q4_0/Q5_0
    # clip the side opposite the largest magnitude.
    bound = {T.Q4_0: 1 / 8, T.Q4_1: 1 / 15, T.Q5_0: 1 / 16, T.Q5_1: 1 / 31,
                 T.Q8_0: 1 / 254, T.BF16: 2.0 ** -8, T.F16: 2.0 ** -11}[qtype]
    err = float((got - torch.from_numpy(weights)).abs().max())
    assert err <= bound * float(np.abs(weights).max()) * 1.01


def _assert_real_types(path, expected: set[str]) -> None:
    with GGUFFile(path) as f:
        smallest: dict[T, object] = {}
        for t in f.tensors.values():
            if t.qtype not in smallest or t.n_bytes < smallest[t.qtype].n_bytes:
                smallest[t.qtype] = t
        assert {q.name for q in smallest} == expected
        for t in smallest.values():
            assert_bit_identical(t.dequantize(), reference(t.data.numpy(), t.qtype).reshape(t.shape))
        # The largest tensor, the embedding, on a row slice (rows are whole blocks).
        emb = f.tensor("token_embd.weight")
        rows = emb.data[1000:1300]
        assert_bit_identical(dequantize(rows, emb.qtype, (300, emb.shape[1])), reference(rows.numpy(), emb.qtype))


def test_real_smollm_tensors_match_reference(smollm_path):
    _assert_real_types(smollm_path, {"Q4_1", "Q8_0", "F32"})


def test_real_gemma_tensors_match_reference(gemma_path):
    _assert_real_types(gemma_path, {"Q5_0", "Q4_K", "Q8_0", "Q6_K", "F32"})


def test_unpack_q4_0_and_q8_0_recombine_exactly():
    for qtype, unpack, lo, hi, dtype in [
        (T.Q4_0, dequant.unpack_q4_0, -8, 7, torch.int8),
        (T.Q8_0, dequant.unpack_q8_0, -128, 127, torch.int8),
    ]:
        raw = torch.from_numpy(random_blocks(qtype, rows=3, cols=96, seed=11))
        codes, scales = unpack(raw, (3, 96))
        assert codes.shape == (3, 3, 32) and codes.dtype == dtype
        assert scales.shape == (3, 3) and scales.dtype == torch.float32
        assert int(codes.min()) >= lo and int(codes.max()) <= hi
        assert torch.equal(bits(scales[..., None] * codes), bits(dequantize(raw, qtype, (3, 96)).reshape(3, 3, 32)))


@pytest.mark.parametrize("qtype, unpack", [(T.Q4_1, dequant.unpack_q4_1), (T.Q4_K, dequant.unpack_q4_k)],
                         ids=["Q4_1", "Q4_K"])
def test_unpack_with_offsets_recombines_exactly(qtype, unpack):
    cols = 512
    raw = torch.from_numpy(random_blocks(qtype, rows=2, cols=cols, seed=12))
    codes, scales, offsets = unpack(raw, (2, cols))
    assert codes.shape == (2, cols // 32, 32) and codes.dtype == torch.uint8
    assert int(codes.max()) <= 15
    assert scales.shape == offsets.shape == (2, cols // 32)
    w = scales[..., None] * codes
    w = w + offsets[..., None]
    assert torch.equal(bits(w), bits(dequantize(raw, qtype, (2, cols)).reshape(2, cols // 32, 32)))


def test_block_info():
    assert block_info(T.Q8_0) == (32, 34)
    assert block_info(int(T.Q4_K)) == (256, 144)
    assert block_info(T.F32) == (1, 4)


def test_unsupported_type_names_the_supported_ones():
    with pytest.raises(ValueError, match=r"IQ1_M is not supported; supported: F32, F16, BF16, Q4_0"):
        dequantize(torch.zeros(56, dtype=torch.uint8), T.IQ1_M, (256,))
    with pytest.raises(ValueError, match="unknown GGML type id 999"):
        dequantize(torch.zeros(4, dtype=torch.uint8), 999, (1,))


def test_wrong_byte_count_and_partial_block_are_rejected():
    with pytest.raises(ValueError, match="needs 68 bytes, got 67"):
        dequantize(torch.zeros(67, dtype=torch.uint8), T.Q8_0, (2, 32))
    with pytest.raises(ValueError, match="not a multiple of the Q8_0 block size 32"):
        dequantize(torch.zeros(34, dtype=torch.uint8), T.Q8_0, (16, 2))
