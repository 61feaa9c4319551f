"""Batch sources: mini-batches as a pure function of the step.

A :class:`BatchSource` is called with the step ``t`` and returns the batch of that step,
so a run resumed from a checkpoint at step ``t`` reads exactly the batches an
uninterrupted run would have read; :func:`lsdl_lab.train.fit` recognizes one by this
class, and uses its ``steps_per_epoch`` (``None`` where an epoch has no fixed length) to
count epochs::

    data = load_images("digits").subset(512)
    batches = ImageBatches(data.train_x, data.train_y, batch_size=64, seed=0)
    xb, yb = batches(step)

Every random choice (an epoch's order, a batch's crops, a text window's start) comes from
its own CPU generator seeded by what it is for, the seed and the epoch or step, so the
batches are the same on every device and whatever steps were read before.

In a dry run (:mod:`lsdl_lab.profiles`) every batch and every evaluation set made here
holds at most ``LSDL_MAX_EXAMPLES`` examples (a text's tokens, in whole windows, one at
least), through one function, :func:`_rows`; the library's other cap, on steps, is
:func:`lsdl_lab.train.fit`'s. A data set keeps its size, so its epochs keep their
length.
"""

from __future__ import annotations

import abc
import bisect
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from .._util import check_bool, check_int, check_tensor, generator
from ..profiles import capped_examples

__all__ = [
    "BatchSource",
    "GrowingBatches",
    "ImageBatches",
    "TextBatches",
    "epoch_permutation",
    "eval_batches",
    "random_crop_flip",
    "text_eval_batches",
]


class BatchSource(abc.ABC):
    """The batch of each step: ``batch = source(step)``, the same batch for the same step.

    ``steps_per_epoch`` is the number of steps that read every example once, or ``None``
    when there is no such fixed number (random windows of a text; a batch size that grows
    with the epoch).
    """

    steps_per_epoch: int | None = None

    @abc.abstractmethod
    def __call__(self, step: int) -> Any:
        """The batch of step ``step`` (an int >= 0)."""


def epoch_permutation(n: int, seed: int, epoch: int) -> torch.Tensor:
    """The order in which epoch ``epoch`` reads ``n`` examples: a permutation drawn from a
    CPU generator seeded by ``("epoch", seed, epoch)``, so every epoch of every seed has its
    own stream and every device gets the same order."""
    return torch.randperm(n, generator=generator("epoch", seed, epoch))


def _rows(n: int, size: int = 1) -> int:
    """``n`` rows of ``size`` examples each (images, or windows of ``size`` tokens), or in
    a dry run (:mod:`lsdl_lab.profiles`) as many as ``LSDL_MAX_EXAMPLES`` examples fill, one
    at least: the one place where the library caps the examples of a batch."""
    return max(min(n, 1), capped_examples(n * size) // size)


def _examples(x, y, *, empty: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` and labels ``y`` (one dimension), as many of each (and some, unless ``empty``)."""
    x, y = check_tensor("x", x), check_tensor("y", y, ndim=1)
    if len(x) != len(y) or (len(x) == 0 and not empty):
        raise ValueError(
            f"Invalid x, y: lengths {len(x)}, {len(y)} "
            f"(expected equal{'' if empty else ' non-zero'} lengths)"
        )
    return x, y


class _ShuffledExamples(BatchSource):
    """Examples ``(x, y)`` that each epoch reads once, in the order of
    :func:`epoch_permutation` (or in their own order without ``shuffle``)."""

    def __init__(self, x, y, seed: int, shuffle: bool, device):
        x, y = _examples(x, y)
        self.seed = check_int("seed", seed, 0)
        self.shuffle = check_bool("shuffle", shuffle)
        self.x, self.y = x.to(device), y.to(device)
        self._epoch, self._perm = -1, None

    @property
    def n(self) -> int:
        """The number of examples."""
        return len(self.y)

    def permutation(self, epoch: int) -> torch.Tensor:
        """The order in which epoch ``epoch`` reads the examples."""
        if epoch != self._epoch:  # an epoch's steps come in a row: draw its order once
            if self.shuffle:
                order = epoch_permutation(self.n, self.seed, epoch)
            else:
                order = torch.arange(self.n)
            self._epoch, self._perm = epoch, order.to(self.y.device)
        return self._perm


def random_crop_flip(x: torch.Tensor, generator: torch.Generator, padding: int = 4):
    """Random crop after zero padding, then a random horizontal flip, for a whole batch.

    The standard CIFAR augmentation of He et al. (2016), Section 4.2. The images are
    already normalized, so zero padding is padding with the mean colour. The random
    offsets come from ``generator`` (on the CPU); the pixels move on ``x``'s device.
    """
    b, _, h, w = check_tensor("x", x, ndim=4).shape
    padding = check_int("padding", padding, 0)
    offsets = torch.randint(0, 2 * padding + 1, (2, b), generator=generator).to(x.device)
    flip = (torch.rand(b, generator=generator) < 0.5).to(x.device)
    rows = offsets[0, :, None] + torch.arange(h, device=x.device)  # (B, H)
    cols = offsets[1, :, None] + torch.arange(w, device=x.device)  # (B, W)
    cols = torch.where(flip[:, None], cols.flip(1), cols)
    padded = F.pad(x, (padding, padding, padding, padding))
    batch = torch.arange(b, device=x.device)[:, None, None]
    # Advanced indices split by the channel slice put the indexed dims first: (B, H, W, C).
    return padded[batch, :, rows[:, :, None], cols[:, None, :]].permute(0, 3, 1, 2).contiguous()


class ImageBatches(_ShuffledExamples):
    """Mini-batches of images as a pure function of the step: ``xb, yb = batches(step)``.

    Epoch ``e = step // len(self)`` reads the examples in the order
    :func:`epoch_permutation` draws for ``(seed, e)``; with ``augment`` each batch is
    randomly cropped and flipped (:func:`random_crop_flip`) with randomness seeded by
    ``(seed, step)``. So step ``t`` gives the same batch whether or not the run was
    interrupted before it.
    """

    def __init__(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        batch_size: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = True,
        augment: bool = False,
        device=None,
    ):
        super().__init__(x, y, seed, shuffle, device)
        self.drop_last = check_bool("drop_last", drop_last)
        self.augment = check_bool("augment", augment)
        if augment and self.x.ndim != 4:
            raise ValueError(
                f"Invalid x: a tensor of shape {tuple(self.x.shape)} "
                f"(expected (N, C, H, W) images for augment=True)"
            )
        self.batch_size = check_int("batch_size", batch_size, 1, self.n)
        n, b = self.n, self.batch_size
        self.steps_per_epoch = n // b if self.drop_last else math.ceil(n / b)

    def __len__(self) -> int:
        return self.steps_per_epoch

    def __call__(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        step = check_int("step", step, 0)
        epoch, i = divmod(step, self.steps_per_epoch)
        idx = self.permutation(epoch)[i * self.batch_size : (i + 1) * self.batch_size]
        idx = idx[: _rows(len(idx))]  # all of it, except in a dry run
        xb, yb = self.x[idx], self.y[idx]
        if self.augment:
            xb = random_crop_flip(xb, generator("augment", self.seed, step))
        return xb, yb


def eval_batches(x, y, batch_size: int, max_batches: int | None = None, device=None) -> list:
    """``(xb, yb)`` batches in order, no shuffle, the last one possibly smaller: all of
    ``x`` or its first ``max_batches`` batches (in a dry run, at most its cap's examples)."""
    x, y = _examples(x, y, empty=True)
    batch_size = check_int("batch_size", batch_size, 1)
    n = len(x)
    if max_batches is not None:
        n = min(n, check_int("max_batches", max_batches, 1) * batch_size)
    n = _rows(n)  # all of them, except in a dry run
    x, y = x[:n], y[:n]
    return [
        (x[i : i + batch_size].to(device), y[i : i + batch_size].to(device))
        for i in range(0, len(x), batch_size)
    ]


def _windows(tokens, block_size, batch_size) -> tuple[torch.Tensor, int, int]:
    """A token stream (one dimension, at least 2 tokens) and the sizes of its batches of
    windows: ``block_size`` in [1, len(tokens) - 1], ``batch_size`` >= 1."""
    tokens = check_tensor("tokens", tokens, ndim=1)
    if len(tokens) < 2:
        raise ValueError(f"Invalid tokens: {len(tokens)} tokens (expected at least 2)")
    block_size = check_int("block_size", block_size, 1, len(tokens) - 1)
    return tokens, block_size, check_int("batch_size", batch_size, 1)


class TextBatches(BatchSource):
    """Random windows of a token stream as a pure function of the step: ``x, y = batches(step)``.

    ``x`` and ``y`` are ``(batch_size, block_size)`` int64; ``y`` is ``x`` shifted one
    token ahead (the next-character targets). The window starts are drawn from a
    generator seeded by ``(seed, step)``, as nanoGPT's ``get_batch`` draws them, but
    reproducibly. Windows are drawn with replacement, so there are no epochs
    (``steps_per_epoch`` is ``None``).
    """

    def __init__(self, tokens, block_size: int, batch_size: int, *, seed: int = 0, device=None):
        tokens, self.block_size, self.batch_size = _windows(tokens, block_size, batch_size)
        self.seed = check_int("seed", seed, 0)
        self.tokens = tokens.to(device=device, dtype=torch.long)
        self._span = torch.arange(self.block_size + 1, device=self.tokens.device)

    def __call__(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        step = check_int("step", step, 0)
        g = generator("text", self.seed, step)
        rows = _rows(self.batch_size, self.block_size)  # a dry run's cap counts tokens
        starts = torch.randint(len(self.tokens) - self.block_size, (rows,), generator=g)
        windows = self.tokens[starts.to(self.tokens.device)[:, None] + self._span]
        return windows[:, :-1], windows[:, 1:]


def text_eval_batches(
    tokens, block_size: int, batch_size: int, max_batches: int | None = None, device=None
) -> list:
    """Contiguous, non-overlapping windows in order, batched; the last batch may be smaller
    (in a dry run, at most its cap's tokens in whole windows, one at least)."""
    tokens, block_size, batch_size = _windows(tokens, block_size, batch_size)
    n_windows = (len(tokens) - 1) // block_size
    starts = torch.arange(n_windows) * block_size
    if max_batches is not None:
        starts = starts[: check_int("max_batches", max_batches, 1) * batch_size]
    starts = starts[: _rows(len(starts), block_size)]  # all of them, except in a dry run
    windows = tokens[starts[:, None] + torch.arange(block_size + 1)].to(device)
    return [(w[:, :-1], w[:, 1:]) for w in windows.split(batch_size)]


class GrowingBatches(_ShuffledExamples):
    """Mini-batches whose size follows a schedule of the epoch: ``xb, yb = batches(step)``.

    The batch-size schedules of Smith, Kindermans, Ying and Le (2018), "Don't decay the
    learning rate, increase the batch size" (see
    :func:`lsdl_lab.schedules.batch_size_schedule`). Like :class:`ImageBatches`, a pure
    function of the step, so a resumed run reads the batches an uninterrupted one would;
    it plugs into :func:`lsdl_lab.train.fit` with ``steps=batches.epoch_start(epochs)``.
    Epoch ``e`` reads the examples in the same order as ``ImageBatches``
    (:func:`epoch_permutation`, so with a constant schedule the two give the same batches)
    in batches of ``schedule(e)``; each example is read once per epoch. The last batch of
    an epoch is smaller when the size does not divide the data, unless ``drop_last=True``
    drops it.

    ``steps_per_epoch`` is ``None`` (it changes with the epoch): :meth:`epoch_start`,
    :meth:`epoch` and :meth:`batch_size` map between steps, epochs and sizes.
    """

    def __init__(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        schedule: Callable[[int], int],
        seed: int = 0,
        device=None,
        *,
        drop_last: bool = False,
    ):
        if not callable(schedule):
            raise TypeError(f"Invalid schedule: {schedule!r} (expected a function of the epoch)")
        super().__init__(x, y, seed, True, device)
        self.schedule = schedule
        self.drop_last = check_bool("drop_last", drop_last)
        self._starts = [0]  # _starts[e]: the first step of epoch e, extended on demand

    def batch_size_of_epoch(self, epoch: int) -> int:
        """The scheduled batch size of epoch ``epoch``."""
        b = check_int(f"schedule({epoch})", self.schedule(check_int("epoch", epoch, 0)), 1)
        if b > self.n:
            raise ValueError(
                f"Invalid schedule({epoch}): {b} (expected an int in [1, {self.n}], "
                f"the data set has {self.n} examples)"
            )
        return b

    def steps_in_epoch(self, epoch: int) -> int:
        """The number of steps of epoch ``epoch``."""
        b = self.batch_size_of_epoch(epoch)
        return self.n // b if self.drop_last else -(-self.n // b)

    def epoch_start(self, epoch: int) -> int:
        """The step at which epoch ``epoch`` starts (``epoch_start(E)`` = steps in E epochs)."""
        epoch = check_int("epoch", epoch, 0)
        while len(self._starts) <= epoch:
            self._starts.append(self._starts[-1] + self.steps_in_epoch(len(self._starts) - 1))
        return self._starts[epoch]

    def epoch(self, step: int) -> int:
        """The epoch that step ``step`` belongs to."""
        step = check_int("step", step, 0)
        while self._starts[-1] <= step:
            self.epoch_start(len(self._starts))
        return bisect.bisect_right(self._starts, step) - 1

    def batch_size(self, step: int) -> int:
        """The size of the batch of step ``step`` (the last of an epoch may be smaller)."""
        e = self.epoch(step)
        b = self.batch_size_of_epoch(e)
        return min(b, self.n - (step - self._starts[e]) * b)

    def __call__(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        e = self.epoch(step)
        b = self.batch_size_of_epoch(e)
        i = step - self._starts[e]
        idx = self.permutation(e)[i * b : (i + 1) * b]
        idx = idx[: _rows(len(idx))]  # all of it, except in a dry run
        return self.x[idx], self.y[idx]
