"""Greedy token selection on the GPU, in one kernel launch.

``greedy_rows(logits, out)`` writes, for each row r of ``logits [R, V]`` (fp32 or bf16, unit
stride along V), ``out[0, r]`` = the first index of the row's maximum (as ``torch.max``
picks it) and ``out[1, r]`` = 1 when that maximum is a number above -inf, else 0 (a row of
-inf, or a row holding a NaN; its index is then some index in [0, V)).

Each row is scanned by ``chunks`` programs (grid ``(R, chunks)``, ``chunk`` columns each,
``BLOCK`` columns per step): every lane keeps its first strict maximum, and the program
reduces its lanes to (max, smallest index at that max) and a NaN flag. With one chunk that
program writes ``out``; otherwise it stores its partial (NaN as the max when its chunk holds
one) and takes an int32 ticket on the row's counter (atomic add, acquire-release), and the
last of the row's programs to arrive combines the partials (max, then smallest index, which
is the earliest chunk) into ``out`` and puts the counter back to 0.

``host=(buf, ctl)``: whichever program writes a row's result also writes it, write-through,
to ``buf[ctl[1]]`` (pinned host memory, int64 [2, 2, >= R]): a decode graph's tokens reach
the host with no copy after the replay (``triton_step_inputs``, whose ``take_inputs`` sets
``ctl[1]`` at the step's start).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from lodestar.kernels.launch import INTERP, graph_buffers, num_sms, pdl, triton_enabled

BLOCK = 4096            # columns per step of a program
NUM_WARPS = 8
MAX_CHUNKS = 64         # programs per row at most (a power of two: the combine loads them at once)
PROGRAMS_PER_SM = 4     # programs per SM the split aims for
MIN_ROWS = 64           # rows the first workspace on a device holds (the largest decode graph)


@dataclass(frozen=True)
class Workspace:
    """Partials and per-row counters of the multi-chunk combine, for up to ``rows`` rows."""

    values: torch.Tensor    # fp32 [rows * MAX_CHUNKS]: each chunk's max (NaN: the chunk holds a NaN)
    index: torch.Tensor     # int32 [rows * MAX_CHUNKS]: the first index of that max
    counters: torch.Tensor  # int32 [rows]: tickets taken so far; 0 between launches

    @property
    def rows(self) -> int:
        return self.counters.numel()


# Per device (``launch.graph_buffers``).
_WORKSPACES: dict[torch.device, list[Workspace]] = {}


def workspace(device: torch.device, rows: int = 0) -> Workspace:
    """The combine's buffers on ``device`` for at least ``rows`` rows (``MIN_ROWS`` at first
    use, so an eager call before a CUDA-graph capture has reserved them; growing during a
    capture is an error)."""
    return graph_buffers(_WORKSPACES, device, rows, MIN_ROWS, lambda ws: ws.rows, _new_workspace,
                         "greedy_rows' workspace rows (triton_sampling.workspace)")


def _new_workspace(n: int, device: torch.device) -> Workspace:
    return Workspace(torch.empty(n * MAX_CHUNKS, device=device, dtype=torch.float32),
                     torch.zeros(n * MAX_CHUNKS, device=device, dtype=torch.int32),
                     torch.zeros(n, device=device, dtype=torch.int32))


def split(rows: int, v: int, device: torch.device) -> tuple[int, int]:
    """(columns per program, programs per row): about ``PROGRAMS_PER_SM`` programs per SM
    in all, at most ``MAX_CHUNKS`` per row, each a whole number of ``BLOCK`` steps."""
    blocks = -(-v // BLOCK)
    want = max(1, min(MAX_CHUNKS, blocks, -(-PROGRAMS_PER_SM * num_sms(device) // rows)))
    chunk = -(-blocks // want) * BLOCK
    return chunk, -(-v // chunk)


def greedy_rows(logits: torch.Tensor, out: torch.Tensor, chunk: int | None = None,
                host: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """``out[0, :R]`` = first index of each row's maximum of ``logits [R, V]``, ``out[1, :R]``
    = 1 where that maximum is a number above -inf; ``out`` int64 [2, >= R]. ``chunk``
    (a multiple of ``BLOCK``) replaces ``split``'s columns per program (tests). ``host``:
    ``(buf, ctl)``, the same results also into ``buf[ctl[1]]`` (see the module docstring)."""
    if logits.dim() != 2 or logits.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"logits must be fp32 or bf16 [rows, vocab]; got {logits.dtype} {tuple(logits.shape)}")
    R, V = logits.shape
    if out.dtype != torch.int64 or out.dim() != 2 or out.shape[0] != 2 or out.shape[1] < R:
        raise ValueError(f"out must be int64 [2, >= {R}]; got {out.dtype} {tuple(out.shape)}")
    if R == 0:
        return
    if V == 0:
        raise ValueError("logits has no columns")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    if chunk is None:
        chunk, chunks = split(R, V, logits.device)
    else:
        if chunk <= 0 or chunk % BLOCK:
            raise ValueError(f"chunk must be a positive multiple of {BLOCK}; got {chunk}")
        chunks = -(-V // chunk)
        if chunks > MAX_CHUNKS:
            raise ValueError(f"{chunks} chunks of {chunk} columns; at most {MAX_CHUNKS}")
    ws = workspace(logits.device, R if chunks > 1 else 0)
    if host is not None:
        buf, ctl = host
        if buf.dtype != torch.int64 or buf.dim() != 3 or buf.shape[:2] != (2, 2) or buf.shape[2] < R:
            raise ValueError(f"host buffer must be int64 [2, 2, >= {R}]; got {buf.dtype} {tuple(buf.shape)}")
        if ctl.dtype != torch.int32 or ctl.numel() < 2 or ctl.device != logits.device:
            raise ValueError("host ctl must be int32 [>= 2] on the logits' device")
        hargs = (buf, ctl, buf.stride(0), buf.stride(1), buf.stride(2))
    else:
        hargs = (out, ws.counters, 0, 0, 0)      # never touched: HOST is off
    _greedy_kernel[(R, chunks)](logits, out, ws.values, ws.index, ws.counters, V, logits.stride(0),
                                out.stride(0), out.stride(1), chunk // BLOCK, *hargs, BLOCK=BLOCK,
                                CHUNKS_PAD=MAX_CHUNKS, SPLIT=chunks > 1, INTERP=INTERP, HOST=host is not None,
                                num_warps=NUM_WARPS, **pdl())


# --------------------------------------------------------------------------- kernels

if triton_enabled():
    import triton
    import triton.language as tl

    from lodestar.kernels.launch import _loop_bound, _pdl_enter

    @triton.jit
    def _store_result(out_ptr, row, stride_o0, stride_o1, m, i, has_nan, host_ptr, ctl_ptr, sh_p, sh_0, sh_1,
                      HOST: tl.constexpr):
        ok = (m > float("-inf")) & (has_nan == 0)
        tl.store(out_ptr + row * stride_o1, i.to(tl.int64))
        tl.store(out_ptr + stride_o0 + row * stride_o1, ok.to(tl.int64))
        if HOST:    # the same into the host's result slot ctl[1] (pinned memory, write-through)
            hp = host_ptr + tl.load(ctl_ptr + 1).to(tl.int64) * sh_p + row * sh_1
            tl.store(hp, i.to(tl.int64), cache_modifier=".wt")
            tl.store(hp + sh_0, ok.to(tl.int64), cache_modifier=".wt")

    @triton.jit
    def _greedy_kernel(x_ptr, out_ptr, val_ptr, idx_ptr, count_ptr, V, stride_x, stride_o0, stride_o1, steps,
                       host_ptr, ctl_ptr, sh_p, sh_0, sh_1, BLOCK: tl.constexpr, CHUNKS_PAD: tl.constexpr,
                       SPLIT: tl.constexpr, INTERP: tl.constexpr, HOST: tl.constexpr, PDL: tl.constexpr):
        """Row ``program_id(0)``, columns ``[c * steps * BLOCK, (c + 1) * steps * BLOCK)`` of
        chunk ``c = program_id(1)``; SPLIT: one of several chunks (the last to arrive combines)."""
        _pdl_enter(PDL)
        row = tl.program_id(0)
        c = tl.program_id(1)
        x_row = x_ptr + row.to(tl.int64) * stride_x
        lanes = tl.arange(0, BLOCK)
        best = tl.full([BLOCK], float("-inf"), tl.float32)
        at = tl.zeros([BLOCK], tl.int32)
        nan = tl.zeros([BLOCK], tl.int32)
        start = c * steps * BLOCK
        for s in range(_loop_bound(steps, INTERP)):
            offs = start + s * BLOCK + lanes
            x = tl.load(x_row + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
            take = x > best          # strict: a lane keeps its first maximum (NaN never taken)
            best = tl.where(take, x, best)
            at = tl.where(take, offs, at)
            nan = nan | (x != x).to(tl.int32)
        m = tl.max(best, 0)
        i = tl.min(tl.where(best == m, at, V), 0)    # all -inf: every lane still holds 0
        has_nan = tl.max(nan, 0)
        if not SPLIT:
            _store_result(out_ptr, row, stride_o0, stride_o1, m, i, has_nan, host_ptr, ctl_ptr, sh_p, sh_0, sh_1,
                          HOST)
        else:
            slot = row * CHUNKS_PAD + c
            tl.store(val_ptr + slot, tl.where(has_nan != 0, float("nan"), m))
            tl.store(idx_ptr + slot, i)
            # Both partials are stored before the ticket (barrier, then a release); the last
            # arrival reads the others' partials from L2 after its acquire.
            tl.debug_barrier()
            arrived = tl.atomic_add(count_ptr + row, 1, sem="acq_rel", scope="gpu")
            if arrived == tl.num_programs(1) - 1:
                tl.debug_barrier()
                ks = tl.arange(0, CHUNKS_PAD)
                mk = ks < tl.num_programs(1)
                vals = tl.load(val_ptr + row * CHUNKS_PAD + ks, mask=mk, other=float("-inf"), cache_modifier=".cg")
                idxs = tl.load(idx_ptr + row * CHUNKS_PAD + ks, mask=mk, other=0, cache_modifier=".cg")
                has_nan = tl.max((vals != vals).to(tl.int32), 0)
                vals = tl.where(vals != vals, float("-inf"), vals)
                m = tl.max(vals, 0)
                i = tl.min(tl.where(vals == m, idxs, V), 0)    # the earliest chunk at the max
                _store_result(out_ptr, row, stride_o0, stride_o1, m, i, has_nan, host_ptr, ctl_ptr, sh_p, sh_0,
                              sh_1, HOST)
                tl.atomic_xchg(count_ptr + row, 0, sem="relaxed", scope="gpu")
