"""Workers for the distributed tests. A spawned process imports its worker by module and
name, so these live in a module on ``sys.path`` (pyproject.toml's pytest ``pythonpath``
lists this folder), not in a test file that pytest imports under a made-up name."""

import hashlib
import os
import time

import torch
import torch.distributed as dist

from lsdl_lab.distributed import (
    all_reduce_sgd,
    asynchronous_sgd,
    fit_alpha_beta,
    measure_collective,
    naive_ring_all_reduce_blocking,
    ring_all_gather,
    ring_all_reduce,
    ring_all_reduce_time,
    ring_reduce_scatter,
    synchronous_sgd,
    tree_all_reduce,
)


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


# -- collectives ---------------------------------------------------------------------------


def sizes(world_size):
    """The sizes of issue 12: smaller than the world, equal to it, prime, large."""
    return (1, 3, world_size, 7, 1000, 1_000_003)


# The large size checks the chunking of a real vector; the rest need no million entries.
SMALL_SIZES = (1, 3, 7, 1000)


def _inputs(rank, n, dtype, salt=0):
    gen = torch.Generator().manual_seed(10_000 * salt + 100 * n + rank)
    if dtype == torch.int64:
        return torch.randint(-1000, 1000, (n,), generator=gen)
    return torch.randn(n, generator=gen, dtype=dtype)


def _digest(tensor):
    return hashlib.sha256(tensor.numpy().tobytes()).hexdigest()


def all_reduce_report(rank, world_size, group=None, ranks=None, ns=None):
    """For every size, ring and tree all-reduce against the exact sum (integers), the
    float64 sum of every rank's inputs regenerated here, and ``dist.all_reduce``; with a
    digest of each result, to compare across ranks."""
    ranks = range(world_size) if ranks is None else ranks
    report = {}
    for n in sizes(len(ranks)) if ns is None else ns:
        exact = sum(_inputs(i, n, torch.int64) for i in ranks)
        expected = sum(_inputs(i, n, torch.float64) for i in ranks)
        builtin = _inputs(rank, n, torch.float64)
        dist.all_reduce(builtin, group=group)
        for name, all_reduce in (("ring", ring_all_reduce), ("tree", tree_all_reduce)):
            ints = _inputs(rank, n, torch.int64)
            x = _inputs(rank, n, torch.float64)
            returned = all_reduce(x, group=group)
            assert all_reduce(ints, group=group) is ints and returned is x
            report[name, n] = {
                "int_exact": torch.equal(ints, exact),
                "error_vs_sum": ((x - expected).abs().max() / expected.abs().max()).item(),
                "error_vs_builtin": ((x - builtin).abs().max() / builtin.abs().max()).item(),
                "digest": _digest(x),
            }
    return report


def untagged_ring_report(rank, world_size):
    """The ring as it runs on a backend without message tags (NCCL: the two phases one
    after the other, each send batched with its receive), run here on gloo by making
    ``get_backend`` answer "nccl": whether it sums exactly, and its digests."""
    from unittest import mock

    report = {}
    with mock.patch.object(dist, "get_backend", return_value=dist.Backend.NCCL):
        for n in SMALL_SIZES + (world_size,):
            ints = _inputs(rank, n, torch.int64)
            ring_all_reduce(ints)
            exact = sum(_inputs(i, n, torch.int64) for i in range(world_size))
            report[n] = (torch.equal(ints, exact), _digest(ints))
    return report


def subgroup_report(rank, world_size):
    """The all-reduces on a group of ranks 1 and 3 (group ranks 0 and 1): peers must be
    addressed by their rank in the group."""
    members = [1, world_size - 1]
    group = dist.new_group(members)
    if rank not in members:
        return None
    return all_reduce_report(rank, world_size, group, members, ns=SMALL_SIZES)


def gather_scatter_report(rank, world_size):
    """Ring all-gather and reduce-scatter against dist.all_gather and dist.reduce_scatter,
    on 1-D tensors of every size and on a 2-D one."""
    report = {}
    for shape in [(n,) for n in SMALL_SIZES + (world_size,)] + [(3, 5)]:
        x = torch.randn(shape, dtype=torch.float64)
        mine = [torch.empty(shape, dtype=torch.float64) for _ in range(world_size)]
        theirs = [torch.empty(shape, dtype=torch.float64) for _ in range(world_size)]
        ring_all_gather(mine, x)
        dist.all_gather(theirs, x)
        inputs = [torch.randn(shape, dtype=torch.float64) for _ in range(world_size)]
        kept = [t.clone() for t in inputs]
        out, ref = torch.empty(shape, dtype=torch.float64), torch.empty(shape, dtype=torch.float64)
        ring_reduce_scatter(out, inputs)
        dist.reduce_scatter(ref, [t.clone() for t in inputs])
        report[shape] = {
            "gather_equal": all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True)),
            "scatter_error": ((out - ref).abs().max() / ref.abs().max()).item(),
            "inputs_unchanged": all(torch.equal(a, b) for a, b in zip(inputs, kept, strict=True)),
        }
    return report


def naive_ring_timed(rank, world_size, n):
    """The deadlocking ring; re-raises its error with the time it took to come."""
    start = time.monotonic()
    try:
        naive_ring_all_reduce_blocking(torch.ones(n))
    except RuntimeError as error:
        # the cause's message too: a rank whose peer timed out first and left may fail
        # with "Connection closed by peer" instead, and be the one reported first
        seconds = time.monotonic() - start
        first_line = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise RuntimeError(f"failed after {seconds:.3f} s: {first_line}") from error
    return time.monotonic() - start


# -- the cost model --------------------------------------------------------------------------


def fitted_ring(rank, world_size, nbytes, held_out, attempts):
    """Measure the ring at ``nbytes``, fit alpha and beta without ``held_out``, predict it;
    measure again (at most ``attempts`` times) while the prediction is off by over 25%.
    Every rank sees the same (slowest-rank) times, so all decide alike."""
    tries = []
    for _ in range(attempts):
        seconds = measure_collective(ring_all_reduce, nbytes, repeats=15, statistic="min")
        kept = [(n, s) for n, s in zip(nbytes, seconds, strict=True) if n != held_out]
        fit = fit_alpha_beta(ring_all_reduce_time, world_size, *zip(*kept, strict=True))
        predicted = fit.predict(ring_all_reduce_time, held_out, world_size)
        measured = seconds[list(nbytes).index(held_out)]
        tries.append({"seconds": seconds, "fit": fit, "predicted": predicted, "measured": measured})
        if abs(predicted - measured) <= 0.25 * measured:
            break
    return tries


# -- the parameter server --------------------------------------------------------------------

ROWS, DIM, BATCH = 96, 5, 8


def least_squares():
    """A float64 least-squares problem, the same on every rank: rows of X, targets y."""
    gen = torch.Generator().manual_seed(7)
    X = torch.randn(ROWS, DIM, generator=gen, dtype=torch.float64)
    w_true = torch.randn(DIM, generator=gen, dtype=torch.float64)
    return X, X @ w_true + 0.1 * torch.randn(ROWS, generator=gen, dtype=torch.float64)


def shard_gradient(w, worker, k, workers=3):
    """The mini-batch gradient of 1/2 mean (Xw - y)^2 on worker's shard, batch k (a
    function of (w, worker, k) alone, so every run can be replayed in one process)."""
    X, y = least_squares()
    rows = torch.arange(worker, ROWS, workers)
    pick = torch.randperm(len(rows), generator=torch.Generator().manual_seed(1000 * worker + k))
    rows = rows[pick[:BATCH]]
    time.sleep(0.002 * worker)  # workers of different speeds, so asynchrony shows
    return X[rows].T @ (X[rows] @ w - y[rows]) / BATCH


def param_server_report(rank, world_size, lr, steps):
    """Synchronous PS SGD, all-reduce SGD, and asynchronous SGD at staleness 0, 1, 2."""
    w0 = torch.zeros(DIM, dtype=torch.float64)
    report = {
        "sync": synchronous_sgd(rank, world_size, w0, shard_gradient, lr, steps),
        "all_reduce": all_reduce_sgd(rank, world_size, w0, shard_gradient, lr, steps),
    }
    for s in (0, 1, 2):
        report[s] = asynchronous_sgd(rank, world_size, w0, shard_gradient, lr, steps, s)
    return report
