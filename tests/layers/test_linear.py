"""QuantizedLinear / QuantizedEmbedding / make_linear against the fp32 dequantized weight.

Tolerances by path (U = 2**-8, the bf16 unit roundoff; derivations in
tests/kernels/test_cpu_quant.py):

* F32, F16, BF16 and the dequantize-then-fp32 path (Q2_K, Q3_K, Q5_K): exact weights,
  fp32 sums in another order: 1e-5 relative.
* the integer types (Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q6_K, Q8_0), compiled ("native") or
  torch ("int") kernels: x as 15-bit integers per 32 values (error at most amax/64768 per
  element, about 2e-5 normwise): 1e-4.
* "bf16" mode: bf16 weights, x and output: < 2U.
"""
from __future__ import annotations


import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants as ref_quants
from gguf.constants import GGML_QUANT_SIZES

from lodestar.formats.gguf import GGUFFile
from lodestar.kernels import native
from lodestar.layers.linear import (
    DenseEmbedding,
    DenseLinear,
    QuantizedEmbedding,
    QuantizedLinear,
    make_embedding,
    make_linear,
)

U = 2.0 ** -8
ALL_TYPES = [T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0,
             T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K]
INT = "native" if native.available() else "int"
PATH = {T.F32: "fp32", **{t: INT for t in (T.Q4_0, T.Q4_1, T.Q4_K, T.Q8_0, T.Q5_0, T.Q5_1, T.Q6_K)}}
TOLERANCE = {"fp32": 1e-5, "dequant": 1e-5, "native": 1e-4, "int": 1e-4}
F16_SCALE_OFFSETS = {T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}


def reference(raw: np.ndarray, qtype: T) -> np.ndarray:
    if qtype == T.F32:
        return raw.view(np.float32)
    if qtype == T.F16:
        return ref_quants.dequantize(raw.view(np.float16), qtype)
    return ref_quants.dequantize(raw, qtype)


def synthetic(qtype: T, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """GGUF bytes ``[n, row_bytes]`` (gguf's quantizer, or random codes with sane fp16
    scales for the K-quants it cannot produce) and their fp32 dequantization."""
    rng = np.random.default_rng(seed)
    try:
        w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
        raw = np.ascontiguousarray(ref_quants.quantize(w, qtype)).view(np.uint8).reshape(n, -1)
    except NotImplementedError:
        block, size = GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, (n, k // block * size), dtype=np.uint8)
        blocks = raw.reshape(-1, size)
        for off in F16_SCALE_OFFSETS[qtype]:
            scales = rng.uniform(1e-3, 2e-2, blocks.shape[0]).astype(np.float16)
            blocks[:, off:off + 2] = scales.view(np.uint8).reshape(-1, 2)
    want = torch.from_numpy(np.ascontiguousarray(reference(raw, qtype), dtype=np.float32)).reshape(n, k)
    return torch.from_numpy(raw.copy()), want


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm())


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32)


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_quantized_linear_matches_fp32_reference(qtype):
    n, k = 200, 512
    data, w = synthetic(qtype, n, k, seed=int(qtype))
    layer = QuantizedLinear(qtype, data, k, n)
    assert layer.path == PATH.get(qtype, "dequant")
    gen = torch.Generator().manual_seed(1)
    for shape in [(1, k), (7, k), (64, k), (2, 3, k)]:
        x = torch.randn(*shape, generator=gen)
        got = layer(x)
        assert got.shape == (*shape[:-1], n) and got.dtype == torch.float32
        assert rel(got, x @ w.t()) < TOLERANCE[layer.path], shape


@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q8_0, T.F32, T.Q5_K], ids=lambda t: t.name)
def test_strided_and_half_precision_inputs(qtype):
    n, k = 64, 256
    data, w = synthetic(qtype, n, k, seed=6)
    layer = QuantizedLinear(qtype, data, k, n)
    wide = torch.randn(3, 2 * k)
    x = wide[:, ::2]                                   # a strided view, as after a split
    assert not x.is_contiguous()
    want = x @ w.t()
    assert rel(layer(x), want) < TOLERANCE[layer.path]
    xb = x.bfloat16()
    got = layer(xb)
    assert got.dtype == torch.float32
    assert rel(got, xb.float() @ w.t()) < TOLERANCE[layer.path]


@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q4_K, T.Q8_0, T.Q6_K], ids=lambda t: t.name)
def test_rows_do_not_depend_on_the_batch(qtype):
    # A prompt's logits must not change with what the scheduler batched it with, at any
    # M (prefill chunks reach hundreds of rows).
    n, k = 256, 512
    data, _ = synthetic(qtype, n, k, seed=8)
    layer = QuantizedLinear(qtype, data, k, n)
    x = torch.randn(300, k, generator=torch.Generator().manual_seed(2))
    whole = layer(x)
    for lo, hi in ((0, 1), (17, 18), (5, 12), (100, 300)):
        assert torch.equal(layer(x[lo:hi]), whole[lo:hi]), (lo, hi)


@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q8_0, T.Q5_1], ids=lambda t: t.name)
def test_dense_min_m_sends_large_calls_to_bf16_matmul(qtype, monkeypatch):
    n, k = 128, 256
    data, w = synthetic(qtype, n, k, seed=2)
    layer = make_linear(qtype, data, k, n, "packed", dense_min_m=5)
    calls = []
    monkeypatch.setattr(layer, "_large", lambda x, s, f=layer._large: calls.append(x.shape[0]) or f(x, s))
    x = torch.randn(9, k)
    assert rel(layer(x), x @ w.t()) < 2 * U
    layer(x[:4])
    assert calls == [9]
    assert QuantizedLinear(qtype, data, k, n)._max_m > 1 << 40   # off by default


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_embedding_rows_equal_dequantized_rows_exactly(qtype):
    n, k = 96, 256
    data, w = synthetic(qtype, n, k, seed=10 + int(qtype))
    emb = QuantizedEmbedding(qtype, data, n, k)
    ids = torch.tensor([[3, 0, 95], [3, 50, 1]])
    assert torch.equal(bits(emb(ids)), bits(w[ids]))
    head = emb.as_linear()
    assert emb.as_linear() is head
    assert torch.equal(bits(emb(ids)), bits(w[ids]))  # still exact once tied
    x = torch.randn(5, k)
    assert rel(head(x), x @ w.t()) < TOLERANCE[head.path]


def test_tied_q8_0_head_shares_one_storage():
    n, k = 256, 128
    data, _ = synthetic(T.Q8_0, n, k)
    emb = QuantizedEmbedding(T.Q8_0, data, n, k)
    assert emb.nbytes == data.numel()
    head = emb.as_linear()
    assert emb.data is None                              # GGUF bytes released
    # byte codes + the block's fp16 scale in the compiled kernels' tiles: its 34 bytes per 32
    # weights; the torch form widens scales to fp32: 36.
    per_block = 34 if head.storage.half else 36
    assert emb.nbytes == head.nbytes == data.numel() * per_block // 34


def test_float_and_byte_kept_types_are_zero_copy():
    for qtype in (T.F32, T.Q3_K):
        data, _ = synthetic(qtype, 64, 256)
        layer = QuantizedLinear(qtype, data, 256, 64)
        assert layer.storage.data_ptr() == data.data_ptr()


@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q8_0, T.Q6_K, T.F16], ids=lambda t: t.name)
def test_make_linear_and_make_embedding_modes(qtype):
    n, k = 128, 256
    data, w = synthetic(qtype, n, k, seed=4)
    x = torch.randn(3, k)
    packed = make_linear(qtype, data, k, n, "packed")
    assert isinstance(packed, QuantizedLinear)
    fp32 = make_linear(qtype, data, k, n, "fp32")
    assert isinstance(fp32, DenseLinear) and fp32.weight.dtype == torch.float32
    assert torch.equal(fp32.weight, w)
    assert rel(fp32(x), x @ w.t()) < 1e-6
    bf16 = make_linear(qtype, data, k, n, "bf16")
    assert bf16.weight.dtype == torch.bfloat16
    y = bf16(x)
    assert y.dtype == torch.float32 and rel(y, x @ w.t()) < 2 * U

    ids = torch.tensor([5, 0, 127])
    assert isinstance(make_embedding(qtype, data, n, k, "packed"), QuantizedEmbedding)
    emb32 = make_embedding(qtype, data, n, k, "fp32")
    assert isinstance(emb32, DenseEmbedding) and torch.equal(emb32(ids), w[ids])
    assert emb32.as_linear().weight.data_ptr() == emb32.weight.data_ptr()
    emb16 = make_embedding(qtype, data, n, k, "bf16")
    assert emb16(ids).dtype == torch.float32
    assert torch.equal(emb16(ids), w[ids].bfloat16().float())


def test_bad_arguments_are_explained():
    data, _ = synthetic(T.Q8_0, 4, 64)
    with pytest.raises(ValueError, match="unknown weight mode 'int3'; choose one of packed, fp32, bf16"):
        make_linear(T.Q8_0, data, 64, 4, "int3")
    with pytest.raises(ValueError, match=r"needs uint8 bytes of shape \[4, 68\]"):
        QuantizedLinear(T.Q8_0, data[:, :60], 64, 4)
    with pytest.raises(ValueError, match="IQ1_M is not supported on the CPU"):
        QuantizedLinear(T.IQ1_M, torch.zeros(4, 56, dtype=torch.uint8), 256, 4)


# ---------------------------------------------------------------------------------------
# Real tensors


def _real(path, names):
    """(type, bytes [n, row bytes], n, k) of the named tensors, by lodestar's GGUF reader (gguf-py's
    takes seconds on Gemma's metadata)."""
    tensors = GGUFFile(path).tensors
    return {name: (T(int(tensors[name].qtype)), tensors[name].data.clone(), *tensors[name].shape) for name in names}


def _check_real(qtype, data, n, k):
    layer = QuantizedLinear(qtype, data, k, n)
    w = torch.from_numpy(np.ascontiguousarray(reference(data.numpy(), qtype), dtype=np.float32)).reshape(n, k)
    gen = torch.Generator().manual_seed(0)
    for m in (1, 7, 64):
        x = torch.randn(m, k, generator=gen)
        assert rel(layer(x), x @ w.t()) < TOLERANCE[layer.path], (qtype.name, m)


def test_real_smollm_projections(smollm_path):
    names = ["blk.3.attn_q.weight", "blk.3.attn_k.weight", "blk.3.ffn_down.weight", "blk.3.ffn_up.weight"]
    for name, (qtype, data, n, k) in _real(smollm_path, names).items():
        assert qtype == T.Q4_1
        _check_real(qtype, data, n, k)


def test_real_smollm_tied_embedding_and_head(smollm_path):
    qtype, data, n, k = _real(smollm_path, ["token_embd.weight"])["token_embd.weight"]
    assert (qtype, n, k) == (T.Q8_0, 49152, 576)
    emb = QuantizedEmbedding(qtype, data, n, k)
    ids = torch.tensor([0, 1, 49151, 12345, 12345, 777])
    want = torch.from_numpy(reference(data[ids].numpy(), qtype).reshape(-1, k).copy())
    assert torch.equal(bits(emb(ids)), bits(want))
    head = emb.as_linear()
    assert torch.equal(bits(emb(ids)), bits(want))
    # The full head against the fp32 product, one decode row and a short batch.
    w = torch.from_numpy(reference(data.numpy(), qtype).reshape(n, k).copy())
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(0))
    for rows in (x[:1], x):
        assert rel(head(rows), rows @ w.t()) < TOLERANCE[INT]


def test_real_gemma_types(gemma_path):
    names = ["blk.0.attn_q.weight", "blk.0.attn_output.weight", "blk.0.attn_v.weight",
             "blk.0.ffn_down.weight"]
    got = _real(gemma_path, names)
    assert {v[0] for v in got.values()} == {T.Q5_0, T.Q4_K, T.Q8_0, T.Q6_K}
    for qtype, data, n, k in got.values():
        _check_real(qtype, data, n, k)


def test_real_gemma_embedding_rows(gemma_path):
    qtype, data, n, k = _real(gemma_path, ["token_embd.weight"])["token_embd.weight"]
    emb = QuantizedEmbedding(qtype, data, n, k)
    ids = torch.tensor([2, 262143, 1000, 2])
    want = torch.from_numpy(reference(data[ids].numpy(), qtype).reshape(-1, k).copy())
    assert torch.equal(bits(emb(ids)), bits(want))
