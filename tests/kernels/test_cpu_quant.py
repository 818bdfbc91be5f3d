"""Packed CPU matmul kernels agree with the fp32 product of the dequantized weight.

Tolerances come from the rounding each path does (``U`` = bf16 unit roundoff, 2**-8):

* int4 kernel: scale and zero rounded to bf16 (weight error at most
  ``U * (8|scale| + |zero|)``), x rounded to bf16 (``U|x|``), output rounded to bf16
  (``U|y|``). Dequantize-then-bf16-matmul also rounds the weight itself (``U|w|``).
* int8 kernel (Q8_0, Q5_0, Q5_1, Q6_K): x as two int8 terms per sub-block, error at most
  ``amax / 64516`` per element; weights and integer products are exact, the rest is
  fp32 rounding.

Each test asserts the elementwise worst-case bound and a normwise error well under it.
"""
from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader
from gguf import quants as ref_quants
from gguf.constants import GGML_QUANT_SIZES

from lodestar.kernels import cpu_quant as cq

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
    """Tensors of a GGUF file by name (parsing Gemma's metadata takes seconds: once)."""
    return {t.name: t for t in GGUFReader(path).tensors}


def real_tensor(path, name: str) -> tuple[T, torch.Tensor, int, int]:
    t = gguf_tensors(path)[name]
    raw = np.ascontiguousarray(t.data).view(np.uint8)
    k, n = int(t.shape[0]), int(t.shape[1])
    return T(t.tensor_type), torch.from_numpy(raw.reshape(n, -1).copy()), n, k


def int4_bound(x: torch.Tensor, w: torch.Tensor, packed: cq.Int4Weight, want: torch.Tensor,
               dense: bool) -> torch.Tensor:
    """Worst-case |error| of the int4 kernel (``dense``: of dequantize-then-bf16-matmul)."""
    sz = packed.scales_zeros[:, : packed.n].float()               # [k/32, n, 2]
    werr = (8 * sz[..., 0].abs() + sz[..., 1].abs()).t().repeat_interleave(cq.GROUP, dim=1)
    ax, aw = x.abs(), w.abs()
    terms = ax @ werr.t() + (2 if dense else 1) * (ax @ aw.t()) + want.abs()
    return U * (1 + 4 * U) * terms + x.shape[1] * F32_EPS * (ax @ aw.t())


def int8_bound(x: torch.Tensor, packed: cq.Int8Weight) -> torch.Tensor:
    """Worst-case |error| of the int8 kernel: x off by at most amax/64516 per sub-block
    (two int8 terms), multiplying the int8 part ``scale * code`` of each weight, plus
    fp32 rounding of the scales, products and the 2 * k/gs (+ k/gs mins) additions."""
    m, k = x.shape
    gs = packed.group
    amax = x.view(m, k // gs, gs).abs().amax(-1).repeat_interleave(gs, dim=1)
    part = (packed.codes.float() * packed.scales.unsqueeze(-1)).abs()      # [k/gs, n, gs]
    part = part.permute(1, 0, 2).reshape(packed.n, k)
    whole = part.t()                                                         # [k, n]
    if packed.mins is not None:
        whole = whole + packed.centred_mins().abs().repeat_interleave(gs, dim=0)
    adds = 3 * (k // gs) + 8
    return (amax / 64516 * (1 + 1e-4)) @ part.t() + adds * F32_EPS * ((x.abs() + amax) @ whole)


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm())


# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q4_K], ids=lambda t: t.name)
@pytest.mark.parametrize("n", [192, 100])  # 100: output rows padded to the 64-row layout
def test_int4_paths_within_bf16_bound(qtype, n):
    k = 512
    data, w = synthetic(qtype, n, k, seed=int(qtype) + n)
    packed = cq.int4_pack(qtype, data, n, k)
    assert packed.packed.numel() + 4 * packed.scales_zeros.numel() // 2 >= n * k // 2
    for m in (1, 7, 64):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        want = x @ w.t()
        for fn, dense in ((cq.int4_matmul, False), (cq.int4_dense_matmul, True)):
            got = fn(x, packed)
            assert got.shape == (m, n) and got.dtype == torch.float32
            err = (got - want).abs()
            bound = int4_bound(x, w, packed, want, dense)
            assert bool((err <= bound).all()), f"{fn.__name__} M={m}: max excess {float((err - bound).max())}"
            # Three or four roundings of RMS about U/sqrt(3) each: normwise error near U.
            assert rel(got, want) < 2 * U


def test_int4_dequant_matches_kernel_arithmetic():
    # The layout reading in int4_dequant_t must agree with torch's packing: compare it
    # with (q - 8) * scale + zero built straight from the codes and the bf16 scales.
    n, k = 128 + 64, 96
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=gen)
    sz = (torch.randn(k // 32, n, 2, generator=gen) * 0.1).bfloat16()
    packed = cq.Int4Weight(torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1), sz, n, k)
    scale = sz[..., 0].float().t().repeat_interleave(32, 1)
    zero = sz[..., 1].float().t().repeat_interleave(32, 1)
    w = codes.float() * scale + (zero - 8 * scale)
    got = cq.int4_dequant_t(packed, dtype=torch.float32)
    assert torch.equal(got, w.t())
    assert torch.equal(cq.int4_dequant_t(packed, 64, 150, torch.float32), w[64:150].t())
    assert torch.equal(cq.int4_dequant_t(packed), w.t().bfloat16())


def test_int4_pack_reconstructs_gguf_weights_before_bf16_rounding():
    # (q - 8) * scale + zero with fp32 scale/zero equals the gguf weights to fp32 rounding,
    # so the only approximation is the bf16 storage of scale and zero.
    for qtype in (T.Q4_0, T.Q4_1, T.Q4_K):
        data, w = synthetic(qtype, 8, 512, seed=3)
        codes, scale, zero = cq._int4_codes_scales(qtype, data, 8, 512)
        assert int(codes.max()) <= 15
        rebuilt = (codes.float() - 8) * scale.repeat_interleave(32, 1) + zero.repeat_interleave(32, 1)
        tol = 4 * F32_EPS * (8 * scale.abs() + zero.abs()).repeat_interleave(32, 1)
        assert bool(((rebuilt - w).abs() <= tol).all()), qtype.name


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q5_0, T.Q5_1, T.Q6_K], ids=lambda t: t.name)
def test_int8_paths_and_exact_rows(qtype):
    n, k = 300, 512
    data, w = synthetic(qtype, n, k, seed=5 + int(qtype))
    packed = cq.int8_pack(qtype, data, n, k)
    assert packed.group == (16 if qtype == T.Q6_K else 32)
    ids = torch.tensor([0, 299, 17, 17, 150])
    assert torch.equal(cq.int8_rows(packed, ids).view(torch.int32), w[ids].view(torch.int32))
    for m in (1, 7, 64):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        want = x @ w.t()
        got = cq.int8_matmul(x, packed)
        assert bool(((got - want).abs() <= int8_bound(x, packed)).all())
        # Uniform remainder error of RMS amax/(127*254*sqrt(12)) on Gaussian blocks
        # (amax ~ 2.1 sigma): about 2e-5 normwise.
        assert rel(got, want) < 1e-4
        dense = cq.int8_dense_matmul(x, packed)
        # bf16 x, bf16 weights, bf16 output; scales are exact.
        ax, aw = x.abs(), w.abs()
        assert bool(((dense - want).abs() <= U * (1 + 4 * U) * (2 * ax @ aw.t() + want.abs())).all())
        assert rel(dense, want) < 2 * U


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q4_K, T.Q8_0, T.Q5_0, T.Q5_1, T.Q6_K],
                         ids=lambda t: t.name)
def test_kernels_give_each_row_the_same_bits_whatever_the_batch(qtype):
    # ARCHITECTURE.md section 4: batching must not change greedy output. The packed
    # kernels compute every row independently of M and of the other rows.
    n, k = 320, 512
    data, _ = synthetic(qtype, n, k, seed=7)
    if qtype in cq.INT4_TYPES:
        packed, fn = cq.int4_pack(qtype, data, n, k), cq.int4_matmul
    else:
        packed, fn = cq.int8_pack(qtype, data, n, k), cq.int8_matmul
    x = torch.randn(150, k, generator=torch.Generator().manual_seed(3))
    alone = torch.cat([fn(x[i:i + 1], packed) for i in range(x.shape[0])])
    for m in (2, 5, 17, 64, 150):
        assert torch.equal(fn(x[:m], packed), alone[:m]), m
    assert torch.equal(fn(x[40:47], packed), alone[40:47])


def test_quantize_rows_q8_error_bound_and_zero_blocks():
    x = torch.randn(3, 96) * torch.logspace(-3, 2, 96)     # wide dynamic range per block
    x[1, 32:64] = 0
    q, d = cq.quantize_rows_q8(x)
    assert q.dtype == torch.int8 and q.shape == (3, 6, 32) and d.shape == (2, 3, 3)
    hi, lo = q[:, :3].transpose(0, 1).float(), q[:, 3:].transpose(0, 1).float()
    back = hi * d[0].unsqueeze(-1) + lo * d[1].unsqueeze(-1)
    amax = x.view(3, 3, 32).abs().amax(-1, keepdim=True)
    err = (back - x.view(3, 3, 32)).abs()
    assert bool((err <= amax / 64516 * (1 + 1e-4) + 4 * F32_EPS * amax).all())
    assert int(q[:, [1, 4]][1].abs().max()) == 0 and float(d[0, 1, 1]) == 0.0


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
def test_real_gemma_int4_and_int8(gemma_path, name):
    qtype, data, n, k = real_tensor(gemma_path, name)      # Q4_K 640x1024, Q8_0 256x640
    w = cq.dequantize(data, qtype, (n, k))
    x = torch.randn(7, k, generator=torch.Generator().manual_seed(1))
    want = x @ w.t()
    if qtype == T.Q4_K:
        packed = cq.int4_pack(qtype, data, n, k)
        got = cq.int4_matmul(x, packed)
        assert bool(((got - want).abs() <= int4_bound(x, w, packed, want, False)).all())
        assert rel(got, want) < 2 * U
    else:
        assert qtype == T.Q8_0
        packed = cq.int8_pack(qtype, data, n, k)
        got = cq.int8_matmul(x, packed)
        assert bool(((got - want).abs() <= int8_bound(x, packed)).all())
        assert rel(got, want) < 1e-4
