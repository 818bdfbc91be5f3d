"""Attention over a paged KV pool for a flattened batch of sequences.

Every forward sees one flattened batch: the new tokens of all sequences laid end to end
(``query_start_loc`` marks where each sequence's tokens begin). Keys and values live in a
pool of fixed-size blocks; ``slot_mapping`` says where each new token's K/V goes and
``block_tables`` says which blocks hold each sequence's context. On the CPU a sequence's
decoded tokens (one per decode step, a grammar's forced run, speculative drafts) attend row
by row, each row over its positions up to its own, exactly as the decode
step of that token would; the compiled kernel (``cpu_ops.attend``) does all such rows in one
call, reading the paged cache in place, else each row is one SDPA call. A longer run (a
prompt chunk) is one SDPA call for the sequence, whose rows' last bits depend on the chunk
(SDPA's blocking follows its row count). Either way a sequence's result does not depend on
the other sequences of the batch. Contexts are a slice of the KV tensors when the blocks are
consecutive, else a gather of the blocks; both give the same bits.

On a CUDA device the batch also carries ``gpu`` (``GpuAttentionMeta``: device copies of
the slots, block tables and lengths) and attention goes to
``lodestar.kernels.triton_attention``: a paged Triton decode kernel when every sequence
has one new token, the paged prefill kernel (or SDPA) otherwise. For an output projection
that takes quantized rows the decode kernel can also quantize its output
(``paged_attention(quantize=True)``, fusion ``attn_quant``).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from lodestar.kernels import cpu_ops
from lodestar.kernels import triton_attention as ta
from lodestar.kernels.policy import active
from lodestar.kernels.quant_layout import GROUP, QuantizedRows, quantizable


@dataclass
class GpuAttentionMeta:
    """Device-side tensors of an ``AttentionBatch`` for the CUDA kernels."""

    slot_mapping: torch.Tensor      # [T] int64
    block_tables: torch.Tensor      # [S, W] int32 (W may exceed what the sequences need)
    seq_lens: torch.Tensor          # [S] int32
    max_partitions: int             # decode partitions of the longest possible context
    splits: int                     # decode programs per (sequence, kv head)


@dataclass
class AttentionBatch:
    """Where a step's tokens read and write the paged KV pool."""

    slot_mapping: torch.Tensor      # [T] int64: KV slot of each new token
    block_tables: torch.Tensor      # [S, max_blocks] int64 (padded with 0)
    seq_lens: torch.Tensor          # [S] int64: context length after this step
    query_start_loc: torch.Tensor   # [S + 1] int64: cumulative new-token counts
    block_size: int
    seq_lens_list: list[int]
    query_lens_list: list[int]
    _cache: dict = field(default_factory=dict, repr=False)
    gpu: GpuAttentionMeta | None = None
    # CPU: sequences whose new tokens are decoded ones (tokens a grammar forced, speculative
    # drafts): they attend one row at a time, each as the decode step of that token would
    stepwise: list[bool] | None = None

    @classmethod
    def build(cls, block_tables: list[list[int]], seq_lens: list[int], query_lens: list[int],
              block_size: int, stepwise: list[bool] | None = None) -> "AttentionBatch":
        """Build from per-sequence block tables, context lengths and new-token counts."""
        width = max(len(t) for t in block_tables)
        tables = torch.zeros(len(block_tables), width, dtype=torch.int64)
        for i, t in enumerate(block_tables):
            tables[i, : len(t)] = torch.tensor(t, dtype=torch.int64)
        lens = torch.tensor(seq_lens, dtype=torch.int64)
        qlens = torch.tensor(query_lens, dtype=torch.int64)
        starts = torch.zeros(len(seq_lens) + 1, dtype=torch.int64)
        starts[1:] = torch.cumsum(qlens, 0)
        # Slot of each new token: its position's block and offset.
        seq_idx = torch.repeat_interleave(torch.arange(len(seq_lens)), qlens)
        pos = _positions(lens, qlens, starts)
        slots = tables[seq_idx, pos // block_size] * block_size + pos % block_size
        return cls(slots, tables, lens, starts, block_size, list(seq_lens), list(query_lens),
                   stepwise=stepwise if stepwise and any(stepwise) else None)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_list)

    def positions(self) -> torch.Tensor:
        """Absolute position of each new token, [T]."""
        return _positions(self.seq_lens, torch.tensor(self.query_lens_list), self.query_start_loc)

    # -- CPU gather/mask plan, computed once per step and shared by every layer --------
    def _plan(self) -> dict:
        if "plan" in self._cache:
            return self._cache["plan"]
        S, bs = self.num_seqs, self.block_size
        max_k, max_q = max(self.seq_lens_list), max(self.query_lens_list)
        k_pos = torch.arange(max_k)
        k_valid = k_pos[None, :] < self.seq_lens[:, None]                      # [S, Lk]
        blk = self.block_tables.gather(1, (k_pos // bs).clamp(max=self.block_tables.shape[1] - 1)
                                       .expand(S, -1))
        context_slots = torch.where(k_valid, blk * bs + k_pos % bs, 0)         # [S, Lk]
        qlens = torch.tensor(self.query_lens_list)
        q_off = torch.arange(max_q)
        q_valid = q_off[None, :] < qlens[:, None]                              # [S, Lq]
        # Padding query rows sit at the last position so they never see an empty row.
        q_pos = torch.where(q_valid, self.seq_lens[:, None] - qlens[:, None] + q_off[None, :],
                            self.seq_lens[:, None] - 1)
        q_index = torch.where(q_valid, self.query_start_loc[:-1, None] + q_off[None, :], 0)
        # One sequence whose blocks are consecutive: its context is a plain slice of the pool.
        contiguous = None
        if S == 1:
            table = self.block_tables[0, : -(-max_k // bs)]
            if bool((table[1:] - table[:-1] == 1).all()):
                start = int(table[0]) * bs
                contiguous = (start, start + max_k)
        plan = dict(max_k=max_k, max_q=max_q, k_valid=k_valid, context_slots=context_slots, contiguous=contiguous,
                    q_pos=q_pos, q_valid=q_valid, q_index=q_index,
                    q_flat=q_valid.reshape(-1).nonzero().squeeze(1))
        self._cache["plan"] = plan
        return plan

    def mask(self, sliding_window: int | None) -> torch.Tensor | None:
        """Boolean [S, 1, Lq, Lk] mask (True = attend), or None when all keys are visible."""
        key = ("mask", sliding_window)
        if key in self._cache:
            return self._cache[key]
        p = self._plan()
        qp, kp = p["q_pos"][:, :, None], torch.arange(p["max_k"])[None, None, :]
        needs = p["max_q"] > 1 or self.num_seqs > 1 or (
            sliding_window is not None and p["max_k"] > sliding_window)
        m = None
        if needs:
            m = (kp <= qp) & p["k_valid"][:, None, :]
            if sliding_window is not None:
                m = m & (qp - kp < sliding_window)
            m = m[:, None]
        self._cache[key] = m
        return m

    def _plans(self, sliding_window: int | None) -> list[dict]:
        """CPU attention plans shared by the layers of a step: one per query row of a sequence
        that attends row by row (``row_by_row``), one per sequence otherwise (a prompt chunk).

        ``context`` is a (start, end) slice of the pool when the sequence's blocks are
        consecutive, else the sequence's block ids (gathered whole, then cut to length).
        """
        key = ("plans", sliding_window)
        if key not in self._cache:
            starts, plans = self.query_start_loc.tolist(), []
            for i, (lk, lq) in enumerate(zip(self.seq_lens_list, self.query_lens_list)):
                if self.row_by_row(i):
                    plans += [self._plan_of(i, starts[i] + r, lk - lq + r + 1, 1, sliding_window) for r in range(lq)]
                else:
                    plans.append(self._plan_of(i, starts[i], lk, lq, sliding_window))
            self._cache[key] = plans
        return self._cache[key]

    def _plan_of(self, i: int, first: int, lk: int, lq: int, sliding_window: int | None) -> dict:
        """Plan of ``lq`` query rows from ``first`` of sequence ``i`` over its first ``lk`` slots."""
        bs = self.block_size
        nb = -(-lk // bs)
        table = self.block_tables[i, :nb]
        if nb == 1 or bool((table[1:] - table[:-1] == 1).all()):
            start = int(table[0]) * bs
            context = (start, start + lk)
        else:
            context = table.clone()
        mask = None
        if lq > 1 or (sliding_window is not None and lk > sliding_window):
            qp = torch.arange(lk - lq, lk)[:, None]
            kp = torch.arange(lk)[None, :]
            mask = kp <= qp
            if sliding_window is not None:
                mask = mask & (qp - kp < sliding_window)
            mask = mask[None, None]
        return {"rows": (first, first + lq), "context": context, "mask": mask, "len": lk, "block_size": bs}

    def query_rows(self, sliding_window: int | None) -> tuple[torch.Tensor, ...] | None:
        """The rows that attend one by one as int64 (row, sequence, context length, first
        visible position) for ``cpu_ops.attend``; None when there are none."""
        key = ("query_rows", sliding_window)
        if key not in self._cache:
            rows, seqs, lens, first = [], [], [], []
            for i, (lk, lq) in enumerate(zip(self.seq_lens_list, self.query_lens_list)):
                if not self.row_by_row(i):
                    continue
                start = int(self.query_start_loc[i])
                for r in range(lq):
                    n = lk - lq + r + 1
                    rows.append(start + r), seqs.append(i), lens.append(n)
                    first.append(max(0, n - sliding_window) if sliding_window is not None else 0)
            self._cache[key] = (tuple(torch.tensor(c, dtype=torch.int64) for c in (rows, seqs, lens, first))
                                if rows else None)
        return self._cache[key]

    def row_by_row(self, i: int) -> bool:
        """Sequence ``i``'s new tokens attend one row at a time: one new token, or decoded ones."""
        return self.query_lens_list[i] == 1 or (self.stepwise is not None and self.stepwise[i])

    @property
    def rows_attend_alone(self) -> bool:
        """Every sequence of the step attends row by row (decode steps, forced runs, drafts)."""
        return all(self.row_by_row(i) for i in range(self.num_seqs))


def _positions(seq_lens: torch.Tensor, query_lens: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    total = int(starts[-1])
    seq_idx = torch.repeat_interleave(torch.arange(len(seq_lens)), query_lens)
    offset_in_query = torch.arange(total) - starts[:-1][seq_idx]
    return seq_lens[seq_idx] - query_lens[seq_idx] + offset_in_query


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             batch: AttentionBatch) -> None:
    """Store this step's keys/values ``[T, Hk, D]`` at their slots."""
    slots = batch.slot_mapping if batch.gpu is None else batch.gpu.slot_mapping
    k_cache.index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.index_copy_(0, slots, v.to(v_cache.dtype))


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    batch: AttentionBatch, scale: float,
                    sliding_window: int | None = None, quantize: bool = False) -> torch.Tensor | QuantizedRows:
    """Attention of new queries ``q [T, Hq, D]`` over each sequence's cached context.

    Returns ``[T, Hq, Dv]``. The new tokens' K/V must already be written to the cache.
    ``quantize`` (the caller's output projection takes ``QuantizedRows``): a GPU decode step
    with fusion ``attn_quant`` on, bf16 output and ``quantizable`` rows returns
    ``QuantizedRows`` ``[T, Hq * Dv]`` (the kernel quantized its output); otherwise as above.
    """
    if batch.gpu is not None:
        return _gpu_attention(q, k_cache, v_cache, batch, scale, sliding_window, quantize)
    out = torch.empty(q.shape[0], q.shape[1], v_cache.shape[2], dtype=q.dtype)
    rows = batch.query_rows(sliding_window)
    native = rows is not None and cpu_ops.attend(q, k_cache, v_cache, out, scale, *rows, batch.block_tables,
                                                  batch.block_size)
    q = q.contiguous()
    for plan in batch._plans(sliding_window):
        a, b = plan["rows"]
        if b - a == 1 and native:
            continue
        out[a:b] = _attend_one(q, k_cache, v_cache, plan, scale)[0].transpose(0, 1)
    return out


def _attend_one(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: dict,
                scale: float) -> torch.Tensor:
    """One plan's attention: its rows of ``q [T, Hq, D]`` -> ``[1, Hq, Lq, Dv]``.

    Every plan goes through here with shapes and strides that depend on that plan alone, so
    its result is bit-identical whichever other sequences share the step (one SDPA call over
    several sequences is not: its rows differ in the last bits). Views are made with
    ``as_strided`` (one op each): this loop runs plans x layers times per step.
    """
    a, b = plan["rows"]
    hq, d = q.shape[1], q.shape[2]
    qp = q.as_strided((1, hq, b - a, d), (0, d, hq * d, 1), q.storage_offset() + a * hq * d)
    ctx = plan["context"]
    if isinstance(ctx, tuple):
        lk, (hk, dk), (hk_, dv) = ctx[1] - ctx[0], k_cache.shape[1:], v_cache.shape[1:]
        k = k_cache.as_strided((1, hk, lk, dk), (0, dk, hk * dk, 1), k_cache.storage_offset() + ctx[0] * hk * dk)
        v = v_cache.as_strided((1, hk_, lk, dv), (0, dv, hk_ * dv, 1), v_cache.storage_offset() + ctx[0] * hk_ * dv)
    else:
        lk = plan["len"]
        k = _gather_blocks(k_cache, ctx, plan["block_size"], lk)
        v = _gather_blocks(v_cache, ctx, plan["block_size"], lk)
    if k.dtype != qp.dtype:
        k, v = k.to(qp.dtype), v.to(qp.dtype)
    return F.scaled_dot_product_attention(qp, k, v, attn_mask=plan["mask"], scale=scale,
                                          enable_gqa=hq != k.shape[1])


def _gather_blocks(cache: torch.Tensor, blocks: torch.Tensor, block_size: int, length: int) -> torch.Tensor:
    """The first ``length`` slots of ``blocks`` (whole blocks copied) as ``[1, H, length, D]``."""
    n, h, d = cache.shape
    got = cache.view(n // block_size, block_size * h * d).index_select(0, blocks)
    return got.as_strided((1, h, length, d), (0, d, h * d, 1))


def _is_decode(batch: AttentionBatch) -> bool:
    """Every sequence has one new token: known on the host (a CUDA graph captures the decode
    path for its batch shape), no device value is read."""
    return max(batch.query_lens_list) == 1


def _gpu_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: AttentionBatch,
                   scale: float, sliding_window: int | None, quantize: bool = False) -> torch.Tensor | QuantizedRows:
    q = q.to(k_cache.dtype)
    if _is_decode(batch):
        g = batch.gpu
        if quantize:
            T, Hq, D = q.shape
            quantize = ("attn_quant" in active().fusions and q.dtype == torch.bfloat16 and D % GROUP == 0
                        and quantizable(T, Hq * D))
        return ta.decode_attention(q, k_cache, v_cache, g.block_tables, g.seq_lens, batch.block_size, scale,
                                   sliding_window, g.max_partitions, g.splits, quantize=quantize)
    return ta.prefill_attention(q, k_cache, v_cache, batch, scale, sliding_window)
