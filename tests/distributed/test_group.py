"""Leaving a process group by abort (the NCCL shutdown path), checked with gloo on one
process: the group is forgotten, and a new one can be made under the same name."""
from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from lodestar.distributed.group import leave_nccl_group


def test_a_group_left_by_abort_can_be_made_again():
    names = []
    for _ in range(2):
        store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timedelta(seconds=10))
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        t = torch.ones(3)
        dist.all_reduce(t)
        assert t.tolist() == [1.0, 1.0, 1.0]
        names.append(dist.group.WORLD.group_name)
        assert leave_nccl_group(5.0)
        assert not dist.is_initialized()
    assert names[0] == names[1]      # ranks that start fresh agree with rank 0 on the name
