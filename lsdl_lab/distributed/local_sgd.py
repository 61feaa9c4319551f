"""Communicating less often: gradient accumulation, local SGD, post-local SGD, overlap.

Synchronous data parallelism all-reduces the gradient once per step. Three ways to pay
for fewer or cheaper rounds:

* :func:`accumulate_gradients`: k micro-batches, one all-reduce. DDP's ``no_sync()``
  turns off the all-reduce for the first k - 1 backward passes; the gradients add up
  locally and the k-th backward all-reduces their sum. The step is a large-batch step of
  k times the memory-bound micro-batch (Goyal et al. 2017 use the same sum).
* :class:`PeriodicAverager`, local SGD (Stich 2019; "periodic model averaging"): every
  rank takes H optimizer steps on its own data, then the ranks average their *models*.
  One all-reduce of the parameters per H steps: H times fewer rounds. With a warm-up of
  synchronous steps first it is Lin et al.'s (2020) post-local SGD, which keeps the
  early, fast-changing phase of training synchronous. :func:`post_local_sgd` sets up
  torch's own implementation of the same schedule as the reference.
* :func:`overlap_times`: DDP cuts the gradients into buckets and all-reduces each as
  soon as the backward pass has filled it, while the gradients of earlier layers are
  still being computed (Li et al. 2020, PyTorch Distributed). Measured against the same
  backward followed by one all-reduce of everything, and against the backward alone.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .._util import check_int, check_positive
from ..steps import accumulate
from ..train import LossFunction

__all__ = [
    "PeriodicAverager",
    "accumulate_gradients",
    "all_reduce_gradients",
    "average_parameters",
    "overlap_times",
    "post_local_sgd",
]


def accumulate_gradients(
    ddp: DistributedDataParallel, loss_fn: Callable, micro_batches: Sequence[tuple]
) -> float:
    r"""Forward and backward over ``micro_batches`` (pairs ``(x, y)``) with one all-reduce:

    .. math:: g = \frac{1}{W}\sum_{w=1}^{W} \frac{1}{k}\sum_{j=1}^{k}
        \nabla \ell(x_{w,j}, y_{w,j})

    the gradient of the mean loss over all W k micro-batches (of equal size), as one
    large batch would give it. The first k - 1 backward passes run under ``no_sync()``;
    the last one triggers DDP's all-reduce of the accumulated ``.grad``: the piece
    :func:`lsdl_lab.steps.accumulate` of every run's step. Returns this rank's mean loss.
    Gradients add to what ``.grad`` holds: zero them before.
    """
    if len(micro_batches) < 1:
        raise ValueError("Invalid micro_batches: empty (expected at least one (x, y) pair)")
    loss, _, _ = accumulate(ddp, list(micro_batches), LossFunction(loss_fn))
    return loss.item()


def average_parameters(parameters: Iterable[torch.Tensor], group=None) -> None:
    r"""Replace every rank's parameters by their mean over the ranks,
    :math:`x \leftarrow \frac1W \sum_w x_w`, with one all-reduce of their concatenation."""
    params = [p for p in parameters]
    with torch.no_grad():
        flat = torch.cat([p.reshape(-1) for p in params])
        dist.all_reduce(flat, group=group)
        flat /= dist.get_world_size(group)
        for p, mean in zip(params, flat.split([p.numel() for p in params]), strict=True):
            p.copy_(mean.view_as(p))


def all_reduce_gradients(parameters: Iterable[torch.Tensor], group=None) -> None:
    """Average the ``.grad`` of ``parameters`` over the ranks (one all-reduce): what DDP
    does after every backward, written out."""
    grads = [p.grad for p in parameters if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    flat /= dist.get_world_size(group)
    for g, mean in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
        g.copy_(mean.view_as(g))


class PeriodicAverager:
    r"""Local SGD: average the models every ``period`` steps (Stich 2019), after
    ``warmup_steps`` synchronous steps (post-local SGD, Lin et al. 2020).

    Call :meth:`before_step` after the backward pass and before ``optimizer.step()``, and
    :meth:`after_step` after it. During the warm-up, ``before_step`` all-reduces the
    gradients (synchronous SGD); afterwards each rank steps on its own gradient and
    ``after_step`` averages the parameters when ``period`` local steps have passed:

    .. math:: x_w \leftarrow x_w - \eta g_w(x_w) \ \text{every step}, \qquad
        x_w \leftarrow \frac1W\sum_v x_v \ \text{when } (t - t_0 + 1) \bmod H = 0.

    ``rounds`` counts the all-reduces done (gradients or parameters). The optimizer's own
    state (momentum) stays local, as in Lin et al.'s and torch's implementations.
    """

    def __init__(
        self, parameters: Iterable[torch.Tensor], period: int, warmup_steps: int = 0, group=None
    ):
        self.parameters = list(parameters)
        self.period = check_int("period", period, 1)
        self.warmup_steps = check_int("warmup_steps", warmup_steps, 0)
        self.group = group
        self.step_count = 0
        self.rounds = 0

    def synchronous(self) -> bool:
        """Whether the current step is a warm-up (all-reduced gradient) step."""
        return self.step_count < self.warmup_steps

    def before_step(self) -> None:
        if self.synchronous():
            all_reduce_gradients(self.parameters, self.group)
            self.rounds += 1

    def after_step(self) -> bool:
        """Count the step; average the models if it ends a period. Returns whether it did."""
        local = self.step_count - self.warmup_steps
        self.step_count += 1
        if local >= 0 and (local + 1) % self.period == 0:
            average_parameters(self.parameters, self.group)
            self.rounds += 1
            return True
        return False


def post_local_sgd(ddp: DistributedDataParallel, period: int, warmup_steps: int):
    """torch's post-local SGD on ``ddp``: its ``post_localSGD_hook`` all-reduces gradients
    for ``warmup_steps`` steps and then only within a subgroup; the returned
    ``PeriodicModelAverager`` must be called as ``averager.average_parameters(params)``
    after each ``optimizer.step()``. The subgroup is one rank each
    (``dist.new_subgroups(group_size=1)``): the hook's default subgroup (one per machine)
    fails on gloo. Every rank must call this (it creates process groups)."""
    from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import (
        PostLocalSGDState,
        post_localSGD_hook,
    )
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

    check_int("period", period, 1)
    check_int("warmup_steps", warmup_steps, 0)
    subgroup = dist.new_subgroups(group_size=1)[0]
    state = PostLocalSGDState(
        process_group=None, subgroup=subgroup, start_localSGD_iter=warmup_steps
    )
    ddp.register_comm_hook(state, post_localSGD_hook)
    return PeriodicModelAverager(period=period, warmup_steps=warmup_steps)


def overlap_times(
    make_model: Callable[[], nn.Module],
    x: torch.Tensor,
    y: torch.Tensor,
    loss_fn: Callable,
    bucket_caps_mb: Sequence[float] = (0.25, 25.0),
    repeats: int = 7,
) -> dict[str, float]:
    """Seconds per forward-backward, median over ``repeats`` (after two warm-up calls),
    the slowest rank's:

    * ``"no all-reduce"``: the model alone, no communication: the computation the
      all-reduce could hide behind;
    * ``"after backward"``: the backward under ``no_sync()``, then one all-reduce of all
      the gradients: no overlap;
    * ``"bucket <cap> MB"``: DDP with that ``bucket_cap_mb`` (MiB, as DDP counts): each
      bucket's all-reduce starts as soon as the backward has filled it and runs beside the
      rest of the backward.

    Small buckets overlap more but pay the latency alpha once per bucket; one bucket holding
    every gradient cannot start before the backward ends. A parameter is never split, so a
    model whose gradients fit in one cap is one bucket whatever the cap: measure on a model
    of many buckets. The configurations take turns within each repeat, so a burst of load
    from another process hits them alike. Every rank must call it. With ``x`` on a GPU each
    call is timed to a synchronization (CUDA work returns before it is done).
    """
    repeats = check_int("repeats", repeats, 1)
    for cap in bucket_caps_mb:
        check_positive("bucket_caps_mb", cap)
    configs = [("no all-reduce", None), ("after backward", 25.0)]
    configs += [(f"bucket {c:g} MB", c) for c in bucket_caps_mb]
    times = torch.empty(repeats, len(configs), dtype=torch.float64)
    models = [
        make_model() if cap is None else DistributedDataParallel(make_model(), bucket_cap_mb=cap)
        for _, cap in configs
    ]

    def run(j: int) -> None:
        model = models[j]
        model.zero_grad(set_to_none=False)
        if j == 1:
            with model.no_sync():
                loss_fn(model(x), y).backward()
            all_reduce_gradients(model.parameters())
        else:
            loss_fn(model(x), y).backward()

    for j in range(len(configs)):
        run(j)  # DDP rebuilds its buckets after the first step
        run(j)
    for i in range(repeats):
        for j in range(len(configs)):  # interleaved: load on the machine hits all alike
            dist.barrier()
            start = time.perf_counter()
            run(j)
            if x.is_cuda:
                torch.cuda.synchronize(x.device)
            times[i, j] = time.perf_counter() - start
    times = times.to(x.device)  # NCCL reduces CUDA tensors only
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    medians = times.median(dim=0).values.tolist()
    return {name: t for (name, _), t in zip(configs, medians, strict=True)}
