"""Paged decode attention (Triton) and the GPU prefill path against torch references."""
from __future__ import annotations

import pytest
import torch
from triton_helpers import kernel_device

from lodestar.kernels import triton_attention as ta
from lodestar.kernels.policy import FUSIONS, KernelPolicy, using
from lodestar.kernels.quant_layout import QuantizedRows
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


PREFILL_CASES = [  # (Hq, Hk, D, context lengths, new tokens, window, dtype)
    pytest.param(9, 3, 64, [300, 40, 97], [300, 1, 20], None, torch.bfloat16, id="smollm-gqa3-mixed"),
    pytest.param(32, 8, 128, [130, 700], [130, 65], None, torch.bfloat16, id="llama8b-prefix"),
    pytest.param(8, 2, 128, [150, 400], [150, 37], 64, torch.float32, id="window-fp32"),
    pytest.param(4, 1, 256, [600], [77], 512, torch.bfloat16, id="gemma-d256-window"),
]


@pytest.mark.parametrize("hq,hk,d,lens,qlens,window,dtype", PREFILL_CASES)
def test_paged_prefill_matches_reference(hq, hk, d, lens, qlens, window, dtype):
    """Varlen causal attention over the paged pool (scattered blocks, cached prefixes, GQA,
    windows) against gather + fp32 softmax."""
    dev = kernel_device()
    blocks = max(100, len(lens) * (-(-max(lens) // BS) + 1))
    kc, vc = _pool(blocks, hk, d, dtype, dev, seed=4)
    tables = _tables(lens, blocks, 1, seed=4).to(dev)
    sl = torch.tensor(lens, dtype=torch.int32, device=dev)
    qsl = torch.tensor([0] + qlens).cumsum(0)
    q = torch.randn(sum(qlens), hq, d, generator=torch.Generator().manual_seed(5)).to(dtype).to(dev)
    got = ta.paged_prefill(q, kc, vc, tables, sl, qsl, qlens, BS, d ** -0.5, window).float()
    want = ta.paged_prefill_ref(q, kc, vc, tables, sl, qsl, BS, d ** -0.5, window).float()
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def test_paged_prefill_rows_do_not_depend_on_cached_prefix_or_batch():
    """A token's output is the same bits whether the context before it was cached or fed in
    the same step, and whatever other sequences share the step."""
    dev = kernel_device()
    hq, hk, d = 8, 2, 64
    kc, vc = _pool(120, hk, d, torch.bfloat16, dev, seed=6)
    tables = _tables([500, 300], 120, 1, seed=6).to(dev)
    q = torch.randn(500, hq, d, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16).to(dev)

    def run(lens, qlens, rows):
        sl = torch.tensor(lens, dtype=torch.int32, device=dev)
        qsl = torch.tensor([0] + qlens).cumsum(0)
        return ta.paged_prefill(q[rows], kc, vc, tables[: len(lens)], sl, qsl, qlens, BS, 0.125)

    def same(a, b):
        if dev == "cuda":
            return torch.equal(a, b)
        # The interpreter computes tl.dot with numpy, whose float32 matmul rounds a row
        # differently by its place in the tile (377 keys cached puts a token's rows elsewhere
        # in its program's tile): there, one bf16 rounding step at most.
        return torch.allclose(a.float(), b.float(), rtol=2 ** -7, atol=1e-6)

    whole = run([500], [500], torch.arange(500))
    cached = run([500], [123], torch.arange(377, 500))                 # 377 keys cached before
    assert same(cached, whole[377:])
    other = torch.arange(200, 230)
    both = run([500, 300], [123, 30], torch.cat([torch.arange(377, 500), other]))
    assert same(both[:123], whole[377:])


def test_prefill_rows():
    assert ta.prefill_rows(4, 128) == (32, 4) and ta.prefill_rows(3, 64) == (32, 4)
    assert ta.prefill_rows(1, 256) == (64, 1) and ta.prefill_rows(16, 128) == (8, 16)


@pytest.mark.parametrize("mode", ["paged", "sdpa"])
def test_prefill_paths_agree(mode):
    """Both prefill forms of ``paged_attention`` (policy ``prefill_attention``) on a step with
    cached prefixes and a single-token row equal the CPU path (fp32)."""
    dev = kernel_device()
    lens, qlens = [260, 33, 90], [60, 1, 90]
    kc, vc = _pool(100, 2, 64, torch.float32, "cpu", seed=8)
    tables = _tables(lens, 100, 0, seed=8)
    q = torch.randn(sum(qlens), 6, 64, generator=torch.Generator().manual_seed(9))
    cpu = _batch(lens, qlens, tables, "cpu")
    cpu.gpu = None
    want = paged_attention(q, kc, vc, cpu, 0.125, 50)
    with using(KernelPolicy(prefill_attention=mode)):
        got = paged_attention(q.to(dev), kc.to(dev), vc.to(dev), _batch(lens, qlens, tables, dev), 0.125, 50)
    torch.testing.assert_close(got.cpu(), want, rtol=2e-5, atol=2e-5)


# ------------------------------------------------------------------ quantized output

def _decode_step(hq, hk, d, lens, dtype, dev, seed=0):
    """Pool, scattered tables, lengths and one query per row."""
    blocks = max(200, len(lens) * (-(-max(lens) // BS) + 2))
    kc, vc = _pool(blocks, hk, d, dtype, dev, seed)
    tables = _tables(lens, blocks, 2, seed).to(dev)
    q = torch.randn(len(lens), hq, d, generator=torch.Generator().manual_seed(seed + 7)).to(dtype).to(dev)
    return kc, vc, tables, torch.tensor(lens, dtype=torch.int32, device=dev), q


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (``torch.equal`` takes -0 for +0)."""
    ints = {2: torch.int16, 4: torch.int32}[a.element_size()]
    return a.dtype == b.dtype and torch.equal(a.view(ints), b.view(ints))


QUANT_CASES = [  # (Hq, Hk, D, lens, window, splits)
    pytest.param(9, 3, 64, [1, 37, 300, 700], None, 3, id="smollm-gqa3-d64"),
    pytest.param(32, 8, 128, [5, 1100], None, 2, id="llama8b-gqa4-d128"),
    pytest.param(4, 1, 128, [2, 64, 65, 1000], 100, 16, id="gqa4-d128-window"),
]


@pytest.mark.parametrize("hq,hk,d,lens,window,splits", QUANT_CASES)
def test_quantized_output_is_quantize_x_of_the_output(hq, hk, d, lens, window, splits):
    """``quantize=True`` (fusion ``attn_quant``): the output rows ``[B, Hq * D]`` are the bits of
    the plain call and words/d1/sums those of ``quantize_x`` of them."""
    from lodestar.kernels.triton_quant import quantize_x
    dev = kernel_device()
    kc, vc, tables, sl, q = _decode_step(hq, hk, d, lens, torch.bfloat16, dev, seed=11)
    scale = d ** -0.5
    parts = ta.num_partitions(tables.shape[1] * BS)
    B = len(lens)
    want = ta.decode_attention(q, kc, vc, tables, sl, BS, scale, window, parts, splits)
    words, d1, sums = quantize_x(want.view(B, hq * d))
    got = ta.decode_attention(q, kc, vc, tables, sl, BS, scale, window, parts, splits, quantize=True)
    assert isinstance(got, QuantizedRows) and got.shape == (B, hq * d)
    assert _same_bits(got.x, want.view(B, hq * d))
    assert torch.equal(got.words, words)
    assert _same_bits(got.d1, d1) and _same_bits(got.sums, sums)


def test_quantized_output_needs_bf16_and_whole_groups():
    dev = kernel_device()
    kc, vc = _pool(8, 1, 64, torch.float32, dev)
    tables = torch.arange(4, dtype=torch.int32, device=dev)[None]
    sl = torch.tensor([40], dtype=torch.int32, device=dev)
    with pytest.raises(ValueError, match="needs bf16"):
        ta.decode_attention(torch.ones(1, 2, 64, device=dev), kc, vc, tables, sl, BS, 0.125, quantize=True)
    kc, vc = _pool(8, 1, 48, torch.bfloat16, dev)
    with pytest.raises(ValueError, match="multiple of 32"):
        ta.decode_attention(torch.ones(1, 2, 48, dtype=torch.bfloat16, device=dev), kc, vc, tables, sl, BS, 0.125,
                            quantize=True)


def test_attention_launch_form():
    """The decode kernel's launch form: ``PDL`` 4 with programmatic dependent launch on (a
    Hopper-class GPU, policy ``pdl``), else off."""
    hopper = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9
    with using(KernelPolicy()):
        assert ta.attention_pdl() == ({"PDL": 4, "launch_pdl": True} if hopper else {"PDL": False})
    with using(KernelPolicy(pdl=False)):
        assert ta.attention_pdl() == {"PDL": False}


@pytest.mark.parametrize("window", [None, 300])
def test_dependent_launch_keeps_the_bits(window):
    """Launched early (``PDL`` 4, with the keys and values of each program's first partition
    prefetched before the wait), with sequences on both sides of ``ATTN_PDL_SHORT_KEYS`` in
    one batch: the bits of a launch without programmatic dependent launch, output and its
    quantized form. GPU only (the interpreter has neither)."""
    if not torch.cuda.is_available():
        pytest.skip("dependent launch runs on a CUDA device only")
    hq, hk, d = 32, 8, 128
    lens = [1, 77, ta.ATTN_PDL_SHORT_KEYS, ta.ATTN_PDL_SHORT_KEYS + 1, 1500]
    kc, vc, tables, sl, q = _decode_step(hq, hk, d, lens, torch.bfloat16, "cuda", seed=6)
    parts = ta.num_partitions(tables.shape[1] * BS)
    runs = []
    for policy in (KernelPolicy(pdl=False), KernelPolicy()):
        with using(policy):
            r = ta.decode_attention(q, kc, vc, tables, sl, BS, d ** -0.5, window, parts, 4, quantize=True)
        runs.append((r.x, r.words, r.d1, r.sums))
    for a, b in zip(*runs):
        assert a.dtype == b.dtype and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def test_grid_splits_and_partitions(monkeypatch):
    """``PROGRAMS_PER_SM`` decode-attention programs per SM, at most 64 per (sequence, kv head),
    at least 1; ``SHORT_PARTITION``-key partitions up to ``SHORT_CONTEXT`` keys, ``PARTITION``
    beyond."""
    cpu = torch.device("cpu")       # 4 "SMs" off the GPU
    assert ta.grid_splits(1, 2, cpu) == 8 and ta.grid_splits(64, 8, cpu) == 1
    monkeypatch.setattr(ta, "num_sms", lambda device: 132)
    assert ta.grid_splits(1, 1, cpu) == 64 and ta.grid_splits(4, 8, cpu) == 17
    assert [ta.num_partitions(n) for n in (1, 64, 65, 1024, 4096, 4097)] == [1, 1, 2, 16, 16, 17]


def test_paged_attention_quantizes_only_with_attn_quant():
    """A decode step of ``paged_attention(quantize=True)`` returns ``QuantizedRows`` (the rows
    of the plain call) with fusion ``attn_quant`` in the policy, else the plain output."""
    dev = kernel_device()
    lens = [40, 300]
    kc, vc, tables, _, q = _decode_step(8, 2, 64, lens, torch.bfloat16, dev, seed=5)
    batch = _batch(lens, [1, 1], tables.cpu(), dev)
    plain = paged_attention(q, kc, vc, batch, 0.125)
    with using(KernelPolicy()):
        got = paged_attention(q, kc, vc, batch, 0.125, None, True)
    assert isinstance(got, QuantizedRows) and _same_bits(got.x, plain.view(len(lens), -1))
    with using(KernelPolicy().with_fusions(set(FUSIONS) - {"attn_quant"})):
        got = paged_attention(q, kc, vc, batch, 0.125, None, True)
    assert isinstance(got, torch.Tensor) and _same_bits(got, plain)
