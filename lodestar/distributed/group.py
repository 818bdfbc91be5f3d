"""Rank 0's handle on the worker processes of one tensor-parallel model.

Rank 0 is the engine's own process; ranks 1..N-1 are processes started here with the
``spawn`` method. They meet on a TCP store on a free loopback port and join the default
process group (gloo on the CPU, NCCL on CUDA). Rank 0 drives them over one pipe each:
``kv`` (allocate the KV pool), ``step`` (the rows of one engine step), ``capture``
(CUDA graphs) and ``stop``. A worker blocks on its pipe between steps, so an idle
server keeps no collective waiting; a worker whose pipe closes (rank 0 died) exits.

A worker that dies or hangs is noticed at the next step (exit code), by a collective
that fails (its peer's socket closed) or by the collective timeout; the group then
kills the other workers and every later call raises the same ``WorkerDiedError``.
"""
from __future__ import annotations

import atexit
import os
import pickle
import signal
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lodestar.kernels.policy import KernelPolicy, active

DEFAULT_TIMEOUT_S = 120.0    # a collective waiting longer for a peer means the peer is gone
LOAD_TIMEOUT_S = 3600.0      # loading a shard may take long; a dead worker is noticed at once


class WorkerDiedError(RuntimeError):
    """A tensor-parallel worker exited or stopped answering; the engine cannot continue."""


@dataclass(frozen=True)
class WorkerArgs:
    """What a worker needs to build its shard and join the group (pickled to the child)."""

    rank: int
    world: int
    spec: str              # model path (GGUF file or Hugging Face folder)
    mode: str
    device: str            # this worker's device: cpu or cuda:<index>
    backend: str
    port: int
    timeout_s: float
    threads: int
    policy: KernelPolicy = field(default_factory=active)    # rank 0's kernel policy, in force in the worker


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank r of a group whose rank 0 runs on ``device``: the same CPU, or the r-th GPU after it."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


def _how(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class TensorParallelGroup:
    """Starts ranks 1..world-1 of ``spec`` in ``mode`` and talks to them.

    ``connect()`` (after rank 0 built its own shard) waits for the workers' shards and
    joins the process group. ``shutdown()`` stops them; it also runs at exit.
    """

    def __init__(self, spec: str, mode: str, device: str | torch.device, world: int,
                 timeout_s: float = DEFAULT_TIMEOUT_S, threads: int | None = None) -> None:
        if world < 2:
            raise ValueError(f"a tensor-parallel group needs at least 2 ranks, got {world}")
        if dist.is_initialized():
            raise RuntimeError("a tensor-parallel model is already loaded in this process; "
                               "close it (LoadedModel.close()) before loading another")
        self.world, self.timeout_s = world, float(timeout_s)
        self.device = torch.device(device)
        self.backend = "nccl" if self.device.type == "cuda" else "gloo"
        if self.device.type == "cuda":
            if torch.cuda.device_count() < (self.device.index or 0) + world:
                raise ValueError(f"--tensor-parallel {world} needs {world} CUDA devices from {self.device}; "
                                 f"{torch.cuda.device_count()} are visible")
            # NVLink SHARP (multicast) needs fabric support that shared hosts often lack.
            for var in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
                os.environ.setdefault(var, "0" if var == "NCCL_NVLS_ENABLE" else "1")
            # Rank 0 watches the workers itself (TPModelRunner) and aborts the communicators
            # when one is gone; the NCCL watchdog's own handling would kill rank 0 instead.
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")
        self.failure: WorkerDiedError | None = None
        self.before_leave: list = []   # run before the NCCL group is left (the runner drops its graphs)
        self._closed = False
        self._connected = False
        self._store = dist.TCPStore("127.0.0.1", 0, world, is_master=True,
                                    timeout=timedelta(seconds=self.timeout_s), wait_for_workers=False)
        from lodestar.distributed.worker import worker_main
        ctx = mp.get_context("spawn")
        self.procs, self.conns = [], []
        threads = threads or torch.get_num_threads()
        try:
            for r in range(1, world):
                parent, child = ctx.Pipe()
                args = WorkerArgs(r, world, str(spec), mode, str(rank_device(self.device, r)), self.backend,
                                  self._store.port, self.timeout_s, threads, active())
                proc = ctx.Process(target=worker_main, args=(args, child), name=f"lodestar-tp-rank{r}",
                                   daemon=True)
                proc.start()
                child.close()
                self.procs.append(proc)
                self.conns.append(parent)
        except BaseException:
            self.shutdown()
            raise
        atexit.register(self.shutdown)

    @property
    def pids(self) -> list[int]:
        """Process ids of ranks 1..world-1."""
        return [p.pid for p in self.procs]

    # -- start -------------------------------------------------------------------------
    def connect(self, load_timeout_s: float = LOAD_TIMEOUT_S) -> None:
        """Wait until every worker built its shard, then join the process group as rank 0."""
        deadline = time.monotonic() + load_timeout_s
        waiting = set(range(len(self.procs)))
        while waiting:
            for i in list(waiting):
                proc, conn = self.procs[i], self.conns[i]
                try:
                    ready = conn.poll(0.1)
                    msg = conn.recv() if ready else None
                except (EOFError, OSError):
                    msg = None
                if msg is not None:
                    if msg[0] == "error":
                        self.shutdown()
                        raise WorkerDiedError(f"tensor-parallel worker rank {i + 1} failed to load its shard: "
                                              f"{msg[1]}")
                    waiting.discard(i)
                elif proc.exitcode is not None:
                    raise self.fail(None)
            if waiting and time.monotonic() > deadline:
                self.shutdown()
                raise WorkerDiedError(f"tensor-parallel workers {sorted(i + 1 for i in waiting)} did not finish "
                                      f"loading within {load_timeout_s:.0f}s")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device.index or 0)
        dist.init_process_group(self.backend, store=self._store, rank=0, world_size=self.world,
                                timeout=timedelta(seconds=self.timeout_s))
        self._connected = True

    # -- steps -------------------------------------------------------------------------
    def check(self) -> None:
        """Raise ``WorkerDiedError`` if the group failed or a worker has exited."""
        if self.failure is not None:
            raise self.failure
        if self._closed:
            raise WorkerDiedError("the tensor-parallel group was shut down")
        if any(p.exitcode is not None for p in self.procs):
            raise self.fail(None)

    def send(self, msg: tuple) -> None:
        """Send one control message to every worker."""
        self.check()
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        for conn in self.conns:
            try:
                conn.send_bytes(data)
            except OSError as e:
                raise self.fail(e) from e

    def fail(self, cause: BaseException | None) -> WorkerDiedError:
        """Record the group as failed (naming the worker that died), stop the rest, return the error."""
        if self.failure is not None:
            return self.failure
        deadline = time.monotonic() + 2.0   # a peer's closed socket is often seen before its exit code
        dead = []
        while not dead and time.monotonic() < deadline:
            dead = [(r, p) for r, p in enumerate(self.procs, start=1) if p.exitcode is not None]
            if not dead:
                time.sleep(0.05)
        tail = "; the engine cannot continue and must be restarted"
        if dead:
            msg = "; ".join(f"tensor-parallel worker rank {r} (pid {p.pid}) {_how(p.exitcode)}" for r, p in dead)
        elif cause is not None:
            msg = (f"a tensor-parallel step failed with no worker exited ({type(cause).__name__}: {cause}); "
                   f"a worker that does not answer within the {self.timeout_s:g}s collective timeout "
                   f"(--tp-timeout) is taken as gone")
        else:
            msg = "the tensor-parallel group failed"
        self.failure = WorkerDiedError(msg + tail)
        self.shutdown()
        return self.failure

    # -- stop --------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop the workers (politely, then by force) and leave the process group."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.shutdown)
        connected = self._connected
        data = pickle.dumps(("stop",))
        for conn, proc in zip(self.conns, self.procs):
            if proc.exitcode is None and self.failure is None:
                try:
                    conn.send_bytes(data)
                except OSError:
                    pass
        if self.backend == "nccl" and self._connected:
            # NCCL: every rank aborts its communicators at the same time (a communicator
            # is reclaimed only once all ranks let go, and not while a captured CUDA graph
            # still holds it, so the graphs go first). After a failure, the abort also ends
            # collectives that wait for the dead peer.
            for release in self.before_leave if self.failure is None else ():   # (a sync would wait
                try:                                                             # on the dead peer)
                    release()
                except Exception:
                    pass
            leave_nccl_group(5.0 if self.failure is not None else 30.0)
            self._connected = False
        for conn in self.conns:     # a worker waits for this before it exits
            conn.close()
        # Workers that never joined the group hold nothing worth a clean stop.
        wait = (10.0 if self.failure is None else 0.5) if connected else 0.0
        for proc in self.procs:
            proc.join(timeout=wait)
            if proc.exitcode is None:
                proc.kill()
                proc.join(timeout=10.0)
        if self._connected and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:   # the group may be broken already; the workers are gone either way
                pass
        self._connected = False


_LEFT_GROUPS: list = []   # NCCL process groups left by abort: kept, never destroyed a second time


def leave_nccl_group(timeout_s: float = 30.0) -> bool:
    """Abort this process's NCCL communicators and forget the default process group.

    The abort runs on a helper thread and is waited for at most ``timeout_s`` seconds;
    either way the group is then forgotten here (and kept alive, so that no destructor
    tears it down again), so that a new group can be made. Returns whether the abort
    finished in time.
    """
    import ctypes
    import threading

    from torch.distributed import distributed_c10d as c10d

    from lodestar.distributed.allreduce import release_buffers
    release_buffers()
    try:
        pg = c10d._get_default_group()
    except (RuntimeError, ValueError):
        return True
    done = threading.Event()

    def abort() -> None:
        try:
            pg.abort()
        except Exception:
            pass
        finally:
            done.set()

    threading.Thread(target=abort, name="lodestar-nccl-abort", daemon=True).start()
    finished = done.wait(timeout_s)
    _LEFT_GROUPS.append(pg)
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(pg))
    c10d._update_default_pg(None)
    world = c10d._world
    for name in ("pg_map", "pg_names", "pg_group_ranks", "pg_backend_config", "pg_to_tag", "tags_to_pg",
                 "pg_coalesce_state"):
        table = getattr(world, name, None)
        if table is not None:
            table.clear()
    unregister = getattr(c10d, "_unregister_all_process_groups", None)
    if unregister is not None:
        unregister()
    world.group_count = 0
    return finished
