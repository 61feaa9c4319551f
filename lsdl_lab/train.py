"""One training loop for every lab: ``fit(model, optimizer, batches, steps=...)``.

``fit`` owns the run: the batch of each step, the learning-rate schedule, the logged
history, evaluation, checkpoints, exact resume and the progress bar. What happens to one
batch belongs to a *step function* ``step(model, optimizer, batch, task) ->``
:class:`StepResult`. The default, :func:`train_step`, does forward, loss, backward,
optional gradient clipping and ``optimizer.step()``; a non-finite loss stops the run with
:class:`NonFiniteLossError` naming the step, *before* the bad gradient reaches the
parameters. Options of a step are bound with :func:`functools.partial`::

    fit(model, optimizer, batches, steps=1000, step=partial(train_step, clip_grad_norm=1.0))

Later chapters swap the step, not the loop: mixed precision with a loss scaler,
gradient accumulation over micro-batches and data-parallel steps are other functions
with the same signature (a step that skips its update, as a loss scaler does on an
overflow, says so with ``stepped=False``, and the schedule does not advance; a step with
state of its own, a :class:`StatefulStep`, is saved in checkpoints and restored on resume).

The :class:`Task` says what the model is trained to do: its loss, how many examples a
batch holds (N images for classification, B x T tokens for language modeling), and its
metric. Every average the history reports, training and evaluation alike, is over those
examples.

Because the batch is a function of the step (a :class:`lsdl_lab.data.BatchSource`, or any
function of the step) and the checkpoint holds the model, the optimizer, the scheduler,
the random number generators and the history, a run stopped and resumed from its
checkpoint computes exactly what an uninterrupted run computes (bit for bit on CPU;
tested in ``tests/test_train.py``). Checkpoints are files of :mod:`lsdl_lab.checkpoint`:
written atomically (a temporary file, ``fsync``, rename, by rank 0 of a world), so a run
killed while saving never leaves half a checkpoint, and holding only tensors and plain
containers, so they load with ``torch.load(..., weights_only=True)`` (a checkpoint from
elsewhere cannot run code when it is loaded). The entry point (:mod:`lsdl_lab.run`) runs
this same loop with a step of :mod:`lsdl_lab.steps` and a :class:`Checkpoint` of its own.
"""

from __future__ import annotations

import abc
import math
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from . import checkpoint as files
from ._util import (
    check_bool,
    check_choice,
    check_int,
    check_positive,
    device_of,
    eval_mode,
)
from .data import BatchSource
from .profiles import capped_steps

__all__ = [
    "Checkpoint",
    "Classification",
    "FileCheckpoint",
    "History",
    "LanguageModeling",
    "LossFunction",
    "NonFiniteLossError",
    "StatefulStep",
    "StepResult",
    "Task",
    "accuracy",
    "evaluate",
    "fit",
    "train_step",
]


class NonFiniteLossError(FloatingPointError):
    """The loss became NaN or infinite; training on it would corrupt every parameter.

    A step function raises it with the loss and learning rate; :func:`fit` raises it again
    with the number of the step (a step function does not know which step it is).
    """

    def __init__(self, loss: float, lr: float, step: int | None = None):
        super().__init__(loss, lr, step)
        self.loss, self.lr, self.step = loss, lr, step

    def at(self, step: int) -> NonFiniteLossError:
        """The same error, naming step ``step``."""
        return NonFiniteLossError(self.loss, self.lr, step)

    def __str__(self) -> str:
        where = "" if self.step is None else f" at step {self.step}"
        return (
            f"the training loss became {self.loss}{where} (lr={self.lr:.3g}); the parameters "
            "were not updated with it. Lower the learning rate, add warmup or gradient "
            "clipping, or check the data."
        )


# -- tasks ---------------------------------------------------------------------------------


def accuracy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Fraction of rows of ``output`` (N, K) whose largest logit is the ``target`` class, as a
    0-dimensional float64 tensor (a metric that :mod:`lsdl_lab.landscape` evaluates too)."""
    return (output.argmax(-1) == target).double().mean()


class Task(abc.ABC):
    """What a model is trained to do: its loss, the examples a batch holds, its metric."""

    name: str

    @abc.abstractmethod
    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The mean loss over the batch's :meth:`examples`."""

    @abc.abstractmethod
    def examples(self, target: torch.Tensor) -> int:
        """How many examples the batch with this target holds (the mean loss's count)."""

    def counts(self, output: torch.Tensor, target: torch.Tensor) -> dict:
        """Sums over the batch (numbers or 0-d tensors) from which :meth:`summarize` makes
        its metric, so averages over batches of any size come out right."""
        return {}

    @abc.abstractmethod
    def summarize(self, loss_sum: float, n: int, counts: dict) -> dict[str, float]:
        """The metrics of ``n`` examples whose losses sum to ``loss_sum``."""


class Classification(Task):
    """Cross-entropy on class logits (N, K); an example is a row; metric: accuracy."""

    name = "classification"

    def loss(self, output, target):
        return F.cross_entropy(output, target)

    def examples(self, target) -> int:
        return target.shape[0]

    def counts(self, output, target) -> dict:
        # A tensor: summed on the device, read (synchronising) only when logged.
        return {"correct": (output.argmax(-1) == target).sum()}

    def summarize(self, loss_sum, n, counts) -> dict[str, float]:
        return {"loss": loss_sum / n, "accuracy": float(counts["correct"]) / n}


class LanguageModeling(Task):
    """Next-token cross-entropy on logits (B, T, V); an example is a token; metric:
    perplexity exp(loss)."""

    name = "language_modeling"

    def loss(self, output, target):
        return F.cross_entropy(output.flatten(0, -2), target.flatten())

    def examples(self, target) -> int:
        return target.numel()

    def summarize(self, loss_sum, n, counts) -> dict[str, float]:
        loss = loss_sum / n
        return {"loss": loss, "perplexity": math.exp(min(loss, 50.0))}


class LossFunction(Task):
    """Any loss function of ``(output, target)`` as a task (a step's pieces take a task,
    :mod:`lsdl_lab.steps`): an example is a row of the target; its only metric is the
    loss."""

    name = "loss"

    def __init__(self, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
        if not callable(loss_fn):
            raise TypeError(f"Invalid loss_fn: a {type(loss_fn).__name__} (expected a function)")
        self.loss_fn = loss_fn

    def loss(self, output, target):
        return self.loss_fn(output, target)

    def examples(self, target) -> int:
        return target.shape[0]

    def summarize(self, loss_sum, n, counts) -> dict[str, float]:
        return {"loss": loss_sum / n}


TASKS = {"classification": Classification, "language_modeling": LanguageModeling}


def _task(task: str | Task) -> Task:
    if isinstance(task, Task):
        return task
    if not isinstance(task, str):
        raise TypeError(
            f"Invalid task: a {type(task).__name__} (expected a lsdl_lab.train.Task or one of "
            f"{', '.join(map(repr, TASKS))})"
        )
    return TASKS[check_choice("task", task, list(TASKS))]()


class _Totals:
    """Running sums of loss x examples, examples and the task's counts."""

    def __init__(self):
        self.loss_sum, self.n, self.counts = 0.0, 0, {}
        self.start = time.perf_counter()

    def add(self, loss: float, examples: int, counts: dict) -> None:
        self.loss_sum += loss * examples
        self.n += examples
        for key, value in counts.items():
            self.counts[key] = self.counts.get(key, 0) + value

    def summarize(self, task: Task) -> dict[str, float]:
        return task.summarize(self.loss_sum, self.n, self.counts)


# -- history and evaluation ----------------------------------------------------------------


@dataclass
class History:
    """What a run recorded: one dict per logged training step, one per evaluation."""

    train: list[dict] = field(default_factory=list)
    eval: list[dict] = field(default_factory=list)

    def series(self, metric: str, x: str = "step") -> tuple[list, list]:
        """(x values, metric values) of the records that have the metric."""
        records = self.eval if metric.startswith("eval_") else self.train
        pairs = [(r[x], r[metric]) for r in records if metric in r]
        if not pairs and not any(metric in r for r in self.train + self.eval):
            known = sorted({k for r in self.train + self.eval for k in r})
            raise KeyError(f"no metric {metric!r} in this history; recorded: {', '.join(known)}")
        return [p[0] for p in pairs], [p[1] for p in pairs]

    def last(self, metric: str) -> float:
        return self.series(metric)[1][-1]

    def state_dict(self) -> dict:
        return {"train": [dict(r) for r in self.train], "eval": [dict(r) for r in self.eval]}

    @classmethod
    def from_state_dict(cls, state: dict) -> History:
        return cls([dict(r) for r in state["train"]], [dict(r) for r in state["eval"]])


@torch.no_grad()
def evaluate(model: nn.Module, batches: Iterable, task="classification", device=None) -> dict:
    """Mean loss and task metric over the examples of ``batches``, in evaluation mode
    (BatchNorm uses its running statistics, dropout is off); every submodule's mode is
    restored afterwards, also when a batch raises."""
    task = _task(task)
    device = torch.device(device) if device is not None else device_of(model)
    totals = _Totals()
    with eval_mode(model):
        for x, y in batches:
            x, y = x.to(device), y.to(device)
            output = model(x)
            totals.add(task.loss(output, y).item(), task.examples(y), task.counts(output, y))
    if totals.n == 0:
        raise ValueError("Invalid batches: empty (expected at least one (x, y) pair)")
    return totals.summarize(task)


# -- the step ------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepResult:
    """What a step function reports to :func:`fit`."""

    loss: float  # the batch's mean loss (before the update)
    examples: int  # how many examples that mean is over (Task.examples)
    counts: dict  # the task's sums over the batch (Task.counts)
    # The global gradient norm before any clipping, when the step computed it (clipping
    # does); else None, and fit measures the gradients left in .grad when it logs.
    grad_norm: torch.Tensor | None = None
    stepped: bool = True  # False: the update was skipped, the schedule does not advance


class StatefulStep(abc.ABC):
    """A step function with state of its own that a resumed run needs (a loss scaler's
    scale and its count of clean steps, say): :func:`fit` saves its ``state_dict()`` in
    the checkpoint and loads it back on resume, as it does the optimizer's."""

    @abc.abstractmethod
    def __call__(self, model, optimizer, batch, task: Task) -> StepResult:
        """One step, as :func:`train_step`."""

    @abc.abstractmethod
    def state_dict(self) -> dict:
        """The step's state."""

    @abc.abstractmethod
    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` returned."""


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: tuple[torch.Tensor, torch.Tensor],
    task: Task,
    *,
    clip_grad_norm: float | None = None,
) -> StepResult:
    """One optimizer step on ``batch = (x, y)``: forward, loss, backward, optional clipping of
    the global gradient norm to ``clip_grad_norm`` (Pascanu et al., 2013), ``optimizer.step()``.

    Raises :class:`NonFiniteLossError` before ``backward`` when the loss is NaN or
    infinite, so the parameters never see that gradient. Bind ``clip_grad_norm`` with
    ``functools.partial(train_step, clip_grad_norm=1.0)`` to pass it to :func:`fit`.
    """
    if clip_grad_norm is not None:
        check_positive("clip_grad_norm", clip_grad_norm)
    x, y = batch
    output = model(x)
    loss = task.loss(output, y)
    value = loss.item()
    if not math.isfinite(value):
        raise NonFiniteLossError(value, _lr(optimizer))
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    grad_norm = None
    if clip_grad_norm is not None:
        grad_norm = nn.utils.clip_grad_norm_(model.parameters(), clip_grad_norm)
    optimizer.step()
    return StepResult(value, task.examples(y), task.counts(output.detach(), y), grad_norm)


def _grad_norm(model: nn.Module) -> float | None:
    """The global norm of the gradients the last step left in the parameters' ``.grad``
    (optimizers read them and leave them there); None when there are none."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return float(nn.utils.get_total_norm(grads)) if grads else None


def _lr(optimizer: torch.optim.Optimizer) -> float:
    lr = optimizer.param_groups[0]["lr"]
    return float(lr.item() if torch.is_tensor(lr) else lr)


# -- checkpoints ---------------------------------------------------------------------------


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    # An RNG state must be a CPU tensor; a checkpoint loaded onto a GPU has moved them there.
    torch.set_rng_state(state["torch"].cpu())
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])


class Checkpoint(abc.ABC):
    """Where :func:`fit` saves its state and from where it resumes. :class:`FileCheckpoint`
    is fit's own (one file of the model, optimizer, scheduler, step function, history and
    random states); a run that keeps its state otherwise (the entry point: whole states
    keyed by parameter name, loadable under any parallelism and world size) passes one of
    its own."""

    @abc.abstractmethod
    def save(self, step: int, history: History, elapsed: float) -> None:
        """Save the state after ``step`` steps, with the history and the elapsed time."""

    @abc.abstractmethod
    def restore(self) -> tuple[History, int, float] | None:
        """Load the saved state into the run's parts and return (history, step, elapsed
        time), or None when there is nothing to resume from."""


class FileCheckpoint(Checkpoint):
    """:func:`fit`'s checkpoint: one file (:mod:`lsdl_lab.checkpoint`, format
    :data:`FORMAT`) holding each of ``parts``' ``state_dict()``, the history, the step, the
    elapsed time and the random number generators' states."""

    FORMAT = "lsdl_lab.fit/1"

    def __init__(self, path, parts: dict, device=None):
        self.path, self.parts, self.device = Path(path), parts, device

    def save(self, step: int, history: History, elapsed: float) -> None:
        states = {name: part.state_dict() for name, part in self.parts.items()}
        files.save(
            self.path,
            self.FORMAT,
            **states,
            history=history.state_dict(),
            step=step,
            elapsed=elapsed,
            rng=_rng_state(),
        )

    def restore(self) -> tuple[History, int, float] | None:
        if not self.path.exists():
            return None
        state = files.load(self.path, self.FORMAT, map_location=self.device)
        for name, part in self.parts.items():
            if state.get(name) is None:
                raise ValueError(
                    f"checkpoint {self.path} holds no {name} state, but this run has one; "
                    "resume with the same kind of run that wrote it, or delete it to start "
                    "afresh"
                )
            part.load_state_dict(state[name])
        _set_rng_state(state["rng"])
        return History.from_state_dict(state["history"]), state["step"], state["elapsed"]


def _stateful(model, optimizer, scheduler, step) -> dict:
    """What fit's checkpoint holds besides the history, the step count and the RNG states."""
    parts = {"model": model, "optimizer": optimizer, "scheduler": scheduler}
    if isinstance(step, StatefulStep):
        parts["step_fn"] = step
    return {name: part for name, part in parts.items() if part is not None}


# -- the loop ------------------------------------------------------------------------------


def _total_steps(batches, steps: int | None, epochs: int | None) -> int:
    if not callable(batches):
        raise TypeError(
            f"Invalid batches: a {type(batches).__name__} (expected a function of the step, "
            "such as a lsdl_lab.data.BatchSource)"
        )
    if (steps is None) == (epochs is None):
        raise ValueError("fit() needs exactly one of steps= and epochs=")
    if steps is not None:
        return check_int("steps", steps, 1)
    epochs = check_int("epochs", epochs, 1)
    if not isinstance(batches, BatchSource):
        raise TypeError(
            f"Invalid batches: a {type(batches).__name__} with epochs= (expected a "
            "lsdl_lab.data.BatchSource, which knows its steps_per_epoch; use steps= otherwise)"
        )
    if batches.steps_per_epoch is None:
        raise ValueError(
            f"Invalid batches: a {type(batches).__name__} has no fixed steps_per_epoch "
            "(use steps= instead of epochs=)"
        )
    return epochs * batches.steps_per_epoch


@dataclass(frozen=True)
class _Schedule:
    """How long a run is and when it logs, evaluates and saves (each also after its last
    step)."""

    steps: int
    steps_per_epoch: int | None
    log_every: int
    eval_every: int
    checkpoint_every: int

    @classmethod
    def of(cls, batches, steps, epochs, log_every, eval_every, checkpoint_every) -> _Schedule:
        # capped_steps: the identity except in the dry run of tests/test_gpu_profile.py
        steps = capped_steps(_total_steps(batches, steps, epochs))
        per_epoch = batches.steps_per_epoch if isinstance(batches, BatchSource) else None

        def every(name: str, value: int | None, default: int) -> int:
            return default if value is None else check_int(name, value, 1)

        return cls(
            steps,
            per_epoch,
            every("log_every", log_every, max(1, steps // 100)),
            every("eval_every", eval_every, per_epoch or max(1, steps // 10)),
            every("checkpoint_every", checkpoint_every, steps),
        )

    def due(self, every: int, done: int) -> bool:
        """Whether something done every ``every`` steps is due after ``done`` steps."""
        return done % every == 0 or done == self.steps


def _to_device(batch, device: torch.device) -> tuple:
    return tuple(t.to(device, non_blocking=True) if torch.is_tensor(t) else t for t in batch)


def _log_record(
    window: _Totals,
    task: Task,
    step: int,
    elapsed: float,
    lr: float,
    grad_norm: float | None,
    when: _Schedule,
) -> dict:
    """The training record after ``step``: the window's averages and the step's state."""
    record = {"step": step, "time": elapsed, "lr": lr, "grad_norm": grad_norm}
    if when.steps_per_epoch:
        record["epoch"] = step / when.steps_per_epoch
    record.update(window.summarize(task))
    record.pop("perplexity", None)  # a windowed training perplexity misleads; eval has it
    record["examples"] = window.n
    record["examples_per_s"] = window.n / max(time.perf_counter() - window.start, 1e-9)
    return record


def fit(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    steps: int | None = None,
    *,
    epochs: int | None = None,
    step: Callable[..., StepResult] = train_step,
    task: str | Task = "classification",
    eval_batches: Iterable | None = None,
    eval_every: int | None = None,
    scheduler=None,
    device=None,
    log_every: int | None = None,
    checkpoint: str | os.PathLike | Checkpoint | None = None,
    checkpoint_every: int | None = None,
    resume: bool = False,
    progress: bool = True,
    callback: Callable[[int, History], None] | None = None,
    desc: str | None = None,
    grad_norm: bool = True,
) -> History:
    """Train ``model`` for ``steps`` optimizer steps (or ``epochs`` passes) and return its history.

    ``batches(t)`` returns the batch of step ``t``; ``epochs=`` needs a
    :class:`lsdl_lab.data.BatchSource` with a fixed ``steps_per_epoch``. Each step is
    ``step(model, optimizer, batch, task)`` (default :func:`train_step`), then
    ``scheduler.step()``. Logged training metrics are averages over the last ``log_every``
    steps (default: a hundred records a run); ``eval_batches`` is evaluated every
    ``eval_every`` steps (default: once an epoch, else ten times a run) and after the last
    step. With ``checkpoint`` set (a file path, for a :class:`FileCheckpoint`, or a
    :class:`Checkpoint`), the state is saved every ``checkpoint_every`` steps and at the
    end; ``resume=True`` continues from it when there is one. ``grad_norm=False`` records
    no gradient norm unless the step reports one (measuring it reads every gradient; a
    sharded one, through collectives).
    ``callback(t, history)`` runs after each step (a lab can stop a run early by raising
    from it).
    """
    task = _task(task)
    when = _Schedule.of(batches, steps, epochs, log_every, eval_every, checkpoint_every)
    if checkpoint_every is not None and checkpoint is None:
        raise ValueError("checkpoint_every= needs checkpoint= (a file path or a Checkpoint)")
    if not callable(step):
        raise TypeError(f"Invalid step: a {type(step).__name__} (expected a step function)")
    check_bool("resume", resume)
    check_bool("progress", progress)
    check_bool("grad_norm", grad_norm)

    device = torch.device(device) if device is not None else device_of(model)
    model.to(device)
    history, start, elapsed = History(), 0, 0.0
    if checkpoint is not None and not isinstance(checkpoint, Checkpoint):
        checkpoint = FileCheckpoint(
            checkpoint, _stateful(model, optimizer, scheduler, step), device
        )
    restored = checkpoint.restore() if resume and checkpoint is not None else None
    if restored is not None:
        history, start, elapsed = restored
    model.train()
    window = _Totals()
    bar = tqdm(
        range(start, when.steps),
        initial=start,
        total=when.steps,
        desc=desc or "training",
        disable=not progress,
        leave=False,
    )
    for t in bar:
        t0 = time.perf_counter()
        lr = _lr(optimizer)
        try:
            result = step(model, optimizer, _to_device(batches(t), device), task)
        except NonFiniteLossError as error:
            raise error.at(t) from None
        if scheduler is not None and result.stepped:
            scheduler.step()
        window.add(result.loss, result.examples, result.counts)
        if device.type == "cuda":  # the GPU's work, not only its launch, in the step's time
            torch.cuda.synchronize(device)
        elapsed += time.perf_counter() - t0
        done = t + 1
        if when.due(when.log_every, done):
            norm = float(result.grad_norm) if result.grad_norm is not None else None
            if norm is None and grad_norm:
                norm = _grad_norm(model)
            record = _log_record(window, task, done, elapsed, lr, norm, when)
            history.train.append(record)
            bar.set_postfix(loss=f"{record['loss']:.3f}")
            window = _Totals()
        if eval_batches is not None and when.due(when.eval_every, done):
            metrics = evaluate(model, eval_batches, task, device)
            metrics = {f"eval_{k}": v for k, v in metrics.items()}
            history.eval.append({"step": done, "time": elapsed, **metrics})
        if checkpoint is not None and when.due(when.checkpoint_every, done):
            checkpoint.save(done, history, elapsed)
        if callback is not None:
            callback(done, history)
    bar.close()
    return history
