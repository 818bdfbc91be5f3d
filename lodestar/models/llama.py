"""Llama-family decoder: Llama 2/3, Mistral, Qwen2 (q/k/v bias), Qwen3 (q/k RMSNorm), SmolLM.

    h = x + o(attn(rope(q), rope(k), v))      with RMSNorm before attention
    y = h + down(silu(gate(h')) * up(h'))     with RMSNorm before the MLP
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from lodestar.formats.config import ModelConfig
from lodestar.layers.activation import silu_mul
from lodestar.layers.attention import AttentionBatch, paged_attention, write_kv
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

    def _rope_store(self, x, positions: torch.Tensor, batch: AttentionBatch):
        """The q|k|v kernel's own RoPE + KV store (fusion ``qkv_rope``; ``CudaQuantLinear.rope_store``),
        or None: not on the GPU, separate q/k/v, a bias or q/k norms (applied before the rotation),
        a partial rotary dim."""
        if (batch.gpu is None or self.qkv_bias is not None or self.q_norm is not None
                or self.rope.rotary_dim != self.head_dim or not hasattr(self.qkv, "rope_store")):
            return None
        return self.qkv.rope_store(x, positions, batch.gpu.slot_mapping, self.rope.cos, self.rope.sin,
                                   self.k_cache, self.v_cache, self.sizes[0], self.sizes[1], self.head_dim)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
                after_qkv=None) -> torch.Tensor:
        """``after_qkv``: called (no arguments) once the q|k|v projection is launched."""
        T = x.shape[0]
        rope = self._rope_store(x, positions, batch)
        if rope is not None:    # rotated and stored by the projection's kernel
            from lodestar.layers.cuda_linear import takes_quantized_input
            q = self.qkv.forward_rope(x, rope)[:, :self.sizes[0]].view(T, self.n_heads, self.head_dim)
            if after_qkv is not None:
                after_qkv()
            o = paged_attention(q, self.k_cache, self.v_cache, batch, self.scale, self.sliding_window, None,
                                takes_quantized_input(self.o))
            return self.o(o.reshape(T, -1) if isinstance(o, torch.Tensor) else o)
        q, k, v = split_fused(self.qkv, x, self.sizes)
        if after_qkv is not None:
            after_qkv()
        if self.qkv_bias is not None:
            q, k, v = (t + b for t, b in zip((q, k, v), self.qkv_bias.split(self.sizes)))
        q = q.view(T, self.n_heads, self.head_dim)
        k = k.view(T, self.n_kv_heads, self.head_dim)
        v = v.view(T, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        new, quantize = None, False
        if batch.gpu is not None:
            from lodestar.layers.attention import decode_new_tokens
            from lodestar.layers.cuda_linear import prefetch_arrays, takes_quantized_input
            quantize = takes_quantized_input(self.o)    # a decode step may quantize for it (attn_quant)
            # decode step, fusion attn_rope: the attention kernel rotates q and k and stores k, v
            new = decode_new_tokens(batch, positions, q, k, v, self.k_cache, self.v_cache, self.rope)
            if new is None:     # rotation and the KV store in one kernel
                q = self.rope.rotate_and_store(positions, q, k, v, self.k_cache, self.v_cache,
                                               batch.gpu.slot_mapping, prefetch=prefetch_arrays(self.o, "o"))
        else:
            q, k = self.rope(positions, q, k)
            write_kv(self.k_cache, self.v_cache, k, v, batch)
        o = paged_attention(q, self.k_cache, self.v_cache, batch, self.scale, self.sliding_window, new, quantize)
        return self.o(o.reshape(T, -1) if isinstance(o, torch.Tensor) else o)    # else QuantizedRows [T, Hq * D]


def mlp_projections(a: LlamaArgs, w: WeightLoader, i: int) -> tuple[nn.Module, nn.Module, int]:
    """(gate|up, down, hidden units) of block ``i``'s MLP, this rank's units only."""
    p = f"blk.{i}."
    f0, f1 = w.ffn_split(a.ffn_dim, p + "ffn_down.weight")
    rows = None if (f0, f1) == (0, a.ffn_dim) else torch.arange(f0, f1)
    gu = w.linears([p + "ffn_gate.weight", p + "ffn_up.weight"], None if rows is None else [rows, rows])
    gate_up = nn.ModuleList(gu) if isinstance(gu, list) else gu
    return gate_up, w.row_parallel_linear(p + "ffn_down.weight", (f0, f1)), f1 - f0


class LlamaMLP(nn.Module):
    def __init__(self, a: LlamaArgs, w: WeightLoader, i: int) -> None:
        super().__init__()
        self.gate_up, self.down, self.ffn_dim = mlp_projections(a, w, i)

    def forward(self, x, quantize: bool = False, glu_epilogue: bool = False) -> torch.Tensor:
        """``quantize`` (GPU): the activation kernel also quantizes its output for ``down``
        (fusion ``glu_quant``: a packed gate|up projection does both itself);
        ``norm_sum`` with ``residual`` (GPU, fusions of those names): a quantized down
        projection may return ``triton_quant.SplitPartials``, which the next RMSNorm sums.
        ``glu_epilogue`` (GPU, fusion of that name): a dense gate|up projection running one
        row through its matrix-vector kernel applies the activation to its own output
        (``CudaDenseLinear.forward_glu``; no activation kernel, same bits). ``x`` may be a
        ``triton_dense.PendingNorm``."""
        if glu_epilogue and not quantize:
            from lodestar.kernels.triton_dense import SILU
            from lodestar.layers.cuda_linear import takes_glu_epilogue
            if takes_glu_epilogue(self.gate_up, x):
                return self.down(self.gate_up.forward_glu(x, SILU))
        if quantize:
            from lodestar.kernels import triton_fused
            from lodestar.kernels.triton_dense import SILU
            from lodestar.kernels.triton_quant import fusions
            from lodestar.layers.cuda_linear import CudaQuantLinear, launch_early, prefetch_arrays, takes_glu_quant
            if takes_glu_quant(self.gate_up, x, self.ffn_dim):
                act = self.gate_up.forward_glu_quant(x, self.ffn_dim, SILU)
            else:
                gate, up = split_fused(self.gate_up, x, (self.ffn_dim, self.ffn_dim))
                act = triton_fused.silu_mul(gate, up, quantize=True, prefetch=prefetch_arrays(self.down, "down"),
                                            launch_next=launch_early("down", self.down, gate.shape[0]))
            if isinstance(self.down, CudaQuantLinear) and {"norm_sum", "residual"} <= fusions():
                return self.down.forward_partials(act)     # summed by the next RMSNorm
            return self.down(act)
        gate, up = split_fused(self.gate_up, x, (self.ffn_dim, self.ffn_dim))
        return self.down(silu_mul(gate, up))


class LlamaBlock(nn.Module):
    def __init__(self, a: LlamaArgs, w: WeightLoader, i: int, rope: RotaryEmbedding) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(w.vector(f"blk.{i}.attn_norm.weight"), a.rms_eps)
        self.attn = LlamaAttention(a, w, i, rope)
        self.ffn_norm = RMSNorm(w.vector(f"blk.{i}.ffn_norm.weight"), a.rms_eps)
        self.mlp = LlamaMLP(a, w, i)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        h, y = self.ffn_norm.add_norm(x, self.attn(self.attn_norm(x), positions, batch))
        return h + self.mlp(y)

    def forward_gpu(self, x: torch.Tensor, delta: torch.Tensor | None, positions: torch.Tensor,
                    batch: AttentionBatch, fuse: frozenset[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward`` on the GPU with the decode fusions in ``fuse`` (``triton_quant.fusions``).

        ``delta`` is the previous block's MLP output not yet added to ``x`` (None if it was;
        ``triton_quant.SplitPartials`` with ``norm_sum``); the first norm adds it. Returns
        ``(h, mlp_out)``: the block's output is their sum, which the caller adds, or leaves to
        the next norm. Every fusion gives the same bits. With
        ``dense_norm`` the residual stream ``x``/``h`` is written by the projection that fuses
        the norm, so it is read only after that projection ran."""
        from lodestar.kernels.triton_quant import SplitPartials, quantizable
        from lodestar.layers.cuda_linear import (fork_side_prefetch, launch_early, prefetch_arrays,
                                                 takes_norm_prologue, takes_pending_input, takes_quantized_input)
        quant = "quant" in fuse and x.dtype == torch.bfloat16
        q_attn = quant and quantizable(x.shape[0], x.shape[1]) and takes_quantized_input(self.attn.qkv)
        q_mlp = quant and quantizable(x.shape[0], x.shape[1]) and takes_quantized_input(self.mlp.gate_up)
        q_down = quant and quantizable(x.shape[0], self.mlp.ffn_dim) and takes_quantized_input(self.mlp.down)
        # small dense one-row projections compute the norm feeding them themselves
        n_attn = (("dense_norm" in fuse and takes_pending_input(self.attn.qkv, x))
                  or ("quant_norm" in fuse and takes_norm_prologue(self.attn.qkv, x)))
        n_mlp = "dense_norm" in fuse and takes_pending_input(self.mlp.gate_up, x)
        if n_attn:
            if isinstance(delta, SplitPartials):
                delta = delta.materialize()
            x, xn = self.attn_norm.pending(x, delta)
        elif delta is None:
            xn = self.attn_norm(x, quantize=q_attn, prefetch=prefetch_arrays(self.attn.qkv, "qkv"),
                                launch_next=launch_early("qkv", self.attn.qkv, x.shape[0]))
        else:
            x, xn = self.attn_norm.add_norm(x, delta, quantize=q_attn, prefetch=prefetch_arrays(self.attn.qkv, "qkv"),
                                            launch_next=launch_early("qkv", self.attn.qkv, x.shape[0]))
        attn_out = self.attn(xn, positions, batch, after_qkv=lambda: fork_side_prefetch(self.mlp.gate_up, x.shape[0]))
        if n_mlp:
            h, y = self.ffn_norm.pending(x, attn_out)
        else:
            h, y = self.ffn_norm.add_norm(x, attn_out, quantize=q_mlp,
                                          prefetch=prefetch_arrays(self.mlp.gate_up, "gate_up"),
                                          launch_next=launch_early("gate_up", self.mlp.gate_up, x.shape[0]))
        return h, self.mlp(y, quantize=q_down, glu_epilogue="glu_epilogue" in fuse)


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

    @property
    def attention_layers(self) -> list[LlamaAttention]:
        return [blk.attn for blk in self.layers]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        h = self.embed(input_ids)
        if h.is_cuda:
            return self._forward_gpu(h, positions, batch)
        for blk in self.layers:
            h = blk(h, positions, batch)
        return self.norm(h)

    def _forward_gpu(self, h: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        from lodestar.kernels.triton_quant import fusions
        from lodestar.layers.cuda_linear import join_side_prefetch, launch_early, prefetch_arrays
        fuse = fusions()
        delta = None
        for blk in self.layers:
            h, delta = blk.forward_gpu(h, delta, positions, batch, fuse)
            if "residual" not in fuse:
                h, delta = h + delta, None
        head, early = prefetch_arrays(self.head, "head"), launch_early("head", self.head, h.shape[0])
        join_side_prefetch()
        if delta is None:
            return self.norm(h, prefetch=head, launch_next=early)
        return self.norm.add_norm(h, delta, prefetch=head, launch_next=early)[1]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden).float()
