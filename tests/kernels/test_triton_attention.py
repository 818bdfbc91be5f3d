"""Paged decode attention (Triton) and the GPU prefill path against torch references."""
from __future__ import annotations

import pytest
import torch
from triton_helpers import kernel_device

from lodestar.kernels import triton_attention as ta
from lodestar.layers.attention import AttentionBatch, paged_attention

BS = 16


def _pool(num_blocks: int, hk: int, d: int, dtype: torch.dtype, dev: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(num_blocks * BS, hk, d, generator=g).to(dtype).to(dev)
    v = torch.randn(num_blocks * BS, hk, d, generator=g).to(dtype).to(dev)
    return k, v


def _tables(lens: list[int], num_blocks: int, extra: int, seed: int = 0) -> torch.Tensor:
    """Scattered (non-consecutive) blocks per sequence, ``extra`` spare columns."""
    width = max(-(-n // BS) for n in lens) + extra
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))[: len(lens) * width]
    return perm.reshape(len(lens), width).to(torch.int32)


CASES = [  # (Hq, Hk, D, lens, window, dtype)
    pytest.param(9, 3, 64, [1, 37, 300, 700], None, torch.bfloat16, id="smollm-gqa3-bf16"),
    pytest.param(32, 8, 128, [5, 1100], None, torch.bfloat16, id="llama8b-gqa4-bf16"),
    pytest.param(8, 2, 128, [64, 1000], 100, torch.float32, id="window-fp32"),
    pytest.param(4, 1, 256, [600], 512, torch.bfloat16, id="gemma-d256-window"),
]


@pytest.mark.parametrize("hq,hk,d,lens,window,dtype", CASES)
def test_decode_matches_reference(hq, hk, d, lens, window, dtype):
    dev = kernel_device()
    kc, vc = _pool(200, hk, d, dtype, dev)
    tables = _tables(lens, 200, 2).to(dev)
    sl = torch.tensor(lens, dtype=torch.int32, device=dev)
    q = torch.randn(len(lens), hq, d, generator=torch.Generator().manual_seed(1)).to(dtype).to(dev)
    got = ta.decode_attention(q, kc, vc, tables, sl, BS, d ** -0.5, window).float()
    want = ta.decode_attention_ref(q, kc, vc, tables, sl, BS, d ** -0.5, window).float()
    # bf16: probabilities are rounded to bf16 before the value product (as flash attention does)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def test_decode_rows_do_not_depend_on_batch_or_grid():
    """Same row, alone or batched, any split count or table width: bit-identical output."""
    dev = kernel_device()
    kc, vc = _pool(300, 2, 64, torch.bfloat16, dev)
    lens = [900, 33, 260, 17]
    tables = _tables(lens, 300, 3).to(dev)
    sl = torch.tensor(lens, dtype=torch.int32, device=dev)
    q = torch.randn(4, 8, 64, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16).to(dev)
    full = ta.decode_attention(q, kc, vc, tables, sl, BS, 0.125)
    for splits, parts in ((1, None), (3, 16), (64, 40)):
        alone = ta.decode_attention(q[:1], kc, vc, tables[:1], sl[:1], BS, 0.125, None, parts, splits)
        assert torch.equal(alone, full[:1]), (splits, parts)


def _batch(lens: list[int], qlens: list[int], tables: torch.Tensor, dev: str) -> AttentionBatch:
    from lodestar.layers.attention import GpuAttentionMeta
    bt = [t[: -(-n // BS)].tolist() for t, n in zip(tables.cpu(), lens)]
    b = AttentionBatch.build(bt, lens, qlens, BS)
    b.gpu = GpuAttentionMeta(b.slot_mapping.to(dev), b.block_tables.to(torch.int32).to(dev),
                             b.seq_lens.to(torch.int32).to(dev), ta.num_partitions(max(lens)),
                             ta.grid_splits(len(lens), 2, torch.device(dev)))
    return b


@pytest.mark.parametrize("lens,qlens,window", [
    pytest.param([300], [300], None, id="fresh-single"),
    pytest.param([300, 40, 97], [300, 1, 20], None, id="mixed-prefix"),
    pytest.param([150], [150], 64, id="fresh-window"),
])
def test_prefill_matches_cpu_path(lens, qlens, window):
    """The GPU prefill path equals the CPU path's masked SDPA on the same pool."""
    dev = kernel_device()
    kc, vc = _pool(100, 2, 64, torch.float32, "cpu")
    tables = _tables(lens, 100, 0)
    q = torch.randn(sum(qlens), 8, 64, generator=torch.Generator().manual_seed(3))
    cpu = _batch(lens, qlens, tables, "cpu")
    cpu.gpu = None
    want = paged_attention(q, kc, vc, cpu, 0.125, window)
    got = paged_attention(q.to(dev), kc.to(dev), vc.to(dev), _batch(lens, qlens, tables, dev), 0.125, window)
    torch.testing.assert_close(got.cpu(), want, rtol=2e-5, atol=2e-5)
