"""Decode fusions (``KernelPolicy.fusions``, ``kernels/policy.py``) give the same bits as the
unfused kernels: x quantized inside RMSNorm, the gated activation and the decode-attention
kernel (a decode step through the attention layer), K splits added inside the
matrix-vector kernel or by the next RMSNorm, the gated activation in the gate|up kernel, the
rotation and KV store in the q|k|v kernel, and repeated calls on the same buffers
(CUDA-graph replays) finding the tile counters back at 0.

Runs on a CUDA device, or on the CPU under TRITON_INTERPRET=1 (see triton_helpers); there
the weights keep their real K (and K split) but only 20 rows, to bound the interpreter's time.
"""
from __future__ import annotations

import json

import pytest
import torch
from gguf.constants import GGML_QUANT_SIZES

from lodestar.kernels import gemv_tiling as gt
from lodestar.kernels import quant_layout as ql
from lodestar.kernels import triton_fused as tf
from lodestar.kernels import triton_quant as tq
from lodestar.kernels.policy import FUSIONS, KernelPolicy, using

from triton_helpers import kernel_device, random_gguf

TYPES = [pytest.param(t, id=t.name) for t in ql.GPU_QUANT_TYPES]
ROWS = (1, 2, 3, 8)
ALL = KernelPolicy()                            # every fusion
NONE = KernelPolicy(fusions=frozenset())


def _fusions(*names: str) -> KernelPolicy:
    return KernelPolicy(fusions=frozenset(names))


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


def _same_quantization(got: ql.QuantizedRows, x: torch.Tensor) -> None:
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
        assert isinstance(q, ql.QuantizedRows) and q.shape == (m, d)
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


def _weight(qtype, n: int, k: int, dev: str, seed: int) -> ql.PackedWeight:
    return ql.pack(qtype, random_gguf(qtype, n, k, seed=seed).to(dev), n, k)


def _rows(n: int, dev: str) -> int:
    return n if dev == "cuda" else 20     # 20: a full and a partial block of 16 rows


# K-quant blocks hold 256 weights: a 576-wide row cannot be one of them (such GGUF files
# store those tensors in another type).
SPLIT_CASES = [pytest.param(t, shape, id=f"{shape}-{t.name}") for shape in SPLIT_SHAPES for t in ql.GPU_QUANT_TYPES
               if SPLIT_SHAPES[shape][1] % GGML_QUANT_SIZES[t][0] == 0]


@pytest.mark.parametrize("qtype,shape", SPLIT_CASES)
def test_split_sum_inside_the_kernel_is_bit_identical(qtype, shape):
    dev = kernel_device()
    n, k, split, tile = SPLIT_SHAPES[shape]
    n = _rows(n, dev)
    # the interpreter's time grows with programs x tiles, not tile size: fewer, larger tiles
    cfg = gt.GemvConfig(16, tile if dev == "cuda" else 64, split, 4)
    pw = _weight(qtype, n, k, dev, seed=k + int(qtype))
    for m in ROWS:
        x = _x(m, k, seed=m).to(dev)
        with using(_fusions("quant", "residual")):                 # split_sum off: _split_sum_kernel
            want = tq.quant_matmul(x, pw, torch.float32, config=cfg)
        with using(ALL):
            got = tq.quant_matmul(x, pw, torch.float32, config=cfg)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), m
        assert not pw.tile_counters.any()                          # left at 0 for the next call


@pytest.mark.parametrize("qtype", TYPES)
def test_norm_quantized_input_gives_the_same_product(qtype):
    """RMSNorm -> q|k|v as the model runs it: fused producer + in-kernel split sum against
    every fusion off."""
    dev = kernel_device()
    n, k, split, tile = SPLIT_SHAPES["8b_qkv"]
    n = _rows(n, dev)
    cfg = gt.GemvConfig(16, tile if dev == "cuda" else 64, split, 4)
    pw = _weight(qtype, n, k, dev, seed=7)
    w = (torch.rand(k, generator=torch.Generator().manual_seed(3)) + 0.5).to(dev)
    for m in ROWS:
        x = _x(m, k, seed=10 + m).to(dev)
        with using(NONE):
            want = tq.quant_matmul(tf.rms_norm(x, w, 1e-5), pw, config=cfg)
        with using(ALL):
            got = tq.quant_matmul(tf.rms_norm(x, w, 1e-5, quantize=True), pw, config=cfg)
        assert got.dtype == torch.bfloat16 and torch.equal(got, want), m


NORM_SUM_CASES = [  # (N = the norm's width, K, split_k, tile_groups): one program a row, and a row in slices
    pytest.param(576, 1536, 4, 8, id="576-split4"),
    pytest.param(2048, 512, 2, 8, id="2048-sliced-split2"),
]


@pytest.mark.parametrize("qtype", [pytest.param(ql.T.Q4_0, id="Q4_0"), pytest.param(ql.T.Q4_K, id="Q4_K")])
@pytest.mark.parametrize("n,k,split,tile", NORM_SUM_CASES)
@pytest.mark.parametrize("quantize", [False, True], ids=["bf16", "quantized"])
def test_norm_summing_the_split_partials_gives_the_bits_of_the_summed_product(qtype, n, k, split, tile, quantize):
    """Fusion ``norm_sum``: the product's K-split partials, left unsummed, then the residual
    add + RMSNorm summing them itself, give the bits of the summed product (in-kernel split
    sum, and the separate sum kernel) then the norm: its output, quantized form and residual."""
    if qtype == ql.T.Q4_K and k % 256:
        pytest.skip("K-quant rows are whole 256-weight blocks")
    dev = kernel_device()
    cfg = gt.GemvConfig(16, tile, split, 4)
    pw = _weight(qtype, n, k, dev, seed=n + k)
    w = (torch.rand(n, generator=torch.Generator().manual_seed(4)) + 0.5).to(dev)
    for m in ((1, 3) if dev == "cuda" else (3,)):
        x = ql.QuantizedRows(_x(m, k, seed=m).to(dev), *tq.quantize_x(_x(m, k, seed=m).to(dev)))
        res = _x(m, n, seed=50 + m, scale=1.0).to(dev)
        summed = tq.quant_matmul(x, pw, config=cfg)
        parts = tq.quant_matmul(x, pw, config=cfg, defer_sum=True)
        assert isinstance(parts, tq.SplitPartials) and parts.shape == summed.shape
        assert _same_bits(parts.materialize(), summed)
        want_y, want_h = tf.rms_norm(summed, w, 1e-5, residual=res, quantize=quantize)
        got_y, got_h = tf.rms_norm(parts, w, 1e-5, residual=res, quantize=quantize)
        assert _same_bits(got_h, want_h), m
        if quantize:
            assert _same_bits(got_y.x, want_y.x) and torch.equal(got_y.words, want_y.words)
            assert _same_bits(got_y.d1, want_y.d1) and _same_bits(got_y.sums, want_y.sums)
        else:
            assert _same_bits(got_y, want_y), m
    one = tq.quant_matmul(x, pw, config=gt.GemvConfig(16, tile, 1, 4), defer_sum=True)
    assert isinstance(one, torch.Tensor)        # no K split: nothing to defer


GLU_TYPES = [pytest.param(t, id=t.name) for t in gt.WORDS_CAPABLE]


@pytest.mark.parametrize("qtype", GLU_TYPES)
@pytest.mark.parametrize("block_n,tile", [(64, 8), (128, 16), (8, 8), (32, 4)],
                         ids=["64rows", "128rows", "8rows", "32rows"])
@pytest.mark.parametrize("act", [0, 1], ids=["silu", "gelu_tanh"])
def test_gate_up_with_the_activation_in_its_epilogue_gives_the_bits_of_product_then_activation(
        qtype, block_n, tile, act):
    """Fusion ``glu_quant``: the gate|up kernel holding gate and up rows of the same units
    writes the gated activation and its quantized form, bit for bit what the product with
    the same tiling, then the activation kernel with ``quantize=True`` give; in programs of
    fewer than 32 units (8 and 32 rows) the last of a group's programs quantizes it, and the
    arrival counters are back at 0 after each launch."""
    from lodestar.kernels.triton_dense import GELU_TANH, SILU
    dev = kernel_device()
    ffn, k = max(2 * block_n, 64), 512
    cfg = gt.GemvConfig(block_n, tile, 1, 4, words=True)
    pw = _weight(qtype, 2 * ffn, k, dev, seed=ffn + act)
    assert gt.glu_epilogue_ok(pw, 3, ffn, cfg)
    glu = tf.silu_mul if act == SILU else tf.gelu_tanh_mul
    for m in ((1, 3, 8) if dev == "cuda" else (3,)):
        x = _x(m, k, seed=m).to(dev)
        for given in (x, ql.QuantizedRows(x, *tq.quantize_x(x))):
            product = tq.quant_matmul(given, pw, config=cfg)
            want = glu(product[:, :ffn], product[:, ffn:], quantize=True)
            got = tq.quant_glu(given, pw, ffn, SILU if act == SILU else GELU_TANH, config=cfg)
            assert _same_bits(got.x, want.x), m
            assert torch.equal(got.words, want.words)
            assert _same_bits(got.d1, want.d1) and _same_bits(got.sums, want.sums)
            if block_n < 64:
                assert pw.tile_counters is not None and not pw.tile_counters.any()


def test_glu_epilogue_ok_refuses_what_the_kernel_cannot_run():
    pw = _weight(ql.T.Q4_0, 256, 512, "cpu", seed=3)
    words = gt.GemvConfig(64, 8, 1, 4, words=True)
    assert gt.glu_epilogue_ok(pw, 1, 128, words)
    assert not gt.glu_epilogue_ok(pw, 1, 64, words)                                  # not 2 x ffn rows
    assert not gt.glu_epilogue_ok(pw, 0, 128, words)
    assert not gt.glu_epilogue_ok(pw, ql.SMALL_M_MAX + 1, 128, words)
    assert not gt.glu_epilogue_ok(pw, 1, 128, gt.GemvConfig(64, 8, 2, 4, words=True))  # K split
    assert gt.glu_epilogue_ok(pw, 1, 128, gt.GemvConfig(32, 8, 1, 4, words=True))      # 16 units: counted
    assert gt.glu_epilogue_ok(pw, 1, 128, gt.GemvConfig(2, 8, 1, 1, words=True))       # one unit of each half
    assert not gt.glu_epilogue_ok(pw, 1, 128, gt.GemvConfig(64, 8, 1, 4))             # group-tile kernel
    odd = _weight(ql.T.Q4_0, 160, 512, "cpu", seed=4)
    assert not gt.glu_epilogue_ok(odd, 1, 80, words)                                  # 80 units: not whole halves
    assert not gt.glu_epilogue_ok(odd, 1, 80, gt.GemvConfig(8, 8, 1, 1, words=True))  # nor whole 32-unit groups
    with pytest.raises(ValueError, match="glu_epilogue_ok"):
        tq.quant_glu(torch.zeros(1, 512, dtype=torch.bfloat16), odd, 80, 0, config=words)


def test_glu_gemv_config_reads_the_tables_and_fits_the_row(tmp_path):
    """The gate|up tiling of ``glu_quant``: a ``GLU:TYPE:n,k`` entry of the tiling table in
    force (policy ``gemv_table``: a file; ``off``: none; unset: the shipped table's for a
    CUDA device), none on the CPU without a file; ``config=`` gives one directly. Its tile
    never exceeds the row."""
    pw = _weight(ql.T.Q4_0, 256, 256, "cpu", seed=5)                     # 8 groups a row
    with using(ALL):
        assert gt.glu_gemv_config(pw) is None
        assert not gt.glu_epilogue_ok(pw, 1, 128)                       # no tiling: the activation kernel runs
    assert gt.glu_epilogue_ok(pw, 1, 128, gt.parse_gemv_config("128,8,1,8,0,0,1"))
    table = tmp_path / "table.json"
    table.write_text(json.dumps({"table": {"GLU:Q4_0:256,256": "128,16,1,8,0,0,1", "Q4_0:256,256": "8,8,1,1"}}))
    with using(KernelPolicy(gemv_table=str(table))):
        cfg = gt.glu_gemv_config(pw)
        assert (cfg.block_n, cfg.tile_groups, cfg.split_k, cfg.num_warps, cfg.words) == (128, 8, 1, 8, True)
        assert gt.glu_epilogue_ok(pw, 1, 128)
        assert gt.glu_gemv_config(_weight(ql.T.Q4_0, 256, 512, "cpu", seed=6)) is None    # no entry for it
        assert gt.gemv_config(256, 256, pw.device, ql.T.Q4_0) == gt.GemvConfig(8, 8, 1, 1)  # the plain product's
    with using(KernelPolicy(gemv_table="off")):
        assert gt.glu_gemv_config(pw) is None
    shipped = gt.shipped_table("NVIDIA H200")
    cfg = gt.glu_entry(shipped, 28672, 4096, ql.T.Q4_0)
    assert gt.glu_epilogue_ok(ql.PackedWeight(ql.T.Q4_0, 28672, 4096, pw.codes, pw.d), 1, 14336, cfg)
    assert gt.glu_entry(shipped, 28672, 4096, ql.T.Q4_K) is None          # measured slower there


@pytest.mark.parametrize("qtype", [pytest.param(ql.T.Q4_0, id="Q4_0"), pytest.param(ql.T.Q6_K, id="Q6_K")])
def test_repeated_calls_on_the_same_buffers_give_the_same_bits(qtype):
    """What a CUDA-graph replay does: the same launch again and again; each must find the
    tile counters at 0 (a counter left at SPLIT - 1 would make the first arrival sum)."""
    with using(ALL):
        _repeated_calls(qtype)


def _repeated_calls(qtype) -> None:
    dev = kernel_device()
    n, k, split, tile = SPLIT_SHAPES["8b_down"]
    n = _rows(n, dev)
    cfg = gt.GemvConfig(16, tile if dev == "cuda" else 64, split, 4)
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


BS = 16


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (``torch.equal`` takes -0 for +0)."""
    ints = {2: torch.int16, 4: torch.int32}[a.element_size()]
    return a.dtype == b.dtype and torch.equal(a.view(ints), b.view(ints))


def _attention_step(kind: str, dev: str, qtype: str = "Q8_0", stack: bool = True):
    """One attention layer of a tiny ``qtype`` geometry (Q8_0: q|k|v and o ``CudaQuantLinear``)
    with its CUDA layers and a GPU decode step of three rows (one of them many partitions
    long) over a scattered bf16 KV pool. ``llama``: GQA 4, D 64; ``gemma3``: Gemma 3's form
    (offset q/k norms, sliding window, query_pre_attn_scalar scale), one kv head, D 256. On
    the CPU the layers are built and run as on a GPU (interpreter). ``stack``: the loader's
    ``WeightLoader.stack`` (projections of one input in several packed types as one)."""
    from lodestar.formats.synthetic import Geometry, SyntheticCheckpoint
    from lodestar.kernels import triton_attention as ta
    from lodestar.layers.attention import AttentionBatch, GpuAttentionMeta
    from lodestar.layers.cuda_linear import CudaQuantLinear
    from lodestar.layers.norm import OffsetRMSNorm
    from lodestar.layers.rotary import RotaryEmbedding
    from lodestar.models import llama
    from lodestar.models.weights import WeightLoader

    lens = [1, 70, 700]
    if kind == "llama":
        geo, extra = Geometry("llama", 256, 1, 8, 2, 64, 64, 10000.0, tied=True, vocab=64, context=1024), {}
    else:
        geo = Geometry("qwen3", 256, 1, 4, 1, 256, 64, 10000.0, tied=True, qk_norm=True, vocab=64, context=1024)
        extra = dict(norm_cls=OffsetRMSNorm, sliding_window=100, scale=256 ** -0.5)
    ck = SyntheticCheckpoint(geo, qtype, device=dev)
    w = WeightLoader(ck, "packed", device=dev)
    w.cuda = True
    w.stack = stack
    a = llama.LlamaArgs.from_config(ck.config)
    rope = RotaryEmbedding(a.rope_dim, a.rope_theta, 1024).to(dev)
    attn = llama.LlamaAttention(a, w, 0, rope, **extra).to(dev)     # q/k norm weights too
    assert isinstance(attn.o, CudaQuantLinear) and (qtype != "Q8_0" or isinstance(attn.qkv, CudaQuantLinear))
    width = -(-max(lens) // BS) + 2
    blocks = len(lens) * width
    tables = torch.randperm(blocks, generator=torch.Generator().manual_seed(1)).reshape(len(lens), width)
    batch = AttentionBatch.build([t[: -(-n // BS)].tolist() for t, n in zip(tables, lens)], lens, [1] * len(lens), BS)
    batch.gpu = GpuAttentionMeta(batch.slot_mapping.to(dev), tables.to(torch.int32).to(dev),
                                 batch.seq_lens.to(torch.int32).to(dev), ta.num_partitions(width * BS),
                                 ta.grid_splits(len(lens), a.n_kv_heads, torch.device(dev)))
    g = torch.Generator().manual_seed(2)
    kc = torch.randn(blocks * BS, a.n_kv_heads, a.head_dim, generator=g).to(torch.bfloat16).to(dev)
    vc = torch.randn(blocks * BS, a.n_kv_heads, a.head_dim, generator=g).to(torch.bfloat16).to(dev)
    x = (torch.randn(len(lens), a.d_model, generator=g) * 2).to(torch.bfloat16).to(dev)
    positions = batch.positions().to(dev)
    return attn, batch, kc, vc, x, positions


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_attention_decode_step_does_not_depend_on_attn_quant(kind, monkeypatch):
    """A decode step through the attention layer (q|k|v, RoPE + KV store, attention, o) with
    ``attn_quant`` on and off, alone and with every other fusion (``qkv_rope``, alone too:
    the q|k|v kernel rotates and stores, no RoPE kernel): the same bits out and in both
    caches; with ``attn_quant`` on the o projection gets the attention kernel's
    ``QuantizedRows`` (no ``quantize_x`` of its own)."""
    from lodestar.layers import rotary
    dev = kernel_device()
    attn, batch, kc, vc, x, positions = _attention_step(kind, dev)
    calls = []
    quantize_x = tq.quantize_x
    monkeypatch.setattr(tq, "quantize_x", lambda x: calls.append(x.shape) or quantize_x(x))
    o_inputs = []
    o_forward = attn.o.forward
    monkeypatch.setattr(attn.o, "forward", lambda x: o_inputs.append(type(x)) or o_forward(x))

    ropes = []
    rope_ = rotary.rope_
    monkeypatch.setattr(rotary, "rope_", lambda *a, **k: ropes.append(1) or rope_(*a, **k))

    def run(fusions: frozenset):
        calls.clear()
        o_inputs.clear()
        ropes.clear()
        attn.k_cache, attn.v_cache = kc.clone(), vc.clone()
        with using(KernelPolicy(fusions=fusions)):
            out = attn(x, positions, batch)
        # qkv_rope (Llama form; Gemma's q/k norms come before the rotation): no RoPE kernel
        assert len(ropes) == (0 if kind == "llama" and "qkv_rope" in fusions else 1), sorted(fusions)
        return out, attn.k_cache, attn.v_cache, len(calls), o_inputs[0]

    everything_else = frozenset(FUSIONS) - {"attn_quant"}
    runs = {name: run(fusions) for name, fusions in (
        ("none", frozenset()), ("attn_quant", frozenset({"attn_quant"})), ("all but attn_quant", everything_else),
        ("all", frozenset(FUSIONS)), ("qkv_rope", frozenset({"qkv_rope"})))}
    want = runs["none"]
    assert want[0].shape == (3, 256) and torch.isfinite(want[0].float()).all()
    for name, (out, k_cache, v_cache, n_quant, o_input) in runs.items():
        assert _same_bits(out, want[0]), name
        assert _same_bits(k_cache, want[1]) and _same_bits(v_cache, want[2]), name
        fused = name in ("attn_quant", "all")
        assert (n_quant, o_input) == ((1, ql.QuantizedRows) if fused else (2, torch.Tensor)), name


ROPE_TYPES = [pytest.param(t, id=t.name) for t in gt.WORDS_CAPABLE]


@pytest.mark.parametrize("qtype", ROPE_TYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_qkv_rope_epilogue_gives_the_bits_of_the_rope_kernel(qtype, head_dim):
    """``quant_matmul(rope=...)`` (fusion ``qkv_rope``): the q|k|v product with q and k rotated
    and k, v stored at each row's slot by the matrix-vector kernel itself, against the product
    then ``triton_fused.rope_`` with the KV store: the same bits in the output and both caches,
    for one tile per split and several, K splits summed in the kernel, and tile rows of 16 and 8."""
    with using(ALL):                   # split_sum: K splits summed in the kernel
        _qkv_rope_epilogue(qtype, head_dim)


def _qkv_rope_epilogue(qtype, head_dim: int) -> None:
    dev = kernel_device()
    hq, hk, k = 4, 2, 256
    n_q, n_k = hq * head_dim, hk * head_dim
    n = n_q + 2 * n_k
    pw = ql.pack(qtype, random_gguf(qtype, n, k, seed=31).to(dev), n, k)
    from lodestar.layers.rotary import RotaryEmbedding
    rope = RotaryEmbedding(head_dim, 10000.0, 2048).to(dev)
    g = torch.Generator().manual_seed(4)
    slots = 40
    kc0 = torch.randn(slots, hk, head_dim, generator=g).to(torch.bfloat16).to(dev)
    vc0 = torch.randn(slots, hk, head_dim, generator=g).to(torch.bfloat16).to(dev)
    configs = [gt.GemvConfig(16, 4, 1, 4, words=True), gt.GemvConfig(8, 4, 2, 2, words=True)]
    for cfg in configs:
        assert gt.rope_epilogue_ok(pw, 3, head_dim, n_q, n_k, cfg)
        for m in (1, 3):
            x = _x(m, k, seed=m).to(dev)
            positions = torch.tensor([5, 1900, 0][:m], dtype=torch.int64).to(dev)
            slot_map = torch.tensor([7, 0, 39][:m], dtype=torch.int64).to(dev)
            want = tq.quant_matmul(x, pw, config=cfg)
            kw, vw = kc0.clone(), vc0.clone()
            q, kk, v = (t.view(m, -1, head_dim) for t in want.split([n_q, n_k, n_k], dim=-1))
            tf.rope_(q, kk, positions, rope.cos, rope.sin, head_dim, v=v, k_cache=kw, v_cache=vw, slots=slot_map)
            kg, vg = kc0.clone(), vc0.clone()
            got = tq.quant_matmul(x, pw, config=cfg, rope=tq.RopeStore(positions, slot_map, rope.cos, rope.sin, kg,
                                                                        vg, n_q, n_k, head_dim))
            assert _same_bits(got, want), (cfg, m)
            assert _same_bits(kg, kw) and _same_bits(vg, vw), (cfg, m)
            assert pw.tile_counters is None or not pw.tile_counters.any()
    assert not gt.rope_epilogue_ok(pw, 3, head_dim, n_q, n_k, gt.GemvConfig(16, 16, 1, 4))         # group tiles
    assert not gt.rope_epilogue_ok(pw, 3, head_dim, n_q, n_k, gt.GemvConfig(2 * head_dim, 8, 1, 4, words=True))
    assert not gt.rope_epilogue_ok(pw, 3, head_dim, n_q + head_dim, n_k, configs[0])          # not q|k|v rows
    assert not gt.rope_epilogue_ok(pw, ql.SMALL_M_MAX + 1, head_dim, n_q, n_k, configs[0])
    with pytest.raises(ValueError, match="cannot rotate"):
        tq.quant_matmul(_x(1, k, 0).to(dev), pw, config=gt.GemvConfig(16, 16, 1, 4),
                        rope=tq.RopeStore(positions[:1], slot_map[:1], rope.cos, rope.sin, kc0, vc0, n_q, n_k,
                                          head_dim))


def test_qkv_rope_lets_attention_launch_early_for_narrow_models_only():
    """A q|k|v kernel that rotates and stores lets decode attention launch as soon as its
    programs started for rows up to 1024 wide (SmolLM2's 576), only when it ends for wider
    ones (the rule ``qkv_rope_waits``)."""
    assert not gt.qkv_rope_waits(576) and not gt.qkv_rope_waits(gt.QKV_ROPE_EARLY_LAUNCH_MAX_K)
    assert gt.qkv_rope_waits(2048) and gt.qkv_rope_waits(4096)


@pytest.mark.parametrize("qtype", [pytest.param(ql.T.Q4_0, id="Q4_0"), pytest.param(ql.T.Q4_K, id="Q4_K")])
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_packed_projection_of_a_pending_norm_runs_the_norm_kernel_first(qtype, residual):
    """A ``PendingNorm`` handed to a packed projection (``CudaQuantLinear``; the dense
    projection's kernel computes it itself) is the norm kernel's output: the bits of
    ``rms_norm`` then the product, the residual sum written to ``h``."""
    from lodestar.kernels.triton_dense import PendingNorm
    from lodestar.layers.cuda_linear import CudaQuantLinear
    dev = kernel_device()
    n, k = 48, 512
    layer = CudaQuantLinear(qtype, random_gguf(qtype, n, k, seed=41), k, n, torch.device(dev))
    w = (torch.rand(k, generator=torch.Generator().manual_seed(5)) + 0.5).to(dev)
    x = _x(2, k, seed=50).to(dev)
    r = _x(2, k, seed=51, scale=1.0).to(dev) if residual else None
    y, h_want = tf.rms_norm(x, w, 1e-5, residual=r) if residual else (tf.rms_norm(x, w, 1e-5), x)
    p = PendingNorm.of(x, w, 1e-5, residual=r)
    assert _same_bits(layer(p), layer(y))
    assert _same_bits(p.h, h_want)
