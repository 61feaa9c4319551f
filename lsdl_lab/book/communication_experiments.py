"""The experiments of Chapter 7 and its lab, as workers for :func:`~lsdl_lab.distributed.spawn`.

A notebook cannot spawn a function it defines (each process would re-run the notebook),
so every experiment the chapter and the lab run on a world of processes lives here, as a
top-level function ``fn(rank, world_size, ...)`` that returns plain results (numbers,
lists, dicts), the same on every rank unless it says otherwise::

    from lsdl_lab.distributed import spawn
    from lsdl_lab.book.communication_experiments import collective_times
    result = spawn(collective_times, 2, [4_000, 400_000, 4_000_000])[0]

* :func:`collective_times`: the hand-built ring and tree all-reduce against
  ``dist.all_reduce`` over sizes, with the alpha-beta model fitted to each and the bytes
  the busiest rank sends counted;
* :func:`compression_run`: the book's ResNet (or any classifier of the 8x8 digits) trained
  under DDP with each compressor's hook: bytes handed to the collectives, test accuracy,
  encode/decode time;
* :func:`local_sgd_run`: local SGD at several averaging periods;
* :func:`overlap_run`: the overlap of the gradients' all-reduce with the backward pass, on
  a model many DDP buckets long, at several bucket sizes, with the buckets counted;
* :func:`overlap_timeline`: the timeline of one DDP step recorded by ``torch.profiler``:
  each rank's backward, each bucket's all-reduce, the communication hidden and exposed;
* :func:`model_parallel_run`: a tensor-parallel transformer block against the dense one,
  and a pipeline's measured bubble against (p - 1)/(m + p - 1).

Every training runs :func:`lsdl_lab.train.fit` (the one loop) with a step function:
:func:`~lsdl_lab.train.train_step` under DDP, a local-SGD step around the averager. Every
byte count is that of :class:`lsdl_lab.distributed.CollectiveBytes`, the library's one
counter: what this rank hands to the collectives, whichever hook calls them.

In a dry run (:mod:`lsdl_lab.profiles`: ``LSDL_MAX_STEPS``, ``LSDL_MAX_EXAMPLES``, which
every rank reads from the caller's environment, see :func:`~lsdl_lab.distributed.spawn`)
``fit`` caps each training's steps (a worker reads how many ran from its history); the
caps of the rest apply in few places: :func:`timed_rounds`, the repeats of every timing
of Chapters 7 and 10; ``_shard``, every batch of the digits; ``_digits``, the test set;
and the lengths handed to the library's own loops (the parameter server's steps,
:func:`~lsdl_lab.distributed.local_sgd.overlap_times`' repeats, a pipeline's rows).
Nothing changes outside a dry run.
"""

from __future__ import annotations

import copy
import json
import os
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel
from torch.profiler import ProfilerActivity, profile, record_function

from .. import models
from .._util import NO_BUFFER_SYNC, check_int, check_positive, eval_mode
from ..compress import (
    QSGD,
    ErrorFeedback,
    HookState,
    PowerSGD,
    RandomK,
    SignSGD,
    TernGrad,
    TopK,
    allgather_hook,
    allreduce_hook,
    powersgd_hook,
)
from ..data import load_digits
from ..distributed.collectives import ring_all_reduce, tree_all_reduce
from ..distributed.cost import (
    fit_alpha_beta,
    measure_collective,
    ring_all_reduce_time,
    tree_all_reduce_time,
)
from ..distributed.local_sgd import PeriodicAverager, average_parameters, overlap_times
from ..distributed.param_server import asynchronous_sgd, synchronous_sgd
from ..distributed.traffic import CollectiveBytes, SentMessages
from ..parallel import TensorParallelBlock, bubble_fraction, pipeline_step
from ..profiles import capped_examples, capped_steps
from ..steps import accumulate
from ..train import StepResult, accuracy, fit

__all__ = [
    "COMPRESSORS",
    "SynchronizedStep",
    "collective_times",
    "compression_run",
    "deep_mlp",
    "digits_mlp",
    "digits_resnet",
    "fastest_rounds",
    "local_sgd_run",
    "overlap_run",
    "overlap_timeline",
    "least_squares_gradient",
    "least_squares_loss",
    "model_parallel_run",
    "staleness_run",
    "timed_rounds",
]

T = TypeVar("T")


def timed_rounds(measure: Callable[[int], T], repeats: int) -> list[T]:
    """``[measure(i) for i in range(repeats)]``: the rounds of a timing, of which the
    caller keeps the minimum or the median. The one place the timings of Chapters 7 and
    10 take their number of rounds: ``repeats`` (at least 1), at most ``LSDL_MAX_STEPS``
    in a dry run (:func:`~lsdl_lab.profiles.capped_steps`)."""
    return [measure(i) for i in range(capped_steps(check_int("repeats", repeats, 1)))]


def fastest_rounds(timed: dict[str, Callable], nbytes: Sequence[int], repeats: int) -> dict:
    """Seconds per call of each of ``timed`` on float32 tensors of each of ``nbytes``
    bytes: the minimum over ``repeats`` rounds (:func:`timed_rounds`), in each of which
    every collective is timed once at every size
    (:func:`~lsdl_lab.distributed.measure_collective`, the slowest rank's time), so that a
    burst of load from another process hits them alike."""
    rounds = timed_rounds(
        lambda _: {name: measure_collective(fn, nbytes, 1) for name, fn in timed.items()},
        repeats,
    )
    return {name: [min(r[name][j] for r in rounds) for j in range(len(nbytes))] for name in timed}


def collective_times(rank, world_size, nbytes: Sequence[int], repeats: int = 5) -> dict:
    """Seconds per all-reduce of float32 tensors of each of ``nbytes`` bytes for the ring,
    the tree and ``dist.all_reduce``: the minimum over ``repeats`` rounds, in each of which
    every algorithm is timed once at every size
    (:func:`~lsdl_lab.distributed.measure_collective`, the slowest rank's time), so that a
    burst of load from another process hits the three alike (:func:`fastest_rounds`). Also
    the (alpha, beta) fitted to the ring's and the tree's times with their own models, and
    ``"sent"``, the bytes the busiest rank sends in one ring and one tree all-reduce of each
    size, counted message by message (:class:`~lsdl_lab.distributed.traffic.SentMessages`;
    gloo's own all-reduce sends from C++, where nothing counts it)."""
    algorithms = {"ring": ring_all_reduce, "tree": tree_all_reduce}
    times = fastest_rounds({**algorithms, "built-in": dist.all_reduce}, nbytes, repeats)
    fits = {
        "ring": fit_alpha_beta(ring_all_reduce_time, world_size, nbytes, times["ring"]),
        "tree": fit_alpha_beta(tree_all_reduce_time, world_size, nbytes, times["tree"]),
    }
    sent = torch.zeros(len(algorithms), len(nbytes), dtype=torch.float64)
    for i, fn in enumerate(algorithms.values()):
        for j, n in enumerate(nbytes):
            with SentMessages() as messages:
                fn(torch.ones(n // 4))
            sent[i, j] = messages.bytes
    dist.all_reduce(sent, op=dist.ReduceOp.MAX)  # the busiest rank's
    return {
        "world_size": world_size,
        "nbytes": list(nbytes),
        "seconds": times,
        "fit": {k: (f.alpha, f.beta) for k, f in fits.items()},
        "sent": {name: [int(b) for b in row] for name, row in zip(algorithms, sent.tolist())},
    }


def _least_squares(dim: int = 20, n: int = 256):
    """A fixed least-squares problem with condition number 100: X (n x dim), y."""
    g = torch.Generator().manual_seed(0)
    q, _ = torch.linalg.qr(torch.randn(dim, dim, generator=g, dtype=torch.float64))
    scales = torch.logspace(0, -1, dim, dtype=torch.float64)  # singular values 1 .. 0.1
    X = torch.randn(n, dim, generator=g, dtype=torch.float64) @ (q * scales) @ q.T
    return X, X @ torch.randn(dim, generator=g, dtype=torch.float64)


def least_squares_loss(w: torch.Tensor) -> float:
    """The loss ``0.5 * mean((X w - y)^2)`` of the problem :func:`least_squares_gradient`
    samples."""
    X, y = _least_squares()
    return 0.5 * ((X @ w - y) ** 2).mean().item()


def least_squares_gradient(w: torch.Tensor, worker: int, k: int) -> torch.Tensor:
    """A worker's stochastic gradient of :func:`least_squares_loss` on 32 examples drawn by
    (worker, k): the gradient function of the parameter-server runs."""
    X, y = _least_squares()
    g = torch.Generator().manual_seed(10_000 * worker + k)
    rows = torch.randint(len(y), (32,), generator=g)
    return X[rows].T @ (X[rows] @ w - y[rows]) / 32


def staleness_run(rank, world_size, staleness: Sequence[int], lr: float, steps: int) -> dict:
    """Asynchronous parameter-server SGD (:func:`~lsdl_lab.distributed.asynchronous_sgd`) on a
    least-squares problem at each staleness bound s, from zero weights: on the server,
    ``{s: {"loss", "max_staleness", "mean_staleness"}}``; ``None`` on the workers.
    Synchronous SGD (:func:`~lsdl_lab.distributed.synchronous_sgd`) is ``"sync"``."""
    # the parameter server's own loops: capped here, except outside a dry run
    steps = capped_steps(steps)
    w0 = torch.zeros(_least_squares()[0].shape[1], dtype=torch.float64)
    out = {}
    w = synchronous_sgd(rank, world_size, w0, least_squares_gradient, lr, steps)
    if rank == 0:
        out["sync"] = {"loss": least_squares_loss(w), "max_staleness": 0, "mean_staleness": 0.0}
    for s in staleness:
        result = asynchronous_sgd(rank, world_size, w0, least_squares_gradient, lr, steps, s)
        if rank == 0:
            w, stale = result
            out[s] = {
                "loss": least_squares_loss(w),
                "max_staleness": max(stale),
                "mean_staleness": sum(stale) / len(stale),
            }
    return out if rank == 0 else None


def digits_mlp(hidden: int = 128) -> nn.Module:
    """The small classifier of the chapter's experiments: an MLP on the 8x8 digits."""
    return models.MLP(64, 10, hidden=hidden)


def digits_resnet(depth: int = 8, width: int = 8) -> nn.Module:
    """The book's CIFAR ResNet (:class:`~lsdl_lab.models.ResNet`, He et al. 2016) on the
    8x8 digits (one input channel): Lab 7 compresses its gradients at the profile's
    ``resnet_depth`` and ``resnet_width``."""
    return models.ResNet(depth, width, num_classes=10, in_channels=1)


# name -> (hook, compressor factory of a rank or None, whether the hook is torch's own)
COMPRESSORS = (
    "none",
    "fp16 (torch)",
    "sign + EF",
    "TernGrad",
    "QSGD s=16",
    "top-1% + EF",
    "random-1% + EF",
    "PowerSGD r=2",
    "PowerSGD r=2 (torch)",
)


def _compressor(name: str, rank: int):
    """(hook, a function making this rank's compressor); torch's hooks have no compressor."""
    return {
        "sign + EF": (allgather_hook, lambda: ErrorFeedback(SignSGD())),
        "TernGrad": (allgather_hook, lambda: TernGrad(seed=rank)),
        "QSGD s=16": (allgather_hook, lambda: QSGD(16, seed=rank)),
        "top-1% + EF": (allgather_hook, lambda: ErrorFeedback(TopK(0.01))),
        "random-1% + EF": (
            allreduce_hook,
            lambda: ErrorFeedback(RandomK(0.01, seed=0, scaled=False)),
        ),
        "PowerSGD r=2": (powersgd_hook, lambda: PowerSGD(2)),
    }.get(name, (None, None))


def _register(ddp: DistributedDataParallel, name: str, rank: int, start_iter: int) -> None:
    """Install the hook ``name`` on ``ddp``, its first ``start_iter`` steps uncompressed.
    Every hook, ours and torch's, calls the collectives from Python, where
    :class:`~lsdl_lab.distributed.CollectiveBytes` counts them."""
    hook, make = _compressor(name, rank)
    if make is not None:
        ddp.register_comm_hook(HookState(make, start_iter=start_iter), hook)
    elif name == "none":
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    elif name == "fp16 (torch)":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif name == "PowerSGD r=2 (torch)":
        state = powerSGD_hook.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=2,
            start_powerSGD_iter=max(start_iter, 2),
            min_compression_rate=1,
        )
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    else:
        raise ValueError(f"Invalid name: {name!r} (expected one of {COMPRESSORS})")


def _codec_seconds(name: str, rank: int, model: nn.Module, world_size: int) -> float:
    """Seconds to encode one step's gradient and decode what comes back (``world_size``
    payloads after an all-gather, one after an all-reduce), median of 5, on random
    gradients shaped like ``model``'s parameters; 0 for no compression. torch's PowerSGD
    is timed as ours (the same products and QR), fp16 as a cast there and back."""
    if name == "none":
        return 0.0
    grads = [torch.randn_like(p) for p in model.parameters()]
    flat = torch.cat([g.reshape(-1) for g in grads])
    hook, make = _compressor(name.replace(" (torch)", ""), rank)

    def one_round(_) -> float:
        start = time.perf_counter()
        if make is None:
            flat.half().float()
        elif hook is powersgd_hook:  # one compressor per matrix; vectors go uncompressed
            for g in grads:
                if g.dim() > 1:
                    c = make()
                    c.decompress(c.compress(g))
        else:
            c = make()
            payload = c.compress(flat)
            for _ in range(world_size if hook is allgather_hook else 1):
                c.decompress(payload)
        return time.perf_counter() - start

    runs = timed_rounds(one_round, 5)
    return sorted(runs)[len(runs) // 2]


def _shard(x: torch.Tensor, y: torch.Tensor, step: int, batch: int, rank: int, world: int):
    """This rank's share of global batch ``step`` (``batch`` examples, cycling the data):
    every batch of these workers, at most ``LSDL_MAX_EXAMPLES`` a rank in a dry run."""
    per_rank = capped_examples(batch // world)
    start = (step * batch + rank * per_rank) % (len(x) - per_rank)
    return x[start : start + per_rank], y[start : start + per_rank]


def _accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad(), eval_mode(model):  # BatchNorm by its running statistics
        return accuracy(model(x), y).item()


def _digits(seed: int):
    """The digits' training set in the order of ``seed`` (the same on every rank) and the
    test set: all of it, at most ``LSDL_MAX_EXAMPLES`` examples in a dry run."""
    digits = load_digits()
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(digits.train_y), generator=g)
    n = capped_examples(len(digits.test_y))
    return digits.train_x[order], digits.train_y[order], digits.test_x[:n], digits.test_y[:n]


def _ddp(model: nn.Module) -> DistributedDataParallel:
    # Buffers are not synchronized: each rank keeps its own BatchNorm statistics, so the
    # gradients' collectives are all the communication there is. A 1x1 convolution's
    # gradient has other (equivalent) strides than its bucket view, about which DDP warns
    # once per process; the copy into the bucket is right. (gradient_as_bucket_view,
    # which avoids the copy, crashed a rank here: "free(): invalid pointer".) One bucket
    # (DDP's 25 MB, given: by default the first bucket holds 1 MB): with two, torch's
    # PowerSGD hook, whose buckets' all-reduces chain in callbacks, ran them in different
    # orders on the two ranks, and gloo stopped ("Received data size doesn't match expected
    # size"; ResNet-20 of width 16, 1.1 MB: 4 runs of 5 failed, 0 of 3 with one bucket).
    warnings.filterwarnings("ignore", message="Grad strides do not match bucket view strides")
    return DistributedDataParallel(model, bucket_cap_mb=25.0, **NO_BUFFER_SYNC)


def _train(ddp, opt, x, y, start: int, steps: int, batch: int, rank: int, world_size: int) -> int:
    """``steps`` global steps of DDP training on this rank's shards from global step
    ``start``: :func:`~lsdl_lab.train.fit` with :func:`~lsdl_lab.train.train_step`
    (cross-entropy, one optimizer step a batch), fit's step ``t`` the global step
    ``start + t``. Returns the steps fit ran (fewer in a dry run, which fit caps)."""
    if not steps:
        return 0
    history = fit(
        ddp,
        opt,
        lambda t: _shard(x, y, start + t, batch, rank, world_size),
        steps,
        progress=False,
        grad_norm=False,
    )
    return history.train[-1]["step"]


# torch's PowerSGD hook all-reduces uncompressed for at least 2 steps of a new DDP model
# (DDP rebuilds its buckets after the first); every hook gets the same
FRESH_DDP_STEPS = 2


def compression_run(
    rank,
    world_size,
    names: Sequence[str] = COMPRESSORS,
    steps: int = 200,
    batch: int = 64,
    lr: float = 0.05,
    make_model: Callable[[], nn.Module] = digits_resnet,
    start_iter: int = 10,
    seed: int = 0,
) -> dict[str, dict]:
    """Train ``make_model()`` on the digits under DDP with each compressor's hook, the
    same initial weights and examples for all: ``steps`` steps of SGD (momentum 0.9, by fit) on
    global batches of ``batch`` examples, the first ``start_iter`` uncompressed (torch's
    PowerSGD needs at least 2; the others follow the same schedule). Those are the same
    for every name, so they run once, and each compressor continues from a copy of the
    model and optimizer (the same numbers as training each from the start). DDP does not
    synchronize buffers: rank 0's model, with its own BatchNorm statistics, is evaluated.

    For each name: ``bytes_per_step``, this rank's bytes handed to collectives per
    compressed step (:class:`~lsdl_lab.distributed.CollectiveBytes`); ``accuracy``, the test
    accuracy at the end; ``seconds``, the training time after the shared steps; ``codec_s``,
    the encode + decode time of one step (see :func:`_codec_seconds`)."""
    start_iter = check_int("start_iter", start_iter, FRESH_DDP_STEPS)
    steps = check_int("steps", steps, start_iter + 1)
    # fit caps each part in a dry run (lsdl_lab.profiles) and says how many steps ran: the
    # fresh model's uncompressed steps, which torch's PowerSGD needs, all run under a cap
    # of at least FRESH_DDP_STEPS
    x, y, test_x, test_y = _digits(seed)
    torch.manual_seed(seed)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    shared = _train(
        _ddp(model), opt, x, y, 0, start_iter - FRESH_DDP_STEPS, batch, rank, world_size
    )
    warm = copy.deepcopy((model.state_dict(), opt.state_dict()))
    results = {}
    for name in names:
        model = make_model()  # a fresh module: the last DDP's hooks stay on the old one
        model.load_state_dict(warm[0])
        ddp = _ddp(model)
        _register(ddp, name, rank, FRESH_DDP_STEPS)
        opt = torch.optim.SGD(ddp.parameters(), lr=lr, momentum=0.9)
        opt.load_state_dict(warm[1])
        start = time.perf_counter()
        fresh = _train(ddp, opt, x, y, shared, FRESH_DDP_STEPS, batch, rank, world_size)
        with CollectiveBytes() as sent:  # the compressed steps only
            compressed = _train(
                ddp, opt, x, y, shared + fresh, steps - start_iter, batch, rank, world_size
            )
        results[name] = {
            "bytes_per_step": sent.bytes / compressed,
            "accuracy": _accuracy(model, test_x, test_y),
            "seconds": time.perf_counter() - start,
            "codec_s": _codec_seconds(name, rank, model, world_size),
            "parameters": sum(p.numel() for p in model.parameters()),
        }
    return results


class SynchronizedStep:
    """:func:`~lsdl_lab.train.fit`'s step of the runs that communicate around the update
    (local SGD here, Chapter 10's DDP, local SGD and DiLoCo): forward and backward of the
    batch (:func:`lsdl_lab.steps.accumulate`, one micro-batch), then ``before()`` (an
    all-reduce of the gradients: DDP's, or a local-SGD warm-up's), the optimizer's update
    and ``after()`` (an averager's or DiLoCo's ``after_step``). The bytes these two hand to
    the collectives are counted in :attr:`counter`; whatever runs between steps is not."""

    def __init__(
        self, before: Callable[[], None] = lambda: None, after: Callable[[], None] = lambda: None
    ):
        self.before, self.after, self.counter = before, after, CollectiveBytes()

    def __call__(self, model, optimizer, batch, task) -> StepResult:
        optimizer.zero_grad(set_to_none=True)
        loss, examples, counts = accumulate(model, [batch], task)
        with self.counter:
            self.before()
        optimizer.step()
        with self.counter:
            self.after()
        return StepResult(loss.item(), examples, counts)


def local_sgd_run(
    rank,
    world_size,
    periods: Sequence[int] = (1, 4, 16),
    steps: int = 200,
    batch: int = 64,
    lr: float = 0.05,
    warmup_steps: int = 0,
    make_model: Callable[[], nn.Module] = digits_mlp,
    seed: int = 0,
) -> dict:
    """Local SGD on the digits at each averaging period H (:class:`PeriodicAverager`, plain
    SGD, ``batch`` examples per step over all ranks, the same examples for every H).

    Returns ``{"periods": {H: {"accuracy", "rounds", "bytes", "seconds"}}}``. ``rounds``
    counts every all-reduce: one per synchronous warm-up step, one per period, and the
    last average when the steps do not end a period (the models are averaged once more
    to evaluate one model): ceil((steps - warmup) / H) after the warm-up. ``bytes`` is what
    this rank handed to those all-reduces (parameters or gradients in float32), by
    :class:`~lsdl_lab.distributed.CollectiveBytes`."""
    x, y, test_x, test_y = _digits(seed)
    out = {}
    for period in periods:
        torch.manual_seed(seed)
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        averager = PeriodicAverager(model.parameters(), period, warmup_steps)
        start = time.perf_counter()
        with CollectiveBytes() as sent:
            history = fit(
                model,
                opt,
                lambda t: _shard(x, y, t, batch, rank, world_size),
                steps,
                step=SynchronizedStep(averager.before_step, averager.after_step),
                progress=False,
                grad_norm=False,
            )
            ran = history.train[-1]["step"]  # steps, or fewer in a dry run (fit caps them)
            last = (ran - warmup_steps) % period != 0  # evaluate one model: average it
            if last:
                average_parameters(model.parameters())
        out[period] = {
            "accuracy": _accuracy(model, test_x, test_y),
            "rounds": averager.rounds + last,
            "bytes": sent.bytes,
            "seconds": time.perf_counter() - start,
        }
    return {"periods": out}


def deep_mlp(width: int = 256, layers: int = 32) -> nn.Module:
    """The model of :func:`overlap_run`: an MLP on the 8x8 digits with ``layers`` hidden
    layers of ``width`` after the first (32 of 256: 8.5 MB of float32 gradients, 257 KiB a
    layer, so that DDP's buckets of a few hundred KiB hold one layer each)."""
    return models.MLP(64, 10, hidden=width, depth=layers + 1)


def _bucket_count(make_model: Callable[[], nn.Module], x, y, cap_mb: float) -> int:
    """How many buckets DDP makes of ``make_model()``'s gradients at ``bucket_cap_mb``: the
    all-reduces that a counting communication hook sees in one step, after the step on
    which DDP rebuilds its buckets."""
    ddp = DistributedDataParallel(make_model(), bucket_cap_mb=cap_mb)
    calls = []

    def counting_hook(state, bucket):
        calls.append(bucket.index())
        return default_hooks.allreduce_hook(state, bucket)

    ddp.register_comm_hook(None, counting_hook)
    for _ in range(2):
        calls.clear()
        nn.functional.cross_entropy(ddp(x), y).backward()
    return len(calls)


def _cores() -> int:
    """The CPU cores this process may run on (all of the machine's where the platform
    cannot say)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def overlap_run(
    rank,
    world_size,
    bucket_caps_mb: Sequence[float] = (0.25, 1.0, 4.0, 25.0),
    make_model: Callable[[], nn.Module] = deep_mlp,
    rows: int = 16,
    repeats: int = 15,
    seed: int = 0,
) -> dict:
    """The overlap of the gradients' all-reduce with the backward pass
    (:func:`~lsdl_lab.distributed.local_sgd.overlap_times`) on ``make_model()`` (by default
    :func:`deep_mlp`, many buckets long) with ``rows`` digits per rank, at each bucket cap
    (MiB): ``{"seconds": {config: median seconds, the slowest rank's}, "buckets": {cap:
    buckets DDP made}, "gradient_bytes": the float32 gradient's size, "cores": the CPU
    cores this rank may run on}``."""
    # overlap_times' own repeats: capped here, except outside a dry run
    repeats = capped_steps(repeats)
    x, y, _, _ = _digits(seed)
    xb, yb = _shard(x, y, 0, rows * world_size, rank, world_size)

    def make():
        torch.manual_seed(seed)
        return make_model()

    buckets = {cap: _bucket_count(make, xb, yb, cap) for cap in bucket_caps_mb}
    seconds = overlap_times(make, xb, yb, nn.functional.cross_entropy, bucket_caps_mb, repeats)
    return {
        "seconds": seconds,
        "buckets": buckets,
        "gradient_bytes": 4 * sum(p.numel() for p in make().parameters()),
        "cores": _cores(),
    }


# The names under which a CPU profile of a gloo world records an all-reduce: the call on
# the main thread that hands it to gloo (c10d's operator), and gloo's run of it on one of
# its own threads. The autograd engine records each node it runs (a layer's backward, the
# accumulation of a gradient with DDP's hook on it) as one event of the third name's
# prefix, on the thread that called backward() (found by running it: torch 2.9 and 2.13).
ISSUE_EVENT, RUN_EVENT = "c10d::allreduce_", "gloo:all_reduce"
BACKWARD_EVENT = "autograd::engine::evaluate_function"


def _merged(intervals: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of ``intervals`` as disjoint (start, end) pairs, in order."""
    out: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def _within(intervals: Sequence[tuple[float, float]], lo: float, hi: float) -> float:
    """The length of the union of ``intervals`` between ``lo`` and ``hi``."""
    return sum(max(0.0, min(end, hi) - max(start, lo)) for start, end in _merged(intervals))


def _trace_events(prof) -> list[dict]:
    """The complete events ("ph": "X") of ``prof``'s Chrome trace: name, thread ("tid"),
    start ("ts") and duration ("dur") in microseconds. (Reading the trace takes a fraction of
    a second; ``prof.events()`` builds a Python object per event: 5 s for 15 steps here.)"""
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            return [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]


def _step_timeline(events: list[dict], step: dict) -> dict:
    """The timeline of one profiled ``step`` (the trace event of the record_function around
    it) in seconds from its start: see :func:`overlap_timeline`. An event belongs to the
    step when it starts within it (gloo may close its event just after the step ends)."""
    t0, t1 = step["ts"], step["ts"] + step["dur"]

    def seconds(e: dict) -> tuple[float, float]:
        return (e["ts"] - t0) / 1e6, (e["ts"] + e["dur"] - t0) / 1e6

    mine = [e for e in events if t0 <= e["ts"] <= t1 and e is not step]
    main = [e for e in mine if e["tid"] == step["tid"]]
    forward = next(seconds(e) for e in main if e["name"] == "forward")
    backward = sorted(seconds(e) for e in main if e["name"].startswith(BACKWARD_EVENT))
    runs = sorted(seconds(e) for e in mine if e["name"] == RUN_EVENT)
    issued = sorted(seconds(e)[0] for e in main if e["name"] == ISSUE_EVENT)
    step_s, backward_end = (t1 - t0) / 1e6, max(end for _, end in backward)
    return {
        "step": step_s,
        "forward": forward,
        "backward": _merged(backward),
        "backward_end": backward_end,
        "all_reduce": runs,
        "issued": issued,
        "hidden": _within(runs, 0.0, backward_end),
        "exposed": step_s - backward_end,
    }


def overlap_timeline(
    rank,
    world_size,
    bucket_cap_mb: float = 1.0,
    make_model: Callable[[], nn.Module] = deep_mlp,
    rows: int = 16,
    repeats: int = 5,
    seed: int = 0,
) -> dict:
    """The timeline of one training step (forward and backward) of ``make_model()`` (by
    default :func:`deep_mlp`), recorded on each rank by ``torch.profiler``, in three
    configurations: ``"no all-reduce"``, the model alone; ``"one bucket"``, DDP with its
    cap of 25 MiB above the whole gradient, whose one all-reduce cannot start before the
    backward ends; and ``"bucket <cap> MB"``, DDP with buckets of ``bucket_cap_mb`` MiB,
    each all-reduced as soon as the backward has filled it.

    The three take turns for ``repeats`` profiled steps each (after two unprofiled ones),
    every step after a barrier. ``"timeline"``: for each configuration, this rank's part of
    the step of median length (the slowest rank's), in seconds from the step's start on
    this rank: ``forward``, (start, end); ``backward``, the intervals in which the autograd
    engine ran its nodes; ``backward_end``, the end of the last node; ``all_reduce``, each
    bucket's all-reduce as gloo's thread ran it, (start, end), waiting for the peer
    included; ``issued``, when the main thread handed each to gloo; ``hidden``, the
    all-reduces' time (their union) before the backward's end; ``exposed``, the step's time
    after the backward's end, which it spends waiting for the communication; ``step``.
    ``"hidden"``: the median over the repeats of this rank's hidden time. ``"world"`` (the
    same on every rank): the medians over the repeats of the slowest rank's ``step`` and
    ``backward_end`` and of their difference, ``exposed``: what the world waits after the
    last backward has ended. ``"cores"``: the CPU cores this rank may run on.
    """
    check_int("repeats", repeats, 1)
    check_positive("bucket_cap_mb", bucket_cap_mb)
    x, y, _, _ = _digits(seed)
    xb, yb = _shard(x, y, 0, rows * world_size, rank, world_size)
    caps = {
        "no all-reduce": None,
        "one bucket": 25.0,
        f"bucket {bucket_cap_mb:g} MB": bucket_cap_mb,
    }
    models = {}
    for name, cap in caps.items():
        torch.manual_seed(seed)
        model = make_model()
        models[name] = model if cap is None else DistributedDataParallel(model, bucket_cap_mb=cap)

    def step(model: nn.Module) -> None:
        with record_function("forward"):
            loss = nn.functional.cross_entropy(model(xb), yb)
        loss.backward()  # under DDP, returns when the last bucket is all-reduced

    for model in models.values():
        for _ in range(2):  # DDP rebuilds its buckets after the first step
            step(model)

    def one_round(i: int) -> None:
        for name, model in models.items():  # interleaved: load on the machine hits all
            dist.barrier()
            with record_function(f"{name} #{i}"):
                step(model)

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        repeats = len(timed_rounds(one_round, repeats))  # fewer in a dry run
    events = _trace_events(prof)
    steps = {
        name: [_step_timeline(events, e) for e in events if e["name"].startswith(f"{name} #")]
        for name in caps
    }
    ends = torch.tensor(
        [[[s["step"], s["backward_end"]] for s in steps[name]] for name in caps],
        dtype=torch.float64,
    )
    dist.all_reduce(ends, op=dist.ReduceOp.MAX)  # the slowest rank's, step by step
    world = {
        name: {
            "step": ends[j, :, 0].median().item(),
            "backward_end": ends[j, :, 1].median().item(),
            "exposed": (ends[j, :, 0] - ends[j, :, 1]).median().item(),
        }
        for j, name in enumerate(caps)
    }
    # the same step on every rank: the one whose slowest rank's time is the median
    median = {name: ends[j, :, 0].argsort()[repeats // 2].item() for j, name in enumerate(caps)}
    return {
        "timeline": {name: s[median[name]] for name, s in steps.items()},
        "hidden": {name: statistics.median(t["hidden"] for t in s) for name, s in steps.items()},
        "world": world,
        "cores": _cores(),
    }


class _Stage(nn.Module):
    """One pipeline stage: ``layers`` blocks of Linear + tanh of width ``width``."""

    def __init__(self, width: int, layers: int):
        super().__init__()
        self.net = nn.Sequential(
            *[m for _ in range(layers) for m in (nn.Linear(width, width), nn.Tanh())]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _sum_of_squares(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((output - target) ** 2).sum()


def _timed_step(stage: nn.Module, inputs: list[torch.Tensor], schedule: str):
    stage.zero_grad()
    m = len(inputs)
    return pipeline_step(
        stage,
        m,
        tuple(inputs[0].shape),
        inputs=inputs,
        targets=inputs,
        loss_fn=_sum_of_squares,
        schedule=schedule,
    )


def model_parallel_run(
    rank,
    world_size,
    micro_batches: Sequence[int] = (1, 2, 4, 8),
    width: int = 512,
    rows: int = 128,
    layers: int = 4,
    dim: int = 64,
    heads: int = 4,
    repeats: int = 3,
) -> dict:
    """Tensor and pipeline parallelism on this world.

    ``"tensor"``: the book's transformer block (``dim``, ``heads``) split over the ranks
    (:class:`~lsdl_lab.parallel.TensorParallelBlock`) against the dense block in float64:
    the largest output and weight-gradient differences, and the bytes all-reduced per
    forward (two all-reduces of the activations, Shoeybi et al. 2019).

    ``"pipeline"``: one stage per rank (``layers`` Linear + tanh layers of ``width`` on
    micro-batches of ``rows`` rows), ``repeats`` 1F1B and GPipe steps per ``micro_batches``
    after an untimed warm-up step: measured bubble (their median), the formula's, peak
    activations in flight, and this rank's timeline (for a figure) at the largest m."""
    rows = capped_examples(rows)  # the pipeline's micro-batches: capped in a dry run only
    torch.manual_seed(0)
    block = models.TransformerBlock(dim, heads, 0.0).double()
    tp = TensorParallelBlock(block)
    x = torch.randn(2, 8, dim, dtype=torch.float64)
    with CollectiveBytes() as sent:
        y_tp = tp(x)
    y = block(x)
    y.square().sum().backward()
    y_tp.square().sum().backward()
    # the first MLP layer is column-parallel: this rank holds rows [r*h, (r+1)*h) of it
    w, w_tp = block.mlp[0].weight.grad, tp.mlp[0].weight.grad
    h = w_tp.shape[0]
    tensor = {
        "output_error": (y - y_tp).abs().max().item(),
        "grad_error": (w[rank * h : (rank + 1) * h] - w_tp).abs().max().item(),
        "bytes_per_forward": sent.bytes,
        "activation_bytes": x.numel() * x.element_size(),
    }

    torch.manual_seed(rank)
    stage = _Stage(width, layers)
    pipeline = {}
    for m in micro_batches:
        inputs = [torch.randn(rows, width) for _ in range(m)]

        _timed_step(stage, inputs, "gpipe")  # warm-up: the first backward of a process is slow
        for schedule in ("gpipe", "1f1b"):
            # the median of a few steps: one step of a few milliseconds is at the mercy of
            # whatever else the machine runs
            reports = timed_rounds(
                lambda _, s=schedule, i=inputs: _timed_step(stage, i, s), repeats
            )
            report = reports[-1]
            pipeline[schedule, m] = {
                "bubble": statistics.median(r.bubble for r in reports),
                "formula": bubble_fraction(world_size, m),
                "peak_in_flight": report.peak_in_flight,
                "timeline": report.timeline,
                "total_s": report.total_s,
            }
    return {"tensor": tensor, "pipeline": pipeline}
