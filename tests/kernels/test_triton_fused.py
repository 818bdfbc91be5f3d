"""Fused RMSNorm (+ residual), RoPE and gated activations against torch references."""
from __future__ import annotations

import pytest
import torch
from triton_helpers import kernel_device

from lodestar.kernels import triton_fused as tf


def _tol(dtype: torch.dtype, dev: str) -> dict:
    if dtype == torch.float32:
        return {"rtol": 2e-6, "atol": 1e-5}
    # one bf16 rounding apart (the interpreter truncates instead of rounding: two)
    return {"rtol": 8e-3 if dev == "cuda" else 1.6e-2, "atol": 1e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("offset", [False, True], ids=["llama", "gemma"])
@pytest.mark.parametrize("d", [64, 576, 4096])
def test_rms_norm(dtype, offset, d):
    dev = kernel_device()
    g = torch.Generator().manual_seed(d)
    x = (torch.randn(7, d, generator=g) * 3).to(dtype).to(dev)
    r = torch.randn(7, d, generator=g).to(dtype).to(dev)
    w = (torch.rand(d, generator=g) + 0.5).to(dev)
    torch.testing.assert_close(tf.rms_norm(x, w, 1e-5, offset).float(), tf.rms_norm_ref(x, w, 1e-5, offset).float(),
                               **_tol(dtype, dev))
    y, h = tf.rms_norm(x, w, 1e-5, offset, residual=r)
    y_ref, h_ref = tf.rms_norm_ref(x, w, 1e-5, offset, residual=r)
    if dev == "cuda" or dtype == torch.float32:
        assert torch.equal(h, h_ref)          # the residual sum is rounded exactly as x + r
    torch.testing.assert_close(y.float(), y_ref.float(), **_tol(dtype, dev))


def test_rms_norm_over_heads_of_a_strided_view():
    dev = kernel_device()
    qkv = torch.randn(5, 9 * 64 + 6 * 64, generator=torch.Generator().manual_seed(0)).to(dev)
    q = qkv[:, : 9 * 64].view(5, 9, 64)
    w = torch.rand(64).to(dev)
    torch.testing.assert_close(tf.rms_norm(q, w, 1e-6), tf.rms_norm_ref(q, w, 1e-6), rtol=2e-6, atol=2e-6)


def _rope_tables(rotary_dim, dev, positions=300):
    """cos/sin ``[positions, rotary_dim]`` (each frequency twice, as the model's tables)."""
    inv = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    ang = torch.arange(positions).float()[:, None] * inv[None, :]
    return torch.cat((ang, ang), -1).cos().to(dev), torch.cat((ang, ang), -1).sin().to(dev)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rotary_dim", [64, 48])
def test_rope_in_place_on_fused_qkv_views(dtype, rotary_dim):
    dev = kernel_device()
    cos, sin = _rope_tables(rotary_dim, dev)
    qkv = torch.randn(6, 9 * 64 + 6 * 64, generator=torch.Generator().manual_seed(1)).to(dtype).to(dev)
    q, k = qkv[:, :576].view(6, 9, 64), qkv[:, 576:768].view(6, 3, 64)
    v_before = qkv[:, 768:].clone()
    pos = torch.tensor([0, 1, 17, 100, 250, 299], device=dev)
    q_ref, k_ref = tf.rope_ref(q, k, pos, cos, sin, rotary_dim)
    tf.rope_(q, k, pos, cos, sin, rotary_dim)
    torch.testing.assert_close(q.float(), q_ref.float(), **_tol(dtype, dev))
    torch.testing.assert_close(k.float(), k_ref.float(), **_tol(dtype, dev))
    assert torch.equal(qkv[:, 768:], v_before)   # v untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rotary_dim", [64, 48])
def test_rope_stores_rotated_k_and_v_at_their_slots(dtype, rotary_dim):
    dev = kernel_device()
    cos, sin = _rope_tables(rotary_dim, dev)
    qkv = torch.randn(5, 9 * 64 + 6 * 64, generator=torch.Generator().manual_seed(2)).to(dtype).to(dev)
    q, k, v = qkv[:, :576].view(5, 9, 64), qkv[:, 576:768].view(5, 3, 64), qkv[:, 768:].view(5, 3, 64)
    pos = torch.tensor([0, 3, 40, 41, 299], device=dev)
    slots = torch.tensor([7, 0, 33, 12, 63], device=dev)
    k_cache = torch.zeros(64, 3, 64, dtype=dtype, device=dev)
    v_cache = torch.zeros(64, 3, 64, dtype=dtype, device=dev)
    q_ref, k_ref = tf.rope_ref(q.clone(), k.clone(), pos, cos, sin, rotary_dim)
    tf.rope_(q, k, pos, cos, sin, rotary_dim, v=v, k_cache=k_cache, v_cache=v_cache, slots=slots)
    torch.testing.assert_close(q.float(), q_ref.float(), **_tol(dtype, dev))
    assert torch.equal(k_cache[slots], k)          # the rotated k, bit for bit, tail included
    assert torch.equal(v_cache[slots], v)
    untouched = torch.ones(64, dtype=torch.bool, device=dev)
    untouched[slots] = False
    assert not k_cache[untouched].any() and not v_cache[untouched].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gated_activations_on_fused_halves(dtype):
    dev = kernel_device()
    gu = (torch.randn(5, 2 * 1536, generator=torch.Generator().manual_seed(2)) * 4).to(dtype).to(dev)
    gate, up = gu.split(1536, dim=-1)
    torch.testing.assert_close(tf.silu_mul(gate, up).float(), tf.silu_mul_ref(gate, up).float(), **_tol(dtype, dev))
    torch.testing.assert_close(tf.gelu_tanh_mul(gate, up).float(), tf.gelu_tanh_mul_ref(gate, up).float(),
                               **_tol(dtype, dev))
