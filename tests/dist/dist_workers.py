"""Workers for the distributed tests. A spawned process imports its worker by module and
name, so these live in a module on ``sys.path`` (the tests add this folder), not in a test
file that pytest imports under a made-up name."""

import os
import time

import torch
import torch.distributed as dist


def describe(rank, world_size, payload=None):
    """What the world looks like from this rank, with a sum over ranks as proof it works."""
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    return {
        "rank": rank,
        "world_size": world_size,
        "dist_rank": dist.get_rank(),
        "dist_world_size": dist.get_world_size(),
        "backend": dist.get_backend(),
        "total": total.item(),
        "threads": torch.get_num_threads(),
        "payload": payload,
        "pid": os.getpid(),
    }


def fail_on(rank, world_size, bad_rank):
    """``bad_rank`` raises; the others wait in a collective for it, forever but for the
    group's timeout, as a real program would."""
    if rank == bad_rank:
        raise ValueError(f"deliberate failure on rank {rank}")
    dist.barrier()
    return rank


def die_on(rank, world_size, bad_rank):
    """``bad_rank`` dies without a word (as after a segfault or an OOM kill)."""
    if rank == bad_rank:
        os._exit(3)
    dist.barrier()
    return rank


def sleep(rank, world_size, seconds):
    time.sleep(seconds)
    return rank


def square(rank, world_size):
    return rank * rank


def tensor_of(rank, world_size, n):
    return torch.full((n,), float(rank), dtype=torch.float64)
