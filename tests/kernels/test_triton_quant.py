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
from lodestar.kernels import triton_quant as tq
from lodestar.kernels.dequant import dequantize

from triton_helpers import kernel_device, random_gguf

TYPES = [pytest.param(t, id=t.name) for t in tq.GPU_QUANT_TYPES]


@pytest.mark.parametrize("qtype", TYPES)
def test_repack_is_exact(qtype):
    data = random_gguf(qtype, 24, 512, seed=3)
    pw = tq.pack(qtype, data, 24, 512)
    want = dequantize(data, qtype, (24, 512))
    assert torch.equal(tq.dequantize_packed_ref(pw).view(torch.int32), want.view(torch.int32))
    gguf_bytes = data.numel()
    assert pw.nbytes <= gguf_bytes * 1.03    # the same bits, a few bytes of alignment at most


@pytest.mark.parametrize("qtype", TYPES)
def test_dequantize_kernel_bit_identical(qtype):
    dev = kernel_device()
    data = random_gguf(qtype, 40, 1024, seed=5)
    pw = tq.pack(qtype, data.to(dev), 40, 1024)
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
    pw = tq.pack(qtype, data.to(dev), n, k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
    got = tq.quant_matmul(x.to(dev), pw, torch.float32).cpu()
    # Exact weights; x is split into two int8 terms (error <= amax/64516 per element)
    # and fp32 summation order differs from the reference.
    want = F.linear(x.float(), dequantize(data, qtype, (n, k)))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))


@pytest.mark.parametrize("qtype", [pytest.param(tq.T.Q4_K, id="Q4_K"), pytest.param(tq.T.Q8_0, id="Q8_0")])
def test_rows_do_not_depend_on_the_batch(qtype):
    """A row's output is bit-identical whatever rows share its batch (M = 1 .. 64)."""
    dev = kernel_device()
    n, k = 128, 1024
    pw = tq.pack(qtype, random_gguf(qtype, n, k, seed=9).to(dev), n, k)
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
    pw = tq.pack(qtype, data.to(dev), n, k)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    cfg = tq.GemvConfig(block_n=16, tile_groups=8, split_k=4, num_warps=4)
    got = tq.quant_matmul(x.to(dev), pw, torch.float32, config=cfg).cpu()
    want = F.linear(x.float(), dequantize(data, qtype, (n, k)))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
    # a row's bits do not depend on the rows beside it
    alone = tq.quant_matmul(x[1:2].to(dev), pw, torch.float32, config=cfg).cpu()
    assert torch.equal(got[1:2], alone)


def test_large_m_path_dequantizes_then_matmuls():
    dev = kernel_device()
    qtype, n, k, m = tq.T.Q4_0, 64, 512, tq.SMALL_M_MAX + 6
    data = random_gguf(qtype, n, k, seed=2)
    pw = tq.pack(qtype, data.to(dev), n, k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    got = tq.matmul(x.to(dev), pw).float().cpu()
    want = F.linear(x.float(), dequantize(data, qtype, (n, k)).to(torch.bfloat16).float())
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * float(want.abs().max()))


def test_unsupported_type_names_the_supported_ones():
    with pytest.raises(ValueError, match="no GPU kernel for Q3_K; kernels exist for Q4_0, Q4_1, Q8_0"):
        tq.pack(tq.T.Q3_K, torch.zeros(1, 110, dtype=torch.uint8), 1, 256)


VARIANTS = [pytest.param(name, id=name) for name in tq.GEMV_VARIANTS]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("qtype", TYPES)
def test_loop_variants_match_reference_and_batch(qtype, variant, monkeypatch):
    """Every loop variant over a K split in 2 (12 groups each: the second tile of 8 is partly
    masked) and a partial row block: within the default's tolerance of the reference, a row
    alone gives the bits it gives in a batch of 3, and the split's tile counters end at 0."""
    dev = kernel_device()
    monkeypatch.setenv("LODESTAR_FUSE", "1")
    n, k = 40, 768
    data = random_gguf(qtype, n, k, seed=13)
    pw = tq.pack(qtype, data.to(dev), n, k)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    cfg = tq.with_variant(tq.GemvConfig(block_n=16, tile_groups=8, split_k=2, num_warps=4), variant)
    got = tq.quant_matmul(x.to(dev), pw, torch.float32, config=cfg).cpu()
    want = F.linear(x.float(), dequantize(data, qtype, (n, k)))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
    alone = tq.quant_matmul(x[1:2].to(dev), pw, torch.float32, config=cfg).cpu()
    assert torch.equal(got[1:2].view(torch.int32), alone.view(torch.int32))
    assert not pw.tile_counters.any()


def test_gemv_config_takes_a_variant_a_full_override_or_a_table(monkeypatch, tmp_path):
    dev = torch.device("cpu")
    rule = tq.default_gemv_config(4096, 4096, dev)
    monkeypatch.delenv("LODESTAR_GEMV", raising=False)
    monkeypatch.delenv("LODESTAR_GEMV_TABLE", raising=False)
    monkeypatch.setenv("LODESTAR_GEMV_VARIANT", "prefetch")
    assert tq.gemv_config(4096, 4096, dev) == tq.GemvConfig(rule.block_n, rule.tile_groups, rule.split_k,
                                                            rule.num_warps, prefetch=True)
    monkeypatch.setenv("LODESTAR_GEMV_VARIANT", "fastest")
    with pytest.raises(ValueError, match="use one of default, prefetch"):
        tq.gemv_config(4096, 4096, dev)
    monkeypatch.delenv("LODESTAR_GEMV_VARIANT")
    table = tmp_path / "gemv.json"
    table.write_text('{"table": {"4096,4096": "32,8,2,8,0,3,0", "Q4_K:4096,4096": "16,16,1,2,0,0,1"}}')
    monkeypatch.setenv("LODESTAR_GEMV_TABLE", str(table))
    assert tq.gemv_config(4096, 4096, dev) == tq.GemvConfig(32, 8, 2, 8, stages=3)
    assert tq.gemv_config(4096, 4096, dev, tq.T.Q4_0) == tq.GemvConfig(32, 8, 2, 8, stages=3)
    assert tq.gemv_config(4096, 4096, dev, tq.T.Q4_K) == tq.GemvConfig(16, 16, 1, 2, unroll=True)
    assert tq.gemv_config(6144, 4096, dev) == tq.default_gemv_config(6144, 4096, dev)   # not in the table
    monkeypatch.setenv("LODESTAR_GEMV", "16,16,1,4")
    assert tq.gemv_config(4096, 4096, dev) == tq.GemvConfig(16, 16, 1, 4)
    for cfg in (tq.GemvConfig(32, 8, 4, 8, stages=2), tq.GemvConfig(8, 16, 1, 2, prefetch=True),
                tq.GemvConfig(16, 16, 2, 4, unroll=True), tq.GemvConfig(64, 16, 1, 4, words=True, maxnreg=128),
                tq.GemvConfig(16, 16, 1, 4, maxnreg=96)):
        assert tq.parse_gemv_config(tq.config_text(cfg)) == cfg
    assert tq.parse_gemv_config("64,16,1,4,0,0,0,1,128") == tq.GemvConfig(64, 16, 1, 4, words=True, maxnreg=128)
    with pytest.raises(ValueError, match="set one of them"):
        tq.GemvConfig(16, 16, 1, 4, prefetch=True, unroll=True)
    with pytest.raises(ValueError, match="maxnreg"):
        tq.parse_gemv_config("64,16,1,4,0,0,0,1,300")
    with pytest.raises(ValueError, match="as integers"):
        tq.parse_gemv_config("64,16,1,4,0,0,0,1,128,1")


def test_shipped_tuned_table_is_well_formed():
    """Every entry of gemv_tuned.json names a GPU type and an [n, k] shape, and parses to a
    tiling the kernel accepts (power-of-two tiles, a loop form at most); ``BF16`` entries
    are the dense kernel's (``triton_dense.parse_config``); ``GLU:`` entries are gate|up
    tilings ``quant_glu`` can run; ``SCALES:`` entries name a K-quant scale layout."""
    from lodestar.kernels import triton_dense as td
    table = json.loads(tq.TUNED_TABLE.read_text())
    devices = {k: v for k, v in table.items() if not k.startswith("_")}
    assert devices
    names = {t.name for t in tq.GPU_QUANT_TYPES}
    for entries in devices.values():
        for key, text in entries.items():
            if key.startswith("SCALES:"):     # a Q4_K / Q5_K weight's scale layout (kquant_scales)
                qtype, shape = key.removeprefix("SCALES:").split(":")
                n, k = (int(v) for v in shape.split(","))
                assert qtype in ("Q4_K", "Q5_K") and n > 0 and k % 256 == 0 and text in tq.KQUANT_SCALE_FORMS
                continue
            glu = key.startswith("GLU:")
            qtype, shape = key.removeprefix("GLU:").split(":")
            n, k = (int(v) for v in shape.split(","))
            if qtype == "BF16":
                dcfg = td.parse_config(text)
                assert n > 0 and k > 0 and dcfg.block_k <= 1 << (k - 1).bit_length()
                continue
            assert qtype in names and n > 0 and k % 32 == 0
            cfg = tq.parse_gemv_config(text)
            assert cfg.block_n & (cfg.block_n - 1) == 0 and cfg.tile_groups & (cfg.tile_groups - 1) == 0
            assert int(cfg.prefetch) + int(cfg.stages > 0) + int(cfg.unroll) <= 1
            if glu:     # a gate|up tiling for glu_quant: whole 32-unit groups of both halves, no K split
                assert n % 2 == 0 and tq.glu_epilogue_ok(tq.PackedWeight(tq.T[qtype], n, k, None, None), 1, n // 2, cfg)


@pytest.mark.parametrize("qtype", [pytest.param(t, id=t.name) for t in tq.WORDS_CAPABLE])
def test_word_tile_kernel_without_masks(qtype):
    """The word-tile kernel on a shape with no partial block or tile (its unmasked form), K
    split in 2, in programs of 4 rows and one warp (the H200's Q5_K gate|up tiling) and in
    64-group tiles (the H200's Q4_K gate|up, capped at 200 registers, and down): within the
    reference's tolerance, and a row's bits do not depend on the batch."""
    dev = kernel_device()
    n, k = 64, 2048
    data = random_gguf(qtype, n, k, seed=17)
    pw = tq.pack(qtype, data.to(dev), n, k)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    want = F.linear(x.float(), dequantize(data, qtype, (n, k)))
    for cfg in (tq.GemvConfig(4, 32, 1, 1, words=True), tq.GemvConfig(16, 64, 1, 2, words=True, maxnreg=200),
                tq.GemvConfig(8, 64, 1, 4, words=True), tq.GemvConfig(16, 32, 2, 4, words=True)):
        got = tq.quant_matmul(x.to(dev), pw, torch.float32, config=cfg).cpu()
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
        alone = tq.quant_matmul(x[2:3].to(dev), pw, torch.float32, config=cfg).cpu()
        assert torch.equal(got[2:3].view(torch.int32), alone.view(torch.int32))
    # a cap on registers (ptxas .maxnreg; spills at 64) changes no bit (the 16-row tiling's got)
    capped = tq.quant_matmul(x.to(dev), pw, torch.float32, config=replace(cfg, maxnreg=64)).cpu()
    assert cfg.block_n == 16 and torch.equal(got.view(torch.int32), capped.view(torch.int32))


@pytest.mark.parametrize("qtype", [pytest.param(tq.T.Q4_K, id="Q4_K"), pytest.param(tq.T.Q5_K, id="Q5_K")])
def test_kquant_scale_forms_give_the_same_bits(qtype, monkeypatch, tmp_path):
    """Q4_K / Q5_K scales in pairs (``LODESTAR_KQUANT_SCALES=pair``), in four arrays
    (``split``) or in the file's blocks (``block``, 4 bytes fewer a block): dequantization and
    the word-tile kernel give the same bits from every layout. The group-tile kernel's
    per-group sum ``(d*sc)*dot - (dmin*m)*xs`` may be contracted into fused multiply-adds
    differently by the compiler for each (seen on the H200: last-bit differences), so there
    it is held to fp32 rounding. Every 6-bit scale and min value occurs in the data, and many
    in each of a block's 8 places."""
    dev = kernel_device()
    n, k = 48, 1024
    data = random_gguf(qtype, n, k, seed=21)
    blocks = data.view(n * k // 256, -1)
    blocks[:, 4:16] = torch.randint(0, 256, (blocks.shape[0], 12), generator=torch.Generator().manual_seed(5),
                                    dtype=torch.uint8)                      # every bit of the 12 scale bytes
    data = data.to(dev)
    forms = {}
    for form in tq.KQUANT_SCALE_FORMS:
        monkeypatch.setenv("LODESTAR_KQUANT_SCALES", form)
        forms[form] = tq.pack(qtype, data, n, k)
    split, pair, block = forms["split"], forms["pair"], forms["block"]
    assert [w.scale_form for w in (split, pair, block)] == [0, 1, 2] and pair.paired and not split.paired
    assert pair.dmin is None and pair.m is None and block.dmin is None and block.sc is None and block.m is None
    assert pair.nbytes == split.nbytes and block.nbytes == split.nbytes - 4 * n * k // 256
    assert block.nbytes == data.numel()                          # the file's bytes, no more
    sc, m = dq._k_scale_min(blocks[:, 4:16])
    assert all(set(v.unique().tolist()) == set(range(64)) for v in (sc, m))
    assert all(len(v[:, j].unique()) > 40 for v in (sc, m) for j in range(8))
    for w in (pair, block):
        assert torch.equal(tq.dequantize_packed_ref(w), tq.dequantize_packed_ref(split))
        assert torch.equal(tq.dequantize_packed(w, torch.float32), tq.dequantize_packed(split, torch.float32))
    x = torch.randn(2, k, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16).to(dev)
    for cfg in (tq.GemvConfig(16, 32, 2, 4, words=True), tq.GemvConfig(8, 32, 1, 1, words=True, unroll=True),
                tq.GemvConfig(16, 32, 1, 4, words=True), tq.GemvConfig(4, 32, 1, 1, words=True),
                tq.GemvConfig(8, 32, 1, 1, words=True, prefetch=True), tq.GemvConfig(16, 8, 2, 4),
                tq.GemvConfig(16, 8, 1, 4, prefetch=True)):
        a = tq.quant_matmul(x, split, torch.float32, config=cfg)
        for w in (pair, block):
            b = tq.quant_matmul(x, w, torch.float32, config=cfg)
            if cfg.words:
                assert torch.equal(a.view(torch.int32), b.view(torch.int32)), (cfg, w.scale_form)
            else:
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6 * float(a.abs().max()))
    monkeypatch.setenv("LODESTAR_KQUANT_SCALES", f"4096x4096,{n}x{k}")
    assert tq.pack(qtype, data, n, k).paired and not tq.pack(qtype, data[: n // 2], n // 2, k).paired
    monkeypatch.delenv("LODESTAR_KQUANT_SCALES")           # a table's SCALES entry
    table = tmp_path / "t.json"
    table.write_text(json.dumps({f"SCALES:{qtype.name}:{n},{k}": "pair"}))
    monkeypatch.setenv("LODESTAR_GEMV_TABLE", str(table))
    assert tq.pack(qtype, data, n, k).paired and not tq.pack(qtype, data[: n // 2], n // 2, k).paired
    monkeypatch.setenv("LODESTAR_GEMV_TABLE", "off")
    assert not tq.pack(qtype, data, n, k).paired
    monkeypatch.delenv("LODESTAR_GEMV_TABLE")
    assert not tq.pack(qtype, data.cpu(), n, k).paired      # no table off the GPU: split
    monkeypatch.setenv("LODESTAR_KQUANT_SCALES", "pairs")
    with pytest.raises(ValueError, match="pair, split, block or shapes"):
        tq.pack(qtype, data, n, k)


@pytest.mark.parametrize("qtype", [pytest.param(t, id=t.name) for t in tq.WORDS_CAPABLE])
@pytest.mark.parametrize("early", ["0", "1"])
def test_word_tile_prefetch_gives_the_plain_loops_bits(qtype, early, monkeypatch):
    """The word-tile loop with the next tile's code words and scales loaded ahead
    (``prefetch``) adds the same products in the same order as the plain loop: the same bits,
    with and without masks (a partial last tile, a partial row block), K split or not, and
    with the first tile loaded before the wait or not."""
    monkeypatch.setenv("LODESTAR_GEMV_EARLY", early)
    dev = kernel_device()
    x = torch.randn(2, 4096, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16).to(dev)
    for n, k, cfg in ((64, 1024, tq.GemvConfig(16, 8, 2, 4, words=True)),
                      (40, 1280, tq.GemvConfig(16, 16, 1, 2, words=True)),
                      (32, 1024, tq.GemvConfig(8, 4, 1, 1, words=True)),
                      (16, 4096, tq.GemvConfig(8, 64, 1, 4, words=True))):     # the H200's Q6_K down tiling
        pw = tq.pack(qtype, random_gguf(qtype, n, k, seed=n).to(dev), n, k)
        plain = tq.quant_matmul(x[:, :k], pw, torch.float32, config=cfg)
        ahead = tq.quant_matmul(x[:, :k], pw, torch.float32, config=replace(cfg, prefetch=True))
        assert torch.equal(plain.view(torch.int32), ahead.view(torch.int32)), (n, k, cfg)


def test_rule_picks_the_word_tile_kernel_for_its_types():
    dev = torch.device("cpu")
    for qtype in tq.GPU_QUANT_TYPES:
        cfg = tq.default_gemv_config(28672, 4096, dev, qtype)
        assert cfg.words == (qtype in tq.WORDS_TYPES)
        assert cfg.tile_groups == (32 if cfg.words else 16)
    small = tq.default_gemv_config(576, 576, dev, tq.T.Q4_1)      # 18 groups: the tile shrinks to 16
    assert small.words and small.tile_groups == 16
    # a loop form of the group-tile kernel applies to that kernel, not to the word tiles
    pre = tq.with_variant(tq.default_gemv_config(4096, 4096, dev, tq.T.Q4_0), "prefetch")
    assert pre.prefetch and not pre.words and pre.tile_groups == 16
    assert tq.with_variant(tq.default_gemv_config(4096, 4096, dev, tq.T.Q4_0), "words_unroll").words



def test_launch_switch(monkeypatch):
    """LODESTAR_PDL: 0, 1 or wait; no dependent launch without a Hopper-class GPU."""
    monkeypatch.setenv("LODESTAR_PDL", "2")
    with pytest.raises(ValueError, match="LODESTAR_PDL"):
        tq.pdl()
    monkeypatch.setenv("LODESTAR_PDL", "0")
    assert tq.pdl() == {"PDL": False}
    hopper = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9
    for env, want in (("1", {"PDL": True, "launch_pdl": True}), ("wait", {"PDL": 2, "launch_pdl": True})):
        monkeypatch.setenv("LODESTAR_PDL", env)
        assert tq.pdl() == (want if hopper else {"PDL": False})
    # launch_next: before the wait (3), unless every kernel waits for the previous one's end
    monkeypatch.setenv("LODESTAR_PDL", "1")
    assert tq.pdl(launch_next=True) == ({"PDL": 3, "launch_pdl": True} if hopper else {"PDL": False})
    monkeypatch.setenv("LODESTAR_PDL", "wait")
    assert tq.pdl(launch_next=True) == ({"PDL": 2, "launch_pdl": True} if hopper else {"PDL": False})


def test_launch_early_sites(monkeypatch):
    """LODESTAR_PDL_EARLY names the projections whose kernel launches before the small
    kernel before it waits (or none); unset: the quantized projections whose programs read
    all their weights before their wait; an unknown site is an error."""
    from lodestar.layers.cuda_linear import PREFETCH_SITES, CudaQuantLinear, launch_early
    monkeypatch.delenv("LODESTAR_PDL_EARLY", raising=False)
    assert not launch_early("qkv", torch.nn.Linear(4, 4), 1)       # not a quantized projection
    # a down projection of a type in EARLY_DOWN_TYPES (Q4_K), not another's
    down = {t: CudaQuantLinear(t, random_gguf(t, 64, 512), 512, 64, torch.device("cpu"))
            for t in (tq.T.Q4_K, tq.T.Q6_K)}
    monkeypatch.setattr(tq, "loads_all_before_wait", lambda *a, **k: False)
    assert launch_early("down", down[tq.T.Q4_K], 1) and not launch_early("down", down[tq.T.Q6_K], 1)
    assert not launch_early("gate_up", down[tq.T.Q4_K], 1)
    monkeypatch.setenv("LODESTAR_PDL_EARLY", "none")
    assert not any(launch_early(s) for s in PREFETCH_SITES)
    monkeypatch.setenv("LODESTAR_PDL_EARLY", "qkv, gate_up")
    assert [s for s in PREFETCH_SITES if launch_early(s)] == ["qkv", "gate_up"]
    monkeypatch.setenv("LODESTAR_PDL_EARLY", "qkv,mlp")
    with pytest.raises(ValueError, match="LODESTAR_PDL_EARLY"):
        launch_early("qkv")


def test_loads_all_before_wait_follows_the_tiling(monkeypatch):
    """Whole rows in one tile, loaded before the wait: the rule's tiling for a 4096-wide
    Q4_0 weight on this device, never for more rows than the matrix-vector kernels take."""
    dev = kernel_device()
    pw = tq.pack(tq.T.Q4_0, random_gguf(tq.T.Q4_0, 64, 256, seed=1).to(dev), 64, 256)
    monkeypatch.setenv("LODESTAR_GEMV", "8,8,1,1,0,0,0,1")        # 8 groups a tile: whole 256-wide rows
    monkeypatch.delenv("LODESTAR_GEMV_EARLY", raising=False)
    assert tq.loads_all_before_wait(pw, 1)
    assert not tq.loads_all_before_wait(pw, tq.SMALL_M_MAX + 1)
    monkeypatch.setenv("LODESTAR_GEMV_EARLY", "0")
    assert not tq.loads_all_before_wait(pw, 1)
    monkeypatch.setenv("LODESTAR_GEMV_EARLY", "")
    monkeypatch.setenv("LODESTAR_GEMV", "8,4,1,1,0,0,0,1")        # two tiles a row
    assert not tq.loads_all_before_wait(pw, 1)


def test_graph_buffers_grow_and_keep_the_old_ones():
    cache = {}
    make = lambda n, dev: torch.zeros(n, device=dev)   # noqa: E731
    first = tq.graph_buffers(cache, torch.device("cpu"), 3, 8, torch.Tensor.numel, make, "x")
    assert first.numel() == 8 and tq.graph_buffers(cache, "cpu", 8, 8, torch.Tensor.numel, make, "x") is first
    grown = tq.graph_buffers(cache, "cpu", 9, 8, torch.Tensor.numel, make, "x")
    assert grown.numel() == 16 and cache[torch.device("cpu")] == [first, grown]


@pytest.mark.parametrize("qtype", [pytest.param(t, id=t.name) for t in tq.WORDS_CAPABLE])
def test_first_tile_loaded_before_the_wait_gives_the_same_bits(qtype, monkeypatch):
    """``LODESTAR_GEMV_EARLY=1`` (the first tile's code words loaded before the kernel waits
    for the previous one) against 0: the same bits, with one tile per split, several, a
    partial last tile and a partial row block."""
    dev = kernel_device()
    n, k = 72, 2048 + 256
    data = random_gguf(qtype, n, k, seed=29)
    pw = tq.pack(qtype, data.to(dev), n, k)
    x = torch.randn(2, k, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16).to(dev)
    for cfg in (tq.GemvConfig(16, 32, 1, 4, words=True), tq.GemvConfig(8, 16, 3, 2, unroll=True, words=True),
                tq.GemvConfig(16, 32, 4, 4, words=True), tq.GemvConfig(16, 128, 1, 4, words=True)):
        got = {}
        for early in ("0", "1"):
            monkeypatch.setenv("LODESTAR_GEMV_EARLY", early)
            got[early] = tq.quant_matmul(x, pw, torch.float32, config=cfg)
        assert torch.equal(got["0"].view(torch.int32), got["1"].view(torch.int32)), cfg
    monkeypatch.setenv("LODESTAR_GEMV_EARLY", "yes")
    with pytest.raises(ValueError, match="LODESTAR_GEMV_EARLY"):
        tq.gemv_early(n, k)


def test_first_tile_early_by_default_for_models_up_to_2048_wide(monkeypatch):
    monkeypatch.delenv("LODESTAR_GEMV_EARLY", raising=False)
    assert tq.gemv_early(3072, 576) and tq.gemv_early(49152, 576) and tq.gemv_early(576, 1536)  # SmolLM2
    assert tq.gemv_early(3072, 2048) and tq.gemv_early(2048, 8192)                             # 1B q|k|v, down
    assert not tq.gemv_early(4096, 4096) and not tq.gemv_early(4096, 14336)                    # 8B
    assert not tq.gemv_early(28672, 4096) and not tq.gemv_early(49152, 4096)
    # a program holding whole rows in one tile reads all of its weights before the wait
    assert tq.gemv_early(4096, 4096, whole_rows=True) and tq.gemv_early(6144, 4096, whole_rows=True)
    monkeypatch.setenv("LODESTAR_GEMV_EARLY", "0")
    assert not tq.gemv_early(64, 64) and not tq.gemv_early(4096, 4096, whole_rows=True)
    monkeypatch.setenv("LODESTAR_GEMV_EARLY", "1")
    assert tq.gemv_early(4096, 14336)
    monkeypatch.setenv("LODESTAR_GEMV_EARLY", "4096x4096, 6144x4096")     # named weights only
    assert tq.gemv_early(4096, 4096) and tq.gemv_early(6144, 4096) and not tq.gemv_early(4096, 14336)
    for bad in ("4096", "4096x4096x2", "ax4096"):
        monkeypatch.setenv("LODESTAR_GEMV_EARLY", bad)
        with pytest.raises(ValueError, match="LODESTAR_GEMV_EARLY"):
            tq.gemv_early(4096, 4096)


@pytest.mark.parametrize("limit,var,default_mib", [("side_prefetch_limit", "LODESTAR_SIDE_PREFETCH", 16),
                                                   ("weight_prefetch_limit", "LODESTAR_WEIGHT_PREFETCH", 4)])
def test_prefetch_limits_read_mib_settings(limit, var, default_mib, monkeypatch):
    """Both weight prefetches read their size in MiB (fractions allowed, 0 off); a negative or
    non-numeric value is an error naming the setting."""
    fn = getattr(tq, limit)
    monkeypatch.delenv(var, raising=False)
    assert fn() == default_mib << 20
    monkeypatch.setenv(var, "1.5")
    assert fn() == 3 << 19
    monkeypatch.setenv(var, "0")
    assert fn() == 0
    for bad in ("-1", "x", "lots"):
        monkeypatch.setenv(var, bad)
        with pytest.raises(ValueError, match=var):
            fn()


def test_side_prefetch_ranges():
    """The side prefetch asks for the same leading fraction of each array (16-byte multiples),
    at most its limit in all."""
    codes = torch.zeros(3 << 20, dtype=torch.uint8)
    scales = torch.zeros(1 << 19, dtype=torch.float16)      # 1 MiB
    got = tq.head_ranges([scales, codes], 2 << 20)            # half of 4 MiB
    assert got == [(codes.data_ptr(), 3 << 19), (scales.data_ptr(), 1 << 19)]
    assert sum(n for _, n in tq.head_ranges([codes, scales], 100 << 20)) == 4 << 20
    assert tq.head_ranges([codes], 0) == []
    assert all(n % 16 == 0 for _, n in tq.head_ranges([codes, scales], 1000))


def test_weight_evict_names_types(monkeypatch):
    """LODESTAR_WEIGHT_EVICT: the quant types (or TYPE:NxK shapes) whose code words load
    evict-first (all, none; default none)."""
    monkeypatch.delenv("LODESTAR_WEIGHT_EVICT", raising=False)
    assert tq.weight_evict(tq.T.Q4_0) == ""
    monkeypatch.setenv("LODESTAR_WEIGHT_EVICT", "Q4_0")
    assert (tq.weight_evict(tq.T.Q4_0), tq.weight_evict(tq.T.Q4_K)) == ("evict_first", "")
    monkeypatch.setenv("LODESTAR_WEIGHT_EVICT", "none")
    assert tq.weight_evict(tq.T.Q4_0) == ""
    monkeypatch.setenv("LODESTAR_WEIGHT_EVICT", "Q4_K,Q8_0")
    assert (tq.weight_evict(tq.T.Q4_0), tq.weight_evict(tq.T.Q8_0)) == ("", "evict_first")
    monkeypatch.setenv("LODESTAR_WEIGHT_EVICT", "all")
    assert tq.weight_evict(tq.T.Q6_K) == "evict_first"
    monkeypatch.setenv("LODESTAR_WEIGHT_EVICT", "Q4_0:28672x4096,Q4_K")
    assert [tq.weight_evict(tq.T.Q4_0, 28672, 4096), tq.weight_evict(tq.T.Q4_0, 4096, 14336),
            tq.weight_evict(tq.T.Q4_0), tq.weight_evict(tq.T.Q4_K, 4096, 14336)] == ["evict_first", "", "", "evict_first"]
    for bad in ("first", "Q4_0:28672", "Q4_0:28672x", "Q9_0:8x8"):
        monkeypatch.setenv("LODESTAR_WEIGHT_EVICT", bad)
        with pytest.raises(ValueError, match="LODESTAR_WEIGHT_EVICT"):
            tq.weight_evict(tq.T.Q4_0)

