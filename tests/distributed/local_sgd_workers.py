"""The rank-side half of test_local_sgd.py: one world of 2 runs every check. A spawned
rank imports its worker by module name, so it lives in this plain module (pytest's
``pythonpath`` puts this folder on sys.path, which the ranks inherit)."""

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lsdl_lab.distributed.local_sgd import (
    PeriodicAverager,
    accumulate_gradients,
    overlap_times,
    post_local_sgd,
)

DIM, MICRO, K, LR = 5, 4, 3, 0.1


def model():
    torch.manual_seed(0)  # the same initial weights on every rank
    return nn.Sequential(nn.Linear(DIM, 7), nn.Tanh(), nn.Linear(7, 1)).double()


def data(rank, step=0, n=MICRO * K):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(n, DIM, generator=g, dtype=torch.float64), torch.randn(
        n, 1, generator=g, dtype=torch.float64
    )


def flat(params):
    return torch.cat([p.detach().reshape(-1) for p in params])


def spread(params):
    """Largest difference between the ranks' parameters (0.0 when identical)."""
    mine = flat(params)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return max((e - everyone[0]).abs().max().item() for e in everyone)


def accumulation(rank, world_size):
    net = model()
    ddp = DistributedDataParallel(net)
    calls = []

    def counting_hook(state, bucket):
        calls.append(bucket.index())
        work = dist.all_reduce(bucket.buffer().div_(world_size), async_op=True)
        return work.get_future().then(lambda fut: fut.value()[0])

    ddp.register_comm_hook(None, counting_hook)
    x, y = data(rank)
    micro = list(zip(x.split(MICRO), y.split(MICRO), strict=True))
    accumulate_gradients(ddp, nn.functional.mse_loss, micro)
    # one process, the large batch of every rank's examples
    reference = model()
    xs, ys = zip(*(data(r) for r in range(world_size)), strict=True)
    nn.functional.mse_loss(reference(torch.cat(xs)), torch.cat(ys)).backward()
    return {
        "grad": flat(p.grad for p in net.parameters()),
        "reference": flat(p.grad for p in reference.parameters()),
        "all_reduces": len(calls),
    }


def local_sgd(rank, world_size, period, warmup, steps):
    """Our PeriodicAverager: the parameters after each step and the ranks' spread."""
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    averager = PeriodicAverager(net.parameters(), period, warmup)
    trace = []
    for t in range(steps):
        x, y = data(rank, t + 1, MICRO)
        opt.zero_grad()
        nn.functional.mse_loss(net(x), y).backward()
        averager.before_step()
        opt.step()
        averaged = averager.after_step()
        trace.append((averaged, spread(net.parameters())))
    return {"trace": trace, "params": flat(net.parameters()), "rounds": averager.rounds}


def torch_post_local_sgd(rank, world_size, period, warmup, steps):
    net = model()
    ddp = DistributedDataParallel(net)
    averager = post_local_sgd(ddp, period, warmup)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    spreads = []
    for t in range(steps):
        x, y = data(rank, t + 1, MICRO)
        opt.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        averager.average_parameters(ddp.parameters())
        spreads.append(spread(net.parameters()))
    return spreads


def overlap(rank, world_size):
    torch.manual_seed(rank)
    x, y = torch.randn(32, 64), torch.randn(32, 1)

    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.Linear(256, 1))

    return overlap_times(make, x, y, nn.functional.mse_loss, (0.1, 25.0), repeats=3)


def all_checks(rank, world_size, period, warmup, steps):
    torch.set_num_threads(1)
    return {
        "accumulation": accumulation(rank, world_size),
        "local": local_sgd(rank, world_size, period, warmup, steps),
        "torch": torch_post_local_sgd(rank, world_size, period, warmup, steps),
        "overlap": overlap(rank, world_size),
    }
