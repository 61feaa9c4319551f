"""Run under torchrun by tests/distributed/test_world.py: join the world from the environment,
sum the ranks, print what each rank sees."""

import torch
import torch.distributed as dist

from lsdl_lab.distributed import world_from_env

with world_from_env(timeout=30) as (rank, world_size):
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    print(f"rank {rank} of {world_size}: sum {total.item():g} on {dist.get_backend()}", flush=True)
