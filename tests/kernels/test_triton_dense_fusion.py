"""Fusions of the dense matrix-vector kernel give the same bits as the unfused kernels: the
producer fusion RMSNorm (with its residual add) computed in the kernel's prologue
(``PendingNorm``, fusion ``dense_norm``) against ``rms_norm`` then the kernel, and the
consumer fusion, the gated activation applied by the gate|up projection to its own output
(``dense_gemv_glu``, fusion ``glu_epilogue``, alone or with the norm in its prologue)
against the projection then ``silu_mul`` / ``gelu_tanh_mul``, and the Llama and Gemma 3
MLPs with that fusion on and off. The packed gate|up's fusion ``glu_quant`` through a Llama
MLP, and a whole synthetic model with the fusions on and off. Also: ``rms_norm`` spread
over several programs per row gives the bits of one.

Runs on a CUDA device, or on the CPU under TRITON_INTERPRET=1 (see triton_helpers); there
the weights keep their real K but only 20 rows (a dozen hidden units for gate|up), to bound
the interpreter's time. The last test runs a small synthetic Llama on CUDA only.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from triton_helpers import kernel_device

from lodestar.kernels import quant_layout as ql
from lodestar.kernels import triton_dense as td
from lodestar.kernels import triton_fused as tf
from lodestar.kernels.policy import FUSIONS, KernelPolicy, using

# tilings: the H200 rule's shape, a K split (each split normalizes its own columns) and
# other warp counts (the sum-of-squares order must not depend on the layout)
CONFIGS = [pytest.param(None, id="rule"), pytest.param(td.DenseGemvConfig(4, 128, 2, 4), id="split2"),
           pytest.param(td.DenseGemvConfig(8, 256, 1, 8), id="warps8"),
           pytest.param(td.DenseGemvConfig(2, 256, 3, 2), id="split3-warps2")]
EPS = 1e-5


def _rows(n: int, dev: str) -> int:
    return n if dev == "cuda" else 20


def _x(m: int, k: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed)) * scale
    x[:, 3] = 0.0
    x[:, 7] *= 300.0                                  # one large element dominates the sum
    return x.to(torch.bfloat16)


def _weight(n: int, k: int, seed: int, dev: str) -> torch.Tensor:
    return (torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05).to(torch.bfloat16).to(dev)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.int16 if a.element_size() == 2 else torch.int32),
                                              b.view(torch.int16 if b.element_size() == 2 else torch.int32))


@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize("k,n", [(576, 960), (4096, 6144), (1000, 300)], ids=["smollm2_qkv", "8b_qkv", "odd"])
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_norm_in_the_gemv_gives_the_bits_of_norm_then_gemv(k, n, residual, cfg):
    dev = kernel_device()
    cfg = cfg or td.config_for(n, k)
    w = _weight(_rows(n, dev), k, seed=k, dev=dev)
    norm_w = (torch.rand(k, generator=torch.Generator().manual_seed(1)) + 0.5).to(dev)
    for m in (1, 3):
        x = _x(m, k, seed=m).to(dev)
        r = _x(m, k, seed=50 + m, scale=1.0).to(dev) if residual else None
        if residual:
            y, h = tf.rms_norm(x, norm_w, EPS, residual=r)
        else:
            y, h = tf.rms_norm(x, norm_w, EPS), x
        pending = td.PendingNorm.of(x, norm_w, EPS, residual=r)
        for out_dtype in (torch.float32, torch.bfloat16):
            want = td.dense_gemv(y, w, out_dtype, cfg)
            got = td.dense_gemv(pending, w, out_dtype, cfg)
            assert _same_bits(got, want), (m, out_dtype)
        assert _same_bits(pending.h, h), m                   # the residual stream, written once


def test_pending_norm_materializes_to_the_unfused_result():
    dev = kernel_device()
    x, r = _x(1, 576, seed=1).to(dev), _x(1, 576, seed=2).to(dev)
    norm_w = torch.rand(576).to(dev) + 0.5
    pending = td.PendingNorm.of(x, norm_w, EPS, residual=r)
    y, h = tf.rms_norm(x, norm_w, EPS, residual=r)
    assert torch.equal(pending.materialize(), y) and torch.equal(pending.h, h)
    alone = td.PendingNorm.of(x, norm_w, EPS)
    assert torch.equal(alone.materialize(), tf.rms_norm(x, norm_w, EPS)) and alone.h is alone.x


def test_fused_x_needs_bf16_rows():
    dev = kernel_device()
    w = _weight(8, 64, seed=0, dev=dev)
    with pytest.raises(ValueError, match="bf16"):
        td.dense_gemv(td.PendingNorm.of(torch.ones(1, 64, device=dev), torch.ones(64, device=dev), EPS), w)


@pytest.mark.parametrize("d", [576, 1000, 4096, 5120])
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_rms_norm_over_several_programs_per_row_gives_the_bits_of_one(d, residual, monkeypatch):
    dev = kernel_device()
    w = (torch.rand(d, generator=torch.Generator().manual_seed(d)) + 0.5).to(dev)
    x = _x(2, d, seed=d).to(dev)
    r = _x(2, d, seed=d + 1, scale=1.0).to(dev) if residual else None
    monkeypatch.setattr(tf, "SLICE_COLS", 256)               # as many programs per row as it can
    sliced = tf.rms_norm(x, w, EPS, residual=r, quantize=d % 32 == 0)
    monkeypatch.setattr(tf, "SLICE_ROWS", 0)                 # one program per row
    whole = tf.rms_norm(x, w, EPS, residual=r, quantize=d % 32 == 0)
    flat = lambda out: [t for o in (out if residual else (out,)) for t in
                        ((o.x, o.words, o.d1, o.sums) if hasattr(o, "words") else (o,))]
    for a, b in zip(flat(sliced), flat(whole)):
        assert _same_bits(a, b)
    y = flat(whole)[0]
    want = tf.rms_norm_ref(x, w, EPS, residual=r)
    torch.testing.assert_close(y.float(), (want[0] if residual else want).float(),
                               rtol=8e-3 if dev == "cuda" else 1.6e-2, atol=1e-2)


# One K split (the epilogue needs whole sums): BLOCK_N 4 and 8, block_k 512 and 256.
GLU_CONFIGS = [pytest.param(td.DenseGemvConfig(4, 512, 1, 4), id="bn4-bk512"),
               pytest.param(td.DenseGemvConfig(8, 256, 1, 8), id="bn8-bk256-warps8"),
               pytest.param(td.DenseGemvConfig(2, 1024, 1, 4), id="bn2-bk1024")]   # the H200 table's 8B gate|up


def _units(f: int, dev: str) -> int:
    """Hidden units of a gate|up test weight: the real count on CUDA; on the CPU a few,
    keeping whether ``f`` is a multiple of 4 (BLOCK_N / 2 of both configs)."""
    return f if dev == "cuda" else (12 if f % 4 == 0 else 13)


@pytest.mark.parametrize("cfg", GLU_CONFIGS)
@pytest.mark.parametrize("k,f", [(576, 1536), (4096, 14336), (1000, 301)], ids=["smollm2_gate_up", "8b_gate_up", "odd"])
@pytest.mark.parametrize("act", [td.SILU, td.GELU_TANH], ids=["silu", "gelu_tanh"])
def test_activation_in_the_gate_up_epilogue_gives_the_bits_of_gemv_then_activation(k, f, act, cfg):
    """``dense_gemv_glu`` (fusion ``glu_epilogue``) against the gate|up projection then the
    activation kernel, for rows given, normalized in the prologue, and with a residual add
    there too (whose sum ``h`` it writes)."""
    dev = kernel_device()
    f = _units(f, dev)
    fn = tf.silu_mul if act == td.SILU else tf.gelu_tanh_mul
    w = _weight(2 * f, k, seed=k + f, dev=dev)                   # [gate; up] rows, as split_fused splits them
    norm_w = (torch.rand(k, generator=torch.Generator().manual_seed(2)) + 0.5).to(dev)
    x = _x(1, k, seed=5).to(dev)
    r = _x(1, k, seed=6, scale=1.0).to(dev)
    for form in ("rows", "norm", "norm+residual"):
        if form == "rows":
            xin, h, got_x = x, None, x
        else:
            res = r if form == "norm+residual" else None
            xin = td.PendingNorm.of(x, norm_w, EPS, residual=res)
            if res is None:
                y, h = tf.rms_norm(x, norm_w, EPS), x
            else:
                y, h = tf.rms_norm(x, norm_w, EPS, residual=res)
            got_x = y
        gate, up = td.dense_gemv(got_x, w, config=cfg).split(f, dim=-1)
        want = fn(gate, up)
        got = td.dense_gemv_glu(xin, w, act, cfg)
        assert got.shape == (1, f) and _same_bits(got, want), form
        if h is not None:
            assert _same_bits(xin.h, h), form                    # the residual stream, written once


def test_the_gate_up_epilogue_needs_one_split_and_pairs():
    assert td.glu_epilogue_fits(td.DenseGemvConfig(4, 512, 1, 4), 28672, 4096)      # the 8B gate|up's rule
    assert not td.glu_epilogue_fits(td.DenseGemvConfig(4, 512, 4, 4), 28672, 4096)  # K split
    assert not td.glu_epilogue_fits(td.DenseGemvConfig(1, 512, 1, 4), 28672, 4096)  # no pair per tile
    assert not td.glu_epilogue_fits(td.DenseGemvConfig(4, 512, 1, 4), 28671, 4096)  # odd rows
    assert not td.glu_epilogue_fits(td.DenseGemvConfig(4, 512, 1, 4), 28672, 4092)  # rows not 16-byte
    w = torch.zeros(16, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="does not fit"):
        td.dense_gemv_glu(torch.zeros(1, 64, dtype=torch.bfloat16), w, td.SILU, td.DenseGemvConfig(4, 32, 2, 4))


def _mlp(kind: str, dev: str, monkeypatch):
    """One MLP of a tiny BF16 Llama or Gemma 3 geometry with its CUDA layers (gate|up one
    ``CudaDenseLinear``, 99 hidden units: not a multiple of BLOCK_N / 2), and for Llama the
    block it is part of (whose ``BlockPlan`` says how the MLP runs). On the CPU the layers are
    built and run as on a GPU (interpreter): CUDA-layer loading, the kernel for CPU rows, and
    the activation kernel the GPU path calls."""
    from lodestar.formats.synthetic import Geometry, SyntheticCheckpoint
    from lodestar.layers import activation
    from lodestar.layers.cuda_linear import CudaDenseLinear
    from lodestar.layers.rotary import RotaryEmbedding
    from lodestar.models import gemma3, llama
    from lodestar.models.weights import WeightLoader

    ck = SyntheticCheckpoint(Geometry("llama", 256, 1, 4, 2, 64, 99, 10000.0, tied=True, vocab=64, context=64),
                             "BF16", device=dev)
    w = WeightLoader(ck, "packed", device=dev)
    if dev == "cpu":
        w.cuda = True
        monkeypatch.setattr(CudaDenseLinear, "runs_gemv", lambda self, x: (
            x.dtype == self.weight.dtype == torch.bfloat16 and x.numel() <= td.MAX_ROWS * x.shape[-1]
            and td.enabled()))
        for mod in (activation, llama, gemma3):
            if hasattr(mod, "silu_mul"):
                monkeypatch.setattr(mod, "silu_mul", tf.silu_mul)
            if hasattr(mod, "gelu_tanh_mul"):
                monkeypatch.setattr(mod, "gelu_tanh_mul", tf.gelu_tanh_mul)
    a = llama.LlamaArgs.from_config(ck.config)
    if kind == "llama":
        blk = llama.LlamaBlock(a, w, 0, RotaryEmbedding(a.rope_dim, a.rope_theta, 64).to(dev))
        mlp = blk.mlp
    else:
        blk, mlp = None, gemma3.Gemma3MLP(a, w, 0)
    assert isinstance(mlp.gate_up, CudaDenseLinear)
    return mlp, blk


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_mlp_decode_output_does_not_depend_on_the_glu_epilogue(kind, monkeypatch):
    """One-row decode through the MLP with the fusions including and excluding
    ``glu_epilogue``: the same bits (and residual stream), no activation kernel when on.
    Llama (as its block's plan says) also takes the RMSNorm left to gate|up (fusion
    ``dense_norm``); Gemma 3's MLP reads the policy itself."""
    dev = kernel_device()
    mlp, blk = _mlp(kind, dev, monkeypatch)
    launches = []
    glu = tf._glu
    monkeypatch.setattr(tf, "_glu", lambda *a: launches.append(a) or glu(*a))
    x, r = _x(1, 256, seed=7).to(dev), _x(1, 256, seed=8, scale=1.0).to(dev)
    norm_w = (torch.rand(256, generator=torch.Generator().manual_seed(3)) + 0.5).to(dev)

    def run(fusions: frozenset, form: str):
        launches.clear()
        res = r if form == "norm+residual" else None
        xin = x if form == "rows" else td.PendingNorm.of(x, norm_w, EPS, residual=res)
        with using(KernelPolicy(fusions=fusions)):
            if kind == "llama":
                step = blk.plan.step(x).mlp                         # as LlamaBlock.forward_gpu passes it
                assert step.form == ("glu_epilogue" if "glu_epilogue" in fusions else "plain")
                out = mlp(xin, step)
            else:
                out = mlp(xin)                                      # reads the policy itself
        return out, None if form == "rows" else xin.h, len(launches)

    for form in ("rows", "norm", "norm+residual") if kind == "llama" else ("rows",):
        on, h_on, n_on = run(frozenset(FUSIONS), form)
        off, h_off, n_off = run(frozenset(FUSIONS) - {"glu_epilogue"}, form)
        assert (n_on, n_off) == (0, 1), form
        assert on.shape == (1, 256) and torch.isfinite(on.float()).all()
        assert _same_bits(on, off), form
        if h_on is not None:
            assert _same_bits(h_on, h_off), form


def _glu_table(path: Path, qtype: str, d_model: int, ffn: int, tiling: str) -> str:
    """A tiling table file whose ``GLU:`` entry gives a packed gate|up (2 * ``ffn`` rows of
    ``d_model``) ``tiling``."""
    path.write_text(json.dumps({"table": {f"GLU:{qtype}:{2 * ffn},{d_model}": tiling}}))
    return str(path)


@pytest.mark.parametrize("rows", [1, 3])
def test_quantized_mlp_output_does_not_depend_on_the_glu_quant_fusion(rows, monkeypatch, tmp_path):
    """Decode rows through one MLP of a tiny Q4_0 Llama geometry (``CudaQuantLinear`` gate|up
    of 2 x 128 rows and down), x quantized by the norm before it: with ``glu_quant`` (and a
    table entry giving the gate|up that tiling) the gate|up kernel applies SiLU·mul and
    quantizes for down (no activation kernel), the same bits as the product in the same
    tiling, then the activation kernel."""
    from lodestar.formats.synthetic import Geometry, SyntheticCheckpoint
    from lodestar.kernels import triton_quant as tq
    from lodestar.layers.cuda_linear import CudaQuantLinear
    from lodestar.layers.rotary import RotaryEmbedding
    from lodestar.models import llama
    from lodestar.models.weights import WeightLoader
    dev = kernel_device()
    ck = SyntheticCheckpoint(Geometry("llama", 256, 1, 4, 2, 64, 128, 10000.0, tied=True, vocab=64, context=64),
                             "Q4_0", device=dev)
    w = WeightLoader(ck, "packed", device=dev)
    w.cuda = True
    a = llama.LlamaArgs.from_config(ck.config)
    tiling = "64,8,1,4,0,0,1"           # the plain gate|up product in glu_quant's tiling: same sums
    pol = KernelPolicy(gemv=tiling, gemv_table=_glu_table(tmp_path / "gemv.json", "Q4_0", 256, 128, tiling))
    with using(pol):
        blk = llama.LlamaBlock(a, w, 0, RotaryEmbedding(a.rope_dim, a.rope_theta, 64).to(dev))
    mlp = blk.mlp
    assert isinstance(mlp.gate_up, CudaQuantLinear) and isinstance(mlp.down, CudaQuantLinear)
    launches = []
    glu = tf._glu
    monkeypatch.setattr(tf, "_glu", lambda *a, **k: launches.append(a) or glu(*a, **k))
    x = _x(rows, 256, seed=rows).to(dev)
    xq = ql.QuantizedRows(x, *tq.quantize_x(x))

    def run(*fusions: str):
        launches.clear()
        with using(pol.with_fusions(fusions)):
            step = blk.plan.step(x).mlp                     # as LlamaBlock.forward_gpu passes it
            assert step.form == ("glu_quant" if "glu_quant" in fusions else "quant")
            return mlp(xq, step), len(launches)

    on, n_on = run("quant", "glu_quant")
    off, n_off = run("quant")
    assert (n_on, n_off) == (0, 1)
    assert on.shape == (rows, 256) and torch.isfinite(on.float()).all()
    assert _same_bits(on, off)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("qtype,tiling,glu", [("F16", None, False), ("Q4_0", "16,8,2,4,0,0,1", False),
                                              ("Q4_0", "64,8,1,4,0,0,1", True)], ids=["F16", "Q4_0-split", "Q4_0-glu"])
def test_synthetic_llama_logits_do_not_depend_on_the_fusions(graphs, qtype, tiling, glu, tmp_path):
    """SmolLM2-135M's geometry in F16 (dense bf16 projections) and Q4_0 (quantized ones): every
    product in two K splits, so that the split sums, and down's sum in the next norm, run
    (``glu_quant`` left out: its gate|up tiling cannot split K); and every product in tiles of
    64 rows, the gate|up kernel's with the activation too (``glu_quant``). Prefill, then
    teacher-forced one-row decode; every logit the same bits with the fusions on and off."""
    from lodestar.engine.llm_engine import EngineConfig, LLMEngine
    from lodestar.engine.loader import LoadedModel
    from lodestar.engine.sequence import Sequence
    from lodestar.formats.synthetic import SyntheticCheckpoint, synthetic_tokenizer_metadata
    from lodestar.layers.cuda_linear import CudaDenseLinear, CudaQuantLinear
    from lodestar.models import build_model
    from lodestar.tokenizer import Tokenizer

    ck = SyntheticCheckpoint("smollm2-135m", qtype, device="cuda", n_layers=4)
    pol = KernelPolicy()
    if tiling:
        pol = KernelPolicy(gemv=tiling, gemv_table=_glu_table(tmp_path / "gemv.json", qtype, ck.config.d_model,
                                                              ck.config.ffn_dim, tiling))
    with using(pol):        # the tilings in force when the projections reserve their tile counters
        model = build_model(ck.config, ck, "packed", device="cuda")
    linear = CudaDenseLinear if qtype == "F16" else CudaQuantLinear
    assert isinstance(model.layers[0].attn.qkv, linear) and isinstance(model.layers[0].mlp.down, linear)
    tok = Tokenizer.from_metadata(synthetic_tokenizer_metadata(ck.config.vocab_size))
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(10, ck.config.vocab_size, (19,), generator=g).tolist()
    forced = torch.randint(10, ck.config.vocab_size, (12,), generator=g).tolist()

    def run(fusions) -> torch.Tensor:
        with using(pol.with_fusions(fusions)):
            engine = LLMEngine(LoadedModel(Path("synthetic"), ck, ck.config, model, tok, "packed", 0.0, "cuda"),
                               EngineConfig(max_num_seqs=1, kv_tokens=1024, device="cuda"))
            engine.runner.cuda_graphs = graphs
            seq = Sequence(1, list(prompt), None)
            rows = [engine.runner.run([seq], [len(prompt)])[0].float().clone()]
            for t in forced:
                seq.output_ids.append(t)
                rows.append(engine.runner.run([seq], [1])[0].float().clone())
            engine.pool.free(seq.block_table)
        return torch.stack(rows)

    fusions = FUSIONS if glu or qtype == "F16" else [n for n in FUSIONS if n != "glu_quant"]
    with using(pol.with_fusions(fusions)):
        x = torch.empty(1, ck.config.d_model, dtype=torch.bfloat16, device="cuda")
        assert (model.layers[0].plan.step(x).mlp.form == "glu_quant") == glu
    fused, unfused = run(fusions), run(())
    assert torch.isfinite(fused).all()
    assert torch.equal(fused.view(torch.int32), unfused.view(torch.int32))
