"""Fused RMSNorm (+ residual), RoPE and gated activations against torch references; the L2
weight prefetch those kernels can issue; the embedding-row kernel."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from triton_helpers import kernel_device

from lodestar.kernels import launch
from lodestar.kernels import triton_fused as tf
from lodestar.kernels.policy import MIB, KernelPolicy, using


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


# ------------------------------------------------------------------ weight prefetch

def test_weight_prefetch_plan_takes_the_largest_arrays_whole_when_they_fit():
    codes, scales, mins, tiny = (1 << 20, 1_600_000), (1 << 30, 100_000), (3 << 30, 100_008), (5 << 30, 64)
    ranges = [tiny, scales, codes, mins]
    total = sum(n for _, n in ranges)
    lanes = 33 * 4 * 256
    line = launch.PREFETCH_LINE
    for form in (line, 1):      # 128-byte lines (what prefetch_launch asks for), bulk prefetches
        extra, *args = launch.prefetch_plan(ranges, total, sms=132, programs_per_row=4, lanes=256, form=form)
        assert extra == 33 and len(args) == 3 * launch.PREFETCH_RANGES
        triples = [tuple(args[i:i + 3]) for i in range(0, len(args), 3)]
        assert [t[:2] for t in triples] == [codes, (mins[0], 100_000), scales]   # largest first, whole 16s
        for _, n, step in triples:                                              # spread over every lane
            if form == 1:       # a chunk of 16-byte multiples a lane
                assert step % 16 == 0 and n <= step * lanes < n + 16 * lanes
            else:               # lines a lane
                assert n <= step * lanes * line < n + lanes * line
    assert launch.prefetch_plan(ranges, total, sms=132, programs_per_row=4, lanes=256) == \
        launch.prefetch_plan(ranges, total, sms=132, programs_per_row=4, lanes=256, form=line)    # the default
    # over the limit: nothing; an unaligned array is skipped
    assert launch.prefetch_plan(ranges, total - 1, sms=132, programs_per_row=4, lanes=256)[1:] == (0,) * 9
    _, *args = launch.prefetch_plan([codes, (scales[0] + 8, scales[1])], 1 << 40, sms=132, programs_per_row=1,
                                    lanes=128)
    assert args[:3] == [codes[0], codes[1], -(-codes[1] // (132 * 128 * line))] and args[3:] == [0] * 6
    _, *args = launch.prefetch_plan([codes], 1 << 40, sms=132, programs_per_row=1, lanes=128, form=1)
    assert args[:3] == [codes[0], codes[1], (-(-codes[1] // (132 * 128)) + 15) // 16 * 16]


def test_weight_prefetch_limit_and_where_it_applies():
    """The policy's ``weight_prefetch_bytes`` (its switch: test_policy.py) bounds what a small
    kernel asks for; never for CPU arrays, without arrays, or with the limit 0."""
    cpu = [torch.zeros(1 << 16, dtype=torch.uint8)]
    none = (0, (0,) * (3 * launch.PREFETCH_RANGES), 0)
    for limit in (16 * MIB, 0):
        with using(KernelPolicy(weight_prefetch_bytes=limit)):
            assert launch.prefetch_launch(cpu, 1, 4, 256) == none                  # CPU: never
            assert launch.prefetch_launch(None, 1, 4, 256) == none
            assert launch.prefetch_launch([], 1, 4, 256) == none
    with using(KernelPolicy(side_prefetch_bytes=16 * MIB)):
        assert launch.side_prefetch(cpu) is None                                   # a no-op off the GPU
        assert launch.side_prefetch(None) is None
    if torch.cuda.is_available() and not launch.interpreted():
        gpu = [torch.zeros(1 << 20, dtype=torch.uint8, device="cuda")]             # 1 MiB
        with using(KernelPolicy(weight_prefetch_bytes=2 * MIB)):
            extra, args, form = launch.prefetch_launch(gpu, 1, 4, 256)
            assert extra > 0 and args[:2] == (gpu[0].data_ptr(), 1 << 20) and form == launch.PREFETCH_LINE
            assert launch.prefetch_launch(gpu, launch.SMALL_M_MAX + 1, 4, 256) == none   # not a decode step
        with using(KernelPolicy(weight_prefetch_bytes=MIB // 2)):
            assert launch.prefetch_launch(gpu, 1, 4, 256) == none                  # over the limit
        with using(KernelPolicy(weight_prefetch_bytes=0)):
            assert launch.prefetch_launch(gpu, 1, 4, 256) == none


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the weight prefetch runs on the GPU only")
def test_weight_prefetch_changes_no_result():
    g = torch.Generator().manual_seed(5)
    arrays = [torch.randint(0, 255, (6 << 20,), generator=g, dtype=torch.uint8).cuda(),
              torch.randn(1 << 18, generator=g).half().cuda(), torch.randn(999, generator=g).cuda()]
    x = torch.randn(1, 4096, generator=g).bfloat16().cuda()
    r = torch.randn(1, 4096, generator=g).bfloat16().cuda()
    w = (torch.rand(4096, generator=g) + 0.5).cuda()
    cos, sin = _rope_tables(128, "cuda")
    qkv0 = torch.randn(1, 48 * 128, generator=g).bfloat16().cuda()
    gu = (torch.randn(1, 2 * 14336, generator=g) * 4).bfloat16().cuda()

    def run():
        y, h = tf.rms_norm(x, w, 1e-5, residual=r, quantize=True, prefetch=arrays)
        qkv = qkv0.clone()
        q, k, v = qkv[:, :4096].view(1, 32, 128), qkv[:, 4096:5120].view(1, 8, 128), qkv[:, 5120:].view(1, 8, 128)
        kc = torch.zeros(16, 8, 128, dtype=torch.bfloat16, device="cuda")
        vc = torch.zeros_like(kc)
        tf.rope_(q, k, torch.tensor([9], device="cuda"), cos, sin, 128, v=v, k_cache=kc, v_cache=vc,
                 slots=torch.tensor([3], device="cuda"), prefetch=arrays)
        a = tf.silu_mul(gu[:, :14336], gu[:, 14336:], quantize=True, prefetch=arrays)
        torch.cuda.synchronize()
        return [y.x, y.words, y.d1, y.sums, h, qkv, kc, vc, a.x, a.words, a.d1, a.sums]

    with using(KernelPolicy(weight_prefetch_bytes=0)):
        ref = run()
    for mib in (7, 64):
        with using(KernelPolicy(weight_prefetch_bytes=mib * MIB)):
            assert launch.prefetch_launch(arrays, 1, 4, 256)[0] > 0
            for got, want in zip(run(), ref):
                assert torch.equal(got, want)


def test_embedding_rows_copies_the_table_rows():
    """``embedding_rows`` gives ``F.embedding``'s rows (bf16 and fp32 tables, a table with a
    row stride past its width, ids in any shape; an id outside the table: zeros)."""
    from lodestar.kernels.triton_fused import EMBED_BLOCK, embedding_rows
    dev = kernel_device()
    g = torch.Generator().manual_seed(3)
    for dtype, d in ((torch.bfloat16, 2 * EMBED_BLOCK + 40), (torch.float32, 576)):
        wide = torch.randn(50, d + 8, generator=g).to(dtype).to(dev)
        table = wide[:, :d]                                  # rows 8 elements apart
        ids = torch.tensor([[3, 0, 49], [7, 7, 12]], device=dev)
        got = embedding_rows(ids, table)
        assert got.shape == (2, 3, d) and torch.equal(got, F.embedding(ids, table))
        bad = embedding_rows(torch.tensor([50, -1, 4], device=dev), table)
        assert (bad[:2] == 0).all() and torch.equal(bad[2], table[4])
    with pytest.raises(ValueError, match="int64 ids"):
        embedding_rows(ids.int(), table)
