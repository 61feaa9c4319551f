"""A parameter server over point-to-point messages: synchronous and asynchronous SGD.

Rank 0 is the server: it holds the weights w and applies the updates. Ranks 1..p-1 are
workers: each *pulls* the weights, computes a gradient on its own data, and *pushes* the
gradient back (Li et al. 2014, "Scaling distributed machine learning with the parameter
server"; Dean et al. 2012's Downpour SGD). Every message is a ``send``/``recv``, and
each carries a version number: a message is one flat float64 tensor ``[version, data...]``.

* :func:`synchronous_sgd`: the server waits for all p-1 gradients of version t, adds them
  in worker order, takes the mean and steps: the same iterates as data-parallel SGD with
  an all-reduce (:func:`all_reduce_sgd`), up to the rounding of another order of addition.
* :func:`asynchronous_sgd`: no waiting for the slowest. A gradient computed on version
  tau and applied when the server is at version v is v - tau versions *stale*. The
  staleness is bounded by s (as in the stale-synchronous parallel server of Ho et al.
  2013): at most s+1 workers compute at a time and the server applies gradients in the
  order the workers pulled, so a gradient is late by exactly the number of computations
  that started before it and had not finished: at most s. A worker beyond the s+1 waits
  for its pull. s = 0 is sequential SGD on fresh weights; s >= p-2 never makes anyone
  wait. The server returns the staleness of every update it applied.

``gradient(w, worker, k)`` is the workers' gradient (worker 0..p-2, its k-th call): an
importable function, like any worker of :func:`~lsdl_lab.distributed.spawn`. All messages are
float64 CPU tensors, and so are the weights, since the server receives from whichever
worker is done first, which gloo's point-to-point can and NCCL's cannot (a gradient
computed on a GPU is moved to the CPU to be sent). Every run is meant to be called by
every rank as the body of a spawned (gloo) world.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import torch
import torch.distributed as dist

from .._util import check_int, check_positive

__all__ = ["all_reduce_sgd", "asynchronous_sgd", "pull", "push", "synchronous_sgd"]

SERVER = 0
STOP = -1.0  # the version of the message that sends a worker home


def push(version: float, data: torch.Tensor, to: int) -> None:
    """Send ``[version, data...]`` to rank ``to`` (blocking), from the CPU."""
    dist.send(torch.cat([torch.tensor([float(version)], dtype=torch.float64), data.cpu()]), to)


def pull(size: int, source: int | None = None) -> tuple[float, torch.Tensor, int]:
    """Receive ``[version, data...]`` of ``size`` data entries from rank ``source`` (from any
    rank when ``None``); returns ``(version, data, sender)``."""
    message = torch.empty(size + 1, dtype=torch.float64)
    sender = dist.recv(message, source)
    return message[0].item(), message[1:], sender


def _worker_loop(w_size: int, gradient: Callable, rank: int) -> int:
    """Pull weights, push the gradient at them, until the server says stop; returns how
    many gradients this worker computed."""
    k = 0
    while True:
        version, w, _ = pull(w_size, SERVER)
        if version == STOP:
            return k
        push(version, gradient(w, rank - 1, k), SERVER)
        k += 1


def _check(rank, world_size, w0, lr, steps) -> torch.Tensor:
    check_int("world_size", world_size, 2)
    check_positive("lr", lr)
    check_int("steps", steps, 1)
    return w0.detach().to("cpu", torch.float64).reshape(-1).clone()


def synchronous_sgd(rank, world_size, w0, gradient, lr: float, steps: int):
    """Synchronous parameter-server SGD for ``steps`` steps of
    w <- w - lr * mean over workers of gradient(w, worker, t).
    Returns the final weights on the server, the number of gradients on a worker."""
    w = _check(rank, world_size, w0, lr, steps)
    if rank != SERVER:
        return _worker_loop(len(w), gradient, rank)
    workers = range(1, world_size)
    for t in range(steps):
        for r in workers:
            push(t, w, r)
        g = torch.stack([pull(len(w), r)[1] for r in workers]).sum(0)
        w -= lr * g / len(workers)
    for r in workers:
        push(STOP, w, r)
    return w


def all_reduce_sgd(rank, world_size, w0, gradient, lr: float, steps: int):
    """The same iterates as :func:`synchronous_sgd` by data parallelism: ranks 1..p-1
    all-reduce their gradients among themselves, rank 0 idles (so the data and the worker
    numbers are the same). Returns the final weights on every worker, ``None`` on rank 0."""
    w = _check(rank, world_size, w0, lr, steps)
    group = dist.new_group(list(range(1, world_size)))  # every rank must call new_group
    if rank == SERVER:
        return None
    for t in range(steps):
        g = gradient(w, rank - 1, t)
        dist.all_reduce(g, group=group)
        w -= lr * g / (world_size - 1)
    return w


def asynchronous_sgd(rank, world_size, w0, gradient, lr: float, steps: int, staleness: int):
    """Asynchronous parameter-server SGD with staleness bounded by ``staleness`` (s):
    ``steps`` updates w <- w - lr * gradient(w_tau, worker, k), each applied as soon as
    the gradients pulled before it have been. Returns ``(w, staleness of each update)``
    on the server, the number of gradients on a worker."""
    w = _check(rank, world_size, w0, lr, steps)
    s = check_int("staleness", staleness, 0)
    if rank != SERVER:
        return _worker_loop(len(w), gradient, rank)
    waiting, computing, arrived, stale = deque(range(1, world_size)), deque(), {}, []
    v = handed = 0
    while v < steps:
        while waiting and len(computing) <= s and handed < steps:  # hand out weights
            r = waiting.popleft()
            push(v, w, r)
            computing.append((r, v))
            handed += 1
        _, g, r = pull(len(w))  # whoever finishes first
        arrived[r] = g
        while computing and computing[0][0] in arrived and v < steps:  # in pull order
            r, tau = computing.popleft()
            stale.append(v - tau)
            w -= lr * arrived.pop(r)
            v += 1
            waiting.append(r)
    for r in range(1, world_size):
        push(STOP, w, r)
    return w, stale
