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


@pytest.mark.parametrize("part", ["16", "32", "128", "512", "1024"])
def test_decode_with_other_short_partitions_matches_reference(part, monkeypatch):
    """LODESTAR_ATTN_SHORT_PARTITION: other partitions below SHORT_CONTEXT keys (one for
    every short sequence at 1024; 16 and 32: one masked 64-key step each), the long-context
    partitions beyond it unchanged."""
    monkeypatch.setenv("LODESTAR_ATTN_SHORT_PARTITION", part)
    assert ta.num_partitions(1024) == max(1024 // int(part), 1024 // ta.PARTITION)
    assert ta.num_partitions(4096) == max(1024 // int(part), 4096 // ta.PARTITION)
    dev = kernel_device()
    kc, vc = _pool(300, 8, 128, torch.bfloat16, dev)
    lens = [5, 384, 1024, 1100]
    tables = _tables(lens, 300, 2).to(dev)
    sl = torch.tensor(lens, dtype=torch.int32, device=dev)
    q = torch.randn(len(lens), 32, 128, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16).to(dev)
    got = ta.decode_attention(q, kc, vc, tables, sl, BS, 128 ** -0.5).float()
    want = ta.decode_attention_ref(q, kc, vc, tables, sl, BS, 128 ** -0.5).float()
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


def test_short_partition_setting_is_checked(monkeypatch):
    monkeypatch.delenv("LODESTAR_ATTN_SHORT_PARTITION", raising=False)
    assert ta.short_partition() == ta.SHORT_PARTITION
    for bad in ("100", "0", "8", "48", "96", "2048", "x"):
        monkeypatch.setenv("LODESTAR_ATTN_SHORT_PARTITION", bad)
        with pytest.raises(ValueError, match="LODESTAR_ATTN_SHORT_PARTITION"):
            ta.short_partition()


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


def test_prefill_kernel_setting(monkeypatch):
    monkeypatch.delenv("LODESTAR_PREFILL_ATTN", raising=False)
    assert ta.prefill_kernel_mode() == "paged"
    monkeypatch.setenv("LODESTAR_PREFILL_ATTN", "sdpa")
    assert ta.prefill_kernel_mode() == "sdpa"
    monkeypatch.setenv("LODESTAR_PREFILL_ATTN", "flash")
    with pytest.raises(ValueError, match="LODESTAR_PREFILL_ATTN"):
        ta.prefill_kernel_mode()
    assert ta.prefill_rows(4, 128) == (32, 4) and ta.prefill_rows(3, 64) == (32, 4)
    assert ta.prefill_rows(1, 256) == (64, 1) and ta.prefill_rows(16, 128) == (8, 16)


@pytest.mark.parametrize("mode", ["paged", "sdpa"])
def test_prefill_paths_agree(mode, monkeypatch):
    """Both prefill forms of ``paged_attention`` on a step with cached prefixes and a
    single-token row equal the CPU path (fp32)."""
    monkeypatch.setenv("LODESTAR_PREFILL_ATTN", mode)
    dev = kernel_device()
    lens, qlens = [260, 33, 90], [60, 1, 90]
    kc, vc = _pool(100, 2, 64, torch.float32, "cpu", seed=8)
    tables = _tables(lens, 100, 0, seed=8)
    q = torch.randn(sum(qlens), 6, 64, generator=torch.Generator().manual_seed(9))
    cpu = _batch(lens, qlens, tables, "cpu")
    cpu.gpu = None
    want = paged_attention(q, kc, vc, cpu, 0.125, 50)
    got = paged_attention(q.to(dev), kc.to(dev), vc.to(dev), _batch(lens, qlens, tables, dev), 0.125, 50)
    torch.testing.assert_close(got.cpu(), want, rtol=2e-5, atol=2e-5)


# ------------------------------------------------------------------ decode fusions

def _rope_tables(d: int, n: int, dev: str):
    from lodestar.layers.rotary import RotaryEmbedding
    rope = RotaryEmbedding(d, 10000.0, n)
    return rope.cos.to(dev), rope.sin.to(dev)


def _decode_step(hq, hk, d, lens, dtype, dev, seed=0):
    """Pool, scattered tables and this step's un-rotated q/k/v of one new token per row."""
    blocks = max(200, len(lens) * (-(-max(lens) // BS) + 2))
    kc, vc = _pool(blocks, hk, d, dtype, dev, seed)
    tables = _tables(lens, blocks, 2, seed).to(dev)
    g = torch.Generator().manual_seed(seed + 7)
    B = len(lens)
    q, k, v = (torch.randn(B, h, d, generator=g) for h in (hq, hk, hk))
    for x in (q, k):    # signed zeros: -0 in the first half with a positive partner
        x[..., 0] = -0.0
        x[..., d // 2] = x[..., d // 2].abs() + 0.5
    q, k, v = (x.to(dtype).to(dev) for x in (q, k, v))
    pos = torch.tensor(lens, device=dev) - 1
    t = tables.long()
    slots = t[torch.arange(B, device=dev), pos // BS] * BS + pos % BS
    return kc, vc, tables, torch.tensor(lens, dtype=torch.int32, device=dev), q, k, v, pos, slots


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (``torch.equal`` takes -0 for +0)."""
    ints = {2: torch.int16, 4: torch.int32}[a.element_size()]
    return a.dtype == b.dtype and torch.equal(a.view(ints), b.view(ints))


FUSED_CASES = [  # (Hq, Hk, D, lens, window, splits): GQA groups 3 (SmolLM2), 4 (Llama-8B), 1
    pytest.param(9, 3, 64, [1, 37, 300, 700], None, 3, id="smollm-gqa3"),
    pytest.param(32, 8, 128, [5, 1100], None, 2, id="llama8b-gqa4-long"),
    pytest.param(4, 4, 64, [2, 64, 65, 1000], 100, 16, id="gqa1-window"),
    pytest.param(6, 2, 64, [129, 3], None, 1, id="gqa3-one-split"),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("hq,hk,d,lens,window,splits", FUSED_CASES)
def test_fused_decode_is_bit_identical(hq, hk, d, lens, window, splits, dtype):
    """RoPE + KV store (``attn_rope``) and the combine of the partials (``attn_reduce``) inside
    the partial kernel, together or alone, give the bits of rope_ + store + the two unfused
    kernels: output and both caches (every slot); the counters are back at 0 after each call."""
    from lodestar.kernels import triton_fused as tf
    dev = kernel_device()
    kc, vc, tables, sl, q, k, v, pos, slots = _decode_step(hq, hk, d, lens, dtype, dev)
    cos, sin = _rope_tables(d, max(lens) + 1, dev)
    scale = d ** -0.5
    parts = ta.num_partitions(tables.shape[1] * BS)
    # unfused: rope_ rotates q, k in place and stores k, v; then partial + reduce kernels
    kc_ref, vc_ref, q_ref, k_ref = kc.clone(), vc.clone(), q.clone(), k.clone()
    tf.rope_(q_ref, k_ref, pos, cos, sin, d, v=v, k_cache=kc_ref, v_cache=vc_ref, slots=slots)
    want = ta.decode_attention(q_ref, kc_ref, vc_ref, tables, sl, BS, scale, window, parts, splits, fuse_reduce=False)
    new = ta.NewTokens(k, v, pos, slots, cos, sin)
    counters = torch.zeros(len(lens) * hk, dtype=torch.int32, device=dev)
    for fuse_reduce in (True, True, False):     # twice in a row: the counters must be back at 0
        kc2, vc2 = kc.clone(), vc.clone()
        got = ta.decode_attention(q, kc2, vc2, tables, sl, BS, scale, window, parts, splits, new=new,
                                  fuse_reduce=fuse_reduce, counters=counters)
        assert _same_bits(got, want), fuse_reduce
        assert _same_bits(kc2, kc_ref) and _same_bits(vc2, vc_ref), fuse_reduce
        assert not counters.any()
    # the combine alone, on the caches rope_ wrote (default per-device counters)
    got = ta.decode_attention(q_ref, kc_ref, vc_ref, tables, sl, BS, scale, window, parts, splits, fuse_reduce=True)
    assert _same_bits(got, want)
    assert not ta.decode_counters(torch.device(dev)).any()


def test_fused_decode_matches_reference():
    """The fused kernel against the torch reference (rotation by rope_ref, its keys in a
    copy of the cache)."""
    from lodestar.kernels import triton_fused as tf
    dev = kernel_device()
    hq, hk, d, lens = 8, 2, 64, [1, 200, 1030]
    kc, vc, tables, sl, q, k, v, pos, slots = _decode_step(hq, hk, d, lens, torch.float32, dev, seed=3)
    cos, sin = _rope_tables(d, max(lens) + 1, dev)
    got = ta.decode_attention(q, kc, vc, tables, sl, BS, 0.125, splits=4, new=ta.NewTokens(k, v, pos, slots, cos, sin),
                              fuse_reduce=True)
    qr, kr = tf.rope_ref(q, k, pos, cos, sin, d)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    kc_ref[slots], vc_ref[slots] = kr, v
    # rope_ref's separate multiplies and adds may round differently from the kernels' fused
    # multiply-adds on a GPU (test_fused_decode_is_bit_identical holds the fused kernel to rope_)
    assert torch.equal(vc, vc_ref)
    torch.testing.assert_close(kc, kc_ref, rtol=1e-6, atol=1e-6)
    want = ta.decode_attention_ref(qr, kc_ref, vc_ref, tables, sl, BS, 0.125)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_new_tokens_only_for_fusable_decode_steps(monkeypatch):
    """``decode_new_tokens`` hands the step to the fused kernel only for a decode step with
    ``attn_rope`` on and a full rotary dim; paged_attention with it equals rotate_and_store +
    paged_attention (the layer's two paths)."""
    from lodestar.layers.attention import decode_new_tokens
    from lodestar.layers.rotary import RotaryEmbedding
    dev = kernel_device()
    lens = [40, 300]
    kc, vc, tables, sl, q, k, v, pos, slots = _decode_step(8, 2, 64, lens, torch.bfloat16, dev, seed=5)
    rope = RotaryEmbedding(64, 10000.0, 512).to(dev)
    batch = _batch(lens, [1, 1], tables.cpu(), dev)
    monkeypatch.setenv("LODESTAR_FUSE", "1")
    new = decode_new_tokens(batch, pos, q, k, v, kc, vc, rope)
    assert new is not None
    kc2, vc2 = kc.clone(), vc.clone()
    got = paged_attention(q.clone(), kc2, vc2, batch, 0.125, None, new)
    monkeypatch.setenv("LODESTAR_FUSE", "attn_reduce")
    assert decode_new_tokens(batch, pos, q, k, v, kc, vc, rope) is None
    q_rot = rope.rotate_and_store(pos, q.clone(), k.clone(), v, kc, vc, batch.gpu.slot_mapping)
    want = paged_attention(q_rot, kc, vc, batch, 0.125)
    assert _same_bits(got, want) and _same_bits(kc2, kc) and _same_bits(vc2, vc)
    monkeypatch.setenv("LODESTAR_FUSE", "1")
    partial = RotaryEmbedding(32, 10000.0, 512).to(dev)
    assert decode_new_tokens(batch, pos, q, k, v, kc, vc, partial) is None           # rotary dim < head dim
    prefill = _batch([40, 300], [2, 1], tables.cpu(), dev)
    assert decode_new_tokens(prefill, pos, q, k, v, kc, vc, rope) is None           # not a decode step


QUANT_CASES = [  # (Hq, Hk, D, lens, window, splits)
    pytest.param(9, 3, 64, [1, 37, 300, 700], None, 3, id="smollm-gqa3-d64"),
    pytest.param(32, 8, 128, [5, 1100], None, 2, id="llama8b-gqa4-d128"),
    pytest.param(4, 1, 128, [2, 64, 65, 1000], 100, 16, id="gqa4-d128-window"),
]


@pytest.mark.parametrize("hq,hk,d,lens,window,splits", QUANT_CASES)
def test_quantized_output_is_quantize_x_of_the_output(hq, hk, d, lens, window, splits):
    """``quantize=True`` (fusion ``attn_quant``): the output rows ``[B, Hq * D]`` are the bits of
    the plain call and words/d1/sums those of ``quantize_x`` of them, whether the reduce
    kernel or the fused combine (``attn_reduce``) writes them, with or without ``attn_rope``."""
    from lodestar.kernels import triton_fused as tf
    from lodestar.kernels import triton_quant as tq
    dev = kernel_device()
    kc, vc, tables, sl, q, k, v, pos, slots = _decode_step(hq, hk, d, lens, torch.bfloat16, dev, seed=11)
    cos, sin = _rope_tables(d, max(lens) + 1, dev)
    scale = d ** -0.5
    parts = ta.num_partitions(tables.shape[1] * BS)
    B = len(lens)
    q_rot, k_rot, kc_rot, vc_rot = q.clone(), k.clone(), kc.clone(), vc.clone()
    tf.rope_(q_rot, k_rot, pos, cos, sin, d, v=v, k_cache=kc_rot, v_cache=vc_rot, slots=slots)
    want = ta.decode_attention(q_rot, kc_rot, vc_rot, tables, sl, BS, scale, window, parts, splits, fuse_reduce=False)
    words, d1, sums = tq.quantize_x(want.view(B, hq * d))
    for fuse_reduce in (False, True):
        for rope in (False, True):
            if rope:
                kc2, vc2 = kc.clone(), vc.clone()
                got = ta.decode_attention(q, kc2, vc2, tables, sl, BS, scale, window, parts, splits,
                                          new=ta.NewTokens(k, v, pos, slots, cos, sin), fuse_reduce=fuse_reduce,
                                          quantize=True)
                assert _same_bits(kc2, kc_rot) and _same_bits(vc2, vc_rot)
            else:
                got = ta.decode_attention(q_rot, kc_rot, vc_rot, tables, sl, BS, scale, window, parts, splits,
                                          fuse_reduce=fuse_reduce, quantize=True)
            case = (fuse_reduce, rope)
            assert isinstance(got, tq.QuantizedRows) and got.shape == (B, hq * d), case
            assert _same_bits(got.x, want.view(B, hq * d)), case
            assert torch.equal(got.words, words), case
            assert _same_bits(got.d1, d1) and _same_bits(got.sums, sums), case
    assert not ta.decode_counters(torch.device(dev)).any()


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


def test_attention_launch_switch(monkeypatch):
    """LODESTAR_ATTN_PDL: the decode kernel's own launch form (default ``short``), never on
    without pdl()."""
    hopper = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9
    monkeypatch.delenv("LODESTAR_PDL", raising=False)
    for env, want in (("", {"PDL": 4, "launch_pdl": True}), ("wait", {"PDL": 2, "launch_pdl": True}),
                      ("1", {"PDL": True, "launch_pdl": True}), ("short", {"PDL": 4, "launch_pdl": True}),
                      ("0", {"PDL": False})):
        monkeypatch.setenv("LODESTAR_ATTN_PDL", env)
        assert ta.attention_pdl() == (want if hopper else {"PDL": False}), env
    monkeypatch.setenv("LODESTAR_PDL", "0")
    monkeypatch.setenv("LODESTAR_ATTN_PDL", "wait")
    assert ta.attention_pdl() == {"PDL": False}
    monkeypatch.setenv("LODESTAR_ATTN_PDL", "early")
    with pytest.raises(ValueError, match="LODESTAR_ATTN_PDL"):
        ta.attention_pdl()


def test_kv_prefetch_switch(monkeypatch):
    monkeypatch.setenv("LODESTAR_KV_PREFETCH", "on")
    with pytest.raises(ValueError, match="LODESTAR_KV_PREFETCH"):
        ta.kv_prefetch()
    monkeypatch.setenv("LODESTAR_KV_PREFETCH", "0")
    assert not ta.kv_prefetch()
    monkeypatch.delenv("LODESTAR_KV_PREFETCH")
    assert ta.kv_prefetch()


@pytest.mark.parametrize("window", [None, 300])
def test_kv_prefetch_keeps_the_bits(window, monkeypatch):
    """Keys and values prefetched before the wait, with and without the fused combine: the
    bits without the prefetch. GPU only (the interpreter has no prefetch)."""
    if not torch.cuda.is_available():
        pytest.skip("the prefetch runs on a CUDA device only")
    hq, hk, d, lens = 32, 8, 128, [1, 77, 300, 1500]
    kc, vc, tables, sl, q, k, v, pos, slots = _decode_step(hq, hk, d, lens, torch.bfloat16, "cuda", seed=5)
    parts = ta.num_partitions(tables.shape[1] * BS)
    for fuse_reduce in (False, True):
        runs = []
        for env in ("0", "1"):
            monkeypatch.setenv("LODESTAR_KV_PREFETCH", env)
            runs.append(ta.decode_attention(q, kc, vc, tables, sl, BS, d ** -0.5, window, parts, 4,
                                            fuse_reduce=fuse_reduce))
        assert _same_bits(runs[0], runs[1]), fuse_reduce


def test_attention_launch_forms_keep_the_bits(monkeypatch):
    """Every LODESTAR_ATTN_PDL form gives the bits of ``wait``, with sequences on both sides
    of ``ATTN_PDL_SHORT_KEYS`` in one batch (form ``short``), with and without the fused
    combine. GPU only (off a Hopper-class GPU every form is no dependent launch)."""
    if not torch.cuda.is_available():
        pytest.skip("dependent launch runs on a CUDA device only")
    hq, hk, d = 32, 8, 128
    lens = [1, 77, ta.ATTN_PDL_SHORT_KEYS, ta.ATTN_PDL_SHORT_KEYS + 1, 1500]
    kc, vc, tables, sl, q, k, v, pos, slots = _decode_step(hq, hk, d, lens, torch.bfloat16, "cuda", seed=6)
    parts = ta.num_partitions(tables.shape[1] * BS)
    for fuse_reduce in (False, True):
        runs = []
        for env in ("wait", "1", "short", "0"):
            monkeypatch.setenv("LODESTAR_ATTN_PDL", env)
            runs.append(ta.decode_attention(q, kc, vc, tables, sl, BS, d ** -0.5, None, parts, 4,
                                            fuse_reduce=fuse_reduce))
        assert all(_same_bits(runs[0], r) for r in runs[1:]), fuse_reduce


def test_reduce_early_switch_keeps_the_bits(monkeypatch):
    """LODESTAR_REDUCE_EARLY: 0 or 1 (unset: 0); the reduce kernel letting the next kernel
    launch before its wait changes no bit of the output or its quantized form."""
    monkeypatch.setenv("LODESTAR_REDUCE_EARLY", "yes")
    with pytest.raises(ValueError, match="LODESTAR_REDUCE_EARLY"):
        ta.reduce_early()
    monkeypatch.delenv("LODESTAR_REDUCE_EARLY")
    assert not ta.reduce_early()
    dev = kernel_device()
    hq, hk, d, lens = 8, 2, 64, [1, 77, 300]
    kc, vc, tables, sl, q, k, v, pos, slots = _decode_step(hq, hk, d, lens, torch.bfloat16, dev, seed=9)
    parts = ta.num_partitions(tables.shape[1] * BS)
    runs = []
    for env in ("0", "1"):
        monkeypatch.setenv("LODESTAR_REDUCE_EARLY", env)
        assert ta.reduce_early() == (env == "1")
        r = ta.decode_attention(q, kc, vc, tables, sl, BS, d ** -0.5, None, parts, 4, fuse_reduce=False,
                                quantize=True)
        runs.append((r.x, r.words, r.d1, r.sums))
    for a, b in zip(*runs):
        assert a.dtype == b.dtype and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def test_grid_splits_follow_the_programs_per_sm_setting(monkeypatch):
    """``LODESTAR_ATTN_PROGRAMS_PER_SM`` (default 4) sets how many decode-attention programs
    a step asks for; at most 64 per (sequence, kv head), at least 1."""
    cpu = torch.device("cpu")       # 4 "SMs" off the GPU
    monkeypatch.delenv("LODESTAR_ATTN_PROGRAMS_PER_SM", raising=False)
    assert ta.grid_splits(1, 2, cpu) == 8 and ta.grid_splits(64, 8, cpu) == 1
    monkeypatch.setenv("LODESTAR_ATTN_PROGRAMS_PER_SM", "1")
    assert ta.grid_splits(1, 2, cpu) == 2
    monkeypatch.setenv("LODESTAR_ATTN_PROGRAMS_PER_SM", "1000")
    assert ta.grid_splits(1, 1, cpu) == 64
    for bad in ("0", "x", "-1"):
        monkeypatch.setenv("LODESTAR_ATTN_PROGRAMS_PER_SM", bad)
        with pytest.raises(ValueError, match="LODESTAR_ATTN_PROGRAMS_PER_SM"):
            ta.grid_splits(1, 2, cpu)
