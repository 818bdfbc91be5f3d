"""A tensor-parallel worker (rank >= 1): build the shard, then mirror rank 0's steps.

The worker runs its own ``ModelRunner`` over its shard. Rank 0 sends each step's rows
(the new token ids, the position they start at, the block table) and which rows want
logits; the worker's runner then takes exactly the decisions rank 0's takes (eager or
CUDA graph, same batch-size bucket), so both issue the same collectives in the same
order. Block tables are rank 0's: every rank's KV slice is addressed identically. The
worker never samples; its slice of the logits goes to rank 0 and is dropped here.
"""
from __future__ import annotations

import faulthandler
import gc
import pickle
import signal
import sys
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from lodestar.distributed.group import WorkerArgs
from lodestar.kernels.policy import install


@dataclass
class StepRow:
    """The part of a ``Sequence`` that ``ModelRunner.run`` reads, for one step."""

    num_computed: int
    tokens: list[int]               # the tokens fed this step, from position num_computed
    block_table: list[int]
    prompt_len: int                 # tokens of the prompt (the rest is output)
    start: int = field(init=False)

    def __post_init__(self) -> None:
        self.start = self.num_computed

    def token_slice(self, a: int, b: int) -> list[int]:
        return self.tokens[a - self.start:b - self.start]


def build_shard(spec: str, mode: str, rank: int, world: int, device: str | torch.device, on_tensor=None):
    """Open ``spec`` and build rank ``rank``'s slice of the model (nothing else is read)."""
    from lodestar.distributed.sharding import ShardedWeightLoader, ShardSpec
    from lodestar.engine.loader import open_checkpoint
    from lodestar.models import build_model
    _, source = open_checkpoint(spec, device)
    loader = ShardedWeightLoader(source, ShardSpec(rank, world), mode, on_tensor, device)
    return source, build_model(source.config, source, mode, on_tensor, device, loader=loader)


def worker_main(args: WorkerArgs, conn) -> None:
    torch.set_num_threads(args.threads)
    install(args.policy)
    faulthandler.register(signal.SIGUSR1, all_threads=True)    # a hang: `kill -USR1 PID` prints every stack
    device = torch.device(args.device)
    try:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        _, model = build_shard(args.spec, args.mode, args.rank, args.world, device)
        if device.type == "cuda":
            torch.cuda.synchronize()
    except BaseException as e:      # rank 0 reports it; nothing else can be done here
        conn.send(("error", f"{type(e).__name__}: {e}"))
        sys.exit(1)
    conn.send(("ready", None))
    try:
        store = dist.TCPStore("127.0.0.1", args.port, args.world, is_master=False,
                              timeout=timedelta(seconds=args.timeout_s))
        dist.init_process_group(args.backend, store=store, rank=args.rank, world_size=args.world,
                                timeout=timedelta(seconds=args.timeout_s))
        _serve(model, device, conn)
    except (EOFError, OSError):
        pass                         # rank 0 is gone: nothing to serve
    except Exception as e:
        print(f"lodestar: tensor-parallel worker rank {args.rank} stopped: {type(e).__name__}: {e}",
              file=sys.stderr, flush=True)
        sys.exit(1)
    if dist.is_initialized():
        if args.backend == "nccl":
            # abort together with rank 0, then stay until rank 0 is done with its own
            from lodestar.distributed.group import leave_nccl_group
            leave_nccl_group(30.0)
            try:
                while conn.poll(30.0):
                    conn.recv_bytes()
            except (EOFError, OSError):
                pass
        else:
            dist.destroy_process_group()


@torch.inference_mode()
def _serve(model, device: torch.device, conn) -> None:
    from lodestar.engine.kv_cache import BlockPool
    from lodestar.engine.model_runner import ModelRunner
    runner = None
    while True:
        msg = pickle.loads(conn.recv_bytes())
        op = msg[0]
        if op == "stop":
            if runner is not None and device.type == "cuda":
                runner.graphs.clear()      # captured collectives hold the NCCL communicator
                runner = None
                gc.collect()
                torch.cuda.synchronize(device)
            return
        if op == "kv":
            _, num_blocks, block_size, kv_dtype, max_model_len, cuda_graphs = msg
            runner = None
            # The pool only gives the runner its geometry; rank 0 hands out the blocks.
            runner = ModelRunner(model, BlockPool(num_blocks, block_size, enable_prefix_cache=False), kv_dtype,
                                 device, max_model_len, cuda_graphs)
            from lodestar.distributed import allreduce
            allreduce.setup(model, runner.device, kv_dtype)
        elif op == "step":
            _, rows, num_new, want = msg
            runner.run([StepRow(*r) for r in rows], num_new, want)
        elif op == "capture":
            runner.capture(msg[1])
        else:
            raise ValueError(f"unknown tensor-parallel message {op!r}")
