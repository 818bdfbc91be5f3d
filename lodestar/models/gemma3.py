"""Gemma 3 text decoder.

Differences from Llama: embeddings scaled by sqrt(d_model); RMSNorm as ``x * (1 + w)``
before *and after* attention and MLP; q/k RMSNorm per head; GeGLU (tanh GELU) MLP;
five sliding-window layers (local rope base) for every global layer; tied head.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from lodestar.formats.config import ModelConfig
from lodestar.kernels import cpu_ops
from lodestar.models.cpu_layers import LlamaLayers
from lodestar.kernels.policy import active
from lodestar.kernels.triton_dense import GELU_TANH
from lodestar.layers.activation import gelu_tanh_mul
from lodestar.layers.attention import AttentionBatch
from lodestar.layers.cuda_linear import CudaDenseLinear
from lodestar.layers.norm import OffsetRMSNorm
from lodestar.layers.rotary import RotaryEmbedding
from lodestar.models.llama import (LlamaArgs, LlamaAttention, block_tensors, check_config, fused_glu, mlp_projections,
                                   trunk_tensors)
from lodestar.models.validate import CheckpointError, TensorSpec
from lodestar.models.weights import WeightLoader, split_fused


@dataclass(frozen=True)
class Gemma3Args:
    base: LlamaArgs
    sliding_window: int
    sliding_window_pattern: int     # every n-th layer is global
    rope_local_theta: float
    query_pre_attn_scalar: float

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> "Gemma3Args":
        e = cfg.extra
        return cls(
            base=LlamaArgs.from_config(cfg),
            sliding_window=cfg.sliding_window or 4096,
            sliding_window_pattern=int(e.get("sliding_window_pattern", 6)),
            rope_local_theta=float(e.get("rope_local_theta", 10000.0)),
            query_pre_attn_scalar=float(e.get("query_pre_attn_scalar", cfg.head_dim)),
        )

    def is_global(self, i: int) -> bool:
        return (i + 1) % self.sliding_window_pattern == 0


class Gemma3MLP(nn.Module):
    def __init__(self, a: LlamaArgs, w: WeightLoader, i: int) -> None:
        super().__init__()
        self.gate_up, self.down, self.ffn_dim = mlp_projections(a, w, i)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # a CUDA dense gate|up (cuda_linear.CudaDenseLinear) applying the activation itself: one
        # kernel, the same bits
        if isinstance(self.gate_up, CudaDenseLinear) and "glu_epilogue" in active().fusions \
                and self.gate_up.fuses_glu(x):
            return self.down(self.gate_up.forward_glu(x, GELU_TANH))
        if not x.is_cuda and not isinstance(self.gate_up, nn.ModuleList):
            return self.down(fused_glu(self.gate_up(x), self.ffn_dim, cpu_ops.GLU_GELU_TANH, gelu_tanh_mul))
        gate, up = split_fused(self.gate_up, x, (self.ffn_dim, self.ffn_dim))
        return self.down(gelu_tanh_mul(gate, up))


class Gemma3Block(nn.Module):
    def __init__(self, g: Gemma3Args, w: WeightLoader, i: int, rope_global: RotaryEmbedding,
                 rope_local: RotaryEmbedding) -> None:
        super().__init__()
        a, p = g.base, f"blk.{i}."
        glob = g.is_global(i)
        self.attn_norm = OffsetRMSNorm(w.vector(p + "attn_norm.weight"), a.rms_eps)
        self.attn = LlamaAttention(a, w, i, rope_global if glob else rope_local, norm_cls=OffsetRMSNorm,
                                   sliding_window=None if glob else g.sliding_window,
                                   scale=g.query_pre_attn_scalar ** -0.5)
        self.post_attn_norm = OffsetRMSNorm(w.vector(p + "post_attention_norm.weight"), a.rms_eps)
        self.ffn_norm = OffsetRMSNorm(w.vector(p + "ffn_norm.weight"), a.rms_eps)
        self.mlp = Gemma3MLP(a, w, i)
        self.post_ffn_norm = OffsetRMSNorm(w.vector(p + "post_ffw_norm.weight"), a.rms_eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        h = x + self.post_attn_norm(self.attn(self.attn_norm(x), positions, batch))
        return h + self.post_ffn_norm(self.mlp(self.ffn_norm(h)))


def check_gemma3_config(cfg: ModelConfig) -> None:
    """Llama's checks plus the extras ``Gemma3Args`` reads."""
    check_config(cfg)
    e, a = cfg.extra, cfg.arch
    pattern = e.get("sliding_window_pattern", 6)
    if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
        raise CheckpointError(f"{a}.sliding_window_pattern is {pattern!r}; expected a positive int")
    for name in ("rope_local_theta", "query_pre_attn_scalar"):
        value = e.get(name, 1.0)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
            raise CheckpointError(f"{a}.{name} is {value!r}; expected a positive number")


def gemma3_tensors(cfg: ModelConfig) -> list[TensorSpec]:
    """Llama's tensors with required q/k norms and the norms after attention and MLP."""
    d = cfg.d_model
    emb = f"{cfg.arch}.embedding_length={d}"
    specs = trunk_tensors(cfg)
    for i in range(cfg.n_layers):
        p = f"blk.{i}."
        specs += [replace(s, required=True, group=None) if s.group == p + "qk_norm" else s
                  for s in block_tensors(cfg, i)]
        specs += [TensorSpec(p + "post_attention_norm.weight", (d,), emb),
                  TensorSpec(p + "post_ffw_norm.weight", (d,), emb)]
    return specs


class Gemma3Model(nn.Module):
    check_config = staticmethod(check_gemma3_config)
    expected_tensors = staticmethod(gemma3_tensors)

    def __init__(self, cfg: ModelConfig, w: WeightLoader) -> None:
        super().__init__()
        self.config = cfg
        g = self.args = Gemma3Args.from_config(cfg)
        a = g.base
        n = min(a.context_length, 4096)
        self.rope_global = RotaryEmbedding(a.rope_dim, a.rope_theta, n, scale=a.rope_scale)   # local: unscaled
        self.rope_local = RotaryEmbedding(a.rope_dim, g.rope_local_theta, n)
        self.embed = w.embedding("token_embd.weight")
        self.embed_scale = torch.tensor(a.d_model ** 0.5, dtype=torch.float32)
        self.layers = nn.ModuleList(Gemma3Block(g, w, i, self.rope_global, self.rope_local)
                                    for i in range(a.n_layers))
        self.norm = OffsetRMSNorm(w.vector("output_norm.weight"), a.rms_eps)
        self.head = w.head("output.weight", self.embed)
        self.fused_cpu_layers = True        # as LlamaModel's: the layer loop in one compiled call
        self._cpu_layers: LlamaLayers | bool | None = None

    @property
    def attention_layers(self) -> list[LlamaAttention]:
        return [blk.attn for blk in self.layers]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        h = self.embed(input_ids) * self.embed_scale
        if not h.is_cuda and self.fused_cpu_layers:
            if self._cpu_layers is None:
                self._cpu_layers = LlamaLayers.of(self) or False
            if self._cpu_layers and self._cpu_layers.run(h, positions, batch):
                return self.norm(h)
        for blk in self.layers:
            h = blk(h, positions, batch)
        return self.norm(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden).float()
