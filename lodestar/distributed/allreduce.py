"""The all-reduces of a tensor-parallel forward: NCCL, or one-shot over symmetric memory.

A decode step of a tensor-parallel model sums a few kilobytes per layer twice (attention
output, MLP down) plus once for the embedding. NCCL's ring all-reduce pays a latency of
tens of microseconds per call for such sizes, which adds up to milliseconds per token.
On CUDA, small sums therefore go through a one-shot all-reduce over symmetric memory
(``torch.distributed._symmetric_memory``): each rank copies its partial into its own
buffer, which every other rank maps over NVLink; after a barrier each rank reads all
partials and adds them in rank order, so every rank ends with the same bits. Larger
sums (prefill) and the CPU (gloo) use ``dist.all_reduce``.

Every call site (each row-parallel layer and the embedding) owns a slice of one
symmetric buffer: a rank can run ahead into the next call while a slower peer still
reads the previous call's partials, and distinct slices keep those apart; a site is
used again only after all the other sites' barriers.

``LODESTAR_TP_ALLREDUCE=nccl`` turns the symmetric-memory path off. It is also off when
the self-test at set-up (a sum across ranks compared with the exact result) fails on
any rank, or when this torch has no symmetric memory; ``describe()`` says which.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn

MODE_ENV = "LODESTAR_TP_ALLREDUCE"        # auto (default) or nccl
CAPACITY_ROWS = 64                        # rows per call site: the largest decode graph

_state: dict = {"buffer": None, "group": None, "sites": 0, "why": "not set up", "used": False, "kept": []}


def describe() -> str:
    """Which all-reduce small sums use in this process, and why."""
    if _state["buffer"] is not None:
        return f"symmetric-memory one-shot ({_state['sites']} call sites, up to {CAPACITY_ROWS} rows)"
    return f"nccl ({_state['why']})"


def all_reduce(y: torch.Tensor, site: int | None = None) -> torch.Tensor:
    """The sum of ``y`` over all ranks (a new tensor or ``y`` itself)."""
    buf = _state["buffer"]
    if buf is None or site is None or not y.is_cuda:
        dist.all_reduce(y)
        return y
    width = _state["width"]
    n = y.numel()
    if n > CAPACITY_ROWS * width or y.dtype != buf.dtype:
        dist.all_reduce(y)
        return y
    off = site * CAPACITY_ROWS * width
    part = buf[off:off + n]
    part.copy_(y.reshape(-1))
    return torch.ops.symm_mem.one_shot_all_reduce(part, "sum", _state["group"]).view(y.shape)


def setup(model: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Give each all-reduce site of ``model`` its slice of one symmetric buffer.

    Collective: every rank calls it at the same point with the same model structure.
    Safe to call again (a second engine on the same model keeps the first set-up).
    """
    from lodestar.distributed.layers import RowParallelLinear, VocabParallelEmbedding
    sites = [m for m in model.modules() if isinstance(m, (RowParallelLinear, VocabParallelEmbedding))]
    for i, m in enumerate(sites):
        m.site = i
    if device.type != "cuda" or not dist.is_initialized():
        _state["why"] = "not CUDA"
        return
    if _state["buffer"] is not None and _state["sites"] >= len(sites):
        return
    mode = os.environ.get(MODE_ENV, "auto").lower()
    if mode not in ("auto", "nccl"):
        raise ValueError(f"{MODE_ENV}={mode!r}: expected auto or nccl")
    if mode == "nccl":
        _state["why"] = f"{MODE_ENV}=nccl"
        return
    try:
        import torch.distributed._symmetric_memory as symm_mem
        has_op = hasattr(torch.ops.symm_mem, "one_shot_all_reduce")
    except (ImportError, AttributeError, RuntimeError):
        has_op = False
    # Symmetric memory is set up once per process: torch keeps per-group state under the
    # group's name, which a later group (after this one is left) would reuse.
    fresh = not _state["used"]
    ok = torch.tensor([1 if has_op and fresh else 0], dtype=torch.int32, device=device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if not int(ok):
        _state["why"] = ("symmetric memory was set up for an earlier group of this process" if has_op else
                         "this torch has no symmetric-memory one-shot all-reduce")
        return
    _state["used"] = True
    width = int(model.config.d_model)      # every site sums [rows, d_model]
    group = dist.group.WORLD.group_name
    try:
        if hasattr(symm_mem, "enable_symm_mem_for_group"):
            symm_mem.enable_symm_mem_for_group(group)
        buf = symm_mem.empty(len(sites) * CAPACITY_ROWS * width, dtype=dtype, device=device)
        symm_mem.rendezvous(buf, group)
        good = _self_test(buf, group, width, dtype, device)
    except Exception as e:   # reported through describe(); the sums stay on NCCL
        _state["why"] = f"symmetric memory unavailable: {type(e).__name__}: {e}"
        good = False
    ok = torch.tensor([1 if good else 0], dtype=torch.int32, device=device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if not int(ok):
        if _state["why"] == "not set up":
            _state["why"] = "the symmetric-memory self-test failed on a rank"
        return
    _state.update(buffer=buf, group=group, sites=len(sites), width=width, why="")


def release_buffers() -> None:
    """Stop using the symmetric buffer (before the process group goes away). The buffer
    itself is kept: freeing memory that other processes map is left to process exit."""
    if _state["buffer"] is not None:
        _state["kept"].append(_state["buffer"])
    _state.update(buffer=None, group=None, sites=0, why="released")


def _self_test(buf: torch.Tensor, group: str, width: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Sum a known pattern through a slice at a non-zero offset; compare with the exact sum."""
    world, rank = dist.get_world_size(), dist.get_rank()
    n = 3 * width
    base = torch.arange(n, device=device, dtype=torch.float32) % 251 / 8
    part = buf[CAPACITY_ROWS * width:CAPACITY_ROWS * width + n]
    part.copy_((base + rank).to(dtype))
    got = torch.ops.symm_mem.one_shot_all_reduce(part, "sum", group)
    want = sum(((base + r).to(dtype).float() for r in range(world)), torch.zeros_like(base)).to(dtype)
    torch.cuda.synchronize(device)
    return bool(torch.equal(got, want))
