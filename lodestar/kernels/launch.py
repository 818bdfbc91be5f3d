"""What every kernel file needs to launch: whether Triton runs, programmatic dependent launch,
the SM count, buffers that CUDA graphs keep, and the L2 weight prefetch.

Host side: ``triton_enabled``, ``interpreted``, ``num_sms``, ``pdl``, ``graph_buffers``,
``prefetch_launch`` (extra programs of a small kernel that ask L2 for the next projection's
weights) and ``side_prefetch`` (the same from a second stream). Device side (``@triton.jit``,
defined when Triton imports): ``_pdl_enter``, ``_prefetch_l2``, ``_weight_prefetch``,
``_loop_bound``.

Weight prefetch. A decode step's small kernels (RMSNorm, RoPE + KV store, gated activation)
read a few KB and leave HBM idle; with a prefetch they also ask L2 for the weights of the
projection that runs next, whole, when those fit in the policy's ``weight_prefetch_bytes``
(the 8B projections do not: there it only lost; docs/tuning.md). The asks come from extra
programs of that kernel, about one per SM, which first wait for the previous kernel and
then issue ``prefetch.global.L2`` for every 128 bytes. Nothing is written, so results are
the same bits with or without it. The side prefetch asks for the first bytes of a larger
gate|up's weights on a second stream forked after q|k|v, so nothing on the step's own path
waits for it.
"""
from __future__ import annotations

import os

import torch

from lodestar.kernels.policy import active


def triton_enabled() -> bool:
    """Triton kernels can run: a CUDA device, or the CPU interpreter (TRITON_INTERPRET=1)."""
    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


def interpreted() -> bool:
    """Kernels run in Triton's CPU interpreter (no CUDA device)."""
    return os.environ.get("TRITON_INTERPRET") == "1" and not torch.cuda.is_available()


# Kernels run in Triton's interpreter (which then also runs them on CUDA tensors): loop bounds
# become Python ints there (``_loop_bound``).
INTERP = os.environ.get("TRITON_INTERPRET") == "1"


def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


# Launch arguments. ``PDL`` is the kernels' constexpr: 0 off; 1 wait for the previous kernel,
# then let the next one launch; 2 let it launch only when this one ends; 3 let it launch before
# this one waits; 4 (decode attention) 1 for short sequences, 2 for long ones.
PDL_OFF = {"PDL": False}
PDL_ON = {"PDL": True, "launch_pdl": True}
PDL_WAIT = {"PDL": 2, "launch_pdl": True}
PDL_FIRST = {"PDL": 3, "launch_pdl": True}
_PDL_DEVICE: bool | None = None


def pdl_device() -> bool:
    """The device supports programmatic dependent launch (Hopper and later, compiled)."""
    global _PDL_DEVICE
    if _PDL_DEVICE is None:     # asked once: this runs at every kernel launch
        _PDL_DEVICE = (torch.cuda.is_available() and not interpreted()
                       and torch.cuda.get_device_capability()[0] >= 9)
    return _PDL_DEVICE


def pdl(launch_next: bool = False) -> dict:
    """Launch arguments for programmatic dependent launch (policy ``pdl``). A decode-path
    kernel starts with ``griddepcontrol.wait`` (nothing is read or written before the previous
    kernel has finished; only data no kernel of the step writes, such as weights, may be read
    or prefetched before it) and then lets the next kernel launch, so that kernel's blocks are
    resident and waiting when this one ends. ``launch_next``: the next kernel may launch
    before this one's own wait (a small kernel before a projection whose programs read their
    weights before their wait; ``decode_plan``). The same bits either way."""
    if not active().pdl or not pdl_device():
        return PDL_OFF
    return PDL_FIRST if launch_next else PDL_ON


def graph_buffers(cache: dict, device: torch.device, need: int, minimum: int, size_of, make, what: str):
    """The newest of ``cache[device]``'s buffers, first adding one of ``make(n)`` with n =
    max(need, minimum, twice the newest's ``size_of``) when it holds fewer than ``need``.
    Older buffers stay alive (a CUDA graph captured with one keeps its addresses); adding
    one during a capture is an error, so an eager call before capturing must reserve it."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    bufs = cache.setdefault(device, [])
    if not bufs or size_of(bufs[-1]) < need:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"{what}: {need} needed inside a CUDA-graph capture; reserve them before capturing")
        bufs.append(make(max(need, minimum, 2 * size_of(bufs[-1]) if bufs else 0), device))
    return bufs[-1]


# ------------------------------------------------------------------- weight prefetch

SMALL_M_MAX = 64                # rows of the matrix-vector kernels (a decode step)
PREFETCH_RANGES = 3             # the largest arrays of a projection (codes, then scales)
PREFETCH_LINE = 128             # bytes a ``prefetch.global.L2`` covers (the kernels' PF constexpr)
NO_PREFETCH = (0,) * (3 * PREFETCH_RANGES)
_PREFETCH_ARGS: dict[tuple, tuple[int, ...]] = {}
SIDE_PREFETCH_PROGRAMS = 32
SIDE_PREFETCH_LANES = 128


def prefetch_plan(ranges: list[tuple[int, int]], limit: int, sms: int, programs_per_row: int, lanes: int,
                  form: int = PREFETCH_LINE) -> tuple[int, ...]:
    """``prefetch_launch``'s arithmetic: ``(extra rows, address, bytes, step, ...)`` for the
    largest PREFETCH_RANGES of ``ranges`` ((address, bytes) each, one projection's arrays),
    whole, when all of ``ranges`` together are at most ``limit`` bytes (else nothing: all
    0), over about ``sms`` programs of ``lanes`` lanes (whole rows of ``programs_per_row``).
    ``step``: bytes a lane asks for in one bulk prefetch (``form`` 1), else the prefetches
    of ``form`` bytes each lane issues. Bytes and chunks are multiples of 16; unaligned
    ranges are left out; unused slots are 0."""
    extra = -(-sms // programs_per_row)
    slots = extra * programs_per_row * lanes
    flat: list[int] = []
    if sum(n for _, n in ranges) <= limit:
        for addr, size in sorted(ranges, key=lambda r: -r[1])[:PREFETCH_RANGES]:
            n = size // 16 * 16
            if addr % 16 or n == 0:
                continue
            step = (-(-n // slots) + 15) // 16 * 16 if form == 1 else -(-n // (slots * form))
            flat += [addr, n, step]
    return (extra,) + tuple(flat + [0] * (3 * PREFETCH_RANGES - len(flat)))


def prefetch_launch(arrays: list[torch.Tensor] | None, rows: int, programs_per_row: int, lanes: int,
                    ) -> tuple[int, tuple[int, ...], int]:
    """(extra rows of programs, their kernel arguments, the ``PF`` constexpr: 0 for none) for
    a kernel whose grid is ``(rows, programs_per_row)`` with ``lanes`` threads a program to
    prefetch ``arrays`` (the next projection's weights) if they fit in the policy's
    ``weight_prefetch_bytes``. Nothing without arrays, in the interpreter, for more rows
    than the matrix-vector kernel takes, or for arrays over the limit."""
    if not arrays or interpreted() or rows > SMALL_M_MAX or not arrays[0].is_cuda:
        return 0, NO_PREFETCH, 0
    limit = active().weight_prefetch_bytes
    if limit <= 0:
        return 0, NO_PREFETCH, 0
    ranges = tuple((a.data_ptr(), a.numel() * a.element_size()) for a in arrays)
    key = (ranges, limit, programs_per_row, lanes)
    args = _PREFETCH_ARGS.get(key)
    if args is None:
        if len(_PREFETCH_ARGS) >= 4096:     # models loaded and dropped in one process
            _PREFETCH_ARGS.clear()
        args = _PREFETCH_ARGS[key] = prefetch_plan(list(ranges), limit, num_sms(arrays[0].device),
                                                   programs_per_row, lanes)
    return (args[0], args[1:], PREFETCH_LINE) if any(args[1:]) else (0, NO_PREFETCH, 0)


def head_ranges(arrays: list[torch.Tensor], limit: int) -> list[tuple[int, int]]:
    """(address, bytes) of the first ``limit`` bytes of ``arrays`` taken together, the same
    fraction of each (row-major weights: the first rows), 16-byte multiples, the
    ``PREFETCH_RANGES`` largest arrays only; unaligned arrays are left out."""
    sizes = [a.numel() * a.element_size() for a in arrays]
    total = sum(sizes)
    if total == 0 or limit <= 0:
        return []
    frac = min(1.0, limit / total)
    out = []
    for a, n in sorted(zip(arrays, sizes), key=lambda t: -t[1])[:PREFETCH_RANGES]:
        take = int(n * frac) // 16 * 16
        if take and a.data_ptr() % 16 == 0:
            out.append((a.data_ptr(), take))
    return out


def side_prefetch(arrays: list[torch.Tensor] | None, limit: int | None = None) -> None:
    """Launch, on the current stream, one kernel of ``SIDE_PREFETCH_PROGRAMS`` programs that
    asks L2 for the first ``limit`` bytes (default: the policy's ``side_prefetch_bytes``) of
    ``arrays`` (``cp.async.bulk.prefetch``, each lane a contiguous chunk); nothing is read
    into registers or written. No-op without arrays, with the limit 0, or in the interpreter."""
    limit = active().side_prefetch_bytes if limit is None else limit
    if not arrays or limit <= 0 or interpreted() or not arrays[0].is_cuda:
        return
    ranges = head_ranges(arrays, limit)
    lanes = SIDE_PREFETCH_PROGRAMS * SIDE_PREFETCH_LANES
    flat: list[int] = []
    for addr, n in ranges:
        flat += [addr, n, (-(-n // lanes) + 15) // 16 * 16]
    flat += [0] * (3 * PREFETCH_RANGES - len(flat))
    _side_prefetch_kernel[(SIDE_PREFETCH_PROGRAMS, 1)](*flat, LANES=SIDE_PREFETCH_LANES, num_warps=4)


if triton_enabled():
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    @triton.jit
    def _pdl_enter(PDL: tl.constexpr):
        """First statement of a kernel launched with ``pdl()``: wait for the previous kernel
        (all of its memory visible), then allow the next one to launch (PDL == 2: not before
        this kernel ends; 3: before the wait)."""
        if PDL == 3:
            gdc_launch_dependents()
            gdc_wait()
        elif PDL:
            gdc_wait()
            if PDL != 2:
                gdc_launch_dependents()

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
    def _prefetch_l2(ptrs):
        """Ask L2 for the 32-byte sectors holding ``ptrs`` (readable addresses); nothing is
        loaded into registers."""
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                                  is_pure=False, pack=1)

    @triton.jit
    def _bulk_prefetch(addr, nbytes, chunk, lane):
        """Ask L2 for bytes ``[lane * chunk, (lane + 1) * chunk)`` (clipped to ``nbytes``) from
        the address ``addr`` (an integer; 16-byte aligned, chunk a multiple of 16), one
        ``cp.async.bulk.prefetch`` a lane; lanes past the end ask nothing."""
        off = lane.to(tl.int64) * chunk
        size = tl.minimum(tl.maximum(nbytes - off, 0), chunk).to(tl.int32)
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r", [addr + off, size], dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def _line_prefetch(addr, nbytes, iters, lane, lanes, STRIDE: tl.constexpr):
        """``prefetch.global.L2`` of the ``STRIDE``-byte pieces ``(j * lanes + lane) * STRIDE``
        (j < iters) of ``nbytes`` from ``addr``: every lane's first piece, then the second..."""
        for j in range(iters):
            off = (lane.to(tl.int64) + j * lanes) * STRIDE
            ok = off < nbytes
            tl.inline_asm_elementwise(
                "{ .reg .pred p; setp.ne.s32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
                "=r,l,r", [addr + tl.where(ok, off, 0), ok.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def _weight_prefetch(ROWS, a0, n0, c0, a1, n1, c1, a2, n2, c2, LANES: tl.constexpr, FORM: tl.constexpr,
                         WAIT: tl.constexpr, PDL: tl.constexpr):
        """A prefetching program of a 2-D grid whose rows ``ROWS ..`` prefetch
        (``prefetch_launch``): its share of up to three ranges (address, bytes, step each;
        bytes 0: none), in bulk (``FORM`` 1) or ``FORM``-byte lines, after the previous
        kernel ended with ``WAIT``."""
        i = (tl.program_id(0) - ROWS) * tl.num_programs(1) + tl.program_id(1)
        programs = (tl.num_programs(0) - ROWS) * tl.num_programs(1)
        if WAIT:
            _pdl_enter(PDL)
        lane = i * LANES + tl.arange(0, LANES)
        if FORM == 1:
            _bulk_prefetch(a0, n0, c0, lane)
            _bulk_prefetch(a1, n1, c1, lane)
            _bulk_prefetch(a2, n2, c2, lane)
        else:
            _line_prefetch(a0, n0, c0, lane, programs * LANES, FORM)
            _line_prefetch(a1, n1, c1, lane, programs * LANES, FORM)
            _line_prefetch(a2, n2, c2, lane, programs * LANES, FORM)

    @triton.jit
    def _side_prefetch_kernel(a0, n0, c0, a1, n1, c1, a2, n2, c2, LANES: tl.constexpr):
        """``side_prefetch``: bulk L2 prefetches of up to three ranges, no wait."""
        _weight_prefetch(0, a0, n0, c0, a1, n1, c1, a2, n2, c2, LANES, 1, False, False)
