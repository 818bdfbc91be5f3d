"""Feed a run of output tokens to a runner as one chunk or one step each (jump-forward's exactness)."""
from __future__ import annotations

import torch

from lodestar.engine.sequence import Sequence


def feed_run(engine, prompt: list[int], run: list[int], step_by_step: bool) -> tuple[torch.Tensor, int]:
    """Prefill ``prompt``, then feed ``run`` (the first token as the prompt's sampled one, the rest
    as tokens that followed it): one runner step per token, or the whole run as one chunk. Returns
    the logits after the run and the CUDA-graph replays the chunk took (0 on the CPU or step by step)."""
    runner = engine.runner
    engine.pool.reset_cache()
    s = Sequence(10_000, list(prompt), None)
    runner.run([s], [len(prompt)])
    s.output_ids.append(run[0])
    replays = 0
    if step_by_step:
        for t in run[1:]:
            runner.run([s], [1])
            s.output_ids.append(t)
        logits = runner.run([s], [1])
    else:
        s.output_ids += run[1:]
        before = getattr(runner, "graph_replays", 0)
        logits = runner.run([s], [len(run)])
        replays = getattr(runner, "graph_replays", 0) - before
    engine.pool.free(s.block_table)
    return logits, replays
