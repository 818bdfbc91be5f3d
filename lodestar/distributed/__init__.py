"""Tensor parallelism over ``torch.distributed``: one process per rank, rank 0 in the engine.

``load_model(..., tensor_parallel=N)`` builds rank 0's slice of the model in the calling
process and starts ranks 1..N-1 (``TensorParallelGroup``); ``LLMEngine`` then runs a
``TPModelRunner`` that sends every step to the workers before running its own slice.
gloo on the CPU, NCCL on CUDA (one GPU per rank).
"""
from lodestar.distributed.group import DEFAULT_TIMEOUT_S, TensorParallelGroup, WorkerDiedError
from lodestar.distributed.sharding import ShardedWeightLoader, ShardingError, ShardSpec, split_heads

__all__ = ["DEFAULT_TIMEOUT_S", "ShardedWeightLoader", "ShardingError", "ShardSpec", "TensorParallelGroup",
           "WorkerDiedError", "split_heads"]
