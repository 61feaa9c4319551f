"""Step functions for :func:`lsdl_lab.train.fit`, composed from small pieces.

A step function takes ``(model, optimizer, batch, task)`` and returns a
:class:`~lsdl_lab.train.StepResult`; :func:`~lsdl_lab.train.train_step` is the plain one.
What differs between one process in float32 and a rank of a data-parallel world in mixed
precision with gradient accumulation is only how that step is put together:

* :func:`micro_batches`: the batch cut into ``k`` micro-batches;
* :func:`accumulate`: forward and backward of each micro-batch, the loss divided by ``k``
  (so the gradients add up to the mean loss's), all but the last backward pass without
  gradient synchronization (:func:`sync_off`: DDP's ``no_sync``, FSDP2's
  ``set_requires_gradient_sync(False)``), the forward under ``torch.autocast`` when a
  16-bit dtype is given, the backward through the loss scaler when there is one;
* :func:`global_loss`: one all-reduce of the loss and of a flag saying whether it is
  finite, so every rank learns the global loss and every rank stops together on a NaN,
  before the update (no rank is left waiting in a collective);
* :func:`update`: ``optimizer.step()``, or the loss scaler's step and update, which skip
  a step whose gradients overflowed.

:class:`DataParallelStep` is their composition, the step of every run of the entry point
(:mod:`lsdl_lab.run`); with ``micro_batches=1``, no group and no 16-bit dtype it computes
what :func:`~lsdl_lab.train.train_step` computes. The loss scaler is its state: a resumed
run restores its scale (:class:`~lsdl_lab.train.StatefulStep`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from ._util import check_choice, check_int
from .train import NonFiniteLossError, StatefulStep, StepResult, Task

__all__ = [
    "AUTOCAST",
    "DataParallelStep",
    "accumulate",
    "global_loss",
    "micro_batches",
    "sync_off",
    "update",
]

# the run's precision names and their autocast dtypes (None: float32, no autocast)
AUTOCAST = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def micro_batches(batch: tuple, k: int) -> list[tuple]:
    """``batch = (x, y)`` cut along its first dimension into ``k`` micro-batches of equal
    size (the last ones one example shorter where ``k`` does not divide it)."""
    x, y = batch
    k = check_int("k", k, 1, len(x))
    return list(zip(x.tensor_split(k), y.tensor_split(k), strict=True))


def sync_off(model: nn.Module) -> contextlib.AbstractContextManager:
    """The context of a backward pass that only accumulates gradients: DDP's ``no_sync()``,
    FSDP2's ``set_requires_gradient_sync(False)``; nothing to switch off for any other
    model (a ZeRO optimizer reduces its gradients when it steps)."""
    if hasattr(model, "no_sync"):
        return model.no_sync()
    if hasattr(model, "set_requires_gradient_sync"):

        @contextlib.contextmanager
        def fsdp_no_sync():
            model.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                model.set_requires_gradient_sync(True)

        return fsdp_no_sync()
    return contextlib.nullcontext()


def accumulate(
    model: nn.Module,
    pairs: list[tuple],
    task: Task,
    *,
    dtype: torch.dtype | None = None,
    scaler=None,
    poison: bool = False,
) -> tuple[torch.Tensor, int, dict]:
    r"""Forward and backward of each micro-batch ``(x, y)`` of ``pairs``:

    .. math:: g \mathrel{+}= \nabla \frac{1}{k} \ell(x_j, y_j), \qquad j = 1, \dots, k

    so ``.grad`` gains the gradient of the mean loss over the ``k`` micro-batches (of
    equal size), as one batch of all of them would give it. Every backward pass but the
    last runs under :func:`sync_off`; the forward under ``torch.autocast`` in ``dtype``
    (if given), the loss computed and summed in float32 or wider; with a ``scaler`` the
    backward pass is of the scaled loss. ``poison`` multiplies the loss by NaN (a fault
    injected by a test). Returns the loss (the sum of the ``k`` divided losses, a float64
    0-d tensor on the model's device, not synchronized), the examples and the task's
    counts, summed over the micro-batches."""
    k = len(pairs)
    if k < 1:
        raise ValueError("Invalid pairs: empty (expected at least one (x, y) micro-batch)")
    total, examples, counts = None, 0, {}
    for j, (x, y) in enumerate(pairs):
        with contextlib.nullcontext() if j == k - 1 else sync_off(model):
            with torch.autocast(x.device.type, dtype=dtype, enabled=dtype is not None):
                output = model(x)
                loss = task.loss(output, y)
            loss = (loss.float() if loss.element_size() < 4 else loss) / k
            if poison:
                loss = loss * float("nan")
            (loss if scaler is None else scaler.scale(loss)).backward()
        total = loss.detach().double() if total is None else total + loss.detach().double()
        examples += task.examples(y)
        for key, value in task.counts(output.detach(), y).items():
            counts[key] = counts.get(key, 0) + value
    return total, examples, counts


def global_loss(loss: torch.Tensor, group=None) -> tuple[float, bool]:
    """(the mean of ``loss`` over the ranks of ``group``, whether every rank's loss is
    finite): one all-reduce of the pair [loss, 1 if not finite], on the loss's device.
    Without a process group (one process), ``loss`` itself."""
    flags = torch.stack([loss.double(), (~torch.isfinite(loss)).double()])
    world = 1
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        world = dist.get_world_size(group)
        dist.all_reduce(flags, group=group)
    mean, nonfinite = flags.tolist()
    return mean / world, nonfinite == 0


def update(optimizer: torch.optim.Optimizer, scaler=None) -> bool:
    """The optimizer's step, through ``scaler`` when given (it unscales the gradients and
    skips a step whose gradients are not finite, then updates its scale); whether the
    step was taken."""
    if scaler is None:
        optimizer.step()
        return True
    scaler.step(optimizer)
    scaler.update()
    return not scaler.skipped


class DataParallelStep(StatefulStep):
    """One step of a rank of a data-parallel world, or of one process: the composition of
    :func:`micro_batches`, :func:`accumulate`, :func:`global_loss` and :func:`update`.

    ``batch`` is this rank's part of the global batch; it is cut into ``micro_batches``.
    ``precision``: ``"none"`` (float32), ``"bf16"`` or ``"fp16"`` (autocast; ``scaler``,
    a :class:`~lsdl_lab.memory.LossScaler` or ``torch.amp.GradScaler``, scales the loss,
    and is needed with fp16). ``group``: the ranks that share the step (default the
    world, when there is one). ``around``: a context that the step's forward, backward and
    update run in (a counter of the bytes handed to the collectives of the gradients and
    parameters; the all-reduce of the loss is outside it). ``faults``: a function of no
    argument telling whether this step's loss is to be poisoned (a test's fault).

    The reported loss is the global one (all ranks' mean) and the examples the global
    count, so the loop's averages are the global batch's; a non-finite loss on any rank
    raises :class:`~lsdl_lab.train.NonFiniteLossError` on every rank before the update.
    """

    def __init__(
        self,
        micro_batches: int = 1,
        *,
        precision: str = "none",
        scaler=None,
        group=None,
        around: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
        faults: Callable[[], bool] = lambda: False,
    ):
        self.k = check_int("micro_batches", micro_batches, 1)
        self.dtype = AUTOCAST[check_choice("precision", precision, list(AUTOCAST))]
        if precision == "fp16" and scaler is None:
            raise ValueError(
                "Invalid scaler: None with precision='fp16' (expected a LossScaler: float16 "
                "gradients underflow without loss scaling)"
            )
        self.scaler, self.group, self.around, self.faults = scaler, group, around, faults

    def __call__(self, model, optimizer, batch, task: Task) -> StepResult:
        world = dist.get_world_size(self.group) if dist.is_initialized() else 1
        optimizer.zero_grad(set_to_none=True)
        with self.around():
            loss, examples, counts = accumulate(
                model,
                micro_batches(batch, self.k),
                task,
                dtype=self.dtype,
                scaler=self.scaler,
                poison=self.faults(),
            )
        mean, finite = global_loss(loss, self.group)
        if not finite:
            raise NonFiniteLossError(mean, float(optimizer.param_groups[0]["lr"]))
        with self.around():
            stepped = update(optimizer, self.scaler)
        return StepResult(mean, examples * world, counts, stepped=stepped)

    def state_dict(self) -> dict:
        return {"scaler": self.scaler.state_dict() if self.scaler is not None else {}}

    def load_state_dict(self, state: dict) -> None:
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
