"""Decode fusions (``triton_quant.fusions``, env LODESTAR_FUSE) give the same bits as the
unfused kernels: x quantized inside RMSNorm and the gated activation, K splits added
inside the matrix-vector kernel, and repeated calls on the same buffers (CUDA-graph
replays) finding the tile counters back at 0.

Runs on a CUDA device, or on the CPU under TRITON_INTERPRET=1 (see triton_helpers); there
the weights keep their real K (and K split) but only 20 rows, to bound the interpreter's time.
"""
from __future__ import annotations

import pytest
import torch

from lodestar.kernels import triton_fused as tf
from lodestar.kernels import triton_quant as tq

from triton_helpers import kernel_device, random_gguf

TYPES = [pytest.param(t, id=t.name) for t in tq.GPU_QUANT_TYPES]
ROWS = (1, 2, 3, 8)
# (N, K, split_k, tile_groups) of the products that split K: SmolLM2-135M's (forced splits:
# the H200 rule keeps them whole) and Llama-3.1-8B's with the H200 tiling rule
# (q|k|v 6144 x 4096 and o 4096 x 4096 split in 2, down 4096 x 14336 in 4).
SPLIT_SHAPES = {
    "smollm2_qkv": (960, 576, 2, 8),
    "smollm2_down": (576, 1536, 4, 8),
    "8b_qkv": (6144, 4096, 2, 16),
    "8b_down": (4096, 14336, 4, 16),
}


def _x(m: int, k: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed)) * scale
    x[:, 5] = 0.0
    x[:, 32:64] = 0.0                               # an all-zero group (d1 = 0)
    x[:, 70] *= 1e4                                 # a group whose sums lose bits in fp32
    return x.to(torch.bfloat16)


def _same_quantization(got: tq.QuantizedRows, x: torch.Tensor) -> None:
    words, d1, sums = tq.quantize_x(x)
    assert torch.equal(got.words, words)
    assert torch.equal(got.d1.view(torch.int32), d1.view(torch.int32))
    assert torch.equal(got.sums.view(torch.int32), sums.view(torch.int32))


@pytest.mark.parametrize("d", [576, 4096])
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_norm_emits_the_bits_of_quantize_x(d, residual):
    dev = kernel_device()
    w = (torch.rand(d, generator=torch.Generator().manual_seed(d)) + 0.5).to(dev)
    for m in ROWS:
        x = _x(m, d, seed=m).to(dev)
        r = _x(m, d, seed=100 + m, scale=1.0).to(dev) if residual else None
        if residual:
            (q, h), (y, h_ref) = tf.rms_norm(x, w, 1e-5, residual=r, quantize=True), tf.rms_norm(x, w, 1e-5, residual=r)
            assert torch.equal(h, h_ref)
        else:
            q, y = tf.rms_norm(x, w, 1e-5, quantize=True), tf.rms_norm(x, w, 1e-5)
        assert isinstance(q, tq.QuantizedRows) and q.shape == (m, d)
        assert torch.equal(q.x, y), m
        _same_quantization(q, y)


@pytest.mark.parametrize("f", [1536, 14336])
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_gated_activation_emits_the_bits_of_quantize_x(f, act):
    dev = kernel_device()
    fn = tf.silu_mul if act == "silu" else tf.gelu_tanh_mul
    for m in ROWS:
        gu = _x(m, 2 * f, seed=m, scale=4.0).to(dev)
        gate, up = gu.split(f, dim=-1)                  # halves of one fused output, as in the MLP
        q, y = fn(gate, up, quantize=True), fn(gate, up)
        assert torch.equal(q.x, y), m
        _same_quantization(q, y)


def test_quantize_needs_bf16_rows_of_whole_groups():
    dev = kernel_device()
    with pytest.raises(ValueError, match="multiple of 32"):
        tf.rms_norm(torch.ones(2, 48, dtype=torch.bfloat16, device=dev), torch.ones(48, device=dev), 1e-5,
                    quantize=True)
    with pytest.raises(ValueError, match="bf16"):
        tf.rms_norm(torch.ones(2, 64, device=dev), torch.ones(64, device=dev), 1e-5, quantize=True)


def _weight(qtype, n: int, k: int, dev: str, seed: int) -> tq.PackedWeight:
    return tq.pack(qtype, random_gguf(qtype, n, k, seed=seed).to(dev), n, k)


def _rows(n: int, dev: str) -> int:
    return n if dev == "cuda" else 20     # 20: a full and a partial block of 16 rows


# K-quant blocks hold 256 weights: a 576-wide row cannot be one of them (such GGUF files
# store those tensors in another type).
SPLIT_CASES = [pytest.param(t, shape, id=f"{shape}-{t.name}") for shape in SPLIT_SHAPES for t in tq.GPU_QUANT_TYPES
               if SPLIT_SHAPES[shape][1] % tq.GGML_QUANT_SIZES[t][0] == 0]


@pytest.mark.parametrize("qtype,shape", SPLIT_CASES)
def test_split_sum_inside_the_kernel_is_bit_identical(qtype, shape, monkeypatch):
    dev = kernel_device()
    n, k, split, tile = SPLIT_SHAPES[shape]
    n = _rows(n, dev)
    # the interpreter's time grows with programs x tiles, not tile size: fewer, larger tiles
    cfg = tq.GemvConfig(16, tile if dev == "cuda" else 64, split, 4)
    pw = _weight(qtype, n, k, dev, seed=k + int(qtype))
    for m in ROWS:
        x = _x(m, k, seed=m).to(dev)
        monkeypatch.setenv("LODESTAR_FUSE", "quant,residual")     # split_sum off: _split_sum_kernel
        want = tq.quant_matmul(x, pw, torch.float32, config=cfg)
        monkeypatch.setenv("LODESTAR_FUSE", "1")
        got = tq.quant_matmul(x, pw, torch.float32, config=cfg)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), m
        assert not pw.tile_counters.any()                          # left at 0 for the next call


@pytest.mark.parametrize("qtype", TYPES)
def test_norm_quantized_input_gives_the_same_product(qtype, monkeypatch):
    """RMSNorm -> q|k|v as the model runs it: fused producer + in-kernel split sum against
    every fusion off."""
    dev = kernel_device()
    n, k, split, tile = SPLIT_SHAPES["8b_qkv"]
    n = _rows(n, dev)
    cfg = tq.GemvConfig(16, tile if dev == "cuda" else 64, split, 4)
    pw = _weight(qtype, n, k, dev, seed=7)
    w = (torch.rand(k, generator=torch.Generator().manual_seed(3)) + 0.5).to(dev)
    for m in ROWS:
        x = _x(m, k, seed=10 + m).to(dev)
        monkeypatch.setenv("LODESTAR_FUSE", "0")
        want = tq.quant_matmul(tf.rms_norm(x, w, 1e-5), pw, config=cfg)
        monkeypatch.setenv("LODESTAR_FUSE", "1")
        got = tq.quant_matmul(tf.rms_norm(x, w, 1e-5, quantize=True), pw, config=cfg)
        assert got.dtype == torch.bfloat16 and torch.equal(got, want), m


@pytest.mark.parametrize("qtype", [pytest.param(tq.T.Q4_0, id="Q4_0"), pytest.param(tq.T.Q6_K, id="Q6_K")])
def test_repeated_calls_on_the_same_buffers_give_the_same_bits(qtype, monkeypatch):
    """What a CUDA-graph replay does: the same launch again and again; each must find the
    tile counters at 0 (a counter left at SPLIT - 1 would make the first arrival sum)."""
    dev = kernel_device()
    monkeypatch.setenv("LODESTAR_FUSE", "1")
    n, k, split, tile = SPLIT_SHAPES["8b_down"]
    n = _rows(n, dev)
    cfg = tq.GemvConfig(16, tile if dev == "cuda" else 64, split, 4)
    pw = _weight(qtype, n, k, dev, seed=5)
    x = _x(8, k, seed=1).to(dev)
    first = tq.quant_matmul(x, pw, config=cfg)
    for _ in range(4 if dev == "cuda" else 2):
        assert torch.equal(tq.quant_matmul(x, pw, config=cfg), first)
        assert torch.equal(tq.quant_matmul(x[:3], pw, config=cfg), first[:3])   # fewer rows, same counters
    assert not pw.tile_counters.any()
    if dev == "cuda":   # and inside a captured graph, replayed
        static_x = x.clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            tq.quant_matmul(static_x, pw, config=cfg)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = tq.quant_matmul(static_x, pw, config=cfg)
        for _ in range(20):
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, first)
        assert not pw.tile_counters.any()


def test_fusion_switch(monkeypatch):
    monkeypatch.delenv("LODESTAR_FUSE", raising=False)
    assert tq.fusions() == set(tq.DEFAULT_FUSIONS) < set(tq.FUSIONS)
    monkeypatch.setenv("LODESTAR_FUSE", "default")
    assert tq.fusions() == set(tq.DEFAULT_FUSIONS)
    monkeypatch.setenv("LODESTAR_FUSE", "1")
    assert tq.fusions() == set(tq.FUSIONS)
    monkeypatch.setenv("LODESTAR_FUSE", "0")
    assert tq.fusions() == set()
    monkeypatch.setenv("LODESTAR_FUSE", "split_sum, residual")
    assert tq.fusions() == {"split_sum", "residual"}
    monkeypatch.setenv("LODESTAR_FUSE", "quant,norm")
    with pytest.raises(ValueError, match="names norm; use 0, 1 or a comma list of quant, split_sum, residual"):
        tq.fusions()
