"""What each kernel of a GPU step fuses, prefetches or launches early, decided once per block.

A Llama-family block on the GPU runs norm -> q|k|v (+ RoPE) -> attention -> o -> norm ->
gate|up -> activation -> down. Which of those kernels may do their neighbour's work (the
policy's fusions, ``kernels/policy.py``), which weights a small kernel asks L2 for ahead of the
projection after it, and which projection may launch before the kernel before it waits,
depends only on the policy, the projections' types and tilings, and the kind of step: one
row, a few rows (decode, at most ``SMALL_M_MAX``), or many (prefill). ``BlockPlan`` works that
out once for each kind and hands the block a ``BlockStep``: a model's forward then reads as
the math, with no capability checks per call. Every choice gives the same bits as the
unfused path (except the ``glu_quant`` tiling; ``policy.FUSIONS``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from gguf.constants import GGMLQuantizationType

from lodestar.kernels import triton_dense as td
from lodestar.kernels.gemv_tiling import glu_epilogue_ok, loads_all_before_wait
from lodestar.kernels.launch import SMALL_M_MAX
from lodestar.kernels.policy import KernelPolicy, active
from lodestar.kernels.quant_layout import quantizable
from lodestar.layers.cuda_linear import CudaDenseLinear, CudaQuantLinear, CudaQuantStack, weight_arrays

# Types whose down projection launches before the activation kernel ahead of it waits (faster
# on the H200 for Q4_K only).
EARLY_DOWN_TYPES = (GGMLQuantizationType.Q4_K,)


@dataclass(frozen=True)
class NormStep:
    """How an RMSNorm feeding a projection runs."""

    quantize: bool = False          # also emit x quantized for the packed projection (fusion quant)
    pending: bool = False           # leave the norm to the dense projection's kernel (dense_norm)
    prefetch: list[torch.Tensor] | None = None     # the projection's weights, asked of L2
    launch_next: bool = False       # the projection may launch before this kernel waits


@dataclass(frozen=True)
class AttnStep:
    """How the attention of a block runs between its q|k|v and o projections."""

    rope_in_qkv: bool = False       # the q|k|v kernel rotates and stores k, v (qkv_rope)
    quantize_o: bool = False        # decode attention quantizes x for a packed o (attn_quant)
    o_prefetch: list[torch.Tensor] | None = None   # o's weights, asked of L2 by the RoPE kernel
    side_prefetch: list[torch.Tensor] | None = None  # gate|up's first bytes, from a second stream


@dataclass(frozen=True)
class MlpStep:
    """How the gated MLP runs: ``plain`` (projection, activation kernel, projection),
    ``glu_epilogue`` (a dense gate|up applies the activation), ``glu_quant`` (a packed gate|up
    applies it and quantizes for down) or ``quant`` (the activation kernel quantizes for down)."""

    form: str = "plain"
    act_prefetch: list[torch.Tensor] | None = None  # down's weights, asked of L2 by the activation kernel
    act_launch_next: bool = False
    down_partials: bool = False     # down leaves its K-split sums to the next norm (norm_sum)


@dataclass(frozen=True)
class BlockStep:
    attn_norm: NormStep
    attn: AttnStep
    ffn_norm: NormStep
    mlp: MlpStep


def _first(module: object) -> object:
    return module.parts[0] if isinstance(module, CudaQuantStack) else module


def _launches_early(module: object, rows: int, down: bool = False) -> bool:
    """The projection may launch before the small kernel ahead of it waits: its programs read
    all their weights before their own wait, or it is a down projection of ``EARLY_DOWN_TYPES``."""
    m = _first(module)
    if not isinstance(m, CudaQuantLinear):
        return False
    return loads_all_before_wait(m.weight, rows) or (down and m.qtype in EARLY_DOWN_TYPES)


def _quantized(module: object) -> bool:
    return isinstance(module, (CudaQuantLinear, CudaQuantStack))


def _dense_small(module: object) -> bool:
    """A bf16 dense projection small enough that the norm feeding one row is best left to its
    kernel (and, for a gate|up, the activation too)."""
    return (isinstance(module, CudaDenseLinear) and module.weight.dtype == torch.bfloat16
            and module.weight.numel() <= td.FUSE_MAX_WEIGHT)


def _side_prefetch(gate_up: object, pol: KernelPolicy) -> list[torch.Tensor] | None:
    """gate|up's weights for the side prefetch: packed, and too large for the norm before it to
    ask for whole."""
    mods = list(gate_up) if isinstance(gate_up, torch.nn.ModuleList) else [gate_up]
    if pol.side_prefetch_bytes <= 0 or pol.weight_prefetch_bytes <= 0 or not all(_quantized(m) for m in mods):
        return None
    arrays = weight_arrays(gate_up)
    if not arrays or sum(a.numel() * a.element_size() for a in arrays) <= pol.weight_prefetch_bytes:
        return None
    return arrays


def attn_step(qkv: object, o: object, rows: int, bf16: bool, rope_ok: bool, pol: KernelPolicy,
              gate_up: object = None) -> AttnStep:
    """``AttnStep`` for ``rows`` rows; ``rope_ok``: the layer's own q|k|v can rotate in its kernel
    (no bias, no q/k norm, the whole head rotates)."""
    decode = 0 < rows <= SMALL_M_MAX
    prefetch = weight_arrays(o) if pol.weight_prefetch_bytes > 0 else None
    return AttnStep(rope_in_qkv=rope_ok and decode and bf16 and "qkv_rope" in pol.fusions,
                    quantize_o=_quantized(o), o_prefetch=prefetch,
                    side_prefetch=_side_prefetch(gate_up, pol) if decode and gate_up is not None else None)


def block_step(blk, rows: int, bf16: bool, pol: KernelPolicy) -> BlockStep:
    """The ``BlockStep`` of a Llama block ``blk`` (``attn.qkv``, ``attn.o``, ``mlp.gate_up``,
    ``mlp.down``) for steps of ``rows`` rows of ``bf16`` (else fp32) activations."""
    qkv, o, gate_up, down, ffn = blk.attn.qkv, blk.attn.o, blk.mlp.gate_up, blk.mlp.down, blk.mlp.ffn_dim
    d = blk.attn_norm.weight.shape[0]
    fuse = pol.fusions
    prefetch = (lambda m: weight_arrays(m)) if pol.weight_prefetch_bytes > 0 else (lambda m: None)
    quant = "quant" in fuse and bf16 and quantizable(rows, d)
    one_row = bf16 and rows == 1 and td.enabled()
    pending_attn = "dense_norm" in fuse and one_row and _dense_small(qkv)
    pending_mlp = "dense_norm" in fuse and one_row and _dense_small(gate_up)
    attn_norm = NormStep(quantize=quant and _quantized(qkv) and not pending_attn, pending=pending_attn,
                         prefetch=prefetch(qkv), launch_next=_launches_early(qkv, rows))
    ffn_norm = NormStep(quantize=quant and _quantized(gate_up) and not pending_mlp, pending=pending_mlp,
                        prefetch=prefetch(gate_up), launch_next=_launches_early(gate_up, rows))
    q_down = quant and quantizable(rows, ffn) and _quantized(down)
    if q_down:
        glu = ("glu_quant" in fuse and isinstance(gate_up, CudaQuantLinear)
               and glu_epilogue_ok(gate_up.weight, rows, ffn))
        mlp = MlpStep("glu_quant" if glu else "quant", act_prefetch=prefetch(down),
                      act_launch_next=_launches_early(down, rows, down=True),
                      down_partials=isinstance(down, CudaQuantLinear) and {"norm_sum", "residual"} <= fuse)
    elif ("glu_epilogue" in fuse and one_row and _dense_small(gate_up)
          and td.glu_epilogue_fits(gate_up.gemv_config, gate_up.out_features, gate_up.in_features)):
        mlp = MlpStep("glu_epilogue")
    else:
        mlp = MlpStep()
    rope_ok = blk.attn.rotates_in_qkv
    return BlockStep(attn_norm, attn_step(qkv, o, rows, bf16, rope_ok, pol, gate_up), ffn_norm, mlp)


class StepPlans:
    """Steps worked out by ``build(rows, bf16, policy)`` once for each kind of step (one row,
    up to ``SMALL_M_MAX`` rows, more; bf16 or not) under the policy in force, and again only
    if another policy is installed."""

    def __init__(self, build) -> None:
        self._build = build
        self._policy: KernelPolicy | None = None
        self._steps: dict[tuple[int, bool], object] = {}

    def step(self, x: torch.Tensor):
        rows = x.shape[0]
        key = (min(rows, 2) if rows <= SMALL_M_MAX else SMALL_M_MAX + 1, x.dtype == torch.bfloat16)
        pol = active()
        if pol is not self._policy:
            self._policy, self._steps = pol, {}
        step = self._steps.get(key)
        if step is None:
            step = self._steps[key] = self._build(rows, key[1], pol)
        return step


class BlockPlan(StepPlans):
    """A Llama block's ``BlockStep`` for each kind of step."""

    def __init__(self, blk) -> None:
        super().__init__(lambda rows, bf16, pol: block_step(blk, rows, bf16, pol))


class HeadPlan(StepPlans):
    """The final norm's ``NormStep``: the head's weights asked of L2, an early launch."""

    def __init__(self, head) -> None:
        super().__init__(lambda rows, bf16, pol: NormStep(
            prefetch=weight_arrays(head) if pol.weight_prefetch_bytes > 0 else None,
            launch_next=_launches_early(head, rows)))
