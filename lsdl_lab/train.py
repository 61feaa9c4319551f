"""One training loop for every lab: ``fit(model, optimizer, batches, steps=...)``.

What it does, in order, at each step ``t``:

1. read the batch ``batches(t)`` (a pure function of the step, see ``lsdl_lab.data``);
2. forward, loss; a non-finite loss stops the run with :class:`NonFiniteLossError`
   naming the step, *before* the bad gradient reaches the parameters;
3. backward, optional gradient clipping, ``optimizer.step()``, ``scheduler.step()``;
4. log (loss, accuracy, learning rate, gradient norm, examples per second, wall time)
   and, every ``eval_every`` steps, evaluate.

Because the batch is a function of the step and the checkpoint holds the model, the
optimizer, the scheduler, the random number generators and the history, a run stopped
and resumed from its checkpoint computes exactly what an uninterrupted run computes
(bit for bit on CPU; tested in ``tests/test_train.py``). Checkpoints are written to a
temporary file and renamed into place, so a run killed while saving never leaves a
half-written checkpoint under the real name.
"""

from __future__ import annotations

import math
import os
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

__all__ = [
    "Classification",
    "History",
    "LanguageModeling",
    "NonFiniteLossError",
    "accuracy",
    "evaluate",
    "fit",
    "load_checkpoint",
    "save_checkpoint",
]


class NonFiniteLossError(FloatingPointError):
    """The loss became NaN or infinite; training on it would corrupt every parameter."""


def accuracy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Fraction of rows of ``output`` (N, K) whose largest logit is the ``target`` class, as a
    0-dimensional float64 tensor (a metric that :mod:`lsdl_lab.landscape` evaluates too)."""
    return (output.argmax(-1) == target).double().mean()


class Classification:
    """Cross-entropy on class logits (N, K); metric: accuracy."""

    name = "classification"

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output, target)

    def counts(self, output, target) -> dict[str, float]:
        """Sums over the batch, so evaluation can average over batches of any size."""
        return {"correct": (output.argmax(-1) == target).sum().item()}

    def summarize(self, loss_sum: float, n: int, counts: dict) -> dict[str, float]:
        return {"loss": loss_sum / n, "accuracy": counts["correct"] / n}


class LanguageModeling:
    """Next-token cross-entropy on logits (B, T, V); metric: perplexity exp(loss)."""

    name = "language_modeling"

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output.flatten(0, -2), target.flatten())

    def counts(self, output, target) -> dict[str, float]:
        return {}

    def summarize(self, loss_sum: float, n: int, counts: dict) -> dict[str, float]:
        loss = loss_sum / n
        return {"loss": loss, "perplexity": math.exp(min(loss, 50.0))}


TASKS = {"classification": Classification, "language_modeling": LanguageModeling}


def _task(task) -> Classification | LanguageModeling:
    if isinstance(task, str):
        if task not in TASKS:
            raise ValueError(f"Invalid task: {task!r}; valid tasks: {', '.join(map(repr, TASKS))}")
        return TASKS[task]()
    return task


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
    """Mean loss and task metric over ``batches`` in evaluation mode (BatchNorm uses its
    running statistics, dropout is off); the model's mode is restored afterwards."""
    task = _task(task)
    device = device or next(model.parameters()).device
    was_training = model.training
    model.eval()
    loss_sum, n, counts = 0.0, 0, {}
    for x, y in batches:
        x, y = x.to(device), y.to(device)
        out = model(x)
        k = y.numel() if isinstance(task, LanguageModeling) else y.shape[0]
        loss_sum += task.loss(out, y).item() * k
        n += k
        for key, v in task.counts(out, y).items():
            counts[key] = counts.get(key, 0) + v
    model.train(was_training)
    if n == 0:
        raise ValueError("evaluate() got no batches")
    return task.summarize(loss_sum, n, counts)


def _grad_norm(params: list[torch.Tensor]) -> float:
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return 0.0
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads))).item()


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(path, **state) -> Path:
    """``torch.save`` to a temporary file beside ``path``, then an atomic rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".part", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def load_checkpoint(path, map_location=None) -> dict:
    path = Path(path)
    try:
        # weights_only=False: the checkpoint holds RNG states and the history (plain
        # Python objects) besides tensors, and is only ever one this loop wrote.
        return torch.load(path, map_location=map_location, weights_only=False)
    except FileNotFoundError:
        raise
    except Exception as e:  # torch.load raises pickle, zip and EOF errors of many kinds
        raise RuntimeError(
            f"checkpoint {path} could not be read ({e}); delete it to start the run afresh"
        ) from e


def fit(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    steps: int | None = None,
    *,
    epochs: int | None = None,
    task="classification",
    eval_batches: Iterable | None = None,
    eval_every: int | None = None,
    scheduler=None,
    device=None,
    log_every: int | None = None,
    clip_grad_norm: float | None = None,
    checkpoint: str | os.PathLike | None = None,
    checkpoint_every: int | None = None,
    resume: bool = False,
    progress: bool = True,
    callback: Callable[[int, History], None] | None = None,
    desc: str | None = None,
) -> History:
    """Train ``model`` for ``steps`` optimizer steps (or ``epochs`` passes) and return its history.

    ``batches(t)`` returns the batch of step ``t``. Logged training metrics are averages
    over the last ``log_every`` steps; ``eval_batches`` is evaluated every ``eval_every``
    steps (default: once an epoch, else ten times a run) and after the last step. With
    ``checkpoint`` set, the state is saved every ``checkpoint_every`` steps and at the end;
    ``resume=True`` continues from that file when it exists. ``callback(t, history)`` runs
    after each step (a lab can stop a run early by raising from it).
    """
    task = _task(task)
    steps_per_epoch = getattr(batches, "steps_per_epoch", None)
    if (steps is None) == (epochs is None):
        raise ValueError("fit() needs exactly one of steps= and epochs=")
    if epochs is not None:
        if steps_per_epoch is None:
            raise ValueError("epochs= needs batches with a steps_per_epoch attribute; use steps=")
        if not isinstance(epochs, int) or epochs < 1:
            raise ValueError(f"Invalid epochs: {epochs!r} (expected an int >= 1)")
        steps = epochs * steps_per_epoch
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"Invalid steps: {steps!r} (expected an int >= 1)")
    if clip_grad_norm is not None and not clip_grad_norm > 0:
        raise ValueError(f"Invalid clip_grad_norm: {clip_grad_norm} (expected > 0 or None)")
    log_every = log_every or max(1, steps // 100)
    eval_every = eval_every or steps_per_epoch or max(1, steps // 10)
    for name, value in (("log_every", log_every), ("eval_every", eval_every)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"Invalid {name}: {value!r} (expected an int >= 1)")
    if checkpoint_every is not None and checkpoint is None:
        raise ValueError("checkpoint_every= needs checkpoint= (a file path)")

    device = torch.device(device) if device is not None else next(model.parameters()).device
    model.to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    history, start, elapsed = History(), 0, 0.0
    if resume and checkpoint is not None and Path(checkpoint).exists():
        state = load_checkpoint(checkpoint, map_location=device)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        if scheduler is not None:
            scheduler.load_state_dict(state["scheduler"])
        history = History.from_state_dict(state["history"])
        start, elapsed = state["step"], state["elapsed"]
        _set_rng_state(state["rng"])

    def save(step: int) -> None:
        save_checkpoint(
            checkpoint,
            model=model.state_dict(),
            optimizer=optimizer.state_dict(),
            scheduler=scheduler.state_dict() if scheduler is not None else None,
            history=history.state_dict(),
            step=step,
            elapsed=elapsed,
            rng=_rng_state(),
        )

    model.train()
    window = {"loss": 0.0, "n": 0, "examples": 0, "counts": {}}
    t_window = time.perf_counter()
    bar = tqdm(
        range(start, steps),
        initial=start,
        total=steps,
        desc=desc or "training",
        disable=not progress,
        leave=False,
    )
    for t in bar:
        t0 = time.perf_counter()
        x, y = batches(t)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        out = model(x)
        loss = task.loss(out, y)
        loss_value = loss.item()
        if not math.isfinite(loss_value):
            raise NonFiniteLossError(
                f"the training loss became {loss_value} at step {t} (lr={_lr(optimizer):.3g}); "
                "the parameters were not updated with it. Lower the learning rate, add warmup "
                "or gradient clipping, or check the data."
            )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        logging = (t + 1) % log_every == 0 or t + 1 == steps
        grad_norm = None
        if clip_grad_norm is not None:
            grad_norm = torch.nn.utils.clip_grad_norm_(params, clip_grad_norm).item()
        elif logging:
            grad_norm = _grad_norm(params)
        lr = _lr(optimizer)
        optimizer.step()
        if scheduler is not None:
            scheduler.step()

        k = y.shape[0]
        window["loss"] += loss_value * k
        window["n"] += k
        window["examples"] += x.shape[0]
        for key, v in task.counts(out.detach(), y).items():
            window["counts"][key] = window["counts"].get(key, 0) + v
        elapsed += time.perf_counter() - t0
        if logging:
            now = time.perf_counter()
            record = {"step": t + 1, "time": elapsed, "lr": lr, "grad_norm": grad_norm}
            if steps_per_epoch:
                record["epoch"] = (t + 1) / steps_per_epoch
            record.update(task.summarize(window["loss"], window["n"], window["counts"]))
            record.pop("perplexity", None)  # a windowed training perplexity misleads; eval has it
            record["examples_per_s"] = window["examples"] / max(now - t_window, 1e-9)
            history.train.append(record)
            bar.set_postfix(loss=f"{record['loss']:.3f}")
            window = {"loss": 0.0, "n": 0, "examples": 0, "counts": {}}
            t_window = now
        if eval_batches is not None and ((t + 1) % eval_every == 0 or t + 1 == steps):
            metrics = evaluate(model, eval_batches, task, device)
            history.eval.append(
                {"step": t + 1, "time": elapsed, **{f"eval_{k}": v for k, v in metrics.items()}}
            )
            model.train()
        if checkpoint is not None and (
            t + 1 == steps or (checkpoint_every and (t + 1) % checkpoint_every == 0)
        ):
            save(t + 1)
        if callback is not None:
            callback(t + 1, history)
    bar.close()
    return history


def _lr(optimizer: torch.optim.Optimizer) -> float:
    lr = optimizer.param_groups[0]["lr"]
    return float(lr.item() if torch.is_tensor(lr) else lr)
