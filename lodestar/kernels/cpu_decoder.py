"""Every decoder layer of a CPU step in one compiled call (``_native.llama_layers``).

For a Llama-family model whose projections are all packed for the compiled kernels (q|k|v
and gate|up fused), without biases, q/k norms or a sliding window, a step whose sequences
all attend row by row (decode steps, forced runs, drafts: ``AttentionBatch.rows_attend_alone``)
runs its layer loop in C: the same kernels in the same order as the Python graph, so the
same bits, without the Python and torch dispatch between them.
``LlamaLayers.of(model)`` says whether a model qualifies; the addresses of its weights and
KV caches are gathered once and again whenever the caches are replaced.
"""
from __future__ import annotations

import torch

from lodestar.kernels import native
from lodestar.kernels.cpu_quant import IntWeight

WEIGHT_FIELDS = 9       # decoder.h: codes, scales, mins, n, k, group, bits, code bits, offset


def _weight(module) -> list[int] | None:
    s = getattr(module, "storage", None)
    if type(module).__name__ != "QuantizedLinear" or not isinstance(s, IntWeight) or not s.native:
        return None
    return [s.codes.data_ptr(), s.scales.data_ptr(), 0 if s.mins is None else s.mins.data_ptr(), s.n, s.k,
            s.fmt.group, s.bits, s.fmt.code_bits, s.fmt.offset]


class LlamaLayers:
    """The addresses one ``llama_layers`` call needs, for one model."""

    def __init__(self, model, fields: list[list[int]]) -> None:
        self.model = model
        self.static = fields                        # per layer: norms and projections
        self.caches: tuple | None = None            # the KV cache tensors the table was built for
        self.table: torch.Tensor | None = None
        blk = model.layers[0]
        a = blk.attn
        self.dims = (model.args.d_model, a.n_heads, a.n_kv_heads, a.head_dim, blk.mlp.ffn_dim, a.rope.rotary_dim)
        self.eps, self.scale, self.rope = blk.attn_norm.eps, a.scale, a.rope

    @classmethod
    def of(cls, model) -> "LlamaLayers | None":
        """The fused loop for ``model``, or None when it does not qualify."""
        from lodestar.layers.norm import RMSNorm
        from lodestar.models.llama import LlamaBlock
        if not native.available() or not all(type(b) is LlamaBlock for b in model.layers):
            return None
        fields, first = [], model.layers[0]
        for b in model.layers:
            a, m = b.attn, b.mlp
            ws = [_weight(x) for x in (a.qkv, a.o, m.gate_up, m.down)]
            if (None in ws or a.qkv_bias is not None or a.q_norm is not None or a.sliding_window is not None
                    or type(b.attn_norm) is not RMSNorm or type(b.ffn_norm) is not RMSNorm
                    or b.attn_norm.eps != first.attn_norm.eps or b.ffn_norm.eps != first.attn_norm.eps
                    or a.scale != first.attn.scale or a.rope is not first.attn.rope
                    or a.head_dim != first.attn.head_dim or m.ffn_dim != first.mlp.ffn_dim):
                return None
            fields.append([b.attn_norm.weight.data_ptr(), b.ffn_norm.weight.data_ptr()] + sum(ws, []))
        return cls(model, fields)

    def _layers(self) -> torch.Tensor | None:
        caches = tuple(c for b in self.model.layers for c in (b.attn.k_cache, b.attn.v_cache))
        if self.caches is None or any(x is not y for x, y in zip(caches, self.caches)):
            if any(c is None or c.dtype != torch.float32 or not c.is_contiguous() for c in caches):
                return None
            self.table = torch.tensor([f + [caches[2 * i].data_ptr(), caches[2 * i + 1].data_ptr()]
                                       for i, f in enumerate(self.static)], dtype=torch.int64)
            self.caches = caches
        return self.table

    def run(self, h: torch.Tensor, positions: torch.Tensor, batch) -> bool:
        """Run every layer on ``h [T, d]`` (fp32, contiguous) in place; False when it cannot."""
        if not batch.rows_attend_alone:
            return False            # a prompt chunk: its attention is one SDPA call (layers.attention)
        table = self._layers()
        if table is None or h.dtype != torch.float32 or not h.is_contiguous() or not self.rope.covers(positions):
            return False
        d, hq, hk, dim, ffn, rot = self.dims
        rows = batch.query_rows(None)
        native._ext.llama_layers(
            h.data_ptr(), h.shape[0], table.data_ptr(), table.shape[0], d, hq, hk, dim, ffn, rot, self.eps,
            self.scale, self.rope.cos.data_ptr(), self.rope.sin.data_ptr(), positions.data_ptr(),
            batch.slot_mapping.data_ptr(), rows[0].numel(), *(r.data_ptr() for r in rows),
            batch.block_tables.data_ptr(), batch.block_tables.shape[1], batch.block_size)
        return True
