"""Llama-family decoder: Llama 2/3, Mistral, Qwen2 (q/k/v bias), Qwen3 (q/k RMSNorm), SmolLM.

    h = x + o(attn(rope(q), rope(k), v))      with RMSNorm before attention
    y = h + down(silu(gate(h')) * up(h'))     with RMSNorm before the MLP
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from lodestar.formats.config import ModelConfig
from lodestar.kernels import cpu_ops, triton_fused
from lodestar.models.cpu_layers import LlamaLayers
from lodestar.kernels.policy import active
from lodestar.kernels.triton_dense import SILU
from lodestar.layers.activation import silu_mul
from lodestar.layers.attention import AttentionBatch, paged_attention, write_kv
from lodestar.layers.cuda_linear import fork_side_prefetch, join_side_prefetch
from lodestar.layers.decode_plan import AttnStep, BlockPlan, HeadPlan, MlpStep, attn_step
from lodestar.layers.norm import RMSNorm
from lodestar.layers.rotary import RotaryEmbedding
from lodestar.models.validate import CheckpointError, TensorSpec
from lodestar.models.weights import WeightLoader, split_fused

# llama.cpp stores Llama/Mistral q and k rows interleaved for its rope; undo that at load.
# Hugging Face checkpoints (config.extra["hf_layout"]) keep the rotate-half order already.
PERMUTED_QK_ARCHS = {"llama", "mistral"}


@dataclass(frozen=True)
class LlamaArgs:
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    vocab_size: int
    rms_eps: float
    rope_theta: float
    rope_dim: int
    context_length: int
    permute_qk: bool
    rope_scale: float = 1.0

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> "LlamaArgs":
        return cls(cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_dim,
                   cfg.vocab_size, cfg.rms_eps, cfg.rope_theta, cfg.rope_dim, cfg.context_length,
                   cfg.arch in PERMUTED_QK_ARCHS and not cfg.extra.get("hf_layout", False), cfg.rope_scale)


def check_config(cfg: ModelConfig) -> None:
    """Hyper-parameters the Llama graph depends on: one head count for every layer, grouped
    query heads, one even head dimension for keys and values, an even rotary dimension."""
    a = cfg.arch
    for suffix in ("attention.head_count", "attention.head_count_kv"):
        per_layer = cfg.extra.get(f"{suffix}_per_layer")
        if per_layer is not None and len(set(per_layer)) > 1:
            raise CheckpointError(f"{a}.{suffix} differs between layers ({sorted(set(per_layer))}); "
                                  "lodestar needs one head count for every layer")
    if cfg.n_heads % cfg.n_kv_heads:
        raise CheckpointError(f"{a}.attention.head_count={cfg.n_heads} is not a multiple of "
                              f"{a}.attention.head_count_kv={cfg.n_kv_heads}")
    if cfg.head_dim % 2:
        raise CheckpointError(f"head dimension {cfg.head_dim} ({_head_dim_source(cfg)}) is odd; "
                              "rotary embeddings need an even one")
    if cfg.v_head_dim != cfg.head_dim:
        raise CheckpointError(f"{a}.attention.value_length={cfg.v_head_dim} differs from the key length "
                              f"{cfg.head_dim}; {a} models use one head dimension")
    if cfg.rope_dim % 2 or not 2 <= cfg.rope_dim <= cfg.head_dim:
        raise CheckpointError(f"{a}.rope.dimension_count is {cfg.rope_dim}; expected an even number from 2 "
                              f"to the head dimension {cfg.head_dim}")


def _head_dim_source(cfg: ModelConfig) -> str:
    if "attention.key_length" in cfg.extra:
        return f"{cfg.arch}.attention.key_length"
    return f"{cfg.arch}.embedding_length / {cfg.arch}.attention.head_count"


def trunk_tensors(cfg: ModelConfig) -> list[TensorSpec]:
    """Embedding, final norm, optional untied head and rope factors."""
    a, d, v = cfg.arch, cfg.d_model, cfg.vocab_size
    vocab = f"{a}.vocab_size={v}" if "vocab_size" in cfg.extra else f"the vocabulary size {v}"
    emb = f"{a}.embedding_length={d}"
    return [
        TensorSpec("token_embd.weight", (v, d), f"{vocab} and {emb}"),
        TensorSpec("output_norm.weight", (d,), emb),
        TensorSpec("output.weight", (v, d), f"{vocab} and {emb}", required=False),
        TensorSpec("rope_freqs.weight", (cfg.rope_dim // 2,), f"{a}.rope.dimension_count={cfg.rope_dim} / 2",
                   required=False),
    ]


def block_tensors(cfg: ModelConfig, i: int) -> list[TensorSpec]:
    """Block ``i``: norms, q/k/v/o (optional q/k/v biases and q/k norms), gate/up/down."""
    a, d, f, hd = cfg.arch, cfg.d_model, cfg.ffn_dim, cfg.head_dim
    p = f"blk.{i}."
    emb = f"{a}.embedding_length={d}"
    head = f"head dimension {hd}"
    q = f"{a}.attention.head_count={cfg.n_heads} x {head}"
    kv = f"{a}.attention.head_count_kv={cfg.n_kv_heads} x {head}"
    ffn = f"{a}.feed_forward_length={f}"
    nq, nkv = cfg.n_heads * hd, cfg.n_kv_heads * hd
    return [
        TensorSpec(p + "attn_norm.weight", (d,), emb),
        TensorSpec(p + "attn_q.weight", (nq, d), f"{q} and {emb}"),
        TensorSpec(p + "attn_k.weight", (nkv, d), f"{kv} and {emb}"),
        TensorSpec(p + "attn_v.weight", (nkv, d), f"{kv} and {emb}"),
        TensorSpec(p + "attn_output.weight", (d, nq), f"{emb} and {q}"),
        TensorSpec(p + "attn_q.bias", (nq,), q, required=False, group=p + "bias"),
        TensorSpec(p + "attn_k.bias", (nkv,), kv, required=False, group=p + "bias"),
        TensorSpec(p + "attn_v.bias", (nkv,), kv, required=False, group=p + "bias"),
        TensorSpec(p + "attn_q_norm.weight", (hd,), head, required=False, group=p + "qk_norm"),
        TensorSpec(p + "attn_k_norm.weight", (hd,), head, required=False, group=p + "qk_norm"),
        TensorSpec(p + "ffn_norm.weight", (d,), emb),
        TensorSpec(p + "ffn_gate.weight", (f, d), f"{ffn} and {emb}"),
        TensorSpec(p + "ffn_up.weight", (f, d), f"{ffn} and {emb}"),
        TensorSpec(p + "ffn_down.weight", (d, f), f"{emb} and {ffn}"),
    ]


def unpermute_rows(n_rows: int, n_heads: int) -> torch.Tensor:
    """Row order that turns llama.cpp's interleaved q/k rows back into rotate-half layout."""
    half = n_rows // n_heads // 2
    return torch.arange(n_rows).reshape(n_heads, half, 2).transpose(1, 2).reshape(-1)


class LlamaAttention(nn.Module):
    def __init__(self, a: LlamaArgs, w: WeightLoader, i: int, rope: RotaryEmbedding,
                 norm_cls: type[RMSNorm] = RMSNorm, sliding_window: int | None = None,
                 scale: float | None = None) -> None:
        super().__init__()
        p = f"blk.{i}."
        hd = a.head_dim
        split = w.attention_split(a.n_heads, a.n_kv_heads)   # every head unless tensor-parallel
        self.n_heads, self.n_kv_heads, self.head_dim = split.n_heads, split.n_kv_heads, hd
        self.sizes = (split.n_heads * hd, split.n_kv_heads * hd, split.n_kv_heads * hd)
        full = (a.n_heads * hd, a.n_kv_heads * hd, a.n_kv_heads * hd)
        orders = [unpermute_rows(full[0], a.n_heads), unpermute_rows(full[1], a.n_kv_heads),
                  None] if a.permute_qk else None
        if self.sizes != full:   # this rank's rows of q, k, v (permutations stay within a head)
            ranges = [(split.q0 * hd, split.q1 * hd)] + [(split.kv0 * hd, split.kv1 * hd)] * 2
            orders = [(o if o is not None else torch.arange(n))[r0:r1]
                      for o, n, (r0, r1) in zip(orders or [None] * 3, full, ranges)]
        names = [p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"]
        qkv = w.linears(names, orders)
        self.qkv = nn.ModuleList(qkv) if isinstance(qkv, list) else qkv
        bias = [p + "attn_q.bias", p + "attn_k.bias", p + "attn_v.bias"]
        self.qkv_bias = None
        if w.has(bias[0]):
            bs = [w.vector(n) for n in bias]
            if orders is not None:
                bs = [b[o] if o is not None else b for b, o in zip(bs, orders)]
            self.qkv_bias = nn.Parameter(torch.cat(bs), requires_grad=False)
        self.q_norm = self.k_norm = None
        if w.has(p + "attn_q_norm.weight"):
            self.q_norm = norm_cls(w.vector(p + "attn_q_norm.weight"), a.rms_eps)
            self.k_norm = norm_cls(w.vector(p + "attn_k_norm.weight"), a.rms_eps)
        self.o = w.row_parallel_linear(p + "attn_output.weight", (split.q0 * hd, split.q1 * hd))
        self.rope = rope
        self.scale = a.head_dim ** -0.5 if scale is None else scale
        self.sliding_window = sliding_window
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    @property
    def rotates_in_qkv(self) -> bool:
        """The q|k|v projection's kernel can rotate q, k and store k, v itself (fusion ``qkv_rope``):
        packed, no bias, no q/k norm (applied before the rotation), the whole head rotates."""
        return (hasattr(self.qkv, "rope_store") and self.qkv_bias is None and self.q_norm is None
                and self.rope.rotary_dim == self.head_dim)

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        T = x.shape[0]
        q, k, v = split_fused(self.qkv, x, self.sizes)
        if self.qkv_bias is not None:
            q, k, v = (t + b for t, b in zip((q, k, v), self.qkv_bias.split(self.sizes)))
        q = q.view(T, self.n_heads, self.head_dim)
        k = k.view(T, self.n_kv_heads, self.head_dim)
        v = v.view(T, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None:
            if not q.is_cuda:            # contiguous: the compiled norm, as the fused layer loop runs it
                q, k = q.contiguous(), k.contiguous()
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def forward(self, x: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
                step: AttnStep | None = None) -> torch.Tensor:
        """Attention of ``x [T, d]``; on the GPU as ``step`` (``decode_plan.AttnStep``) says
        (worked out here when not given)."""
        T = x.shape[0]
        if batch.gpu is None:
            q, k, v = self._qkv(x)
            if not (self.rope.covers(positions) and cpu_ops.rope_store(
                    q, k, v, positions, batch.slot_mapping, self.rope.cos, self.rope.sin, self.k_cache, self.v_cache)):
                q, k = self.rope(positions, q, k)
                write_kv(self.k_cache, self.v_cache, k, v, batch)
            o = paged_attention(q, self.k_cache, self.v_cache, batch, self.scale, self.sliding_window)
            return self.o(o.reshape(T, -1))
        if step is None:
            step = attn_step(self.qkv, self.o, T, x.dtype == torch.bfloat16, self.rotates_in_qkv, active())
        g = batch.gpu
        rope = (self.qkv.rope_store(x, positions, g.slot_mapping, self.rope.cos, self.rope.sin, self.k_cache,
                                    self.v_cache, self.sizes[0], self.sizes[1], self.head_dim)
                if step.rope_in_qkv else None)
        if rope is not None:    # rotated and stored by the projection's kernel
            q = self.qkv.forward_rope(x, rope)[:, :self.sizes[0]].view(T, self.n_heads, self.head_dim)
        else:
            q, k, v = self._qkv(x)
        if step.side_prefetch is not None:
            fork_side_prefetch(step.side_prefetch)
        if rope is None:
            q = self.rope.rotate_and_store(positions, q, k, v, self.k_cache, self.v_cache, g.slot_mapping,
                                           prefetch=step.o_prefetch)
        o = paged_attention(q, self.k_cache, self.v_cache, batch, self.scale, self.sliding_window, step.quantize_o)
        return self.o(o.reshape(T, -1) if isinstance(o, torch.Tensor) else o)    # else QuantizedRows [T, Hq * D]


def mlp_projections(a: LlamaArgs, w: WeightLoader, i: int) -> tuple[nn.Module, nn.Module, int]:
    """(gate|up, down, hidden units) of block ``i``'s MLP, this rank's units only."""
    p = f"blk.{i}."
    f0, f1 = w.ffn_split(a.ffn_dim, p + "ffn_down.weight")
    rows = None if (f0, f1) == (0, a.ffn_dim) else torch.arange(f0, f1)
    gu = w.linears([p + "ffn_gate.weight", p + "ffn_up.weight"], None if rows is None else [rows, rows])
    gate_up = nn.ModuleList(gu) if isinstance(gu, list) else gu
    return gate_up, w.row_parallel_linear(p + "ffn_down.weight", (f0, f1)), f1 - f0


def fused_glu(gate_up: torch.Tensor, ffn: int, kind: int, torch_form) -> torch.Tensor:
    """``act(gate) * up`` of a fused gate|up output: the compiled kernel, else ``torch_form``."""
    act = cpu_ops.glu(gate_up, ffn, kind)
    return act if act is not None else torch_form(*gate_up.split([ffn, ffn], dim=-1))


class LlamaMLP(nn.Module):
    def __init__(self, a: LlamaArgs, w: WeightLoader, i: int) -> None:
        super().__init__()
        self.gate_up, self.down, self.ffn_dim = mlp_projections(a, w, i)

    def forward(self, x, step: MlpStep | None = None) -> torch.Tensor:
        """``down(silu(gate(x)) * up(x))``; on the GPU as ``step`` (``decode_plan.MlpStep``) says.
        ``x`` may be ``QuantizedRows`` or a ``triton_dense.PendingNorm`` there."""
        form = "plain" if step is None else step.form
        if form == "plain" and isinstance(x, torch.Tensor) and not x.is_cuda \
                and not isinstance(self.gate_up, nn.ModuleList):
            return self.down(fused_glu(self.gate_up(x), self.ffn_dim, cpu_ops.GLU_SILU, silu_mul))
        if form == "glu_epilogue":
            return self.down(self.gate_up.forward_glu(x, SILU))
        if form == "plain":
            gate, up = split_fused(self.gate_up, x, (self.ffn_dim, self.ffn_dim))
            return self.down(silu_mul(gate, up))
        if form == "glu_quant":
            act = self.gate_up.forward_glu_quant(x, self.ffn_dim, SILU)
        else:   # quant: the activation kernel quantizes for down
            gate, up = split_fused(self.gate_up, x, (self.ffn_dim, self.ffn_dim))
            act = triton_fused.silu_mul(gate, up, quantize=True, prefetch=step.act_prefetch,
                                        launch_next=step.act_launch_next)
        return self.down.forward_partials(act) if step.down_partials else self.down(act)


class LlamaBlock(nn.Module):
    def __init__(self, a: LlamaArgs, w: WeightLoader, i: int, rope: RotaryEmbedding) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(w.vector(f"blk.{i}.attn_norm.weight"), a.rms_eps)
        self.attn = LlamaAttention(a, w, i, rope)
        self.ffn_norm = RMSNorm(w.vector(f"blk.{i}.ffn_norm.weight"), a.rms_eps)
        self.mlp = LlamaMLP(a, w, i)
        self.plan = BlockPlan(self)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        h, y = self.ffn_norm.add_norm(x, self.attn(self.attn_norm(x), positions, batch))
        return h + self.mlp(y)

    def forward_gpu(self, x: torch.Tensor, delta, positions: torch.Tensor,
                    batch: AttentionBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward`` on the GPU as this block's ``BlockPlan`` says (the same bits). ``delta`` is
        the previous block's MLP output not yet added to ``x`` (None if it was); returns ``(h,
        mlp_out)``, whose sum is the block's output, added by the caller or the next norm."""
        step = self.plan.step(x)
        x, xn = self.attn_norm.run(x, delta, step.attn_norm)
        h, y = self.ffn_norm.run(x, self.attn(xn, positions, batch, step.attn), step.ffn_norm)
        return h, self.mlp(y, step.mlp)


class LlamaModel(nn.Module):
    """Trunk (embedding → blocks → final norm) plus a separate head."""

    check_config = staticmethod(check_config)

    @staticmethod
    def expected_tensors(cfg: ModelConfig) -> list[TensorSpec]:
        return trunk_tensors(cfg) + [s for i in range(cfg.n_layers) for s in block_tensors(cfg, i)]

    def __init__(self, cfg: ModelConfig, w: WeightLoader) -> None:
        super().__init__()
        self.config = cfg
        a = self.args = LlamaArgs.from_config(cfg)
        freq_factors = w.vector("rope_freqs.weight") if w.has("rope_freqs.weight") else None
        # One table for all layers; not a registered child of each block.
        self.rope = RotaryEmbedding(a.rope_dim, a.rope_theta, min(a.context_length, 4096), freq_factors,
                                    a.rope_scale)
        self.embed = w.embedding("token_embd.weight")
        self.layers = nn.ModuleList(LlamaBlock(a, w, i, self.rope) for i in range(a.n_layers))
        self.norm = RMSNorm(w.vector("output_norm.weight"), a.rms_eps)
        self.head = w.head("output.weight", self.embed)
        self.head_plan = HeadPlan(self.head)
        # CPU: the layer loop in one compiled call where the model qualifies (models.cpu_layers; the
        # same bits). Tests and the step profiler turn it off to run the per-operation graph.
        self.fused_cpu_layers = True
        self._cpu_layers: LlamaLayers | bool | None = None

    @property
    def attention_layers(self) -> list[LlamaAttention]:
        return [blk.attn for blk in self.layers]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        h = self.embed(input_ids)
        if h.is_cuda:
            return self._forward_gpu(h, positions, batch)
        if self.fused_cpu_layers:
            if self._cpu_layers is None:
                self._cpu_layers = LlamaLayers.of(self) or False
            if self._cpu_layers and self._cpu_layers.run(h, positions, batch):
                return self.norm(h)
        for blk in self.layers:
            h = blk(h, positions, batch)
        return self.norm(h)

    def _forward_gpu(self, h: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        add_residual = "residual" not in active().fusions     # else the next norm adds it
        delta = None
        for blk in self.layers:
            h, delta = blk.forward_gpu(h, delta, positions, batch)
            if add_residual:
                h, delta = h + delta, None
        join_side_prefetch()
        return self.norm.run(h, delta, self.head_plan.step(h))[1]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden).float()
