"""The rank-side half of test_traffic.py: one world of 2 calls each collective inside and
outside counters' blocks. A spawned rank imports its worker by module name, so it lives in
this plain module (pytest's pythonpath setting puts this folder on sys.path, which the
ranks inherit)."""

import warnings

import torch
import torch.distributed as dist

from lsdl_lab.distributed import CollectiveBytes
from lsdl_lab.distributed.collectives import all_to_all
from lsdl_lab.distributed.traffic import COUNTED, BuiltInCollective, SentMessages

N = 1000  # entries this rank hands to each collective (a world's worth for reduce-scatter)
FLAT_GATHERS = ("all_gather_single", "all_gather_into_tensor")
FLAT_SCATTERS = ("reduce_scatter_single", "reduce_scatter_tensor")


CALLS: list = []  # (name, the counter's calls, its bytes) for each _counted


def _counted(name: str, *args, **kwargs) -> int:
    """The bytes a counter counts for ``dist.<name>(*args, **kwargs)``, completed (looked up
    in the block, as callers of ``dist.<name>`` do); its record of calls kept in CALLS."""
    with CollectiveBytes() as counter:
        work = getattr(dist, name)(*args, **kwargs)
        if work is not None:  # async_op=True
            work.wait()
    CALLS.append((name, [tuple(c) for c in counter.calls], counter.bytes))
    return counter.bytes


def every_collective(rank, world_size) -> dict:
    """Bytes counted for one call of each collective this torch has (each name of a flat
    collective on its own), and that each still computed its result."""
    w = world_size
    out = {}
    summed = torch.ones(N)
    out["all_reduce"] = _counted("all_reduce", summed)
    out["all_reduce sums"] = torch.equal(summed, torch.full((N,), float(w)))
    out["all_reduce float64 by keyword"] = _counted(
        "all_reduce", tensor=torch.ones(N, dtype=torch.float64)
    )
    out["all_reduce float16 async"] = _counted(
        "all_reduce", torch.ones(N, dtype=torch.float16), async_op=True
    )
    out["broadcast"] = _counted("broadcast", torch.full((N,), float(rank)), src=0)
    gathered = [torch.empty(N) for _ in range(w)]
    out["all_gather"] = _counted("all_gather", gathered, torch.full((N,), float(rank)))
    out["all_gather gathers"] = [g[0].item() for g in gathered]
    with warnings.catch_warnings():  # torch 2.13 deprecates the older flat names
        warnings.simplefilter("ignore", FutureWarning)
        for name in (n for n in FLAT_GATHERS if n in COUNTED):
            output = torch.empty(w * N)
            out[name] = _counted(name, output, torch.full((N,), float(rank)))
            out[name + " gathers"] = output[::N].tolist()
        for name in (n for n in FLAT_SCATTERS if n in COUNTED):
            output = torch.empty(N)
            out[name] = _counted(name, output, torch.ones(w * N))
            out[name + " sums"] = torch.equal(output, torch.full((N,), float(w)))
    # all-to-all: block j of rank i's input (N entries, each i * w + j) goes to rank j
    blocks = torch.arange(w).repeat_interleave(N).float() + rank * w
    expected = (torch.arange(w) * w + rank).float().repeat_interleave(N)
    output = torch.empty(w * N)
    out["all_to_all_single"] = _counted("all_to_all_single", output, blocks)
    out["all_to_all_single moves"] = torch.equal(output, expected)
    outputs = [torch.empty(N) for _ in range(w)]
    try:  # the list form: gloo runs it on torch 2.13; on 2.9 it raises
        out["all_to_all"] = _counted("all_to_all", outputs, list(blocks.split(N)))
        out["all_to_all moves"] = torch.equal(torch.cat(outputs), expected)
    except RuntimeError as e:
        if "does not support alltoall" not in str(e):
            raise
    # the library's all-to-all: point-to-point messages, which SentMessages counts (its
    # own block stays here) and CollectiveBytes does not see
    output = torch.empty(w * N)
    with CollectiveBytes() as counter, SentMessages() as messages:
        all_to_all(output, blocks)
    out["library all_to_all"] = (counter.bytes, messages.bytes, messages.numels)
    out["library all_to_all moves"] = torch.equal(output, expected)
    # each counted call's record: (collective, bytes, group size), the group by position
    out["calls"] = CALLS
    groups = [dist.new_group([r]) for r in range(w)]  # every rank makes every group
    with CollectiveBytes() as counter:
        dist.all_reduce(torch.ones(N), dist.ReduceOp.SUM, groups[rank])  # a group of 1
        dist.all_reduce(torch.ones(2 * N), group=groups[rank])
    out["calls in a group of 1"] = [tuple(c) for c in counter.calls]
    return out


def blocks(rank, world_size) -> dict:
    """Counts across blocks: calls outside a block, a counter reopened, nested counters, a
    block that raises; and torch's functions after all of them."""
    torch_functions = {name: getattr(dist, name) for name in COUNTED}
    out = {}
    counter = CollectiveBytes()
    dist.all_reduce(torch.ones(N))  # before the block
    with counter:
        dist.all_reduce(torch.ones(N))
    dist.all_reduce(torch.ones(N))  # after it
    out["one block"] = counter.bytes
    with counter:  # a second block adds to the count
        dist.all_reduce(torch.ones(2 * N))
    out["two blocks"] = counter.bytes

    outer, inner = CollectiveBytes(), CollectiveBytes()
    with outer:
        dist.all_reduce(torch.ones(N))
        with inner:
            dist.all_reduce(torch.ones(2 * N))
        dist.all_reduce(torch.ones(3 * N))
    out["nested"] = (outer.bytes, inner.bytes)

    failing = CollectiveBytes()
    try:
        with failing:
            dist.all_reduce(torch.ones(N))
            raise KeyError("a step that fails")
    except KeyError:
        pass
    dist.all_reduce(torch.ones(N))
    out["failed block"] = failing.bytes

    bound = dist.all_reduce  # torch's function, bound to a name before the block opens
    with CollectiveBytes() as unseen:
        bound(torch.ones(N))
    out["bound before the block"] = unseen.bytes
    # the module that defines the collectives: its names are counted, and forbidden
    c10d = dist.distributed_c10d
    with CollectiveBytes() as by_c10d:
        c10d.all_reduce(torch.ones(N))
        c10d.all_gather([torch.empty(N) for _ in range(world_size)], torch.ones(N))
    out["distributed_c10d"] = (by_c10d.bytes, [c.name for c in by_c10d.calls])
    with SentMessages(forbid=True) as messages:
        try:
            c10d.all_reduce(torch.ones(N))
            out["forbidden by distributed_c10d"] = False
        except BuiltInCollective:
            out["forbidden by distributed_c10d"] = True
        out["messages by distributed_c10d"] = _exchange(rank, c10d)
    out["messages by distributed_c10d"] += [messages.numels]
    out["restored"] = all(
        getattr(module, n) is fn
        for module in (dist, c10d)
        for n, fn in {**torch_functions, "send": SEND, "isend": ISEND}.items()
    )
    return out


SEND, ISEND = dist.send, dist.isend


def _exchange(rank: int, module) -> list[bool]:
    """Messages of N, 2N and 3N entries to the other rank of a world of 2, by ``module``'s
    send, isend and batch_isend_irecv; whether each arrived."""
    peer = 1 - rank
    first, second, third = torch.empty(N), torch.empty(2 * N), torch.empty(3 * N)
    if rank == 0:  # a blocking send: one rank sends first
        module.send(torch.ones(N), peer)
        module.recv(first, peer)
    else:
        module.recv(first, peer)
        module.send(torch.ones(N), peer)
    work = module.isend(torch.ones(2 * N), peer)
    module.recv(second, peer)
    work.wait()
    ops = [module.P2POp(module.isend, torch.ones(3 * N), peer)]
    ops.append(module.P2POp(module.irecv, third, peer))
    for work in module.batch_isend_irecv(ops):
        work.wait()
    return [bool(t.eq(1).all()) for t in (first, second, third)]
