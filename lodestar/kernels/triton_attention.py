"""Attention over the paged KV pool on the GPU: a Triton decode kernel, a gather + SDPA
prefill path, and torch references.

Decode (one new token per sequence), ``decode_attention`` [``decode_attention_ref``]
    Split-KV ("flash decoding") in two kernels. Each sequence's visible context is cut
    into partitions counted from its first visible key: ``short_partition()`` keys when the
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

    Launch (``attention_pdl``, ``kv_prefetch``): under programmatic dependent launch the
    first kernel is launched early and, before its wait, asks L2 for the keys and values
    of each program's first partition (lengths and block tables are step inputs). A program
    whose sequence has at most ``ATTN_PDL_SHORT_KEYS`` keys lets the next kernel launch as
    soon as it has waited; one of a longer sequence only when it ends (early, the next
    kernel's waiting blocks made long contexts slower: 8B Q4_K at 32k 238.7 against 288.0
    tok/s; at 128-384 keys it is faster).

    Fused forms (decode fusions of ``triton_quant.fusions()``, read at each call; each one
    removes a launch per layer and gives the same bits):

    ``attn_reduce``: no second kernel. After storing its partials every program that owns
    a partition takes a ticket on its (sequence, kv head)'s int32 counter (atomic add,
    acquire-release; programs past the sequence's partitions, most of them at short
    contexts, take none); the program that draws the last ticket (``min(splits,
    partitions) - 1``) combines the partials of the G
    query heads, reading them past L1, with the same function as the reduce kernel
    (``_combine_partials``, same chunks, same order: same bits), writes the output and
    puts the counter back to 0. The counters (``decode_counters``, one zeroed buffer per
    device, reserved for ``MIN_COUNTERS`` pairs at first use, so before any CUDA-graph
    capture; or the caller's ``counters``) are thus at 0 for the next launch and graph
    replay. The combine is a function the compiler does not inline, so its tiles get the
    reduce kernel's register layout (inlined, the bf16 query tile's wider vectors would
    change the order of the sums).

    ``attn_rope`` (``decode_attention(new=NewTokens(...))``, rotary dim = head dim): q,
    k and v come straight from the projection, not rotated, not stored. Every program
    rotates the G query heads it reads (fp32, one rounding, the fused multiply-adds
    ``triton_fused.rope_`` compiles to); the program that owns the last partition, the
    only one to read key ``len - 1``, rotates the new key and stores it and the value at
    the token's slot, then a block barrier, then its partitions. All memory accesses
    follow the programmatic-dependent-launch wait. Output and caches are the bits of
    ``rope_`` + store + attention; q is not rotated in place (nothing reads it after).
    A partial rotary dim, a q not in the caches' dtype, or a prefill keeps ``rope_``.

    ``attn_quant`` (``decode_attention(quantize=True)``, bf16, head dim a multiple of 32):
    whichever program writes a head's output row (the reduce kernel, or the fused combine
    of ``attn_reduce``) also quantizes it, from the stored bf16 values, as ``quantize_x``
    of ``out.view(B, Hq * D)`` (a head is a whole number of 32-element groups;
    ``triton_fused._quant_store``): the output projection skips its x quantization.

Prefill (several new tokens), ``prefill_attention``
    ``paged_prefill`` (``_prefill_kernel``): causal attention of every sequence's new tokens
    over its paged context in one kernel, varlen (a host-built map gives each program a
    sequence and its first token), reading the block table itself. A program holds the G
    query heads of one kv head for up to 32 tokens (128 rows; 64 for head dims above 128:
    the K/V tiles are read once for the group), walks the keys in blocks of 64 counted from
    key 0, from the block holding its first visible key (blocks a row does not see add exact
    zeros to it), online softmax in base 2. A row's result depends only on its own query and keys, not on the
    other rows of its program, on the batch, or on how much of its context was cached
    before the step. One sequence with no cached prefix runs torch's causal SDPA over its
    own keys instead (flash kernel; prefill graphs capture that form), ``LODESTAR_PREFILL_ATTN=sdpa``
    the former gathered, padded, masked SDPA for the rest. H200, 8B geometry (run 46; run 48
    for long prefixes), ms per call, SDPA form / kernel: 32 prompts of 128 0.284 / 0.125,
    eight mixed sequences 0.972 / 0.238, 512 new tokens after 3,584 / 7,680 / 15,872 /
    32,256 cached 0.259 / 0.445 / 0.831 / 1.600 against 0.205 / 0.388 / 0.729 / 1.412; one
    fresh prompt of 4,096: flash 0.321, kernel 0.640 (of 512: 0.136 / 0.076).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lodestar.kernels.triton_quant import (GROUP, QuantizedRows, fusions, graph_buffers, interpreted, pdl,
                                           triton_enabled)

PARTITION = 256     # keys per decode partition
SHORT_PARTITION = 64    # keys per partition when the visible context is at most SHORT_CONTEXT
SHORT_CONTEXT = 1024
BLOCK_N = 64        # keys per inner step
# Short partitions below one step: the partition is one BLOCK_N-key step with its keys past
# the partition masked (no loads for them), so the kernel keeps its one step size.
SUB_BLOCK_PARTITIONS = (16, 32)
REDUCE_CHUNK = 16   # partials combined per step of the reduce kernel
PREFILL_BLOCK_N = 64    # keys per inner step of the prefill kernel
LOG2E = 1.4426950408889634
NO_WINDOW = 1 << 30  # window passed to the kernels when every key is visible
# Kernels run in Triton's interpreter (which then also runs them on CUDA tensors): loop
# bounds become Python ints there (``_loop_bound``).
_INTERP = os.environ.get("TRITON_INTERPRET") == "1"


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def short_partition() -> int:
    """Keys per partition of a short context (at most ``SHORT_CONTEXT`` keys): env
    ``LODESTAR_ATTN_SHORT_PARTITION`` (a multiple of ``BLOCK_N`` up to ``SHORT_CONTEXT``, or
    one of ``SUB_BLOCK_PARTITIONS``: one masked step a partition), unset: ``SHORT_PARTITION``.
    Read at each call. Longer partitions mean fewer programs with work and fewer partials to
    combine; the combine's grouping follows the partitions, so another value gives other fp32
    rounding (not the same bits).

    H200, 8B Q4_K one-stream decode at 128-384 keys against 64 in the same run, same greedy
    tokens: 128 / 256 / 512 keys 559.2 / 528.4 / 517.4 against 580.3 tok/s (run 137). Two
    32-key forms, not kept: 32-key partitions stepped 32 keys at a time while long ones kept
    64-key steps (both loops in one kernel, 153 registers) 569.8 against 580.3, slower at 640
    and 896 keys too (run 139); 32-key steps everywhere 586.6 against 579.9 at 128-384 keys
    (run 138), but 493.8 / 408.6 / 283.8 tok/s at 1k / 8k / 32k against 513.7 / 424.3 / 291.2
    for 64 keys in run 137 (another machine); with Triton's ``num_stages=5`` for the partial
    kernel (run 144, same run): 585.4 against 579.4 / 579.6, and 509.4 / 467.3 / 420.6 /
    289.3 at 1k / 4k / 8k / 32k against 513.6 / 468.4 / 424.6 / 290.7. A short-band kernel
    (one graph per context band, one 64-key partition per program without loops, same bits;
    7dacb36): 556.0 against 579.4 (run 141). 32 / 16-key partitions of one masked 64-key step
    (``SUB_BLOCK_PARTITIONS``): 588.0 / 576.2 against 587.5 / 587.8 (run 170), 603.7 against
    604.8 / 604.4 at stop 30's tilings (run 179): the partitions alone do not give run 138's gain."""
    env = os.environ.get("LODESTAR_ATTN_SHORT_PARTITION", "").strip()
    if not env:
        return SHORT_PARTITION
    n = int(env) if env.isdigit() else 0
    if not (n in SUB_BLOCK_PARTITIONS or (n % BLOCK_N == 0 and BLOCK_N <= n <= SHORT_CONTEXT)):
        raise ValueError(f"LODESTAR_ATTN_SHORT_PARTITION={env!r}; use {' or '.join(map(str, SUB_BLOCK_PARTITIONS))} "
                         f"or a multiple of {BLOCK_N} up to {SHORT_CONTEXT}")
    return n


def num_partitions(max_context: int) -> int:
    """Partitions needed for any context up to ``max_context`` keys."""
    short = -(-min(max_context, SHORT_CONTEXT) // short_partition())
    return max(1, short, -(-max_context // PARTITION))


def grid_splits(num_seqs: int, n_kv_heads: int, device: torch.device) -> int:
    """Programs per (sequence, kv head): enough to give every SM ``LODESTAR_ATTN_PROGRAMS_PER_SM``
    (default 4; read at each call), at most 64. Results do not depend on it (partition
    boundaries and the combine order follow the sequence's length only)."""
    env = os.environ.get("LODESTAR_ATTN_PROGRAMS_PER_SM", "").strip() or "4"
    if not env.isdigit() or int(env) < 1:
        raise ValueError(f"LODESTAR_ATTN_PROGRAMS_PER_SM={env!r}; use a positive integer")
    want = -(-int(env) * _num_sms(device) // max(1, num_seqs * n_kv_heads))
    return max(1, min(64, want))


@dataclass
class NewTokens:
    """This decode step's un-rotated keys and values and what rotates them, for a
    ``decode_attention`` that applies RoPE and stores the KV itself (fusion ``attn_rope``).

    ``k``, ``v`` ``[B, Hk, D]`` (views into the q|k|v projection are fine), ``positions [B]``
    and ``slots [B]`` (int64) of the one new token per sequence; ``cos``/``sin`` ``[P, D]``
    fp32 rotate-half tables (``RotaryEmbedding.cos``/``sin``, rotary dim = head dim)."""

    k: torch.Tensor
    v: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor


def rope_fusable(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, rotary_dim: int) -> bool:
    """The decode kernel can rotate and store this step's q/k/v itself: every head dim
    rotates (no pass-through tail) and q is already in the caches' dtype (the unfused
    path would convert it after the rotation)."""
    D = q.shape[-1]
    return (rotary_dim == D and D % 2 == 0 and q.dtype == k_cache.dtype and k.shape[1:] == k_cache.shape[1:]
            and v.shape[1:] == v_cache.shape[1:] and q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1)


# Counter buffers of the fused combine, per device; the newest is used. Older ones stay
# alive: a CUDA graph captured with one keeps its address.
_COUNTERS: dict[torch.device, list[torch.Tensor]] = {}
MIN_COUNTERS = 64 * 64      # (sequence, kv head) pairs: a 64-row decode graph with up to 64 kv heads


def decode_counters(device: torch.device, n: int = 0) -> torch.Tensor:
    """Zero-initialised int32 counters (at least ``n``) of the fused combine on ``device``,
    one per (sequence, kv head); every launch leaves them at 0 again. Allocated at first
    use for at least ``MIN_COUNTERS`` pairs, so the eager warm-up before a CUDA-graph
    capture has reserved them; growing during a capture is an error."""
    return graph_buffers(_COUNTERS, device, n, MIN_COUNTERS, torch.Tensor.numel,
                         lambda size, dev: torch.zeros(size, device=dev, dtype=torch.int32),
                         "decode attention's combine counters (triton_attention.decode_counters)")


def kv_prefetch() -> bool:
    """Whether the decode kernel, launched under programmatic dependent launch, asks L2 for
    the keys and values of its first partition before it waits for the previous kernel (env
    ``LODESTAR_KV_PREFETCH``, unset or 1 on, 0 off; read at each call). Same bits either
    way. H200 run 23, same tokens: 8B Q4_0 one-stream decode 510.9 -> 514.9 tok/s,
    Q4_K 503.7 -> 507.8, SmolLM2 F16 1,666 -> 1,689."""
    env = os.environ.get("LODESTAR_KV_PREFETCH", "1").strip()
    if env not in ("", "0", "1"):
        raise ValueError(f"LODESTAR_KV_PREFETCH={env!r}; use 0 or 1")
    return env == "1"


# LODESTAR_ATTN_PDL=short: a program whose sequence has at most this many keys lets the next
# kernel launch as soon as it has waited (the form ``1``); one of a longer sequence does not
# (the form ``wait``: the next kernel launches when this one ends).
ATTN_PDL_SHORT_KEYS = 512


def attention_pdl() -> dict:
    """``pdl()`` for the decode-attention kernel, ``LODESTAR_ATTN_PDL``: ``wait``: launched
    early (it waits for the previous kernel) but the next kernel only launches when it
    ends; 1: as ``pdl()`` (the next kernel launches as soon as every program of this one
    has started); unset or ``short``: as 1 for the programs of sequences of at most
    ``ATTN_PDL_SHORT_KEYS`` keys, as ``wait`` for the others (the next kernel launches once
    every program has either let it or ended); 0: off. Read at each call; same bits in
    every form. H200 run 29, 8B Q4_K decode against context:
    ``wait`` 473.7 / 416.0 / 288.0 tok/s at 1k / 8k / 32k, 1: 470.5 / 392.4 / 238.7, 0:
    462.7 / 417.1 / 296.8. One stream at 128-384 keys, same tokens: run 97, 8B Q4_0
    ``wait`` 601.2, 1 605.7; run 98, ``wait`` against ``short``: 8B Q4_0 596.9 -> 604.3,
    Q4_K 555.1 -> 558.0, Llama-3.2-1B Q4_0 1,853.1 -> 1,877.8, SmolLM2-135M Q4_0 1,878.2
    -> 1,923.0. The bound of 512 keys is not tuned (1 lost at 1k keys in run 29)."""
    env = os.environ.get("LODESTAR_ATTN_PDL", "short").strip() or "short"
    if env not in ("", "0", "1", "wait", "short"):
        raise ValueError(f"LODESTAR_ATTN_PDL={env!r}; use 0, 1, wait or short")
    launch = pdl()
    if env == "0" or not launch["PDL"]:
        return {"PDL": False}
    if env == "short":
        return {"PDL": 4, "launch_pdl": True}
    return launch if env == "1" else {"PDL": 2, "launch_pdl": True}


def reduce_early() -> bool:
    """Whether the decode-attention reduce kernel lets the next kernel (the output projection)
    launch before its own wait (``triton_quant.pdl(launch_next=True)``), so that projection's
    programs become resident, and read the weights they read before their wait, while the
    partial kernel still runs. Env ``LODESTAR_REDUCE_EARLY``, unset or 0 off, 1 on; read at
    each call. Same bits either way: the projection still waits for the reduce kernel, which
    ends only after its own wait."""
    env = os.environ.get("LODESTAR_REDUCE_EARLY", "0").strip() or "0"
    if env not in ("0", "1"):
        raise ValueError(f"LODESTAR_REDUCE_EARLY={env!r}; use 0 or 1")
    return env == "1"


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int, scale: float,
                     window: int | None = None, max_partitions: int | None = None,
                     splits: int | None = None, new: NewTokens | None = None,
                     fuse_reduce: bool | None = None, counters: torch.Tensor | None = None,
                     quantize: bool = False) -> torch.Tensor | QuantizedRows:
    """Attention of one query per sequence over its paged context.

    ``q [B, Hq, D]``; caches ``[slots, Hk, D]``; ``block_tables [B, W]`` and ``seq_lens [B]``
    int32 on the device. ``max_partitions`` bounds every sequence's partitions (pass it
    when the lengths are not known on the host, as in a CUDA graph). Returns ``[B, Hq, D]``.

    ``new`` (fusion ``attn_rope``; see ``rope_fusable``): ``q`` is not rotated yet and this
    step's K/V are not stored yet; the kernel does both, with the bits of
    ``triton_fused.rope_`` + store. ``fuse_reduce`` (default: ``attn_reduce`` in
    ``triton_quant.fusions()``): the partial kernel combines the partials itself, using
    ``counters`` (default ``decode_counters(q.device)``; at least B * Hk int32 zeros, left
    at zero). ``quantize`` (fusion ``attn_quant``; bf16, D a multiple of 32): returns
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
    if fuse_reduce is None:
        fuse_reduce = "attn_reduce" in fusions()
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
    is_f32 = q.dtype == torch.float32
    if fuse_reduce:
        if counters is None:
            counters = decode_counters(q.device, B * Hk)
        elif counters.numel() < B * Hk or counters.dtype != torch.int32:
            raise ValueError(f"counters: need {B * Hk} int32, got {counters.numel()} {counters.dtype}")
    else:
        counters = part_m       # never read: REDUCE is off
    if new is not None:
        if not rope_fusable(q, new.k, new.v, k_cache, v_cache, new.cos.shape[1]):
            raise ValueError("decode_attention(new=...): rotary dim must equal the head dim and q must be in the "
                             "caches' dtype (see rope_fusable)")
        nk, nv, pos, cos, sin, slots = new.k, new.v, new.positions, new.cos, new.sin, new.slots
    else:       # never read: ROPE is off
        nk, nv, pos, cos, sin, slots = k_cache, v_cache, seq_lens, part_m, part_m, seq_lens
    launch = attention_pdl()
    part_short = short_partition()
    _decode_partial_kernel[(B, Hk, splits)](
        q, k_cache, v_cache, block_tables, seq_lens, part_o, part_m, part_l,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        block_tables.stride(0), scale * LOG2E, win, max_partitions,
        out, counters, out.stride(0), out.stride(1), words, d1, sums,
        nk, nv, pos, cos, sin, slots, nk.stride(0), nk.stride(1), nv.stride(0), nv.stride(1), cos.stride(0),
        G=G, G_PAD=g_pad, D=D, BS=block_size, BLOCK_N=BLOCK_N, PART=PARTITION, PART_SHORT=part_short,
        SHORT=SHORT_CONTEXT, SPLITS=splits, IS_F32=is_f32, DOT_F32=interpreted(), REDUCE=fuse_reduce,
        CHUNK=REDUCE_CHUNK, ROPE=new is not None, QUANT=quantize, INTERP=_INTERP,
        PREFETCH=launch["PDL"] != 0 and kv_prefetch(), PDL_SHORT_KEYS=ATTN_PDL_SHORT_KEYS, num_warps=4, **launch)
    if not fuse_reduce:
        _decode_reduce_kernel[(B, Hq)](
            part_o, part_m, part_l, seq_lens, out, out.stride(0), out.stride(1), words, d1, sums, win,
            max_partitions, Hq, D=D, PART=PARTITION, PART_SHORT=part_short, SHORT=SHORT_CONTEXT,
            CHUNK=REDUCE_CHUNK, QUANT=quantize, INTERP=_INTERP, num_warps=4, **pdl(launch_next=reduce_early()))
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

def prefill_kernel_mode() -> str:
    """Which prefills run the paged varlen kernel (``_prefill_kernel``), env
    ``LODESTAR_PREFILL_ATTN`` (read at each call): unset or ``paged``, every prefill but one
    sequence with no cached prefix (that one runs torch's causal flash kernel over its own
    keys, as prefill graphs capture it); ``sdpa``, none (keys gathered per sequence, padded,
    masked SDPA)."""
    env = os.environ.get("LODESTAR_PREFILL_ATTN", "paged").strip() or "paged"
    if env not in ("paged", "sdpa"):
        raise ValueError(f"LODESTAR_PREFILL_ATTN={env!r}; use paged or sdpa")
    return env


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch, scale: float,
                      window: int | None = None) -> torch.Tensor:
    """Attention of all new queries ``q [T, Hq, D]`` (their K/V already written to the pool).

    One sequence with no cached prefix (within the window) runs torch's causal SDPA over its
    own keys (flash kernel, GQA without copies); other steps run ``paged_prefill`` (see
    ``prefill_kernel_mode``)."""
    T, Hq, D = q.shape
    Hk = k_cache.shape[1]
    fresh = batch.num_seqs == 1 and batch.seq_lens_list[0] == T and (not window or T <= window)
    if not fresh and prefill_kernel_mode() == "paged":
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
        DOT_F32=interpreted(), INTERP=_INTERP, num_warps=4 if D <= 128 else 8)
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

    from lodestar.kernels.triton_dense import _pdl_enter
    from lodestar.kernels.triton_fused import _quant_store
    from lodestar.kernels.triton_quant import _prefetch_l2

    @triton.jit
    def _partition(ctx, PART: tl.constexpr, PART_SHORT: tl.constexpr, SHORT: tl.constexpr):
        """Keys per partition for a visible context of ``ctx`` keys: PART_SHORT up to SHORT keys,
        PART beyond (integer arithmetic only: exact for contexts below SHORT**3 keys)."""
        q = (ctx - 1) // SHORT                               # 0 when ctx <= SHORT
        long = ((q + SHORT - 1) // SHORT + SHORT - 1) // SHORT   # min(q, 1)
        return PART_SHORT + (PART - PART_SHORT) * long

    @triton.jit
    def _loop_bound(x, INTERP: tl.constexpr):
        """The scalar tensor ``x`` as a ``range`` bound. Compiled kernels take it as is (the
        branch is resolved at compile time); Triton's interpreter holds scalars as
        one-element arrays, which its ``range`` cannot take under NumPy 2, so there it
        becomes a Python int."""
        if INTERP:     # returned, not assigned: the interpreter turns assigned values into tensors
            return int(x.handle.data.reshape(-1)[0])
        return x

    @triton.jit
    def _rope_cols(x, partner, c, s, first):
        """Rotate-half RoPE of a row (or rows) ``x`` whose columns' rotation partners are
        ``partner`` (column d + D/2 for the first half, d - D/2 for the second; ``first``
        marks the first half), by the fp32 ``c``/``s`` of each column, rounded once to x's
        dtype: the bits of ``triton_fused._rope_rows``. Its ``f1 * c - f2 * s`` and
        ``f2 * c + f1 * s`` are compiled (sm_90, every head count and dtype) to
        ``fma(f1, c, -(f2 * s))`` and ``fma(f2, c, f1 * s)``, which is written out here:
        left to the compiler in another kernel, the second sum was fused the other way
        round. ``* -1.0`` is an exact sign flip (unary minus is ``0 - x``: +0 for x = +0).
        Columns rather than halves joined with ``tl.join``: a join upstream of ``tl.dot``
        makes the compiler pick another operand layout (K order) for the product.
        (The interpreter evaluates ``tl.fma`` unfused, as it evaluates both sums.)"""
        ps = partner.to(tl.float32) * s
        return tl.fma(x.to(tl.float32), c, tl.where(first, ps * -1.0, ps)).to(x.dtype)

    @triton.jit
    def _combine_partials(po_ptr, pm_ptr, pl_ptr, base, n_parts, D: tl.constexpr, CHUNK: tl.constexpr,
                          CG: tl.constexpr, INTERP: tl.constexpr):
        """One query head's output ``[D]`` (fp32) from its ``n_parts`` partials at ``base``:
        CHUNK partials a step in partition order, running max and rescaled sums. Both the
        reduce kernel and the fused combine of the partial kernel call this, so their bits
        agree. CG: load through L2 only (partials that other programs just wrote)."""
        offs_d = tl.arange(0, D)
        m_run = tl.full([1], float("-inf"), tl.float32)
        l_run = tl.zeros([1], tl.float32)
        o_run = tl.zeros([D], tl.float32)
        for c0 in range(0, _loop_bound(n_parts, INTERP), CHUNK):
            offs = c0 + tl.arange(0, CHUNK)
            mask = offs < n_parts
            if CG:
                m = tl.load(pm_ptr + base + offs, mask=mask, other=float("-inf"), cache_modifier=".cg")
                l = tl.load(pl_ptr + base + offs, mask=mask, other=0.0, cache_modifier=".cg")
                o = tl.load(po_ptr + (base + offs)[:, None] * D + offs_d[None, :], mask=mask[:, None], other=0.0,
                            cache_modifier=".cg")
            else:
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

    @triton.jit(noinline=True)
    def _combine_group(po_ptr, pm_ptr, pl_ptr, out_row, stride_oh, bh0, h0, max_parts, n_parts,
                       words_ptr, d1_ptr, sums_ptr, row, K, G: tl.constexpr, D: tl.constexpr,
                       CHUNK: tl.constexpr, QUANT: tl.constexpr, INTERP: tl.constexpr):
        """The fused combine: heads ``h0 .. h0 + G - 1`` (partial rows ``bh0 ..``) into ``out_row``;
        QUANT: also quantized, head h as columns ``h * D ..`` of row ``row`` of ``K`` features.

        A function of its own (not inlined), so that the compiler lays out its tiles from
        its own loads and stores only, as in the reduce kernel: inlined into the partial
        kernel, the [CHUNK, D] partials took the wider vector layout of the bf16 query
        tile (same shape) and their sums another order."""
        offs_d = tl.arange(0, D)
        for g in range(G):
            o = _combine_partials(po_ptr, pm_ptr, pl_ptr, (bh0 + g).to(tl.int64) * max_parts, n_parts, D, CHUNK,
                                  True, INTERP)
            y = o.to(out_row.dtype.element_ty)
            tl.store(out_row + (h0 + g) * stride_oh + offs_d, y)
            if QUANT:   # from the stored (rounded) values, exactly as quantize_x would read them
                _quant_store(words_ptr, d1_ptr, sums_ptr, y, row, (h0 + g) * (D // 32), K, D)

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
                               out_ptr, cnt_ptr, stride_ob, stride_oh, words_ptr, d1_ptr, sums_ptr,
                               nk_ptr, nv_ptr, pos_ptr, cos_ptr, sin_ptr, slot_ptr,
                               stride_nkb, stride_nkh, stride_nvb, stride_nvh, stride_cos,
                               G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                               BLOCK_N: tl.constexpr, PART: tl.constexpr, PART_SHORT: tl.constexpr,
                               SHORT: tl.constexpr, SPLITS: tl.constexpr,
                               IS_F32: tl.constexpr, DOT_F32: tl.constexpr, REDUCE: tl.constexpr,
                               CHUNK: tl.constexpr, ROPE: tl.constexpr, QUANT: tl.constexpr, INTERP: tl.constexpr,
                               PREFETCH: tl.constexpr, PDL: tl.constexpr, PDL_SHORT_KEYS: tl.constexpr):
        """Program (sequence b, kv head, split): the partials of partitions split, split +
        SPLITS, ... for the G query heads of the kv head (see the module docstring).

        ROPE: ``q``, ``nk``, ``nv`` are this step's un-rotated query, key and value (one token
        per sequence): every program rotates its G query heads in registers; the program
        that owns the last partition (the one holding key L - 1) also rotates the new key and
        stores it and the value at ``slot[b]`` of the caches, before its own loads of them.
        REDUCE: the last program of (b, kv head) to take a ticket on ``cnt[b, kv head]``
        combines the partials of the G heads into ``out`` (QUANT: and their quantized form,
        ``words``/``d1``/``sums`` of the rows ``out[b].view(Hq * D)``) and sets the counter back to 0.
        PREFETCH: before ``_pdl_enter``, ask L2 for the keys and values of this program's first
        partition (``_prefetch_partition``; lengths and block tables are step inputs, written
        before the step's first kernel; a key the previous kernel is storing is prefetched
        stale, harmlessly: L2 is where its store lands)."""
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        if PREFETCH:
            _prefetch_partition(k_ptr, v_ptr, tables_ptr, lens_ptr, b, kvh, split, stride_ks, stride_kh, stride_vs,
                                stride_vh, stride_tb, window, D, BS, BLOCK_N, PART, PART_SHORT, SHORT)
        if PDL == 4:    # form ``short``: the next kernel may launch now if this sequence is short
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
        if ROPE:
            HALF: tl.constexpr = D // 2
            first = offs_d < HALF
            partner = tl.where(first, offs_d + HALF, offs_d - HALF)
            pos = tl.load(pos_ptr + b).to(tl.int64)
            # cos/sin rows are [cos(f), cos(f)]: the first half serves both halves (as _rope_kernel)
            cos_d = tl.load(cos_ptr + pos * stride_cos + offs_d % HALF)
            sin_d = tl.load(sin_ptr + pos * stride_cos + offs_d % HALF)
            q_row = q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh
            x = tl.load(q_row + offs_d[None, :], mask=mask_g[:, None], other=0.0)
            xp = tl.load(q_row + partner[None, :], mask=mask_g[:, None], other=0.0)
            q = _rope_cols(x, xp, cos_d[None, :], sin_d[None, :], first[None, :])
            q = tl.where(mask_g[:, None], q, 0.0)   # padding rows +0, as loaded unfused
        else:
            q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                        mask=mask_g[:, None], other=0.0)
        if DOT_F32:
            q = q.to(tl.float32)
        table = tables_ptr + b.to(tl.int64) * stride_tb
        k_head = k_ptr + kvh.to(tl.int64) * stride_kh
        v_head = v_ptr + kvh.to(tl.int64) * stride_vh
        if ROPE:
            if split == (n_parts - 1) % SPLITS:     # this program reads key L - 1: store it first
                new_slot = tl.load(slot_ptr + b).to(tl.int64)
                k_new = nk_ptr + b.to(tl.int64) * stride_nkb + kvh * stride_nkh
                k_rot = _rope_cols(tl.load(k_new + offs_d), tl.load(k_new + partner), cos_d, sin_d, first)
                tl.store(k_head + new_slot * stride_ks + offs_d, k_rot.to(k_ptr.dtype.element_ty))
                v_new = tl.load(nv_ptr + b.to(tl.int64) * stride_nvb + kvh * stride_nvh + offs_d)
                tl.store(v_head + new_slot * stride_vs + offs_d, v_new.to(v_ptr.dtype.element_ty))
                tl.debug_barrier()      # every thread's stores are seen by the block loads below
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
        if REDUCE:
            # Only the programs that own a partition take a ticket. Every thread's partials
            # are stored before it (barrier, then a release); the last arrival reads the
            # others' partials from L2 after its acquire.
            owners = tl.minimum(n_parts, SPLITS)
            if split < owners:
                tl.debug_barrier()
                cnt = cnt_ptr + b * tl.num_programs(1) + kvh
                arrived = tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu")
                if arrived == owners - 1:
                    tl.debug_barrier()
                    _combine_group(po_ptr, pm_ptr, pl_ptr, out_ptr + b.to(tl.int64) * stride_ob, stride_oh,
                                   b * Hq + kvh * G, kvh * G, max_parts, n_parts, words_ptr, d1_ptr, sums_ptr,
                                   b.to(tl.int64), Hq * D, G, D, CHUNK, QUANT, INTERP)
                    tl.atomic_xchg(cnt, 0, sem="relaxed", scope="gpu")

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
        out = _combine_partials(po_ptr, pm_ptr, pl_ptr, base, n_parts, D, CHUNK, False, INTERP)
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
