"""The compiled per-layer CPU operations (lodestar.kernels.cpu_ops) against their torch forms,
and the fused decoder-layer loop (models.cpu_layers) against the per-operation graph."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lodestar.kernels import cpu_ops, native
from lodestar.models.cpu_layers import LlamaLayers
from lodestar.layers.attention import AttentionBatch, paged_attention
from lodestar.layers.rotary import _apply

pytestmark = pytest.mark.skipif(not native.available(), reason="the native kernels are not built")


def test_rms_norm_with_and_without_the_residual():
    x, res, w = torch.randn(5, 576), torch.randn(5, 576), torch.rand(576) + 0.5
    h, y = cpu_ops.rms_norm(x, w, 1e-5, residual=res)
    assert torch.equal(h, x + res)
    want = w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5))
    torch.testing.assert_close(y, want, rtol=2e-6, atol=1e-6)
    _, alone = cpu_ops.rms_norm(h[3:4].contiguous(), w, 1e-5)
    assert torch.equal(alone[0], y[3])                      # a row's bits do not depend on the batch
    assert cpu_ops.rms_norm(x.t(), w, 1e-5) is None         # not contiguous: the caller's torch form


def test_gated_activations_within_a_few_ulps_of_fp64():
    # The compiled exp is a polynomial (vectorized); GELU is v / (1 + exp(-2y)), free of the
    # cancellation in torch's fp32 0.5 v (1 + tanh y) (hundreds of ulps where gelu is small).
    gu = torch.cat([torch.randn(3, 1536) * 4, torch.linspace(-12, 12, 3 * 1536).view(3, 1536)]).view(3, 2 * 1536)
    gate, up = gu.double().split([1536, 1536], dim=-1)
    torch.testing.assert_close(cpu_ops.glu(gu, 1536, cpu_ops.GLU_SILU).double(), F.silu(gate) * up, rtol=3e-7,
                               atol=1e-30)
    torch.testing.assert_close(cpu_ops.glu(gu, 1536, cpu_ops.GLU_GELU_TANH).double(),
                               F.gelu(gate, approximate="tanh") * up, rtol=3e-6, atol=1e-7)


@pytest.mark.parametrize("rot", [64, 32])
def test_rope_store_gives_torchs_bits_and_fills_the_cache(rot):
    t, hq, hk, d = 4, 9, 3, 64
    qkv = torch.randn(t, (hq + 2 * hk) * d)
    q, k, v = (p.view(t, -1, d) for p in qkv.split([hq * d, hk * d, hk * d], dim=-1))
    pos = torch.tensor([0, 7, 100, 4095])
    ang = pos[:, None].float() * (1.0 / 10000 ** (torch.arange(0, rot, 2).float() / rot))
    emb = torch.cat([ang, ang], -1)
    cos, sin = emb.cos(), emb.sin()
    want_q = _apply(q.clone(), cos[:, None], sin[:, None], rot)
    want_k = _apply(k.clone(), cos[:, None], sin[:, None], rot)
    kc, vc = torch.zeros(32, hk, d), torch.zeros(32, hk, d)
    slots = torch.tensor([3, 9, 0, 31])
    table_cos = torch.zeros(4096, rot)
    table_sin = torch.zeros(4096, rot)
    table_cos[pos], table_sin[pos] = cos, sin
    assert cpu_ops.rope_store(q, k, v, pos, slots, table_cos, table_sin, kc, vc)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)
    assert torch.equal(kc[slots], want_k) and torch.equal(vc[slots], v)


@pytest.mark.parametrize("window", [None, 5])
def test_attention_rows_match_sdpa_and_do_not_depend_on_the_batch(window):
    hq, hk, d, bs = 6, 2, 32, 4
    kc, vc = torch.randn(64, hk, d), torch.randn(64, hk, d)
    # two sequences: 7 decoded rows (drafts) over a 10-token context (blocks 2, 9, 5), one over
    # 3 (block 0); both attend row by row (a prompt chunk would be one SDPA call)
    batch = AttentionBatch.build([[2, 9, 5], [0]], [10, 3], [7, 1], bs, stepwise=[True, False])
    assert batch.rows_attend_alone
    q = torch.randn(8, hq, d)
    got = paged_attention(q, kc, vc, batch, 0.125, window)
    for row, (seq, pos) in enumerate([(0, p) for p in range(3, 10)] + [(1, 2)]):
        table = [[2, 9, 5], [0]][seq]
        slots = torch.tensor([table[j // bs] * bs + j % bs for j in range(pos + 1)])
        first = 0 if window is None else max(0, pos + 1 - window)
        k, v = kc[slots[first:]], vc[slots[first:]]
        want = F.scaled_dot_product_attention(q[row][:, None], k.repeat_interleave(hq // hk, 1).transpose(0, 1),
                                              v.repeat_interleave(hq // hk, 1).transpose(0, 1), scale=0.125)[:, 0]
        torch.testing.assert_close(got[row], want, rtol=1e-5, atol=1e-6)
    alone = paged_attention(q[6:7].contiguous(), kc, vc, AttentionBatch.build([[2, 9, 5]], [10], [1], bs), 0.125,
                            window)
    assert torch.equal(alone[0], got[6])                    # the last row of sequence 0, fed alone


def _generate(engine_model, fused: bool):
    from lodestar.engine.llm_engine import EngineConfig, LLMEngine
    from lodestar.engine.sampling import SamplingParams
    lm = engine_model
    lm.model.fused_cpu_layers = fused
    engine = LLMEngine(lm, EngineConfig(max_num_seqs=4, kv_tokens=2048, max_num_batched_tokens=48,
                                        enable_prefix_cache=False))
    prompts = [lm.tokenizer.encode(p, add_special_tokens=False)
               for p in ("def fibonacci(n):", "The capital of France is", "Once upon a time " * 12)]
    out = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2))
    return [(o.token_ids, o.logprobs) for o in out]


def test_the_fused_layer_loop_gives_the_per_operation_bits(smollm_path, gemma_path):
    from lodestar.engine.loader import load_model
    lm = load_model(str(smollm_path), progress=False)
    assert LlamaLayers.of(lm.model) is not None
    assert _generate(lm, True) == _generate(lm, False)       # batched, chunked prefill, decode
    gemma = load_model(str(gemma_path), progress=False)      # q/k norms, post norms, sliding windows, GELU,
    assert LlamaLayers.of(gemma.model) is not None            # two rotary tables, q/k/v of different types
    assert _generate(gemma, True) == _generate(gemma, False)
    assert LlamaLayers.of(load_model(str(smollm_path), mode="fp32", progress=False).model) is None
