"""Packed CPU matmul kernels agree with the fp32 product of the dequantized weight.

The integer kernels (``int_matmul``) quantize x per 32 values to 15-bit integers (error
at most ``amax / 64768`` per element); weights and integer products are exact, the rest is fp32
rounding. Dequantize-then-bf16-matmul rounds x, the weights and the output to bf16
(``U`` = bf16 unit roundoff, 2**-8). The compiled kernels (every instruction set the CPU
has) and the torch form must give the same bits.

Each test asserts the elementwise worst-case bound and a normwise error well under it.
"""
from __future__ import annotations

import dataclasses
import functools
import shutil

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants as ref_quants
from gguf.constants import GGML_QUANT_SIZES

from lodestar.formats.gguf import GGUFFile
from lodestar.kernels import cpu_quant as cq
from lodestar.kernels import native

U = 2.0 ** -8          # bf16 unit roundoff (8 significant bits)
F32_EPS = 2.0 ** -24

# Byte offsets of fp16 super-scales inside a block, for random blocks with sane scales.
F16_SCALE_OFFSETS = {T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}


def reference(raw: np.ndarray, qtype: T) -> np.ndarray:
    """gguf-py's numpy dequantization of ``[rows, bytes_per_row]`` bytes."""
    if qtype == T.F32:
        return raw.view(np.float32)
    if qtype == T.F16:
        return ref_quants.dequantize(raw.view(np.float16), qtype)
    return ref_quants.dequantize(raw, qtype)


def synthetic(qtype: T, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """GGUF bytes ``[n, row_bytes]`` and their fp32 dequantization ``[n, k]``."""
    rng = np.random.default_rng(seed)
    try:
        w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
        raw = np.ascontiguousarray(ref_quants.quantize(w, qtype)).view(np.uint8).reshape(n, -1)
    except NotImplementedError:  # K-quants: random codes, fp16 scales in [1e-3, 2e-2]
        block, size = GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, (n, k // block * size), dtype=np.uint8)
        blocks = raw.reshape(-1, size)
        for off in F16_SCALE_OFFSETS[qtype]:
            scales = rng.uniform(1e-3, 2e-2, blocks.shape[0]).astype(np.float16)
            blocks[:, off:off + 2] = scales.view(np.uint8).reshape(-1, 2)
    want = torch.from_numpy(np.ascontiguousarray(reference(raw, qtype), dtype=np.float32)).reshape(n, k)
    return torch.from_numpy(raw.copy()), want


@functools.cache
def gguf_tensors(path) -> dict:
    """Tensors of a GGUF file by name (lodestar's reader: gguf-py's takes seconds on Gemma's metadata)."""
    return GGUFFile(path).tensors


def real_tensor(path, name: str) -> tuple[T, torch.Tensor, int, int]:
    t = gguf_tensors(path)[name]
    n, k = t.shape
    return T(int(t.qtype)), t.data.clone(), n, k


def layouts() -> list[bool]:
    """The packed layouts this machine can run: the torch form always, the native one when built."""
    return [False, True] if native.built() else [False]


def int_bound(x: torch.Tensor, packed: cq.IntWeight) -> torch.Tensor:
    """Worst-case |error| of ``int_matmul`` against the fp32 product with the same weights:
    x off by at most amax/64768 per element (15-bit integers per 32 values) times the weight,
    plus fp32 rounding of the scale products, the products and the k/gs (2k/gs with mins)
    additions, relative to the magnitudes they add up."""
    m, k = x.shape
    gs = packed.fmt.group
    amax = x.view(m, k // 32, 32).abs().amax(-1).repeat_interleave(32, dim=1)
    ids = torch.arange(packed.n)
    whole = cq.int_rows(dataclasses.replace(packed, mins=None), ids).abs()            # |scale * (u - offset)|
    if packed.mins is not None:
        whole += cq.int_rows(dataclasses.replace(packed, scales=torch.zeros_like(packed.scales)), ids).abs()
    adds = 3 * (k // gs) + 8
    return (amax / 64768 * (1 + 1e-4)) @ whole.t() + adds * F32_EPS * ((x.abs() + amax) @ whole.t())


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm())


# ---------------------------------------------------------------------------------------


def test_native_kernels_are_built_where_a_compiler_is():
    # `make test` installs with the compiler the machine has; a silent fallback to the torch
    # form would leave the compiled kernels untested.
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler on this machine: the torch form runs")
    assert native.built(), "lodestar.kernels._native is not built: reinstall (pip install -e .) with a C compiler"
    assert native.isa() in native.isas() and native.isas()[-1] == "generic"
    from lodestar.models.cpu_layers import WEIGHT_FIELDS
    assert native._ext.WEIGHT_FIELDS == WEIGHT_FIELDS        # decoder.h and the Python side agree


@pytest.mark.parametrize("qtype", cq.INT_TYPES, ids=lambda t: t.name)
def test_rows_are_gguf_weights_in_both_layouts(qtype):
    n, k = 100, 512                     # 100: the last 16-row tile is partial
    data, w = synthetic(qtype, n, k, seed=11 + int(qtype))
    ids = torch.tensor([0, 99, 17, 17, 50, 96])
    for nat in layouts():
        packed = cq.int_pack(qtype, data, n, k, native=nat)
        assert packed.native == nat and packed.fmt.group == (16 if qtype == T.Q6_K else 32)
        # fp16 scales where the blocks hold fp16 ones; the K-quants' d * sc products stay fp32
        assert packed.half == (nat and qtype not in (T.Q4_K, T.Q6_K))
        assert torch.equal(cq.int_rows(packed, ids).view(torch.int32), w[ids].view(torch.int32)), nat


# Every fp16 field of each integer type's block (scales, mins), by byte offset.
F16_FIELDS = {T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q8_0: (0,), T.Q4_K: (0, 2),
              T.Q6_K: (208,)}


@pytest.mark.parametrize("qtype", cq.INT_TYPES, ids=lambda t: t.name)
def test_random_blocks_pack_to_gguf_weights(qtype):
    # Every byte random (codes, 6-bit scale fields, fp16 signs, subnormal and zero fp16 scales)
    # except fp16 exponents kept finite: the packed rows are still gguf's, bit for bit.
    n, k = 37, 512
    block, size = GGML_QUANT_SIZES[qtype]
    raw = np.random.default_rng(int(qtype)).integers(0, 256, (n, k // block * size), dtype=np.uint8)
    blocks = raw.reshape(-1, size)
    for off in F16_FIELDS[qtype]:
        blocks[:, off + 1] &= 0xBF                       # exponent < 16: finite, often subnormal
        blocks[::7, off:off + 2] = [0x01, 0x80]          # the smallest negative subnormal
    want = torch.from_numpy(np.ascontiguousarray(reference(raw, qtype), dtype=np.float32)).reshape(n, k)
    for nat in layouts():
        got = cq.int_rows(cq.int_pack(qtype, torch.from_numpy(raw.copy()), n, k, native=nat), torch.arange(n))
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), nat


@pytest.mark.parametrize("qtype", cq.INT_TYPES, ids=lambda t: t.name)
def test_int_matmul_within_the_int8_bound(qtype):
    n, k = 300, 512
    data, w = synthetic(qtype, n, k, seed=5 + int(qtype))
    packed = cq.int_pack(qtype, data, n, k, native=False)
    for m in (1, 7, 40):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        want = x @ w.t()
        got = cq.int_matmul(x, packed)
        assert got.shape == (m, n) and got.dtype == torch.float32
        excess = (got - want).abs() - int_bound(x, packed)
        assert bool((excess <= 0).all()), f"M={m}: max excess {float(excess.max())}"
        # Uniform x error of RMS amax/(64768*sqrt(3)) on Gaussian blocks (amax ~ 2.1 sigma): ~2e-5.
        assert rel(got, want) < 1e-4
        dense = cq.int_dense_matmul(x, packed)      # bf16 x, bf16 weights, exact scales
        ax, aw = x.abs(), w.abs()
        assert bool(((dense - want).abs() <= U * (1 + 4 * U) * (2 * ax @ aw.t() + want.abs())).all())


@pytest.mark.parametrize("qtype", cq.INT_TYPES, ids=lambda t: t.name)
def test_every_instruction_set_and_the_torch_form_give_the_same_bits(qtype):
    if not native.built():
        pytest.skip("the native kernels are not built")
    n, k = 200, 512                      # a partial tile; M above one 16-row chunk
    data, _ = synthetic(qtype, n, k, seed=3 + int(qtype))
    ref = cq.int_pack(qtype, data, n, k, native=False)
    packed = cq.int_pack(qtype, data, n, k, native=True)
    x = torch.randn(37, k, generator=torch.Generator().manual_seed(4)) * torch.logspace(-2, 1, k)
    x[3, 64:96] = 0                      # a zero block of x
    want = cq.int_matmul(x, ref)
    first = native.isa()
    try:
        for isa in native.isas():
            native.set_isa(isa)
            for m in (1, 2, 37):
                got = cq.int_matmul(x[:m], packed)
                assert torch.equal(got.view(torch.int32), want[:m].view(torch.int32)), (isa, m)
    finally:
        native.set_isa(first)


def test_x_quantization_is_the_same_in_c_and_torch():
    if not native.built():
        pytest.skip("the native kernels are not built")
    x = torch.randn(5, 128) * torch.logspace(-3, 3, 128)
    x[1, 32:64] = 0
    x[2, :32] = torch.arange(32) - 15.5          # halfway cases at several scales
    x[4, :32] = 127 * (torch.arange(32) % 3 - 1) / 2.0
    want = cq.quantize_x(x)
    got = [torch.empty_like(t) for t in want]
    native.quantize(x.data_ptr(), 5, 128, *(t.data_ptr() for t in got))
    for a, b in zip(want, got):
        assert torch.equal(a, b)
    q1, q2, dx, sums, sx = want
    big = 254 * q1.int() + q2.int()
    assert int(q1.abs().max()) <= 127 and -127 <= int(q2.min()) and int(q2.max()) <= 126
    assert int(big[1, 32:64].abs().max()) == 0 and float(dx[1, 1]) == 0.0
    assert torch.equal(sums, big.view(5, 8, 16).sum(-1, dtype=torch.int32))
    back = big.float().view(5, 4, 32) * dx.unsqueeze(-1)
    amax = x.view(5, 4, 32).abs().amax(-1, keepdim=True)
    assert bool(((back - x.view(5, 4, 32)).abs() <= amax / 64768 * (1 + 1e-5)).all())


@pytest.mark.parametrize("qtype", cq.INT_TYPES, ids=lambda t: t.name)
def test_kernels_give_each_row_the_same_bits_whatever_the_batch(qtype):
    # ARCHITECTURE.md section 4: batching must not change greedy output. The packed
    # kernels compute every row independently of M and of the other rows.
    n, k = 320, 512
    data, _ = synthetic(qtype, n, k, seed=7)
    packed = cq.int_pack(qtype, data, n, k)
    x = torch.randn(150, k, generator=torch.Generator().manual_seed(3))
    alone = torch.cat([cq.int_matmul(x[i:i + 1], packed) for i in range(x.shape[0])])
    for m in (2, 5, 17, 64, 150):
        assert torch.equal(cq.int_matmul(x[:m], packed), alone[:m]), m
    assert torch.equal(cq.int_matmul(x[40:47], packed), alone[40:47])


def test_tiled_matmul_is_exact_fp32(monkeypatch):
    monkeypatch.setattr(cq, "TILE_ELEMENTS", 64 * 64)  # several tiles and a partial one
    data, w = synthetic(T.Q5_0, 200, 64, seed=9)
    x = torch.randn(5, 64)
    got = cq.tiled_matmul(x, 200, 64, lambda r0, r1: cq.dequantize(data[r0:r1], T.Q5_0, (r1 - r0, 64)))
    assert torch.allclose(got, x @ w.t(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("numpy_fallback", [False, True], ids=["torch", "numpy"])
@pytest.mark.parametrize("qtype", [T.F32, T.F16, T.BF16, T.Q4_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K, T.Q6_K],
                         ids=lambda t: t.name)
def test_dequantize_matches_gguf(qtype, numpy_fallback, monkeypatch):
    if numpy_fallback:
        monkeypatch.setattr(cq, "_dequantize_torch", None)
    data, w = synthetic(qtype, 4, 256, seed=1)
    got = cq.dequantize(data, qtype, (4, 256))
    assert torch.equal(got.view(torch.int32), w.view(torch.int32))


def test_bad_bytes_name_the_expected_shape():
    with pytest.raises(ValueError, match=r"Q8_0 weight of 4x64 needs uint8 bytes of shape \[4, 68\]"):
        cq.check_bytes(T.Q8_0, torch.zeros(4, 64, dtype=torch.uint8), 4, 64)
    with pytest.raises(ValueError, match="IQ2_XS is not supported on the CPU; supported: F32"):
        cq.check_bytes(T.IQ2_XS, torch.zeros(4, 66, dtype=torch.uint8), 4, 256)
    with pytest.raises(ValueError, match="not a multiple of the Q4_K block size 256"):
        cq.check_bytes(T.Q4_K, torch.zeros(4, 72, dtype=torch.uint8), 4, 128)


@pytest.mark.parametrize("name", ["blk.0.attn_output.weight", "blk.0.attn_v.weight"])
def test_real_gemma_q4_k_and_q8_0(gemma_path, name):
    qtype, data, n, k = real_tensor(gemma_path, name)      # Q4_K 640x1024, Q8_0 256x640
    assert qtype in (T.Q4_K, T.Q8_0)
    w = cq.dequantize(data, qtype, (n, k))
    x = torch.randn(7, k, generator=torch.Generator().manual_seed(1))
    want = x @ w.t()
    results = []
    for nat in layouts():
        packed = cq.int_pack(qtype, data, n, k, native=nat)
        got = cq.int_matmul(x, packed)
        assert bool(((got - want).abs() <= int_bound(x, packed)).all())
        assert rel(got, want) < 1e-4
        results.append(got)
    assert all(torch.equal(r, results[0]) for r in results)
