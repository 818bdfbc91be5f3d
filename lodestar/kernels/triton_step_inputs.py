"""A decode graph's step inputs read from pinned host memory by the graph itself.

A CUDA-graph decode step needs each row's token id (first step only), position, KV slot,
length and block table. Copied in with ``cudaMemcpyAsync`` before each replay, and the
greedy tokens copied out after it, every step puts two copies between consecutive graphs
on the stream. Here the graph's first kernel reads the inputs straight from pinned
(mapped) host memory and the greedy kernel writes its tokens straight back
(``triton_sampling.greedy_rows(host=...)``): consecutive replays follow each other with
nothing in between.

Host buffer (``stage_bytes``): two stages, used by alternate replays, each

=========  ========================  =============================================
bytes      what                      written by the host before the replay
=========  ========================  =============================================
0 - 16     int32 [4] header          ``host_ids`` (1: take the ids below), the
                                     block-table columns in use, 0, 0
16 -       int64 [size] token ids    read only when ``host_ids``
then       the graph's input buffer  positions, KV slots, lengths, block tables, laid
           (``input_bytes``)         out as ``ModelRunner._input_views``
=========  ========================  =============================================

``take_inputs`` (one program) reads the step counter ``ctl[0]``, takes stage ``ctl[0] % 2``:
the fixed inputs and the first ``table_chunk`` table columns of every row in one round
trip over the bus (the header's column count is not waited for; columns past a row's
blocks are never read), further columns only past that; writes ``ctl[1]`` = the stage
it took (the greedy kernel's result slot) and ``ctl[0] + 1``. The host fills stage ``p``
again only after the replay that read it has ended (an event), so a stage is never
written while read. Loads bypass the caches (``.cv``): the host rewrites the stage
between replays. [``take_inputs_ref``]
"""
from __future__ import annotations

import torch

from lodestar.kernels.launch import INTERP, pdl, triton_enabled
from lodestar.kernels.triton_fused import _pow2

HEADER_BYTES = 16
# Table elements (rows x columns) read in the first round trip; more columns, one more trip each.
FIRST_TRIP_ELEMENTS = 4096


def stage_bytes(size: int, input_bytes: int) -> int:
    """Bytes of one stage (a multiple of 16) for a graph of ``size`` rows whose input buffer
    has ``input_bytes`` (a multiple of 4)."""
    if input_bytes % 4:
        raise ValueError(f"input_bytes must be a multiple of 4; got {input_bytes}")
    return (HEADER_BYTES + 8 * size + input_bytes + 15) // 16 * 16


def stage_views(stage: torch.Tensor, size: int, input_bytes: int) -> dict:
    """A stage (uint8 [stage_bytes]) as ``header`` (int32 [4]), ``ids`` (int64 [size]) and
    ``raw`` (uint8 [input_bytes]: the graph's input-buffer layout)."""
    i0 = HEADER_BYTES + 8 * size
    return {"header": stage[:HEADER_BYTES].view(torch.int32), "ids": stage[HEADER_BYTES:i0].view(torch.int64),
            "raw": stage[i0:i0 + input_bytes]}


def table_chunk(size: int, max_blocks: int) -> int:
    """Table columns per round trip of ``take_inputs`` (a power of two)."""
    return max(1, min(_pow2(max_blocks), FIRST_TRIP_ELEMENTS // _pow2(size)))


def _check(host: torch.Tensor, ctl: torch.Tensor, raw: torch.Tensor, ids: torch.Tensor, size: int,
           max_blocks: int, tables_offset: int) -> None:
    need = stage_bytes(size, raw.numel())
    if host.dtype != torch.uint8 or host.shape != (2, need):
        raise ValueError(f"host must be uint8 [2, {need}]; got {host.dtype} {tuple(host.shape)}")
    if raw.numel() != tables_offset + 4 * size * max_blocks or tables_offset % 16 or tables_offset < 20 * size:
        raise ValueError(f"raw: {raw.numel()} bytes for tables at {tables_offset} of {size} x {max_blocks}")
    if ids.dtype != torch.int64 or ids.numel() < size or ctl.dtype != torch.int32 or ctl.numel() < 2:
        raise ValueError("ids must be int64 [>= size] and ctl int32 [>= 2]")


def take_inputs(host: torch.Tensor, ctl: torch.Tensor, raw: torch.Tensor, ids: torch.Tensor, size: int,
                max_blocks: int, tables_offset: int) -> None:
    """Copy stage ``ctl[0] % 2`` of ``host`` (pinned uint8 [2, stage_bytes]) into the graph's
    input buffer ``raw`` (device uint8; block tables of ``size`` x ``max_blocks`` int32 from
    byte ``tables_offset``) and, when its header says so, its token ids into ``ids`` (device
    int64 [size]); then ``ctl[1]`` = that stage and ``ctl[0]`` += 1. One program."""
    _check(host, ctl, raw, ids, size, max_blocks, tables_offset)
    wc = table_chunk(size, max_blocks)
    fixed = tables_offset // 4
    _take_inputs_kernel[(1,)](host.view(torch.int32), ctl, raw.view(torch.int32), ids.view(torch.int32),
                              STAGE_WORDS=host.shape[1] // 4, SIZE=size, SIZE_PAD=_pow2(size),
                              MAXB=max_blocks, FIXED=fixed, FIXED_PAD=_pow2(fixed), IDS_PAD=_pow2(2 * size),
                              WC=wc, INTERP=INTERP, EARLY=pdl()["PDL"] is not False, num_warps=4)


def take_inputs_ref(host: torch.Tensor, ctl: torch.Tensor, raw: torch.Tensor, ids: torch.Tensor, size: int,
                    max_blocks: int, tables_offset: int) -> None:
    """Torch reference of ``take_inputs``: the same bytes written (every table column up to
    the first trip's chunk, and the header's columns past it)."""
    _check(host, ctl, raw, ids, size, max_blocks, tables_offset)
    step = int(ctl[0])
    st = stage_views(host[step % 2], size, raw.numel())
    src = st["raw"].to(raw.device)
    head = st["header"].tolist()
    raw[:tables_offset].copy_(src[:tables_offset])
    cols = max(min(table_chunk(size, max_blocks), max_blocks), min(head[1], max_blocks))
    view = lambda b: b[tables_offset:].view(torch.int32).view(size, max_blocks)  # noqa: E731
    view(raw)[:, :cols].copy_(view(src)[:, :cols])
    if head[0]:
        ids[:size].copy_(st["ids"].to(ids.device))
    ctl[1] = step % 2
    ctl[0] = step + 1


if triton_enabled():
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents

    from lodestar.kernels.launch import _loop_bound

    @triton.jit
    def _take_inputs_kernel(host_ptr, ctl_ptr, raw_ptr, ids_ptr, STAGE_WORDS: tl.constexpr, SIZE: tl.constexpr,
                            SIZE_PAD: tl.constexpr, MAXB: tl.constexpr, FIXED: tl.constexpr,
                            FIXED_PAD: tl.constexpr, IDS_PAD: tl.constexpr, WC: tl.constexpr,
                            INTERP: tl.constexpr, EARLY: tl.constexpr = False):
        """All of ``take_inputs`` in int32 words: header at 0, ids at 4, the input buffer at
        4 + 2 * SIZE (FIXED words, then SIZE x MAXB table words). EARLY: the next kernel
        (launched as ``launch.pdl`` launches, so it waits for this one to end) may
        launch at once."""
        if EARLY:
            gdc_launch_dependents()
        step = tl.load(ctl_ptr)
        par = step % 2
        base = host_ptr + par * STAGE_WORDS
        h = tl.arange(0, 4)
        head = tl.load(base + h, cache_modifier=".cv")
        host_ids = tl.sum(tl.where(h == 0, head, 0), 0)
        width = tl.sum(tl.where(h == 1, head, 0), 0)
        ki = tl.arange(0, IDS_PAD)
        kmask = ki < 2 * SIZE
        idv = tl.load(base + 4 + ki, mask=kmask, other=0, cache_modifier=".cv")
        src = base + 4 + 2 * SIZE
        kf = tl.arange(0, FIXED_PAD)
        fmask = kf < FIXED
        fv = tl.load(src + kf, mask=fmask, other=0, cache_modifier=".cv")
        r = tl.arange(0, SIZE_PAD)[:, None]
        c = tl.arange(0, WC)[None, :]
        tmask = (r < SIZE) & (c < MAXB)
        tv = tl.load(src + FIXED + r * MAXB + c, mask=tmask, other=0, cache_modifier=".cv")
        tl.store(raw_ptr + kf, fv, mask=fmask)
        tl.store(raw_ptr + FIXED + r * MAXB + c, tv, mask=tmask)
        tl.store(ids_ptr + ki, idv, mask=tl.where(host_ids != 0, kmask, False))
        for c0 in range(WC, _loop_bound(width, INTERP), WC):      # only tables wider than a trip
            cc = c0 + c
            m = (r < SIZE) & (cc < width) & (cc < MAXB)
            tv = tl.load(src + FIXED + r * MAXB + cc, mask=m, other=0, cache_modifier=".cv")
            tl.store(raw_ptr + FIXED + r * MAXB + cc, tv, mask=m)
        tl.store(ctl_ptr + 1, par)
        tl.store(ctl_ptr, step + 1)
