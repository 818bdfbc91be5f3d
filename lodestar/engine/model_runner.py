"""Builds one flattened batch per step and runs the model on it."""
from __future__ import annotations

import torch
from torch import nn

from lodestar.engine.kv_cache import BlockPool, allocate_kv_tensors
from lodestar.engine.sequence import Sequence
from lodestar.layers.attention import AttentionBatch


class ModelRunner:
    """Owns the model and its KV tensors; turns (sequence, new-token count) rows into logits."""

    def __init__(self, model: nn.Module, pool: BlockPool, kv_dtype: torch.dtype = torch.float32) -> None:
        self.model = model
        self.pool = pool
        self.kv_bytes = allocate_kv_tensors(model.attention_layers, pool.num_blocks, pool.block_size, kv_dtype)

    def ensure_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Grow ``seq.block_table`` to hold ``num_tokens`` tokens (may raise OutOfBlocksError)."""
        need = self.pool.blocks_needed(num_tokens) - len(seq.block_table)
        if need > 0:
            seq.block_table.extend(self.pool.allocate(need))

    @torch.inference_mode()
    def run(self, seqs: list[Sequence], num_new: list[int], want_logits: list[bool] | None = None
            ) -> torch.Tensor | None:
        """Feed ``num_new[i]`` uncomputed tokens of each sequence; advance ``num_computed``.

        Returns fp32 logits ``[R, V]`` at the last new token of each row whose
        ``want_logits`` is true (all rows by default), or None when none is wanted.
        """
        ids: list[int] = []
        for s, n in zip(seqs, num_new):
            self.ensure_blocks(s, s.num_computed + n)
            ids.extend(s.token_slice(s.num_computed, s.num_computed + n))
        batch = AttentionBatch.build([s.block_table for s in seqs],
                                     [s.num_computed + n for s, n in zip(seqs, num_new)],
                                     num_new, self.pool.block_size)
        hidden = self.model(torch.tensor(ids, dtype=torch.int64), batch.positions(), batch)
        for s, n in zip(seqs, num_new):
            s.num_computed += n
        rows = batch.query_start_loc[1:] - 1
        if want_logits is not None:
            rows = rows[torch.tensor(want_logits, dtype=torch.bool)]
        if rows.numel() == 0:
            return None
        return self.model.compute_logits(hidden[rows])
