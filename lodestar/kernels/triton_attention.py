"""Attention over the paged KV pool on the GPU: a Triton decode kernel, a gather + SDPA
prefill path, and torch references.

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

Prefill (several new tokens), ``prefill_attention``
    First version: torch SDPA over each sequence's context gathered from the pool (the
    gather indices and masks are the CPU path's plan, moved to the device once per step
    and shared by all layers). A single sequence with no cached prefix runs ``is_causal``
    (flash attention, GQA without copies); anything else runs a padded batch with the
    boolean mask, kv heads repeated for the GQA groups (memory-efficient kernel). A
    Triton varlen kernel reading the block table would avoid the gather and the padding.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from lodestar.kernels.triton_quant import interpreted, pdl, triton_enabled

PARTITION = 256     # keys per decode partition
SHORT_PARTITION = 64    # keys per partition when the visible context is at most SHORT_CONTEXT
SHORT_CONTEXT = 1024
BLOCK_N = 64        # keys per inner step
REDUCE_CHUNK = 16   # partials combined per step of the reduce kernel
LOG2E = 1.4426950408889634
NO_WINDOW = 1 << 30  # window passed to the kernels when every key is visible


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def num_partitions(max_context: int) -> int:
    """Partitions needed for any context up to ``max_context`` keys."""
    short = -(-min(max_context, SHORT_CONTEXT) // SHORT_PARTITION)
    return max(1, short, -(-max_context // PARTITION))


def grid_splits(num_seqs: int, n_kv_heads: int, device: torch.device) -> int:
    """Programs per (sequence, kv head): enough to give every SM a few, at most 64."""
    want = -(-4 * _num_sms(device) // max(1, num_seqs * n_kv_heads))
    return max(1, min(64, want))


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int, scale: float,
                     window: int | None = None, max_partitions: int | None = None,
                     splits: int | None = None) -> torch.Tensor:
    """Attention of one query per sequence over its paged context.

    ``q [B, Hq, D]``; caches ``[slots, Hk, D]``; ``block_tables [B, W]`` and ``seq_lens [B]``
    int32 on the device. ``max_partitions`` bounds every sequence's partitions (pass it
    when the lengths are not known on the host, as in a CUDA graph). Returns ``[B, Hq, D]``.
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
    win = int(window) if window else NO_WINDOW
    g_pad = max(16, 1 << (G - 1).bit_length())
    is_f32 = q.dtype == torch.float32
    _decode_partial_kernel[(B, Hk, splits)](
        q, k_cache, v_cache, block_tables, seq_lens, part_o, part_m, part_l,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        block_tables.stride(0), scale * LOG2E, win, max_partitions,
        G=G, G_PAD=g_pad, D=D, BS=block_size, BLOCK_N=BLOCK_N, PART=PARTITION, PART_SHORT=SHORT_PARTITION,
        SHORT=SHORT_CONTEXT, SPLITS=splits,
        IS_F32=is_f32, DOT_F32=interpreted(), num_warps=4, **pdl())
    _decode_reduce_kernel[(B, Hq)](
        part_o, part_m, part_l, seq_lens, out, out.stride(0), out.stride(1), win, max_partitions, Hq,
        D=D, PART=PARTITION, PART_SHORT=SHORT_PARTITION, SHORT=SHORT_CONTEXT, CHUNK=REDUCE_CHUNK, num_warps=4,
        **pdl())
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
    """Attention of all new queries ``q [T, Hq, D]`` (their K/V already written to the pool)."""
    T, Hq, D = q.shape
    Hk = k_cache.shape[1]
    plan = _device_plan(batch, q.device, window)
    k = k_cache[plan["context_slots"]].transpose(1, 2)                           # [S, Hk, Lk, D]
    v = v_cache[plan["context_slots"]].transpose(1, 2)
    if batch.num_seqs == 1 and batch.seq_lens_list[0] == T and (not window or T <= window):
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

    from lodestar.kernels.triton_dense import _pdl_enter

    @triton.jit
    def _partition(ctx, PART: tl.constexpr, PART_SHORT: tl.constexpr, SHORT: tl.constexpr):
        """Keys per partition for a visible context of ``ctx`` keys: PART_SHORT up to SHORT keys,
        PART beyond (integer arithmetic only: exact for contexts below SHORT**3 keys)."""
        q = (ctx - 1) // SHORT                               # 0 when ctx <= SHORT
        long = ((q + SHORT - 1) // SHORT + SHORT - 1) // SHORT   # min(q, 1)
        return PART_SHORT + (PART - PART_SHORT) * long

    @triton.jit
    def _decode_partial_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, po_ptr, pm_ptr, pl_ptr,
                               stride_qb, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_tb,
                               qk_scale, window, max_parts,
                               G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                               BLOCK_N: tl.constexpr, PART: tl.constexpr, PART_SHORT: tl.constexpr,
                               SHORT: tl.constexpr, SPLITS: tl.constexpr,
                               IS_F32: tl.constexpr, DOT_F32: tl.constexpr, PDL: tl.constexpr):
        _pdl_enter(PDL)
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
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
        for p in range(split, n_parts, SPLITS):
            lo = start + p * part
            hi = tl.minimum(lo + part, L)
            m_i = tl.full([G_PAD], float("-inf"), tl.float32)
            l_i = tl.zeros([G_PAD], tl.float32)
            acc = tl.zeros([G_PAD, D], tl.float32)
            for j0 in range(lo, hi, BLOCK_N):
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
                s = s * qk_scale
                s = tl.where(mask_j[None, :], s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, 1))
                alpha = tl.exp2(m_i - m_new)
                pr = tl.exp2(s - m_new[:, None])
                l_i = l_i * alpha + tl.sum(pr, 1)
                if IS_F32:
                    pv = tl.dot(pr, v, input_precision="ieee")
                else:
                    pv = tl.dot(pr.to(v.dtype), v)
                acc = acc * alpha[:, None] + pv
                m_i = m_new
            idx = part_base + p
            tl.store(pm_ptr + idx, m_i, mask=mask_g)
            tl.store(pl_ptr + idx, l_i, mask=mask_g)
            tl.store(po_ptr + idx[:, None] * D + offs_d[None, :], acc, mask=mask_g[:, None])

    @triton.jit
    def _decode_reduce_kernel(po_ptr, pm_ptr, pl_ptr, lens_ptr, out_ptr, stride_ob, stride_oh,
                              window, max_parts, Hq,
                              D: tl.constexpr, PART: tl.constexpr, PART_SHORT: tl.constexpr,
                              SHORT: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr):
        _pdl_enter(PDL)
        b = tl.program_id(0)
        h = tl.program_id(1)
        L = tl.load(lens_ptr + b)
        start = tl.maximum(L - window, 0)
        part = _partition(L - start, PART, PART_SHORT, SHORT)
        n_parts = tl.cdiv(L - start, part)
        base = (b * Hq + h).to(tl.int64) * max_parts
        offs_d = tl.arange(0, D)
        m_run = tl.full([1], float("-inf"), tl.float32)
        l_run = tl.zeros([1], tl.float32)
        o_run = tl.zeros([D], tl.float32)
        for c0 in range(0, n_parts, CHUNK):
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
        out = o_run / l_run
        tl.store(out_ptr + b.to(tl.int64) * stride_ob + h * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty))
