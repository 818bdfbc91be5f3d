"""Every decoder layer of a CPU step in one compiled call (``_native.llama_layers``).

For a Llama-family model (without biases, q/k norms or a sliding window) or a Gemma-3 one
whose projections are all packed for the compiled kernels (gate|up fused; q, k and v fused or
three parts of different types), a step
whose sequences
all attend row by row (decode steps, forced runs, drafts: ``AttentionBatch.rows_attend_alone``)
runs its layer loop in C: the same kernels in the same order as the Python graph, so the
same bits, without the Python and torch dispatch between them.
``LlamaLayers.of(model)`` says whether a model qualifies; the addresses of its weights and
KV caches are gathered once and again whenever the caches are replaced.
"""
from __future__ import annotations

import torch

from lodestar.kernels import native
from lodestar.kernels.cpu_ops import GLU_GELU_TANH, GLU_SILU
from lodestar.kernels.cpu_quant import IntWeight
from lodestar.layers.norm import OffsetRMSNorm, RMSNorm

WEIGHT_FIELDS = 10      # decoder.h: codes, scales, mins, n, k, group, bits, code bits, offset, fp16 scales


def _weight(module) -> list[int] | None:
    s = getattr(module, "storage", None)
    if type(module).__name__ != "QuantizedLinear" or not isinstance(s, IntWeight) or not s.native:
        return None
    return [s.codes.data_ptr(), s.scales.data_ptr(), 0 if s.mins is None else s.mins.data_ptr(), s.n, s.k,
            s.fmt.group, s.bits, s.fmt.code_bits, s.fmt.offset, int(s.half)]


class LlamaLayers:
    """The addresses one ``llama_layers`` call needs, for one model."""

    def __init__(self, model, fields: list[list[int]], ropes: list, act: int) -> None:
        self.model = model
        self.static = fields                        # per layer: norms and projections
        self.ropes = ropes                          # per layer: its rotary tables
        self.act = act
        self.caches: tuple | None = None            # the KV cache tensors the table was built for
        self.tables: tuple | None = None            # the rotary tables it was built for
        self.table: torch.Tensor | None = None
        blk = model.layers[0]
        a = blk.attn
        self.dims = (blk.attn_norm.weight.numel(), a.n_heads, a.n_kv_heads, a.head_dim, blk.mlp.ffn_dim,
                     a.rope.rotary_dim)
        self.eps, self.scale = blk.attn_norm.eps, a.scale

    @classmethod
    def of(cls, model) -> "LlamaLayers | None":
        """The fused loop for ``model``, or None when it does not qualify."""
        from lodestar.models.gemma3 import Gemma3Block   # they import this module
        from lodestar.models.llama import LlamaBlock
        kinds = {type(b) for b in model.layers}
        if not native.available() or len(kinds) != 1 or not kinds <= {LlamaBlock, Gemma3Block}:
            return None
        gemma = kinds == {Gemma3Block}
        norm = OffsetRMSNorm if gemma else RMSNorm
        first = model.layers[0]
        fields, ropes = [], []
        for b in model.layers:
            a, m = b.attn, b.mlp
            qkv = [_weight(x) for x in a.qkv] if isinstance(a.qkv, torch.nn.ModuleList) else [_weight(a.qkv)]
            ws = [qkv[0]] + [_weight(x) for x in (a.o, m.gate_up, m.down)] + qkv[1:]
            norms = [b.attn_norm, b.ffn_norm] + ([a.q_norm, a.k_norm, b.post_attn_norm, b.post_ffn_norm] if gemma
                                                 else [])
            if (None in ws or a.qkv_bias is not None or (a.q_norm is not None) != gemma
                    or any(type(n) is not norm or n.eps != first.attn_norm.eps for n in norms)
                    or (a.sliding_window is not None and not gemma) or a.scale != first.attn.scale
                    or a.n_heads != first.attn.n_heads or a.n_kv_heads != first.attn.n_kv_heads
                    or a.head_dim != first.attn.head_dim or m.ffn_dim != first.mlp.ffn_dim
                    or a.rope.rotary_dim != first.attn.rope.rotary_dim):
                return None
            extra = ([a.q_norm.weight.data_ptr(), a.k_norm.weight.data_ptr(), b.post_attn_norm.weight.data_ptr(),
                      b.post_ffn_norm.weight.data_ptr()] if gemma else [0, 0, 0, 0])
            if len(qkv) not in (1, 3):
                return None
            fields.append(([b.attn_norm.weight.data_ptr(), b.ffn_norm.weight.data_ptr()] + sum(ws[:4], []), extra,
                           a.sliding_window or 0, len(qkv), sum(ws[4:], []) or [0] * 2 * WEIGHT_FIELDS))
            ropes.append(a.rope)
        return cls(model, fields, ropes, GLU_GELU_TANH if gemma else GLU_SILU)

    def _layers(self) -> torch.Tensor | None:
        caches = tuple(c for b in self.model.layers for c in (b.attn.k_cache, b.attn.v_cache))
        tables = tuple(t for r in self.ropes for t in (r.cos, r.sin))
        if (self.caches is None or any(x is not y for x, y in zip(caches, self.caches))
                or any(x is not y for x, y in zip(tables, self.tables))):
            if any(c is None or c.dtype != torch.float32 or not c.is_contiguous() for c in caches):
                return None
            rows = []
            for i, (base, extra, window, parts, kv) in enumerate(self.static):
                rope = self.ropes[i]
                rows.append(base + [caches[2 * i].data_ptr(), caches[2 * i + 1].data_ptr()] + extra
                            + [window, rope.cos.data_ptr(), rope.sin.data_ptr(), parts] + kv)
            self.table = torch.tensor(rows, dtype=torch.int64)
            self.caches, self.tables = caches, tables
        return self.table

    def run(self, h: torch.Tensor, positions: torch.Tensor, batch) -> bool:
        """Run every layer on ``h [T, d]`` (fp32, contiguous) in place; False when it cannot."""
        if not batch.rows_attend_alone:
            return False            # a prompt chunk: its attention is one SDPA call (layers.attention)
        if not all(r.covers(positions) for r in {id(r): r for r in self.ropes}.values()):
            return False
        table = self._layers()
        if table is None or h.dtype != torch.float32 or not h.is_contiguous():
            return False
        d, hq, hk, dim, ffn, rot = self.dims
        rows = batch.query_rows(None)
        native._ext.llama_layers(
            h.data_ptr(), h.shape[0], table.data_ptr(), table.shape[0], d, hq, hk, dim, ffn, rot, self.eps,
            self.scale, self.act, positions.data_ptr(), batch.slot_mapping.data_ptr(), rows[0].numel(),
            rows[0].data_ptr(), rows[1].data_ptr(), rows[2].data_ptr(), batch.block_tables.data_ptr(),
            batch.block_tables.shape[1], batch.block_size)
        return True
