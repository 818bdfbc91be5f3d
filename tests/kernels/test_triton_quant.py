"""Triton quantized matmul and dequantization against their torch references.

Runs on a CUDA device, or on the CPU under TRITON_INTERPRET=1 (see triton_helpers).
The repacked layout itself is checked on every machine.
"""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from lodestar.kernels import dequant as dq
from lodestar.kernels import gemv_tiling as gt
from lodestar.kernels import launch
from lodestar.kernels import quant_layout as ql
from lodestar.kernels import triton_quant as tq
from lodestar.kernels.dequant import dequantize
from lodestar.kernels.policy import KernelPolicy, using

from triton_helpers import kernel_device, random_gguf

TYPES = [pytest.param(t, id=t.name) for t in ql.GPU_QUANT_TYPES]


@pytest.mark.parametrize("qtype", TYPES)
def test_repack_is_exact(qtype):
    data = random_gguf(qtype, 24, 512, seed=3)
    pw = ql.pack(qtype, data, 24, 512)
    want = dequantize(data, qtype, (24, 512))
    assert torch.equal(ql.dequantize_packed_ref(pw).view(torch.int32), want.view(torch.int32))
    gguf_bytes = data.numel()
    assert pw.nbytes <= gguf_bytes * 1.03    # the same bits, a few bytes of alignment at most


@pytest.mark.parametrize("qtype", TYPES)
def test_dequantize_kernel_bit_identical(qtype):
    dev = kernel_device()
    data = random_gguf(qtype, 40, 1024, seed=5)
    pw = ql.pack(qtype, data.to(dev), 40, 1024)
    want = dequantize(data, qtype, (40, 1024))
    got = tq.dequantize_packed(pw, torch.float32).cpu()
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    if dev == "cuda":   # the interpreter rounds fp32 -> bf16 by truncation; the GPU to nearest even
        assert torch.equal(tq.dequantize_packed(pw, torch.bfloat16).cpu(), want.to(torch.bfloat16))


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("m,n,k", [(1, 80, 512), (33, 200, 2048)])
def test_small_m_matmul_matches_reference(qtype, m, n, k):
    dev = kernel_device()
    data = random_gguf(qtype, n, k, seed=m + n)
    pw = ql.pack(qtype, data.to(dev), n, k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
    got = tq.quant_matmul(x.to(dev), pw, torch.float32).cpu()
    # Exact weights; x is split into two int8 terms (error <= amax/64516 per element)
    # and fp32 summation order differs from the reference.
    want = F.linear(x.float(), dequantize(data, qtype, (n, k)))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))


@pytest.mark.parametrize("qtype", [pytest.param(ql.T.Q4_K, id="Q4_K"), pytest.param(ql.T.Q8_0, id="Q8_0")])
def test_rows_do_not_depend_on_the_batch(qtype):
    """A row's output is bit-identical whatever rows share its batch (M = 1 .. 64)."""
    dev = kernel_device()
    n, k = 128, 1024
    pw = ql.pack(qtype, random_gguf(qtype, n, k, seed=9).to(dev), n, k)
    x = torch.randn(64, k, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16).to(dev)
    alone = tq.quant_matmul(x[:1], pw)
    for m in (2, 7, 16, 17, 40, 64):
        assert torch.equal(tq.quant_matmul(x[:m], pw)[:1], alone), m


@pytest.mark.parametrize("qtype", TYPES)
def test_split_k_and_partial_tiles_match_reference(qtype):
    """K split in 4 (6 groups each: the second tile of 8 is partly masked), 5 row blocks."""
    dev = kernel_device()
    n, k = 75, 768
    data = random_gguf(qtype, n, k, seed=11)
    pw = ql.pack(qtype, data.to(dev), n, k)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    cfg = gt.GemvConfig(block_n=16, tile_groups=8, split_k=4, num_warps=4)
    got = tq.quant_matmul(x.to(dev), pw, torch.float32, config=cfg).cpu()
    want = F.linear(x.float(), dequantize(data, qtype, (n, k)))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
    # a row's bits do not depend on the rows beside it
    alone = tq.quant_matmul(x[1:2].to(dev), pw, torch.float32, config=cfg).cpu()
    assert torch.equal(got[1:2], alone)


def test_large_m_path_dequantizes_then_matmuls():
    dev = kernel_device()
    qtype, n, k, m = ql.T.Q4_0, 64, 512, ql.SMALL_M_MAX + 6
    data = random_gguf(qtype, n, k, seed=2)
    pw = ql.pack(qtype, data.to(dev), n, k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    got = tq.matmul(x.to(dev), pw).float().cpu()
    want = F.linear(x.float(), dequantize(data, qtype, (n, k)).to(torch.bfloat16).float())
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * float(want.abs().max()))


def test_unsupported_type_names_the_supported_ones():
    with pytest.raises(ValueError, match="no GPU kernel for Q3_K; kernels exist for Q4_0, Q4_1, Q8_0"):
        ql.pack(ql.T.Q3_K, torch.zeros(1, 110, dtype=torch.uint8), 1, 256)



# Tilings of every form the kernels still have: the group-tile kernel (rows of 16 and 32) and
# the word-tile kernel (plain loop, unrolled, next tile loaded ahead; other row, warp and
# tile counts).
FORMS = {
    "groups": gt.GemvConfig(16, 8, 2, 4),
    "groups_bn32": gt.GemvConfig(32, 8, 2, 4),
    "words": gt.GemvConfig(16, 32, 2, 4, words=True),
    "words_unroll": gt.GemvConfig(16, 32, 2, 4, words=True, unroll=True),
    "words_prefetch": gt.GemvConfig(16, 32, 2, 4, words=True, prefetch=True),
    "words_bn8": gt.GemvConfig(8, 32, 2, 4, words=True),
    "words_bn32_w8": gt.GemvConfig(32, 32, 2, 8, words=True),
    "words_tg16": gt.GemvConfig(16, 16, 2, 4, words=True),
}


@pytest.mark.parametrize("form", list(FORMS), ids=list(FORMS))
@pytest.mark.parametrize("qtype", TYPES)
def test_tiling_forms_match_reference_and_batch(qtype, form):
    """Every tiling form over a K split in 2 (12 groups each: the tile is partly masked) and a
    partial row block, the split summed in the kernel: within the reference's tolerance, a
    row alone gives the bits it gives in a batch of 3, and the split's tile counters end at 0."""
    dev = kernel_device()
    n, k = 40, 768
    data = random_gguf(qtype, n, k, seed=13)
    pw = ql.pack(qtype, data.to(dev), n, k)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    cfg = FORMS[form]
    with using(KernelPolicy()):                     # every fusion, split_sum among them
        got = tq.quant_matmul(x.to(dev), pw, torch.float32, config=cfg).cpu()
        alone = tq.quant_matmul(x[1:2].to(dev), pw, torch.float32, config=cfg).cpu()
    want = F.linear(x.float(), dequantize(data, qtype, (n, k)))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
    assert torch.equal(got[1:2].view(torch.int32), alone.view(torch.int32))
    assert not pw.tile_counters.any()


def test_gemv_config_takes_a_full_override_or_a_table(tmp_path):
    """Policy ``gemv`` (one tiling for every shape) before policy ``gemv_table`` (a file's
    ``TYPE:n,k`` entry, then its untyped ``n,k`` one) before the rule; ``off`` and the CPU
    without a file: the rule. Tiling texts round-trip; a bad one is refused."""
    dev = torch.device("cpu")
    table = tmp_path / "gemv.json"
    table.write_text('{"table": {"4096,4096": "32,8,2,8", "Q4_K:4096,4096": "16,16,1,2,0,1,1"}}')
    with using(KernelPolicy(gemv_table=str(table))):
        assert gt.gemv_config(4096, 4096, dev) == gt.GemvConfig(32, 8, 2, 8)
        assert gt.gemv_config(4096, 4096, dev, ql.T.Q4_0) == gt.GemvConfig(32, 8, 2, 8)
        assert gt.gemv_config(4096, 4096, dev, ql.T.Q4_K) == gt.GemvConfig(16, 16, 1, 2, unroll=True, words=True)
        assert gt.gemv_config(6144, 4096, dev) == gt.default_gemv_config(6144, 4096, dev)   # not in the table
    with using(KernelPolicy(gemv_table=str(table), gemv="16,16,1,4")):
        assert gt.gemv_config(4096, 4096, dev, ql.T.Q4_K) == gt.GemvConfig(16, 16, 1, 4)
    for pol in (KernelPolicy(gemv_table="off"), KernelPolicy()):
        with using(pol):
            assert gt.gemv_config(4096, 4096, dev, ql.T.Q4_K) == gt.default_gemv_config(4096, 4096, dev, ql.T.Q4_K)
    for cfg in (gt.GemvConfig(32, 8, 4, 8), gt.GemvConfig(8, 16, 1, 2, prefetch=True, words=True),
                gt.GemvConfig(16, 16, 2, 4, unroll=True, words=True), gt.GemvConfig(64, 16, 1, 4, words=True, maxnreg=128),
                gt.GemvConfig(16, 16, 1, 4, maxnreg=96)):
        assert gt.parse_gemv_config(gt.config_text(cfg)) == cfg
    assert gt.parse_gemv_config("64,16,1,4,0,0,1,128") == gt.GemvConfig(64, 16, 1, 4, words=True, maxnreg=128)
    with pytest.raises(ValueError, match="set one"):
        gt.GemvConfig(16, 16, 1, 4, prefetch=True, unroll=True, words=True)
    with pytest.raises(ValueError, match="word-tile kernel"):
        gt.parse_gemv_config("16,16,1,4,1")                    # prefetch of the group-tile kernel: gone
    with pytest.raises(ValueError, match="maxnreg"):
        gt.parse_gemv_config("64,16,1,4,0,0,1,300")
    with pytest.raises(ValueError, match="as integers"):
        gt.parse_gemv_config("64,16,1,4,0,0,1,128,1")


def test_shipped_tuned_table_is_well_formed():
    """Every entry of gemv_tuned.json names a GPU type and an [n, k] shape, and parses to a
    tiling the kernel accepts (power-of-two tiles, a loop form at most); ``BF16`` entries
    are the dense kernel's (``triton_dense.parse_config``); ``GLU:`` entries are gate|up
    tilings ``quant_glu`` can run; ``SCALES:`` entries name a K-quant scale layout."""
    from lodestar.kernels import triton_dense as td
    table = json.loads(gt.TUNED_TABLE.read_text())
    devices = {k: v for k, v in table.items() if not k.startswith("_")}
    assert devices
    names = {t.name for t in ql.GPU_QUANT_TYPES}
    for entries in devices.values():
        for key, text in entries.items():
            if key.startswith("SCALES:"):     # a Q4_K / Q5_K weight's scale layout (kquant_scales)
                qtype, shape = key.removeprefix("SCALES:").split(":")
                n, k = (int(v) for v in shape.split(","))
                assert qtype in ("Q4_K", "Q5_K") and n > 0 and k % 256 == 0 and text in ql.KQUANT_SCALE_FORMS
                continue
            glu = key.startswith("GLU:")
            qtype, shape = key.removeprefix("GLU:").split(":")
            n, k = (int(v) for v in shape.split(","))
            if qtype == "BF16":
                dcfg = td.parse_config(text)
                assert n > 0 and k > 0 and dcfg.block_k <= 1 << (k - 1).bit_length()
                continue
            assert qtype in names and n > 0 and k % 32 == 0
            cfg = gt.parse_gemv_config(text)
            assert cfg.block_n & (cfg.block_n - 1) == 0 and cfg.tile_groups & (cfg.tile_groups - 1) == 0
            assert int(cfg.prefetch) + int(cfg.unroll) <= 1
            if glu:     # a gate|up tiling for glu_quant: whole 32-unit groups of both halves, no K split
                assert n % 2 == 0 and gt.glu_epilogue_ok(ql.PackedWeight(ql.T[qtype], n, k, None, None), 1, n // 2, cfg)


@pytest.mark.parametrize("qtype", [pytest.param(t, id=t.name) for t in gt.WORDS_CAPABLE])
def test_word_tile_kernel_without_masks(qtype):
    """The word-tile kernel on a shape with no partial block or tile (its unmasked form), K
    split in 2, in programs of 4 rows and one warp (the H200's Q5_K gate|up tiling) and in
    64-group tiles (the H200's Q4_K gate|up, capped at 200 registers, and down): within the
    reference's tolerance, and a row's bits do not depend on the batch."""
    dev = kernel_device()
    n, k = 64, 2048
    data = random_gguf(qtype, n, k, seed=17)
    pw = ql.pack(qtype, data.to(dev), n, k)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    want = F.linear(x.float(), dequantize(data, qtype, (n, k)))
    for cfg in (gt.GemvConfig(4, 32, 1, 1, words=True), gt.GemvConfig(16, 64, 1, 2, words=True, maxnreg=200),
                gt.GemvConfig(8, 64, 1, 4, words=True), gt.GemvConfig(16, 32, 2, 4, words=True)):
        got = tq.quant_matmul(x.to(dev), pw, torch.float32, config=cfg).cpu()
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
        alone = tq.quant_matmul(x[2:3].to(dev), pw, torch.float32, config=cfg).cpu()
        assert torch.equal(got[2:3].view(torch.int32), alone.view(torch.int32))
    # a cap on registers (ptxas .maxnreg; spills at 64) changes no bit (the 16-row tiling's got)
    capped = tq.quant_matmul(x.to(dev), pw, torch.float32, config=replace(cfg, maxnreg=64)).cpu()
    assert cfg.block_n == 16 and torch.equal(got.view(torch.int32), capped.view(torch.int32))


@pytest.mark.parametrize("qtype", [pytest.param(ql.T.Q4_K, id="Q4_K"), pytest.param(ql.T.Q5_K, id="Q5_K")])
def test_kquant_scale_forms_give_the_same_bits(qtype, tmp_path):
    """Q4_K / Q5_K scales in pairs (``pack(scales="pair")``), in four arrays (``split``) or in
    the file's blocks (``block``, 4 bytes fewer a block): dequantization and the word-tile
    kernel give the same bits from every layout. The group-tile kernel's per-group sum
    ``(d*sc)*dot - (dmin*m)*xs`` may be contracted into fused multiply-adds differently by
    the compiler for each (seen on the H200: last-bit differences), so there it is held to
    fp32 rounding. Every 6-bit scale and min value occurs in the data, and many in each of a
    block's 8 places. The form a weight is packed in (``gemv_tiling.kquant_scales``): a tiling
    table's ``SCALES:TYPE:n,k`` entry, else ``split``."""
    dev = kernel_device()
    n, k = 48, 1024
    data = random_gguf(qtype, n, k, seed=21)
    blocks = data.view(n * k // 256, -1)
    blocks[:, 4:16] = torch.randint(0, 256, (blocks.shape[0], 12), generator=torch.Generator().manual_seed(5),
                                    dtype=torch.uint8)                      # every bit of the 12 scale bytes
    data = data.to(dev)
    forms = {form: ql.pack(qtype, data, n, k, scales=form) for form in ql.KQUANT_SCALE_FORMS}
    split, pair, block = forms["split"], forms["pair"], forms["block"]
    assert [w.scale_form for w in (split, pair, block)] == [0, 1, 2] and pair.paired and not split.paired
    assert pair.dmin is None and pair.m is None and block.dmin is None and block.sc is None and block.m is None
    assert pair.nbytes == split.nbytes and block.nbytes == split.nbytes - 4 * n * k // 256
    assert block.nbytes == data.numel()                          # the file's bytes, no more
    assert ql.pack(qtype, data, n, k).scale_form == 0             # split unless asked
    sc, m = dq._k_scale_min(blocks[:, 4:16])
    assert all(set(v.unique().tolist()) == set(range(64)) for v in (sc, m))
    assert all(len(v[:, j].unique()) > 40 for v in (sc, m) for j in range(8))
    for w in (pair, block):
        assert torch.equal(ql.dequantize_packed_ref(w), ql.dequantize_packed_ref(split))
        assert torch.equal(tq.dequantize_packed(w, torch.float32), tq.dequantize_packed(split, torch.float32))
    x = torch.randn(2, k, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16).to(dev)
    for cfg in (gt.GemvConfig(16, 32, 2, 4, words=True), gt.GemvConfig(8, 32, 1, 1, words=True, unroll=True),
                gt.GemvConfig(16, 32, 1, 4, words=True), gt.GemvConfig(4, 32, 1, 1, words=True),
                gt.GemvConfig(8, 32, 1, 1, words=True, prefetch=True), gt.GemvConfig(16, 8, 2, 4)):
        a = tq.quant_matmul(x, split, torch.float32, config=cfg)
        for w in (pair, block):
            b = tq.quant_matmul(x, w, torch.float32, config=cfg)
            if cfg.words:
                assert torch.equal(a.view(torch.int32), b.view(torch.int32)), (cfg, w.scale_form)
            else:
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6 * float(a.abs().max()))
    with pytest.raises(ValueError, match="scales='pairs'; use one of split, pair, block"):
        ql.pack(qtype, data, n, k, scales="pairs")
    # which form a weight gets: a table file's SCALES entry for its type and shape
    table = tmp_path / "t.json"
    table.write_text(json.dumps({f"SCALES:{qtype.name}:{n},{k}": "pair"}))
    with using(KernelPolicy(gemv_table=str(table))):
        assert gt.kquant_scales(qtype, n, k, data.device) == "pair"
        assert gt.kquant_scales(qtype, n // 2, k, data.device) == "split"
        assert gt.kquant_scales(ql.T.Q6_K, n, k, data.device) == "split"      # one form for other types
    shipped = gt.shipped_table("NVIDIA H200")
    key = next(key for key in shipped if key.startswith("SCALES:"))
    name, shape = key.removeprefix("SCALES:").split(":")
    sn, sk = (int(v) for v in shape.split(","))
    with using(KernelPolicy()):
        assert gt.kquant_scales(ql.T[name], sn, sk, None, gpu="NVIDIA H200") == shipped[key]
        assert gt.kquant_scales(ql.T[name], sn, sk, torch.device("cpu")) == "split"   # no table off the GPU
    with using(KernelPolicy(gemv_table="off")):
        assert gt.kquant_scales(ql.T[name], sn, sk, None, gpu="NVIDIA H200") == "split"


def _early(monkeypatch, early: bool) -> None:
    """Make ``quant_matmul`` load the first tile before its wait (``early``) or after it, whatever
    the rule (``gemv_tiling.gemv_early``) says for the shape."""
    monkeypatch.setattr(tq, "gemv_early", lambda n, k, whole=False: early)


@pytest.mark.parametrize("qtype", [pytest.param(t, id=t.name) for t in gt.WORDS_CAPABLE])
@pytest.mark.parametrize("early", [False, True], ids=["wait_first", "early"])
def test_word_tile_prefetch_gives_the_plain_loops_bits(qtype, early, monkeypatch):
    """The word-tile loop with the next tile's code words and scales loaded ahead
    (``prefetch``) adds the same products in the same order as the plain loop: the same bits,
    with and without masks (a partial last tile, a partial row block), K split or not, and
    with the first tile loaded before the wait or not."""
    _early(monkeypatch, early)
    dev = kernel_device()
    x = torch.randn(2, 4096, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16).to(dev)
    for n, k, cfg in ((64, 1024, gt.GemvConfig(16, 8, 2, 4, words=True)),
                      (40, 1280, gt.GemvConfig(16, 16, 1, 2, words=True)),
                      (32, 1024, gt.GemvConfig(8, 4, 1, 1, words=True)),
                      (16, 4096, gt.GemvConfig(8, 64, 1, 4, words=True))):     # the H200's Q6_K down tiling
        pw = ql.pack(qtype, random_gguf(qtype, n, k, seed=n).to(dev), n, k)
        plain = tq.quant_matmul(x[:, :k], pw, torch.float32, config=cfg)
        ahead = tq.quant_matmul(x[:, :k], pw, torch.float32, config=replace(cfg, prefetch=True))
        assert torch.equal(plain.view(torch.int32), ahead.view(torch.int32)), (n, k, cfg)


def test_rule_picks_the_word_tile_kernel_for_its_types():
    dev = torch.device("cpu")
    for qtype in ql.GPU_QUANT_TYPES:
        cfg = gt.default_gemv_config(28672, 4096, dev, qtype)
        assert cfg.words == (qtype in gt.WORDS_TYPES)
        assert cfg.tile_groups == (32 if cfg.words else 16)
    small = gt.default_gemv_config(576, 576, dev, ql.T.Q4_1)      # 18 groups: the tile shrinks to 16
    assert small.words and small.tile_groups == 16


def test_pdl_follows_the_policy():
    """Policy ``pdl``: dependent launch on a Hopper-class GPU (compiled kernels), never
    elsewhere; ``launch_next``: the next kernel may launch before this one's wait (3)."""
    hopper = (torch.cuda.is_available() and not launch.interpreted()
              and torch.cuda.get_device_capability()[0] >= 9)
    with using(KernelPolicy(pdl=False)):
        assert launch.pdl() == launch.pdl(launch_next=True) == {"PDL": False}
    with using(KernelPolicy(pdl=True)):
        assert launch.pdl() == ({"PDL": True, "launch_pdl": True} if hopper else {"PDL": False})
        assert launch.pdl(launch_next=True) == ({"PDL": 3, "launch_pdl": True} if hopper else {"PDL": False})


def test_loads_all_before_wait_follows_the_tiling():
    """Whole rows in one tile, loaded before the wait: a 256-wide Q4_0 weight in tiles of 8
    groups, never for more rows than the matrix-vector kernels take nor in tiles of 4."""
    pw = ql.pack(ql.T.Q4_0, random_gguf(ql.T.Q4_0, 64, 256, seed=1), 64, 256)
    with using(KernelPolicy(gemv="8,8,1,1,0,0,1")):            # 8 groups a tile: whole 256-wide rows
        assert gt.loads_all_before_wait(pw, 1)
        assert not gt.loads_all_before_wait(pw, ql.SMALL_M_MAX + 1)
        assert not gt.loads_all_before_wait(pw, 0)
    with using(KernelPolicy(gemv="8,4,1,1,0,0,1")):            # two tiles a row
        assert not gt.loads_all_before_wait(pw, 1)
    with using(KernelPolicy(gemv="8,8,1,1")):                  # the group-tile kernel
        assert not gt.loads_all_before_wait(pw, 1)


def test_graph_buffers_grow_and_keep_the_old_ones():
    cache = {}
    make = lambda n, dev: torch.zeros(n, device=dev)   # noqa: E731
    first = launch.graph_buffers(cache, torch.device("cpu"), 3, 8, torch.Tensor.numel, make, "x")
    assert first.numel() == 8 and launch.graph_buffers(cache, "cpu", 8, 8, torch.Tensor.numel, make, "x") is first
    grown = launch.graph_buffers(cache, "cpu", 9, 8, torch.Tensor.numel, make, "x")
    assert grown.numel() == 16 and cache[torch.device("cpu")] == [first, grown]


@pytest.mark.parametrize("qtype", [pytest.param(t, id=t.name) for t in gt.WORDS_CAPABLE])
def test_first_tile_loaded_before_the_wait_gives_the_same_bits(qtype, monkeypatch):
    """The first tile's code words loaded before the kernel waits for the previous one
    (``EARLY``) against after it: the same bits, with one tile per split, several, a partial
    last tile and a partial row block."""
    dev = kernel_device()
    n, k = 72, 2048 + 256
    data = random_gguf(qtype, n, k, seed=29)
    pw = ql.pack(qtype, data.to(dev), n, k)
    x = torch.randn(2, k, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16).to(dev)
    for cfg in (gt.GemvConfig(16, 32, 1, 4, words=True), gt.GemvConfig(8, 16, 3, 2, unroll=True, words=True),
                gt.GemvConfig(16, 32, 4, 4, words=True), gt.GemvConfig(16, 128, 1, 4, words=True)):
        got = {}
        for early in (False, True):
            _early(monkeypatch, early)
            got[early] = tq.quant_matmul(x, pw, torch.float32, config=cfg)
        assert torch.equal(got[False].view(torch.int32), got[True].view(torch.int32)), cfg


def test_first_tile_early_for_models_up_to_2048_wide():
    assert gt.gemv_early(3072, 576) and gt.gemv_early(49152, 576) and gt.gemv_early(576, 1536)  # SmolLM2
    assert gt.gemv_early(3072, 2048) and gt.gemv_early(2048, 8192)                             # 1B q|k|v, down
    assert not gt.gemv_early(4096, 4096) and not gt.gemv_early(4096, 14336)                    # 8B
    assert not gt.gemv_early(28672, 4096) and not gt.gemv_early(49152, 4096)
    # a program holding whole rows in one tile reads all of its weights before the wait
    assert gt.gemv_early(4096, 4096, whole=True) and gt.gemv_early(6144, 4096, whole=True)
    cfg = gt.GemvConfig(16, 128, 1, 4, words=True)
    assert gt.whole_rows(cfg, 4096) and not gt.whole_rows(cfg, 4128) and not gt.whole_rows(replace(cfg, split_k=2), 4096)


def test_side_prefetch_ranges():
    """The side prefetch asks for the same leading fraction of each array (16-byte multiples),
    at most its limit in all."""
    codes = torch.zeros(3 << 20, dtype=torch.uint8)
    scales = torch.zeros(1 << 19, dtype=torch.float16)      # 1 MiB
    got = launch.head_ranges([scales, codes], 2 << 20)            # half of 4 MiB
    assert got == [(codes.data_ptr(), 3 << 19), (scales.data_ptr(), 1 << 19)]
    assert sum(n for _, n in launch.head_ranges([codes, scales], 100 << 20)) == 4 << 20
    assert launch.head_ranges([codes], 0) == []
    assert all(n % 16 == 0 for _, n in launch.head_ranges([codes, scales], 1000))
