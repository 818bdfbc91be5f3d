"""``decode_plan``: what each kernel of a GPU block step fuses, prefetches or launches early,
worked out from the policy and the block's projections. Runs on every machine: the packed
projections are built on the CPU and no kernel runs."""
from __future__ import annotations

import json
from types import SimpleNamespace

import torch
from gguf import GGMLQuantizationType as T
from gguf.constants import GGML_QUANT_SIZES

from lodestar.kernels.launch import SMALL_M_MAX
from lodestar.kernels.policy import FUSIONS, KernelPolicy, active, using
from lodestar.layers import decode_plan as dp
from lodestar.layers.cuda_linear import CudaQuantLinear, weight_arrays

D = FFN = 256          # whole Q4_K / Q6_K blocks


def _packed(qtype: T, n: int, k: int) -> CudaQuantLinear:
    block, size = GGML_QUANT_SIZES[qtype]
    return CudaQuantLinear(qtype, torch.zeros(n, k // block * size, dtype=torch.uint8), k, n, torch.device("cpu"))


def _block(qkv=None, o=None, gate_up=None, down=None, qtype: T = T.Q4_K):
    """What ``block_step`` reads of a Llama block; packed ``qtype`` projections unless given."""
    given = lambda m, n, k: _packed(qtype, n, k) if m is None else m  # noqa: E731
    return SimpleNamespace(
        attn=SimpleNamespace(qkv=given(qkv, 3 * D, D), o=given(o, D, D), rotates_in_qkv=False),
        mlp=SimpleNamespace(gate_up=given(gate_up, 2 * FFN, D), down=given(down, D, FFN), ffn_dim=FFN),
        attn_norm=SimpleNamespace(weight=torch.ones(D)))


def _step(blk, rows: int, bf16: bool, pol: KernelPolicy) -> dp.BlockStep:
    """``block_step`` as ``BlockPlan`` runs it: with ``pol`` the policy in force (the tilings
    it consults come from ``active()``)."""
    with using(pol):
        return dp.block_step(blk, rows, bf16, active())


def _attn(qkv, o, rows: int, bf16: bool, rope_ok: bool, pol: KernelPolicy, gate_up=None) -> dp.AttnStep:
    with using(pol):
        return dp.attn_step(qkv, o, rows, bf16, rope_ok, active(), gate_up)


def test_down_of_an_early_type_launches_before_the_activation_waits(monkeypatch):
    """A down projection of ``EARLY_DOWN_TYPES`` (Q4_K) may launch before the activation kernel
    ahead of it waits, another type's not; q|k|v and gate|up only when their programs read
    all their weights before their wait; a projection that is not packed never."""
    monkeypatch.setattr(dp, "loads_all_before_wait", lambda *a, **k: False)
    for down_type, early in ((T.Q4_K, True), (T.Q6_K, False)):
        step = _step(_block(down=_packed(down_type, D, FFN)), 1, True, KernelPolicy())
        assert step.mlp.form == "quant" and step.mlp.act_launch_next == early, down_type.name
        assert not step.attn_norm.launch_next and not step.ffn_norm.launch_next
    monkeypatch.setattr(dp, "loads_all_before_wait", lambda *a, **k: True)
    step = _step(_block(qtype=T.Q6_K), 1, True, KernelPolicy())
    assert step.attn_norm.launch_next and step.ffn_norm.launch_next and step.mlp.act_launch_next
    step = _step(_block(qkv=torch.nn.Linear(D, 3 * D), qtype=T.Q6_K), 1, True, KernelPolicy())
    assert not step.attn_norm.launch_next and step.ffn_norm.launch_next


def test_early_launch_follows_the_tiling():
    """With the real rule: a 256-wide Q4_0 q|k|v in tiles of whole rows (the word-tile kernel)
    launches early for a decode step's rows, not for prefill, nor in tiles of half a row."""
    blk = _block(qtype=T.Q4_0)
    whole = KernelPolicy(gemv="16,8,1,4,0,0,1")
    assert _step(blk, 1, True, whole).attn_norm.launch_next
    assert _step(blk, SMALL_M_MAX, True, whole).attn_norm.launch_next
    assert not _step(blk, SMALL_M_MAX + 1, True, whole).attn_norm.launch_next
    assert not _step(blk, 1, True, KernelPolicy(gemv="16,4,1,4,0,0,1")).attn_norm.launch_next


def test_mlp_form_and_norms_follow_the_policy(tmp_path):
    blk = _block(qtype=T.Q4_0)
    step = _step(blk, 3, True, KernelPolicy())
    assert step.attn_norm.quantize and step.ffn_norm.quantize and not step.attn_norm.pending
    assert step.attn_norm.prefetch == weight_arrays(blk.attn.qkv)
    assert step.ffn_norm.prefetch == weight_arrays(blk.mlp.gate_up)
    assert step.mlp.act_prefetch == weight_arrays(blk.mlp.down)
    # no GLU tiling for the gate|up (none on the CPU without a table): the activation kernel quantizes
    assert step.mlp.form == "quant" and step.mlp.down_partials
    table = tmp_path / "gemv.json"
    table.write_text(json.dumps({f"GLU:Q4_0:{2 * FFN},{D}": "64,8,1,4,0,0,1"}))
    assert _step(blk, 3, True, KernelPolicy(gemv_table=str(table))).mlp.form == "glu_quant"
    no_glu = KernelPolicy(gemv_table=str(table)).with_fusions(set(FUSIONS) - {"glu_quant"})
    assert _step(blk, 3, True, no_glu).mlp.form == "quant"
    assert not _step(blk, 3, True, KernelPolicy().with_fusions(set(FUSIONS) - {"norm_sum"})).mlp.down_partials
    for rows, bf16, pol in ((SMALL_M_MAX + 1, True, KernelPolicy()), (3, False, KernelPolicy()),
                            (3, True, KernelPolicy(fusions=frozenset()))):
        step = _step(blk, rows, bf16, pol)
        assert step.mlp == dp.MlpStep() and not step.attn_norm.quantize and not step.ffn_norm.quantize
    off = _step(blk, 3, True, KernelPolicy(weight_prefetch_bytes=0))
    assert off.attn_norm.prefetch is None and off.ffn_norm.prefetch is None and off.mlp.act_prefetch is None


def test_attention_step_follows_the_policy():
    blk = _block(qtype=T.Q4_0)
    qkv, o, gate_up = blk.attn.qkv, blk.attn.o, blk.mlp.gate_up
    step = _attn(qkv, o, 1, True, True, KernelPolicy(), gate_up)
    assert step.rope_in_qkv and step.quantize_o and step.o_prefetch == weight_arrays(o)
    assert step.side_prefetch is None                                   # gate|up fits the norm's prefetch
    assert not _attn(qkv, o, 1, True, False, KernelPolicy()).rope_in_qkv     # the layer cannot
    assert not _attn(qkv, o, SMALL_M_MAX + 1, True, True, KernelPolicy()).rope_in_qkv
    assert not _attn(qkv, o, 1, False, True, KernelPolicy()).rope_in_qkv
    assert not _attn(qkv, o, 1, True, True, KernelPolicy().with_fusions(set(FUSIONS) - {"qkv_rope"})).rope_in_qkv
    small = KernelPolicy(weight_prefetch_bytes=1024)                    # gate|up larger than that: side prefetch
    assert _attn(qkv, o, 1, True, True, small, gate_up).side_prefetch == weight_arrays(gate_up)
    assert _attn(qkv, o, SMALL_M_MAX + 1, True, True, small, gate_up).side_prefetch is None
    assert _attn(qkv, o, 1, True, True, KernelPolicy(weight_prefetch_bytes=1024, side_prefetch_bytes=0),
                        gate_up).side_prefetch is None
