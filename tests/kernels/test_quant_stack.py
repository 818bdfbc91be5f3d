"""Projections of one input in several packed types as one (``cuda_linear.CudaQuantStack``,
``triton_quant.quant_matmul(out=, row0=)``): each part's kernel writes its columns of one
output, with the bits of the parts apart; with ``qkv_rope`` each part rotates and stores
its own rows of the q|k|v layout. A llama.cpp Q4_K_M layer (attn_v in Q6_K beside q and k
in Q4_K) runs its attention step with the bits of separate projections.

Runs on a CUDA device, or on the CPU under TRITON_INTERPRET=1 (see triton_helpers).
"""
from __future__ import annotations

import pytest
import torch

from lodestar.kernels import gemv_tiling as gt
from lodestar.kernels import quant_layout as ql
from lodestar.kernels import triton_fused as tf
from lodestar.kernels import triton_quant as tq
from lodestar.kernels.policy import KernelPolicy, active, using

from triton_helpers import kernel_device, random_gguf

T = ql.T


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (``torch.equal`` takes -0 for +0)."""
    ints = {2: torch.int16, 4: torch.int32}[a.element_size()]
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(ints), b.view(ints))


def _x(m: int, k: int, seed: int) -> torch.Tensor:
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed)) * 3.0
    x[:, 32:64] = 0.0                                   # an all-zero group
    return x.to(torch.bfloat16)


# (type, rows) of each part: q|k in Q4_K and v in Q6_K (a Q4_K_M layer), and three types
PARTS = {
    "q4_k_m_qkv": [(T.Q4_K, 80), (T.Q6_K, 16)],
    "three_types": [(T.Q4_0, 32), (T.Q6_K, 16), (T.Q8_0, 48)],
}


@pytest.mark.parametrize("parts", list(PARTS), ids=list(PARTS))
@pytest.mark.parametrize("fuse", [True, False], ids=["split_sum", "unfused"])
def test_parts_write_their_columns_with_the_bits_of_their_own_products(parts, fuse):
    """``quant_matmul(out=, row0=)`` for each part, one tile a split and K splits (summed in
    the kernel, or, with the fusions off, by the split-sum kernel over the part's columns
    only): the concatenation of each part's own product, bit for bit."""
    with using(KernelPolicy() if fuse else KernelPolicy(fusions=frozenset())):
        _parts_write_their_columns(parts)


def _parts_write_their_columns(parts: str) -> None:
    dev = kernel_device()
    k = 512
    pws = [ql.pack(t, random_gguf(t, n, k, seed=7 + i).to(dev), n, k) for i, (t, n) in enumerate(PARTS[parts])]
    row0s = [sum(n for _, n in PARTS[parts][:i]) for i in range(len(pws))]
    total = sum(n for _, n in PARTS[parts])
    for cfg in (gt.GemvConfig(16, 8, 1, 4, words=True), gt.GemvConfig(16, 4, 2, 2, words=True)):
        for m in (1, 3):
            x = _x(m, k, seed=m).to(dev)
            want = torch.cat([tq.quant_matmul(x, pw, config=cfg) for pw in pws], dim=-1)
            out = torch.full((m, total), float("nan"), dtype=torch.bfloat16, device=dev)
            for pw, r0 in zip(pws, row0s):
                assert tq.quant_matmul(x, pw, config=cfg, out=out, row0=r0) is out
            assert _same_bits(out, want), (cfg, m)
            for pw in pws:
                assert pw.tile_counters is None or not pw.tile_counters.any()
    x = _x(1, k, seed=0).to(dev)
    out = torch.empty(1, total, dtype=torch.bfloat16, device=dev)
    with pytest.raises(ValueError, match="row0"):      # not a multiple of block_n
        tq.quant_matmul(x, pws[1], config=gt.GemvConfig(16, 8, 1, 4, words=True), out=out, row0=8)
    with pytest.raises(ValueError, match="row0"):      # the group-tile kernel cannot
        tq.quant_matmul(x, pws[0], config=gt.GemvConfig(16, 8, 1, 4), out=out, row0=0)
    with pytest.raises(ValueError, match="row0"):      # past the end of out
        tq.quant_matmul(x, pws[-1], config=gt.GemvConfig(16, 8, 1, 4, words=True), out=out, row0=total)


@pytest.mark.parametrize("split", [1, 2])
def test_qkv_stack_rotates_and_stores_as_the_rope_kernel_does(split):
    """A q|k|v stack (q and k in Q4_K, v in Q6_K) with ``rope``: each part rotates its q and k
    rows and stores its k and v rows at the token's slot; the output and both caches have
    the bits of the parts' products then ``triton_fused.rope_`` with the KV store."""
    with using(KernelPolicy()):                 # split_sum: K splits summed in the kernel
        _qkv_stack_rotates(split)


def _qkv_stack_rotates(split: int) -> None:
    from lodestar.layers.rotary import RotaryEmbedding
    dev = kernel_device()
    hd, hq, hk, k = 64, 4, 2, 512
    n_q, n_k = hq * hd, hk * hd
    qk = ql.pack(T.Q4_K, random_gguf(T.Q4_K, n_q + n_k, k, seed=1).to(dev), n_q + n_k, k)
    v = ql.pack(T.Q6_K, random_gguf(T.Q6_K, n_k, k, seed=2).to(dev), n_k, k)
    cfg = gt.GemvConfig(16, 16 // split, split, 4, words=True)
    for pw in (qk, v):
        assert gt.rope_epilogue_ok(pw, 3, hd, n_q, n_k, cfg, n_out=n_q + 2 * n_k)
    assert not gt.rope_epilogue_ok(v, 3, hd, n_q, n_k, cfg)        # alone it is not a q|k|v layout
    rope = RotaryEmbedding(hd, 10000.0, 2048).to(dev)
    g = torch.Generator().manual_seed(3)
    kc0 = torch.randn(16, hk, hd, generator=g).to(torch.bfloat16).to(dev)
    vc0 = torch.randn(16, hk, hd, generator=g).to(torch.bfloat16).to(dev)
    for m in (1, 3):
        x = _x(m, k, seed=10 + m).to(dev)
        positions = torch.tensor([4, 1500, 0][:m], dtype=torch.int64).to(dev)
        slots = torch.tensor([3, 0, 15][:m], dtype=torch.int64).to(dev)
        want = torch.cat([tq.quant_matmul(x, qk, config=cfg), tq.quant_matmul(x, v, config=cfg)], dim=-1)
        kw, vw = kc0.clone(), vc0.clone()
        q_, k_, v_ = (t.view(m, -1, hd) for t in want.split([n_q, n_k, n_k], dim=-1))
        tf.rope_(q_, k_, positions, rope.cos, rope.sin, hd, v=v_, k_cache=kw, v_cache=vw, slots=slots)
        kg, vg = kc0.clone(), vc0.clone()
        store = tq.RopeStore(positions, slots, rope.cos, rope.sin, kg, vg, n_q, n_k, hd)
        out = torch.empty(m, n_q + 2 * n_k, dtype=torch.bfloat16, device=dev)
        tq.quant_matmul(x, qk, config=cfg, rope=store, out=out, row0=0)
        tq.quant_matmul(x, v, config=cfg, rope=store, out=out, row0=n_q + n_k)
        assert _same_bits(out, want) and _same_bits(kg, kw) and _same_bits(vg, vw), m


def test_stack_module_runs_like_its_parts():
    """``CudaQuantStack``: bf16 rows, ``QuantizedRows``, a ``PendingNorm`` and more rows than
    the matrix-vector kernel takes (the parts apart, concatenated) give the parts' outputs
    side by side."""
    with using(KernelPolicy()):
        _stack_module_runs_like_its_parts()


def _stack_module_runs_like_its_parts() -> None:
    from lodestar.kernels.triton_dense import PendingNorm
    from lodestar.layers.cuda_linear import CudaQuantLinear, CudaQuantStack
    dev = kernel_device()
    k = 256
    parts = [CudaQuantLinear(t, random_gguf(t, n, k, seed=20 + n), k, n, torch.device(dev))
             for t, n in PARTS["q4_k_m_qkv"]]
    stack = CudaQuantStack(parts)
    assert stack.out_features == 96 and stack.row0s == [0, 80]
    assert stack.nbytes == sum(p.nbytes for p in parts)
    for m in (1, 2, ql.SMALL_M_MAX + 1):
        x = _x(m, k, seed=30 + m).to(dev)
        want = torch.cat([p(x) for p in parts], dim=-1)
        assert _same_bits(stack(x), want), m
        if m <= ql.SMALL_M_MAX:
            xq = ql.QuantizedRows(x, *tq.quantize_x(x))
            assert _same_bits(stack(xq), want), m
    w = (torch.rand(k, generator=torch.Generator().manual_seed(1)) + 0.5).to(dev)
    x = _x(2, k, seed=40).to(dev)
    assert _same_bits(stack(PendingNorm.of(x, w, 1e-5)), torch.cat([p(tf.rms_norm(x, w, 1e-5)) for p in parts], -1))
    with pytest.raises(ValueError, match="one input width"):
        CudaQuantStack([parts[0], CudaQuantLinear(T.Q6_K, random_gguf(T.Q6_K, 16, 512), 512, 16, torch.device(dev))])


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
@pytest.mark.parametrize("fuse", [True, False], ids=["default", "unfused"])
def test_q4_k_m_attention_step_has_the_bits_of_separate_projections(kind, fuse):
    """A Q4_K_M layer whose attn_v is Q6_K loads its q|k|v as a stack (q and k fused in Q4_K,
    v in Q6_K) and runs a GPU-form decode step of three rows (Llama: RoPE in the q|k|v
    kernels with the default fusions; Gemma 3's form: q/k norms first, then the RoPE kernel)
    with the bits of separate q, k and v projections (``WeightLoader.stack`` off): the same
    output and caches."""
    with using(KernelPolicy() if fuse else KernelPolicy(fusions=frozenset())):
        _q4_k_m_attention_step(kind, fuse)


def _q4_k_m_attention_step(kind: str, fuse: bool) -> None:
    from test_triton_decode_fusion import _attention_step
    from lodestar.layers.cuda_linear import CudaQuantLinear, CudaQuantStack
    from lodestar.layers.decode_plan import attn_step
    dev = kernel_device()
    runs = {}
    for stack in (True, False):
        attn, batch, kc, vc, x, positions = _attention_step(kind, dev, "Q4_K_M", stack=stack)
        attn.k_cache, attn.v_cache = kc.clone(), vc.clone()
        if stack:
            assert isinstance(attn.qkv, CudaQuantStack)
            qk, v = (640, 128) if kind == "llama" else (1280, 256)
            assert [(p.qtype, p.out_features) for p in attn.qkv.parts] == [(T.Q4_K, qk), (T.Q6_K, v)]
            step = attn_step(attn.qkv, attn.o, x.shape[0], True, attn.rotates_in_qkv, active())
            rope = step.rope_in_qkv and attn.qkv.rope_store(
                x, positions, batch.gpu.slot_mapping, attn.rope.cos, attn.rope.sin, attn.k_cache, attn.v_cache,
                attn.sizes[0], attn.sizes[1], attn.head_dim) is not None
            assert rope == (fuse and kind == "llama")
        else:
            assert [type(m) for m in attn.qkv] == [CudaQuantLinear] * 3
        runs[stack] = (attn(x, positions, batch), attn.k_cache, attn.v_cache)
    for got, want in zip(runs[True], runs[False]):
        assert _same_bits(got, want)
    assert torch.isfinite(runs[True][0].float()).all()
