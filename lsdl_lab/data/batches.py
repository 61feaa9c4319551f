"""Batch sources: mini-batches as a pure function of the step.

A :class:`BatchSource` is called with the step ``t`` and returns the batch of that step,
so a run resumed from a checkpoint at step ``t`` reads exactly the batches an
uninterrupted run would have read; :func:`lsdl_lab.train.fit` recognizes one by this
class, and uses its ``steps_per_epoch`` (``None`` where an epoch has no fixed length) to
count epochs.
"""

from __future__ import annotations

import abc
from typing import Any

__all__ = ["BatchSource"]


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
