"""Attention over the paged KV pool on the GPU: a Triton decode kernel, a paged varlen
prefill kernel, and torch references.

Decode (one new token per sequence), ``decode_attention`` [``decode_attention_ref``]
    Split-KV ("flash decoding") in two kernels. Each sequence's visible context is cut
    into partitions counted from its first visible key: ``SHORT_PARTITION`` keys when the
    visible context is at most ``SHORT_CONTEXT`` keys (short contexts: more partitions run
    side by side, each one step long), ``PARTITION`` keys beyond (long contexts: fewer
    partials to write and combine); a program
    (sequence, kv head, split) walks the partitions ``split, split + splits, ...`` and
    for each writes an unnormalised partial (running max, sum, weighted values) for all
    query heads of the GQA group at once (the group is padded to 16 rows so the scores
    and values go through the tensor cores). The second kernel combines a sequence's
    partials in chunks of ``REDUCE_CHUNK`` in partition order. Partition boundaries and
    the combine order depend only on the sequence's own length, never on the batch or on
    the number of splits, so a row gives the same result alone, batched, or inside a
    CUDA graph whose block table is wider than needed. The block table is read in the
    kernel (``block = table[key // block_size]``); sliding windows start the context at
    ``max(0, len - window)``.

    Launch (``attention_pdl``): under programmatic dependent launch the partial kernel is
    launched early and, before its wait, asks L2 for the keys and values of each program's
    first partition (lengths and block tables are step inputs). A program whose sequence
    has at most ``ATTN_PDL_SHORT_KEYS`` keys lets the next kernel launch as soon as it has
    waited; one of a longer sequence only when it ends (the next kernel's waiting blocks
    slow long contexts down; at a few hundred keys the early launch is faster).

    ``attn_quant`` (``decode_attention(quantize=True)``, bf16, head dim a multiple of 32):
    the reduce kernel also quantizes each output row it writes, from the stored bf16
    values, as ``quantize_x`` of ``out.view(B, Hq * D)`` (a head is a whole number of
    32-element groups; ``_quant_store``): the output projection skips its x quantization.

    Other short partitions, the combine done by the last partial program, and RoPE + KV
    store inside the partial kernel were measured on the H200 and not kept: none was faster
    (docs/benchmarks.md).

Prefill (several new tokens), ``prefill_attention``
    ``paged_prefill`` (``_prefill_kernel``): causal attention of every sequence's new tokens
    over its paged context in one kernel, varlen (a host-built map gives each program a
    sequence and its first token), reading the block table itself. A program holds the G
    query heads of one kv head for up to 32 tokens (128 rows; 64 for head dims above 128:
    the K/V tiles are read once for the group), walks the keys in blocks of 64 counted from
    key 0, from the block holding its first visible key (blocks a row does not see add exact
    zeros to it), online softmax in base 2. A row's result depends only on its own query and
    keys, not on the other rows of its program, on the batch, or on how much of its context
    was cached before the step. One sequence with no cached prefix runs torch's causal SDPA
    over its own keys instead (flash kernel; prefill graphs capture that form). Policy
    ``prefill_attention="sdpa"``: the rest gather their keys and run padded, masked SDPA
    (slower than the kernel on the H200; docs/benchmarks.md).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from lodestar.kernels.launch import INTERP, PDL_OFF, interpreted, num_sms, pdl, triton_enabled
from lodestar.kernels.policy import active
from lodestar.kernels.quant_layout import GROUP, QuantizedRows

PARTITION = 256     # keys per decode partition
SHORT_PARTITION = 64    # keys per partition when the visible context is at most SHORT_CONTEXT
SHORT_CONTEXT = 1024
BLOCK_N = 64        # keys per inner step
REDUCE_CHUNK = 16   # partials combined per step of the reduce kernel
PREFILL_BLOCK_N = 64    # keys per inner step of the prefill kernel
PROGRAMS_PER_SM = 4     # decode programs per SM ``grid_splits`` aims for
LOG2E = 1.4426950408889634
NO_WINDOW = 1 << 30  # window passed to the kernels when every key is visible
# A decode program whose sequence has at most this many keys lets the next kernel launch as
# soon as it has waited; one of a longer sequence only when it ends (``attention_pdl``).
ATTN_PDL_SHORT_KEYS = 512
PDL_SHORT = {"PDL": 4, "launch_pdl": True}


def num_partitions(max_context: int) -> int:
    """Partitions needed for any context up to ``max_context`` keys."""
    short = -(-min(max_context, SHORT_CONTEXT) // SHORT_PARTITION)
    return max(1, short, -(-max_context // PARTITION))


def grid_splits(num_seqs: int, n_kv_heads: int, device: torch.device) -> int:
    """Programs per (sequence, kv head): enough to give every SM ``PROGRAMS_PER_SM``, at most
    64. Results do not depend on it (partition boundaries and the combine order follow the
    sequence's length only)."""
    want = -(-PROGRAMS_PER_SM * num_sms(device) // max(1, num_seqs * n_kv_heads))
    return max(1, min(64, want))


def attention_pdl() -> dict:
    """Launch arguments of the decode partial kernel: with ``pdl()`` on, the form ``PDL`` 4
    (the next kernel may launch once the programs of sequences of at most
    ``ATTN_PDL_SHORT_KEYS`` keys have waited, and the others have ended); else off. Same
    bits either way."""
    return PDL_SHORT if pdl()["PDL"] else PDL_OFF


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int, scale: float,
                     window: int | None = None, max_partitions: int | None = None,
                     splits: int | None = None, quantize: bool = False) -> torch.Tensor | QuantizedRows:
    """Attention of one query per sequence over its paged context.

    ``q [B, Hq, D]``; caches ``[slots, Hk, D]``; ``block_tables [B, W]`` and ``seq_lens [B]``
    int32 on the device. ``max_partitions`` bounds every sequence's partitions (pass it
    when the lengths are not known on the host, as in a CUDA graph). Returns ``[B, Hq, D]``.
    ``quantize`` (fusion ``attn_quant``; bf16, D a multiple of 32): returns
    ``QuantizedRows`` of the output as ``[B, Hq * D]`` rows, quantized by the kernel that
    writes them (the bits of ``quantize_x``).
    """
    B, Hq, D = q.shape
    Hk = k_cache.shape[1]
    G = Hq // Hk
    if max_partitions is None:
        max_partitions = num_partitions(block_tables.shape[1] * block_size)
    if splits is None:
        splits = grid_splits(B, Hk, q.device)
    part_o = torch.empty(B, Hq, max_partitions, D, device=q.device, dtype=torch.float32)
    part_m = torch.empty(B, Hq, max_partitions, device=q.device, dtype=torch.float32)
    part_l = torch.empty(B, Hq, max_partitions, device=q.device, dtype=torch.float32)
    out = torch.empty(B, Hq, D, device=q.device, dtype=q.dtype)
    if quantize:
        if q.dtype != torch.bfloat16 or D % GROUP:
            raise ValueError(f"decode_attention(quantize=True) needs bf16 and a head dim that is a multiple of "
                             f"{GROUP}; got {q.dtype}, D={D}")
        words, d1, sums = QuantizedRows.empty(B, Hq * D, q.device)
    else:       # never written: QUANT is off
        words, d1, sums = out, out, out
    win = int(window) if window else NO_WINDOW
    g_pad = max(16, 1 << (G - 1).bit_length())
    launch = attention_pdl()
    _decode_partial_kernel[(B, Hk, splits)](
        q, k_cache, v_cache, block_tables, seq_lens, part_o, part_m, part_l,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        block_tables.stride(0), scale * LOG2E, win, max_partitions,
        G=G, G_PAD=g_pad, D=D, BS=block_size, BLOCK_N=BLOCK_N, PART=PARTITION, PART_SHORT=SHORT_PARTITION,
        SHORT=SHORT_CONTEXT, SPLITS=splits, IS_F32=q.dtype == torch.float32, DOT_F32=interpreted(),
        INTERP=INTERP, PREFETCH=launch["PDL"] != 0, PDL_SHORT_KEYS=ATTN_PDL_SHORT_KEYS, num_warps=4, **launch)
    _decode_reduce_kernel[(B, Hq)](
        part_o, part_m, part_l, seq_lens, out, out.stride(0), out.stride(1), words, d1, sums, win,
        max_partitions, Hq, D=D, PART=PARTITION, PART_SHORT=SHORT_PARTITION, SHORT=SHORT_CONTEXT,
        CHUNK=REDUCE_CHUNK, QUANT=quantize, INTERP=INTERP, num_warps=4, **pdl())
    if quantize:
        return QuantizedRows(out.view(B, Hq * D), words, d1, sums)
    return out


def decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int, scale: float,
                         window: int | None = None) -> torch.Tensor:
    """Torch reference of ``decode_attention``: gather, mask, fp32 softmax."""
    B, Hq, D = q.shape
    Hk = k_cache.shape[1]
    lens = seq_lens.long()
    max_k = int(lens.max())
    pos = torch.arange(max_k, device=q.device)
    blk = block_tables.long().gather(1, (pos // block_size).expand(B, -1))
    slots = blk * block_size + pos % block_size                                # [B, Lk]
    valid = pos[None, :] < lens[:, None]
    if window:
        valid &= pos[None, :] >= (lens[:, None] - window)
    k = k_cache[slots].float().repeat_interleave(Hq // Hk, dim=2)                # [B, Lk, Hq, D]
    v = v_cache[slots].float().repeat_interleave(Hq // Hk, dim=2)
    s = torch.einsum("bhd,bkhd->bhk", q.float(), k) * scale
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1)
    return torch.einsum("bhk,bkhd->bhd", p, v).to(q.dtype)


# --------------------------------------------------------------------------- prefill

def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch, scale: float,
                      window: int | None = None) -> torch.Tensor:
    """Attention of all new queries ``q [T, Hq, D]`` (their K/V already written to the pool).

    One sequence with no cached prefix (within the window) runs torch's causal SDPA over its
    own keys (flash kernel, GQA without copies); other steps run ``paged_prefill``, or with
    the policy's ``prefill_attention="sdpa"`` a gathered, padded, masked SDPA."""
    T, Hq, D = q.shape
    Hk = k_cache.shape[1]
    fresh = batch.num_seqs == 1 and batch.seq_lens_list[0] == T and (not window or T <= window)
    if not fresh and active().prefill_attention == "paged":
        g = batch.gpu
        return paged_prefill(q, k_cache, v_cache, g.block_tables, g.seq_lens, batch.query_start_loc,
                             batch.query_lens_list, batch.block_size, scale, window, cache=batch._cache)
    plan = _device_plan(batch, q.device, window)
    k = k_cache[plan["context_slots"]].transpose(1, 2)                           # [S, Hk, Lk, D]
    v = v_cache[plan["context_slots"]].transpose(1, 2)
    if fresh:
        # no cached prefix: plain causal attention (flash kernel, GQA without copies)
        qp = q.transpose(0, 1).unsqueeze(0)                                     # [1, Hq, T, D]
        out = F.scaled_dot_product_attention(qp, k.to(q.dtype), v.to(q.dtype), is_causal=True, scale=scale,
                                             enable_gqa=Hq != Hk)
        return out[0].transpose(0, 1)
    if Hq != Hk:
        k = k.repeat_interleave(Hq // Hk, dim=1)
        v = v.repeat_interleave(Hq // Hk, dim=1)
    qp = q[plan["q_index"]].transpose(1, 2)                                      # [S, Hq, Lq, D]
    out = F.scaled_dot_product_attention(qp, k.to(qp.dtype), v.to(qp.dtype), attn_mask=plan[("mask", window)],
                                         scale=scale)
    out = out.transpose(1, 2)                                                    # [S, Lq, Hq, D]
    return out.reshape(-1, Hq, out.shape[-1])[plan["q_flat"]]


def prefill_rows(G: int, D: int) -> tuple[int, int]:
    """(query tokens, padded heads) of one ``_prefill_kernel`` program: the GQA group's query
    heads padded to a power of two, times enough tokens for 128 rows (64 for head dims
    above 128)."""
    g_pad = 1 << (G - 1).bit_length()
    rows = 128 if D <= 128 else 64
    return max(1, rows // g_pad), g_pad


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                  seq_lens: torch.Tensor, query_start_loc: torch.Tensor, query_lens: list[int],
                  block_size: int, scale: float, window: int | None = None, cache: dict | None = None,
                  ) -> torch.Tensor:
    """Causal attention of varlen new tokens over the paged KV pool, one kernel.

    ``q [T, Hq, D]``: sequence s's ``query_lens[s]`` new tokens start at row
    ``query_start_loc[s]`` (host tensor, [S + 1]) and are its last ones: token i sees keys
    ``0 .. L - n + i`` (``L = seq_lens[s]``, device int32; within ``window`` keys when set),
    read through ``block_tables`` (device int32 [S, W]); their K/V are in the pool already.
    A program takes ``prefill_rows`` tokens of one sequence and the G query heads of one kv
    head (K/V read once for the group) and walks the visible keys in blocks of
    ``PREFILL_BLOCK_N`` counted from key 0 (a row's result does not depend on which other
    rows share its program, nor on how much of the context was cached before). ``cache``:
    a dict kept for the step (the layers share the program map). Returns ``[T, Hq, D]``."""
    T, Hq, D = q.shape
    Hk = k_cache.shape[1]
    G = Hq // Hk
    bm, g_pad = prefill_rows(G, D)
    key = ("prefill_map", bm)
    plan = cache.get(key) if cache is not None else None
    if plan is None:
        blocks = -(-torch.tensor(query_lens, dtype=torch.int64) // bm)           # programs per sequence
        seqs = torch.repeat_interleave(torch.arange(len(query_lens)), blocks)
        first = torch.cumsum(blocks, 0) - blocks                                  # each sequence's first program
        starts = (torch.arange(len(seqs)) - first[seqs]) * bm
        m = torch.stack([seqs, starts]).to(torch.int32).to(q.device, non_blocking=True)
        qs = query_start_loc.to(torch.int32).to(q.device, non_blocking=True)
        plan = (m, qs, len(seqs))
        if cache is not None:
            cache[key] = plan
    m, qs, n_prog = plan
    if q.stride(-1) != 1:
        q = q.contiguous()
    out = torch.empty(T, Hq, D, device=q.device, dtype=q.dtype)
    if n_prog == 0:
        return out
    win = int(window) if window else NO_WINDOW
    is_f32 = q.dtype == torch.float32
    _prefill_kernel[(n_prog, Hk)](
        q, k_cache, v_cache, out, block_tables, seq_lens, qs, m[0], m[1],
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        out.stride(0), out.stride(1), block_tables.stride(0), scale * LOG2E, win,
        G=G, G_PAD=g_pad, BM=bm, D=D, BS=block_size, BLOCK_N=PREFILL_BLOCK_N, IS_F32=is_f32,
        DOT_F32=interpreted(), INTERP=INTERP, num_warps=4 if D <= 128 else 8)
    return out


def paged_prefill_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                      seq_lens: torch.Tensor, query_start_loc: torch.Tensor, block_size: int, scale: float,
                      window: int | None = None) -> torch.Tensor:
    """Torch reference of ``paged_prefill``: per sequence, gather its keys, mask, fp32 softmax."""
    T, Hq, D = q.shape
    Hk = k_cache.shape[1]
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    for s, L in enumerate(seq_lens.tolist()):
        q0, q1 = starts[s], starts[s + 1]
        n = q1 - q0
        if n == 0:
            continue
        j = torch.arange(L, device=q.device)
        slots = block_tables[s].long()[j // block_size] * block_size + j % block_size
        k = k_cache[slots].float().repeat_interleave(Hq // Hk, dim=1)            # [L, Hq, D]
        v = v_cache[slots].float().repeat_interleave(Hq // Hk, dim=1)
        pos = torch.arange(L - n, L, device=q.device)
        valid = j[None, :] <= pos[:, None]
        if window:
            valid &= j[None, :] > pos[:, None] - window
        sc = torch.einsum("thd,khd->htk", q[q0:q1].float(), k) * scale
        sc = sc.masked_fill(~valid[None], float("-inf"))
        out[q0:q1] = torch.einsum("htk,khd->thd", torch.softmax(sc, dim=-1), v).to(q.dtype)
    return out


def _device_plan(batch, device: torch.device, window: int | None) -> dict:
    """The CPU path's gather/mask plan, moved to the device once per step (shared by layers)."""
    cache = batch._cache.setdefault("device_plan", {})
    if not cache:
        p = batch._plan()
        cache.update(context_slots=p["context_slots"].to(device, non_blocking=True),
                     q_index=p["q_index"].to(device, non_blocking=True),
                     q_flat=p["q_flat"].to(device, non_blocking=True))
    key = ("mask", window)
    if key not in cache:
        m = batch.mask(window)
        cache[key] = None if m is None else m.to(device, non_blocking=True)
    return cache


# --------------------------------------------------------------------------- kernels

if triton_enabled():
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    from lodestar.kernels.launch import _loop_bound, _pdl_enter, _prefetch_l2
    from lodestar.kernels.triton_common import _quant_store

    @triton.jit
    def _partition(ctx, PART: tl.constexpr, PART_SHORT: tl.constexpr, SHORT: tl.constexpr):
        """Keys per partition for a visible context of ``ctx`` keys: PART_SHORT up to SHORT keys,
        PART beyond (integer arithmetic only: exact for contexts below SHORT**3 keys)."""
        q = (ctx - 1) // SHORT                               # 0 when ctx <= SHORT
        long = ((q + SHORT - 1) // SHORT + SHORT - 1) // SHORT   # min(q, 1)
        return PART_SHORT + (PART - PART_SHORT) * long

    @triton.jit
    def _combine_partials(po_ptr, pm_ptr, pl_ptr, base, n_parts, D: tl.constexpr, CHUNK: tl.constexpr,
                          INTERP: tl.constexpr):
        """One query head's output ``[D]`` (fp32) from its ``n_parts`` partials at ``base``:
        CHUNK partials a step in partition order, running max and rescaled sums."""
        offs_d = tl.arange(0, D)
        m_run = tl.full([1], float("-inf"), tl.float32)
        l_run = tl.zeros([1], tl.float32)
        o_run = tl.zeros([D], tl.float32)
        for c0 in range(0, _loop_bound(n_parts, INTERP), CHUNK):
            offs = c0 + tl.arange(0, CHUNK)
            mask = offs < n_parts
            m = tl.load(pm_ptr + base + offs, mask=mask, other=float("-inf"))
            l = tl.load(pl_ptr + base + offs, mask=mask, other=0.0)
            o = tl.load(po_ptr + (base + offs)[:, None] * D + offs_d[None, :], mask=mask[:, None], other=0.0)
            m_new = tl.maximum(m_run, tl.max(m, 0))
            alpha = tl.exp2(m_run - m_new)
            w = tl.exp2(m - m_new)
            l_run = l_run * alpha + tl.sum(w * l, 0)
            o_run = o_run * alpha + tl.sum(w[:, None] * o, 0)
            m_run = m_new
        return o_run / l_run

    @triton.jit
    def _prefetch_partition(k_ptr, v_ptr, tables_ptr, lens_ptr, b, kvh, p, stride_ks, stride_kh, stride_vs,
                            stride_vh, stride_tb, window, D: tl.constexpr, BS: tl.constexpr, BLOCK_N: tl.constexpr,
                            PART: tl.constexpr, PART_SHORT: tl.constexpr, SHORT: tl.constexpr):
        """``_prefetch_l2`` of the keys and values of sequence b's partition p (kv head kvh)."""
        L = tl.load(lens_ptr + b)
        start = tl.maximum(L - window, 0)
        part = _partition(L - start, PART, PART_SHORT, SHORT)
        lo = start + p * part
        hi = tl.minimum(lo + part, L)
        sectors = tl.arange(0, D // 16) * 16        # 32-byte pieces of a bf16 row
        for j0 in range(lo, hi, BLOCK_N):
            offs_j = tl.minimum(j0 + tl.arange(0, BLOCK_N), hi - 1)
            slot = tl.load(tables_ptr + b.to(tl.int64) * stride_tb + offs_j // BS).to(tl.int64) * BS + offs_j % BS
            _prefetch_l2(k_ptr + kvh.to(tl.int64) * stride_kh + slot[:, None] * stride_ks + sectors[None, :])
            _prefetch_l2(v_ptr + kvh.to(tl.int64) * stride_vh + slot[:, None] * stride_vs + sectors[None, :])

    @triton.jit
    def _paged_scores(q, k_head, v_head, table, j0, hi, offs_d, stride_ks, stride_vs, qk_scale, BS: tl.constexpr,
                      BLOCK_N: tl.constexpr, IS_F32: tl.constexpr, DOT_F32: tl.constexpr):
        """Keys ``j0 .. j0 + BLOCK_N`` (below ``hi``) of one kv head through the block table:
        (key indices, their mask, scaled scores ``q @ k.T`` in base 2, the values tile)."""
        offs_j = j0 + tl.arange(0, BLOCK_N)
        mask_j = offs_j < hi
        blk = tl.load(table + offs_j // BS, mask=mask_j, other=0)
        slot = blk.to(tl.int64) * BS + offs_j % BS
        k = tl.load(k_head + slot[:, None] * stride_ks + offs_d[None, :], mask=mask_j[:, None], other=0.0)
        v = tl.load(v_head + slot[:, None] * stride_vs + offs_d[None, :], mask=mask_j[:, None], other=0.0)
        if DOT_F32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        if IS_F32:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        return offs_j, mask_j, s * qk_scale, v

    @triton.jit
    def _weighted(pr, v, IS_F32: tl.constexpr):
        """``pr @ v`` (probabilities rounded to the values' dtype first unless fp32)."""
        if IS_F32:
            return tl.dot(pr, v, input_precision="ieee")
        return tl.dot(pr.to(v.dtype), v)

    @triton.jit
    def _softmax_step(m_i, l_i, acc, s, v, IS_F32: tl.constexpr, UNSEEN: tl.constexpr):
        """One block of the online softmax in base 2: scores ``s`` (masked keys -inf) and values
        ``v`` folded into the running max, sum and weighted values; returns them. UNSEEN: rows
        may have seen no key yet (all -inf so far): they add exact zeros."""
        m_new = tl.maximum(m_i, tl.max(s, 1))
        if UNSEEN:
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_use = m_new
        alpha = tl.exp2(m_i - m_use)
        pr = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(pr, 1)
        pv = _weighted(pr, v, IS_F32)
        acc = acc * alpha[:, None] + pv
        return m_new, l_i, acc


    @triton.jit
    def _decode_partial_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, po_ptr, pm_ptr, pl_ptr,
                               stride_qb, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_tb,
                               qk_scale, window, max_parts,
                               G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                               BLOCK_N: tl.constexpr, PART: tl.constexpr, PART_SHORT: tl.constexpr,
                               SHORT: tl.constexpr, SPLITS: tl.constexpr,
                               IS_F32: tl.constexpr, DOT_F32: tl.constexpr, INTERP: tl.constexpr,
                               PREFETCH: tl.constexpr, PDL: tl.constexpr, PDL_SHORT_KEYS: tl.constexpr):
        """Program (sequence b, kv head, split): the partials of partitions split, split +
        SPLITS, ... for the G query heads of the kv head (see the module docstring).

        PREFETCH: before the wait, ask L2 for the keys and values of this program's first
        partition (``_prefetch_partition``; lengths and block tables are step inputs, written
        before the step's first kernel; a key the previous kernel is storing is prefetched
        stale, harmlessly: L2 is where its store lands)."""
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        if PREFETCH:
            _prefetch_partition(k_ptr, v_ptr, tables_ptr, lens_ptr, b, kvh, split, stride_ks, stride_kh, stride_vs,
                                stride_vh, stride_tb, window, D, BS, BLOCK_N, PART, PART_SHORT, SHORT)
        if PDL == 4:    # ``attention_pdl``: the next kernel may launch now if this sequence is short
            gdc_wait()
            L = tl.load(lens_ptr + b)
            if L <= PDL_SHORT_KEYS:
                gdc_launch_dependents()
        else:
            _pdl_enter(PDL)
            L = tl.load(lens_ptr + b)
        start = tl.maximum(L - window, 0)
        part = _partition(L - start, PART, PART_SHORT, SHORT)
        n_parts = tl.cdiv(L - start, part)
        Hq = tl.num_programs(1) * G
        offs_g = tl.arange(0, G_PAD)
        offs_d = tl.arange(0, D)
        mask_g = offs_g < G
        heads = kvh * G + offs_g
        q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=mask_g[:, None], other=0.0)
        if DOT_F32:
            q = q.to(tl.float32)
        table = tables_ptr + b.to(tl.int64) * stride_tb
        k_head = k_ptr + kvh.to(tl.int64) * stride_kh
        v_head = v_ptr + kvh.to(tl.int64) * stride_vh
        part_base = (b * Hq + heads).to(tl.int64) * max_parts                       # [G_PAD]
        for p in range(_loop_bound(split, INTERP), _loop_bound(n_parts, INTERP), SPLITS):
            lo = start + p * part
            hi = tl.minimum(lo + part, L)
            m_i = tl.full([G_PAD], float("-inf"), tl.float32)
            l_i = tl.zeros([G_PAD], tl.float32)
            acc = tl.zeros([G_PAD, D], tl.float32)
            for j0 in range(_loop_bound(lo, INTERP), _loop_bound(hi, INTERP), BLOCK_N):
                offs_j, mask_j, s, v = _paged_scores(q, k_head, v_head, table, j0, hi, offs_d, stride_ks, stride_vs,
                                                     qk_scale, BS, BLOCK_N, IS_F32, DOT_F32)
                s = tl.where(mask_j[None, :], s, float("-inf"))
                m_i, l_i, acc = _softmax_step(m_i, l_i, acc, s, v, IS_F32, False)
            idx = part_base + p
            tl.store(pm_ptr + idx, m_i, mask=mask_g)
            tl.store(pl_ptr + idx, l_i, mask=mask_g)
            tl.store(po_ptr + idx[:, None] * D + offs_d[None, :], acc, mask=mask_g[:, None])

    @triton.jit
    def _decode_reduce_kernel(po_ptr, pm_ptr, pl_ptr, lens_ptr, out_ptr, stride_ob, stride_oh,
                              words_ptr, d1_ptr, sums_ptr, window, max_parts, Hq,
                              D: tl.constexpr, PART: tl.constexpr, PART_SHORT: tl.constexpr,
                              SHORT: tl.constexpr, CHUNK: tl.constexpr, QUANT: tl.constexpr, INTERP: tl.constexpr,
                              PDL: tl.constexpr):
        """Program (sequence b, query head h): the output row ``out[b, h]`` from its partials;
        QUANT: also its quantized form, columns ``h * D ..`` of the rows ``out[b].view(Hq * D)``."""
        _pdl_enter(PDL)
        b = tl.program_id(0)
        h = tl.program_id(1)
        L = tl.load(lens_ptr + b)
        start = tl.maximum(L - window, 0)
        part = _partition(L - start, PART, PART_SHORT, SHORT)
        n_parts = tl.cdiv(L - start, part)
        base = (b * Hq + h).to(tl.int64) * max_parts
        offs_d = tl.arange(0, D)
        out = _combine_partials(po_ptr, pm_ptr, pl_ptr, base, n_parts, D, CHUNK, INTERP)
        y = out.to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + b.to(tl.int64) * stride_ob + h * stride_oh + offs_d, y)
        if QUANT:   # from the stored (rounded) values, exactly as quantize_x would read them
            _quant_store(words_ptr, d1_ptr, sums_ptr, y, b.to(tl.int64), h * (D // 32), Hq * D, D)

    @triton.jit
    def _prefill_kernel(q_ptr, k_ptr, v_ptr, o_ptr, tables_ptr, lens_ptr, qs_ptr, pseq_ptr, pstart_ptr,
                        stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_ot, stride_oh,
                        stride_tb, qk_scale, window,
                        G: tl.constexpr, G_PAD: tl.constexpr, BM: tl.constexpr, D: tl.constexpr,
                        BS: tl.constexpr, BLOCK_N: tl.constexpr, IS_F32: tl.constexpr, DOT_F32: tl.constexpr,
                        INTERP: tl.constexpr):
        """Program (map entry, kv head): tokens ``pstart .. pstart + BM`` of sequence ``pseq``,
        query heads ``kvh * G ..`` (rows: token r // G_PAD, head r % G_PAD; padding rows are
        computed over a valid key range and not stored). Online softmax in base 2 over the
        visible keys, blocks of BLOCK_N from key 0 (fully masked blocks add exact zeros)."""
        pid = tl.program_id(0)
        kvh = tl.program_id(1)
        s = tl.load(pseq_ptr + pid)
        t0 = tl.load(pstart_ptr + pid)
        q0 = tl.load(qs_ptr + s)
        n = tl.load(qs_ptr + s + 1) - q0
        L = tl.load(lens_ptr + s)
        ROWS: tl.constexpr = BM * G_PAD
        r = tl.arange(0, ROWS)
        tok = t0 + r // G_PAD
        hg = r % G_PAD
        valid = (tok < n) & (hg < G)
        pos = L - n + tl.minimum(tok, n - 1)                   # absolute position of each row's token
        head = kvh * G + tl.minimum(hg, G - 1)
        offs_d = tl.arange(0, D)
        q_rows = q_ptr + (q0 + tl.minimum(tok, n - 1)).to(tl.int64) * stride_qt + head.to(tl.int64) * stride_qh
        q = tl.load(q_rows[:, None] + offs_d[None, :])
        if DOT_F32:
            q = q.to(tl.float32)
        p_lo = L - n + t0                                      # the program's first and last positions
        p_hi = L - n + tl.minimum(t0 + BM, n) - 1
        lo = tl.maximum(p_lo - window + 1, 0)
        hi = p_hi + 1
        table = tables_ptr + s.to(tl.int64) * stride_tb
        k_head = k_ptr + kvh.to(tl.int64) * stride_kh
        v_head = v_ptr + kvh.to(tl.int64) * stride_vh
        m_i = tl.full([ROWS], float("-inf"), tl.float32)
        l_i = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, D], tl.float32)
        for j0 in range(_loop_bound(lo // BLOCK_N * BLOCK_N, INTERP), _loop_bound(hi, INTERP), BLOCK_N):
            offs_j, mask_j, sc, v = _paged_scores(q, k_head, v_head, table, j0, hi, offs_d, stride_ks, stride_vs,
                                                  qk_scale, BS, BLOCK_N, IS_F32, DOT_F32)
            see = (offs_j[None, :] <= pos[:, None]) & (offs_j[None, :] > pos[:, None] - window)
            sc = tl.where(see, sc, float("-inf"))
            m_i, l_i, acc = _softmax_step(m_i, l_i, acc, sc, v, IS_F32, True)
        out = acc / l_i[:, None]
        o_rows = o_ptr + (q0 + tl.minimum(tok, n - 1)).to(tl.int64) * stride_ot + head.to(tl.int64) * stride_oh
        tl.store(o_rows[:, None] + offs_d[None, :], out.to(o_ptr.dtype.element_ty), mask=valid[:, None])
