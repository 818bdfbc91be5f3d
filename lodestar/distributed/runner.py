"""Rank 0's model runner: each step goes to the workers first, then runs on rank 0's shard."""
from __future__ import annotations

import gc
import time
import weakref

import torch
from torch import nn

from lodestar.distributed.group import TensorParallelGroup, WorkerDiedError
from lodestar.engine.kv_cache import BlockPool
from lodestar.engine.model_runner import GRAPH_BATCH_SIZES, ModelRunner
from lodestar.engine.sequence import Sequence


class TPModelRunner(ModelRunner):
    """A ``ModelRunner`` whose every step is mirrored by the group's workers.

    The scheduler, block pool and sampler stay in rank 0; per step the workers get the
    rows' new tokens, start positions and block tables, and which rows want logits.
    """

    def __init__(self, group: TensorParallelGroup, model: nn.Module, pool: BlockPool,
                 kv_dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 max_model_len: int | None = None, cuda_graphs: bool = True) -> None:
        self.group = group
        group.send(("kv", pool.num_blocks, pool.block_size, kv_dtype, max_model_len, cuda_graphs))
        super().__init__(model, pool, kv_dtype, device, max_model_len, cuda_graphs)
        from lodestar.distributed import allreduce
        allreduce.setup(model, self.device, kv_dtype)   # collective, mirrored by the workers
        self.allreduce = allreduce.describe()
        group.before_leave.append(_weak_call(self.release_graphs))

    def release_graphs(self) -> None:
        """Drop the captured decode graphs (they hold the NCCL communicator)."""
        if self.graphs:
            self.graphs.clear()
            gc.collect()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def run(self, seqs: list[Sequence], num_new: list[int], want_logits: list[bool] | None = None
            ) -> torch.Tensor | None:
        for s, n in zip(seqs, num_new):   # the workers get the finished block tables
            self.ensure_blocks(s, s.num_computed + n)
        rows = [(s.num_computed, s.token_slice(s.num_computed, s.num_computed + n), list(s.block_table),
                 s.prompt_len) for s, n in zip(seqs, num_new)]
        self.group.send(("step", rows, list(num_new), None if want_logits is None else list(want_logits)))
        try:
            out = super().run(seqs, num_new, want_logits)
        except WorkerDiedError:
            raise
        except RuntimeError as e:   # a collective failed (a peer closed its socket, or the timeout)
            raise self.group.fail(e) from e
        if self.device.type == "cuda":
            self._wait_for_step()
        return out

    def _wait_for_step(self) -> None:
        """Wait for this step's GPU work while watching the workers.

        An NCCL collective whose peer died never finishes and reports nothing to the host,
        so blocking on it (the sampler's copy of the tokens) would hang for good. Instead
        the step's completion is polled; a worker that exits, or a step that runs past the
        collective timeout, fails the group (which aborts the NCCL communicators)."""
        done = torch.cuda.Event()
        done.record()
        deadline = time.monotonic() + self.group.timeout_s
        polls = 0
        while not done.query():
            polls += 1
            if polls % 64 == 0:
                self.group.check()
                if time.monotonic() > deadline:
                    raise self.group.fail(TimeoutError(
                        f"a step took longer than {self.group.timeout_s:g}s on the GPUs"))
                time.sleep(0.0001 if polls > 4096 else 0)

    def capture(self, sizes: tuple[int, ...] = GRAPH_BATCH_SIZES) -> None:
        self.group.send(("capture", tuple(sizes)))
        try:
            super().capture(sizes)
        except RuntimeError as e:
            raise self.group.fail(e) from e
        if self.device.type == "cuda":
            self._wait_for_step()


def _weak_call(method):
    """A callable that runs ``method`` while its object lives (the group must not keep a
    dropped engine's runner alive)."""
    ref = weakref.WeakMethod(method)

    def call() -> None:
        m = ref()
        if m is not None:
            m()
    return call
