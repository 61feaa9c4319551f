r"""Races of optimizers: loss against steps and against wall-clock, and what each one keeps.

A second-order method is judged on three clocks at once (Chapter 6): the *steps* it needs
to reach a loss (where curvature helps), the *seconds* those steps take (where its extra
work per step costs), and the *bytes* of state it keeps beside the weights (its
preconditioners). :func:`race` trains one fresh model per optimizer on the same batches
and records all three; :class:`Run` answers "how many steps, how many seconds to a target
loss" and "how many bytes per parameter".

Every optimizer of the book steps here, whatever its protocol:

* first-order ones and Shampoo: ``loss.backward(); opt.step()``;
* :class:`~lsdl_lab.optim.KFAC`: ``opt.backward(loss)`` (its sampled-label pass for the
  true Fisher) then ``opt.step()``;
* :class:`~lsdl_lab.optim.Newton` and :class:`~lsdl_lab.optim.HessianFree`:
  ``opt.step(closure)`` with a closure returning ``(loss, outputs)`` with their graph
  (Newton reads the loss, HF the outputs too).

A run is :func:`lsdl_lab.train.fit` (the one loop) with a step function of this module,
:class:`TimedStep`, which steps by the optimizer's protocol and times it: around the
forward pass, the backward pass and the update (``time.perf_counter``; on CUDA after a
synchronization), and the update alone (``opt.step``) separately, so the cost of a
preconditioner refresh can be read off the steps on which it happens. Evaluating the
loss that is compared with the target (after the step, in fit's callback) is not timed.
In a dry run (:mod:`lsdl_lab.profiles`) fit caps the steps.

A run may follow a learning-rate schedule (a factor of the step, :mod:`lsdl_lab.schedules`,
applied by ``LambdaLR``), and an optimizer with two points, like
:class:`~lsdl_lab.optim.ScheduleFreeAdamW`, is evaluated at its average (``eval()``, then
``train()`` again). :func:`modern_optimizers` holds the race of 2026 (AdamW, Muon, SOAP,
Shampoo and schedule-free AdamW, each with its paper's hyperparameters; Muon on convolution
kernels too, so that a ResNet races as a GPT does), and
:func:`sweep` the short learning-rate sweep that gives AdamW its best one.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from .. import optim, schedules
from .._util import check_int, check_real, eval_mode
from ..memory.measure import measure
from ..optim.second_order import SecondOrderOptimizer
from ..train import LossFunction, StepResult, fit

__all__ = [
    "SCHEDULE_FREE",
    "SWEPT",
    "ModernRace",
    "Run",
    "TimedStep",
    "modern_optimizers",
    "modern_race",
    "race",
    "relative_cost",
    "state_bytes",
    "sweep",
    "train_run",
    "warmup_cosine",
]


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """The bytes of every tensor in ``optimizer.state`` (nested in lists, tuples or dicts
    too, as Shampoo's per-block statistics are): the optimizer's memory beside the weights
    and their gradients, as :func:`lsdl_lab.memory.measure` counts it (each storage once,
    none that a parameter or a gradient holds). Step counters kept as Python numbers count
    nothing."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"Invalid optimizer: a {type(optimizer).__name__} (expected a torch.optim.Optimizer)"
        )
    # measure() reads the parameters from a module; these are the optimizer's own, once each.
    params = {id(p): p for group in optimizer.param_groups for p in group["params"]}
    return measure(nn.ParameterList(params.values()), optimizer)["optimizer_state"]


@dataclass
class Run:
    """One optimizer's run: after step ``t`` (``t = 1 .. steps``) the evaluated loss
    ``losses[t - 1]``, the training seconds so far ``seconds[t - 1]`` and the seconds of
    that step's update alone ``update_seconds[t - 1]``; the optimizer's ``state_bytes`` at
    the end, and the model's ``num_parameters``. ``losses[t - 1]`` is NaN on the steps
    that were not evaluated; a run that diverged stops early (``diverged``)."""

    name: str
    num_parameters: int
    losses: list[float] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    update_seconds: list[float] = field(default_factory=list)
    state_bytes: int = 0
    diverged: bool = False

    @property
    def steps(self) -> int:
        return len(self.seconds)

    @property
    def bytes_per_parameter(self) -> float:
        """The optimizer's state in bytes per parameter of the model (Adam in float32: 8)."""
        return self.state_bytes / self.num_parameters

    def steps_to(self, target: float) -> int | None:
        """The first step after which the evaluated loss is at most ``target`` (None: never)."""
        for t, loss in enumerate(self.losses, 1):
            if loss <= target:
                return t
        return None

    def seconds_to(self, target: float) -> float | None:
        """The training seconds until the loss first reached ``target`` (None: never)."""
        t = self.steps_to(target)
        return None if t is None else self.seconds[t - 1]

    def final_loss(self) -> float:
        """The last evaluated loss (infinity when the run diverged)."""
        if self.diverged:
            return math.inf
        evaluated = [x for x in self.losses if not math.isnan(x)]
        return evaluated[-1] if evaluated else math.nan

    def loss_at_seconds(self, budget: float) -> float:
        """The last loss evaluated within ``budget`` training seconds (NaN: none was; the
        run's final loss when it diverged after the budget, infinity when before)."""
        check_real("budget", budget, 0.0)
        within = [x for x, s in zip(self.losses, self.seconds) if s <= budget]
        if self.diverged and len(within) == len(self.seconds):
            return math.inf
        evaluated = [x for x in within if not math.isnan(x)]
        return evaluated[-1] if evaluated else math.nan


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class TimedStep:
    """:func:`lsdl_lab.train.fit`'s step for a race: one step of the optimizer's protocol
    (see the module's docstring), its seconds and its update's seconds appended to
    ``run`` (the training seconds so far, and the update's alone); the batch's loss, before
    the update, is what fit logs and what :attr:`loss` keeps."""

    def __init__(self, run: Run, device: torch.device):
        self.run, self.device = run, device
        self.elapsed = 0.0
        self.loss = math.nan

    def __call__(self, model, optimizer, batch, task) -> StepResult:
        x, y = batch
        _sync(self.device)
        start = time.perf_counter()
        if isinstance(optimizer, SecondOrderOptimizer):

            def closure():
                out = model(x)
                return task.loss(out, y), out

            update_start = start
            loss = optimizer.step(closure)
        else:
            optimizer.zero_grad(set_to_none=True)
            loss = task.loss(model(x), y)
            getattr(optimizer, "backward", torch.Tensor.backward)(loss)  # K-FAC's own
            _sync(self.device)
            update_start = time.perf_counter()
            optimizer.step()
        _sync(self.device)
        end = time.perf_counter()
        self.elapsed += end - start
        self.run.seconds.append(self.elapsed)
        self.run.update_seconds.append(end - update_start)
        self.loss = float(loss.detach())
        return StepResult(self.loss, task.examples(y), {})


class _Diverged(Exception):
    """Raised from fit's callback to end a run whose loss is no longer finite."""


@contextlib.contextmanager
def _evaluation_point(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """The parameters at the point an optimizer with two of them evaluates (schedule-free's
    average: its ``eval()``), and back at its training point after (``train()``)."""
    two_points = callable(getattr(optimizer, "eval", None)) and callable(
        getattr(optimizer, "train", None)
    )
    if two_points:
        optimizer.eval()
    try:
        yield
    finally:
        if two_points:
            optimizer.train()


def train_run(
    name: str,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Callable[[int], tuple[Tensor, Tensor]],
    steps: int,
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    evaluate: Callable[[nn.Module], float] | None = None,
    eval_every: int = 1,
    progress: bool = True,
    schedule: Callable[[int], float] | None = None,
) -> Run:
    """Train ``model`` with ``optimizer`` for ``steps`` steps on ``batches(t)`` (``t = 0,
    1, ...``) and record a :class:`Run`: :func:`lsdl_lab.train.fit` with a
    :class:`TimedStep`. ``evaluate(model)`` gives the loss compared with targets (default:
    the training batch's loss before the step, as most training loops log); it runs in
    evaluation mode, without gradients, every ``eval_every`` steps and after the last, at
    the optimizer's evaluation point (schedule-free's average). A loss that is not finite
    ends the run (``diverged``). ``progress`` shows a bar of the steps. ``schedule``, a
    factor of the step, scales every group's learning rate (``LambdaLR``, stepped by fit
    after each step; not timed)."""
    steps = check_int("steps", steps, 1)
    eval_every = check_int("eval_every", eval_every, 1)
    if schedule is not None and not callable(schedule):
        raise TypeError(
            f"Invalid schedule: {schedule!r} (expected a function of the step, or None)"
        )
    params = [p for group in optimizer.param_groups for p in group["params"]]
    device = params[0].device if params else torch.device("cpu")
    run = Run(name, sum(p.numel() for p in model.parameters() if p.requires_grad))
    step = TimedStep(run, device)
    scheduler = None if schedule is None else torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)

    def evaluated() -> float:
        with eval_mode(model), torch.no_grad(), _evaluation_point(optimizer):
            return float(evaluate(model))

    def after_step(done: int, _history) -> None:
        due = evaluate is not None and done % eval_every == 0
        value = evaluated() if due else (step.loss if evaluate is None else math.nan)
        run.losses.append(value)
        if not math.isfinite(step.loss) or (due and not math.isfinite(value)):
            raise _Diverged

    try:
        fit(
            model,
            optimizer,
            batches,
            steps,
            step=step,
            task=LossFunction(loss_fn),
            scheduler=scheduler,
            device=device,
            progress=progress,
            callback=after_step,
            desc=name,
            grad_norm=False,
        )
    except _Diverged:
        run.diverged = True
    if evaluate is not None and not run.diverged and run.steps % eval_every:
        # after the last step fit ran (fewer than steps in a dry run), if not evaluated yet
        run.losses[-1] = evaluated()
        run.diverged = not math.isfinite(run.losses[-1])
    run.state_bytes = state_bytes(optimizer)
    return run


def race(
    make_model: Callable[[], nn.Module],
    optimizers: Mapping[str, Callable[[nn.Module], torch.optim.Optimizer]],
    batches: Callable[[int], tuple[Tensor, Tensor]],
    steps: int,
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    evaluate: Callable[[nn.Module], float] | None = None,
    eval_every: int = 1,
    progress: Callable[[Iterable], Iterable] | None = None,
    schedules: Mapping[str, Callable[[int], float]] | None = None,
) -> dict[str, Run]:
    """One :func:`train_run` per optimizer, each on a fresh ``make_model()`` (which should
    seed itself, so that every optimizer starts from the same weights) and the same
    ``batches``. ``optimizers`` maps a name to a function of the model that builds the
    optimizer (K-FAC takes the model, the others its parameters). ``progress`` wraps the
    names (``tqdm.auto.tqdm``, say). ``schedules`` maps some of the names to their
    learning-rate schedules (the others keep a constant rate)."""
    if not isinstance(optimizers, Mapping) or not optimizers:
        raise ValueError(
            f"Invalid optimizers: {optimizers!r} (expected a non-empty mapping from names to "
            "functions of the model)"
        )
    schedules = dict(schedules or {})
    if set(schedules) - set(optimizers):
        raise ValueError(
            f"Invalid schedules: names {sorted(set(schedules) - set(optimizers))} (expected "
            f"some of the optimizers' names {list(optimizers)})"
        )
    names = list(optimizers)
    runs = {}
    for name in progress(names) if progress is not None else names:
        model = make_model()
        runs[name] = train_run(
            name, model, optimizers[name](model), batches, steps, loss_fn, evaluate, eval_every,
            schedule=schedules.get(name),
        )  # fmt: skip
    return runs


def sweep(
    make_model: Callable[[], nn.Module],
    make_optimizer: Callable[[nn.Module, float], torch.optim.Optimizer],
    lrs: Sequence[float],
    batches: Callable[[int], tuple[Tensor, Tensor]],
    steps: int,
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    evaluate: Callable[[nn.Module], float] | None = None,
    eval_every: int = 1,
    schedule: Callable[[int], float] | None = None,
) -> tuple[float, dict[float, Run]]:
    """A learning-rate sweep: one :func:`race` entry per rate in ``lrs`` (``make_optimizer(
    model, lr)``), all on the same schedule; returns the rate whose run ended lowest
    (:meth:`Run.final_loss`; a diverged run never wins) and every run by rate."""
    lrs = [check_real("lrs", lr, 0.0, low_open=True) for lr in lrs]
    if not lrs:
        raise ValueError("Invalid lrs: [] (expected at least one learning rate)")
    names = {lr: f"lr={lr:g}" for lr in lrs}
    runs = race(
        make_model,
        {names[lr]: (lambda model, lr=lr: make_optimizer(model, lr)) for lr in lrs},
        batches, steps, loss_fn, evaluate, eval_every,
        schedules=None if schedule is None else {name: schedule for name in names.values()},
    )  # fmt: skip
    by_lr = {lr: runs[names[lr]] for lr in lrs}
    return min(lrs, key=lambda lr: by_lr[lr].final_loss()), by_lr


def warmup_cosine(steps: int, warmup: int) -> Callable[[int], float]:
    """AdamW's usual schedule for a run of ``steps``: linear warmup over ``warmup`` steps,
    then a cosine decay to zero over the rest (:func:`lsdl_lab.schedules.warmup_then`)."""
    steps = check_int("steps", steps, 1)
    warmup = check_int("warmup", warmup, 0, steps - 1)
    return schedules.warmup_then(warmup, schedules.cosine_decay(steps - warmup), total_steps=steps)


#: the one contender of :func:`modern_optimizers` that runs without a schedule
SCHEDULE_FREE = "schedule-free AdamW"
#: the contenders whose learning rate :func:`modern_race` sweeps
SWEPT = ("AdamW", "SOAP")


def modern_optimizers(
    adamw_lr: float,
    soap_lr: float,
    warmup: int,
    betas: tuple[float, float] = (0.9, 0.95),
    weight_decay: float = 0.1,
) -> dict[str, Callable[[nn.Module], torch.optim.Optimizer]]:
    """The race of 2026, name to a function of the model building the optimizer, each with
    its paper's hyperparameters, scaled as its docstring says:

    * ``"AdamW"``: ``adamw_lr``, ``betas`` and ``weight_decay`` (nanoGPT's and most
      language models' 0.9, 0.95 and 0.1);
    * ``"Muon"``: the same rate and decay (Liu et al.'s shape scaling makes AdamW's carry
      over), momentum 0.95 with Nesterov and five Newton–Schulz steps (Jordan et al.), on
      the hidden matrices and the convolution kernels, viewed as out × (in·kh·kw) as in
      Jordan et al.'s CIFAR-10 runs (:func:`~lsdl_lab.optim.muon_param_groups` with
      ``conv=True``; a GPT has no kernels); its AdamW groups take ``betas``;
    * ``"SOAP"``: ``soap_lr``, and the authors' other defaults (``betas=(0.95, 0.95)``,
      weight decay 0.01, eigenbases every 10 steps); a kernel gets a basis per dimension
      (out, in, kh and kw: SOAP's merging of dimensions is not offered);
    * ``"Shampoo"``: Adagrad grafting at ``lr=0.03`` (the rate Lab 6 measured best for the
      GPT), roots every 10 steps; a kernel gets a statistic and a root per dimension;
    * :data:`SCHEDULE_FREE`: ``adamw_lr`` with ``betas``, and the same ``warmup`` as its
      only schedule (Defazio et al.: a rate like the scheduled AdamW's).

    Every one but schedule-free is meant to run under :func:`warmup_cosine`.
    """
    adamw_lr = check_real("adamw_lr", adamw_lr, 0.0, low_open=True)
    soap_lr = check_real("soap_lr", soap_lr, 0.0, low_open=True)
    warmup = check_int("warmup", warmup, 0)
    return {
        "AdamW": lambda m: optim.AdamW(m.parameters(), lr=adamw_lr, betas=betas,
                                       weight_decay=weight_decay),
        "Muon": lambda m: optim.Muon(optim.muon_param_groups(m, conv=True, betas=betas),
                                     lr=adamw_lr, weight_decay=weight_decay),
        "SOAP": lambda m: optim.SOAP(m.parameters(), lr=soap_lr),
        "Shampoo": lambda m: optim.Shampoo(m.parameters(), lr=0.03, update_freq=10),
        SCHEDULE_FREE: lambda m: optim.ScheduleFreeAdamW(m.parameters(), lr=adamw_lr,
                                                         betas=betas, warmup_steps=warmup),
    }  # fmt: skip


@dataclass
class ModernRace:
    """The result of :func:`modern_race`: one :class:`Run` per contender (``runs``, in
    :func:`modern_optimizers`' order), the learning rate each swept contender got
    (``lr``) and every run of its sweep (``sweeps``, by rate)."""

    runs: dict[str, Run]
    lr: dict[str, float]
    sweeps: dict[str, dict[float, Run]]


def modern_race(
    make_model: Callable[[], nn.Module],
    batches: Callable[[int], tuple[Tensor, Tensor]],
    steps: int,
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    evaluate: Callable[[nn.Module], float] | None = None,
    eval_every: int = 1,
    lrs: Sequence[float] = (3e-3, 1e-2, 3e-2),
    warmup: int | None = None,
    progress: Callable[[Iterable], Iterable] | None = None,
) -> ModernRace:
    """The race of 2026 (:func:`modern_optimizers`) at equal steps, on the same batches from
    the same weights. AdamW and SOAP each get the best of a :func:`sweep` over ``lrs`` (the
    sweep's best run is the race's run), under :func:`warmup_cosine` with ``warmup`` steps
    (default: a tenth of the run); Muon and schedule-free AdamW then take AdamW's best rate,
    Muon and Shampoo its schedule."""
    steps = check_int("steps", steps, 1)
    warmup = steps // 10 if warmup is None else check_int("warmup", warmup, 0, steps - 1)
    schedule = warmup_cosine(steps, warmup)
    lr, sweeps = {}, {}
    for name in SWEPT:
        lr[name], sweeps[name] = sweep(
            make_model,
            lambda model, rate, name=name: modern_optimizers(rate, rate, warmup)[name](model),
            lrs, batches, steps, loss_fn, evaluate, eval_every, schedule,
        )  # fmt: skip
    contenders = modern_optimizers(lr["AdamW"], lr["SOAP"], warmup)
    rest = {name: make for name, make in contenders.items() if name not in SWEPT}
    ran = race(
        make_model, rest, batches, steps, loss_fn, evaluate, eval_every, progress,
        schedules={name: schedule for name in rest if name != SCHEDULE_FREE},
    )  # fmt: skip
    runs = {}
    for name in contenders:
        runs[name] = sweeps[name][lr[name]] if name in SWEPT else ran[name]
        runs[name].name = name
    return ModernRace(runs, lr, sweeps)


def _median_step_seconds(run: Run) -> float:
    # the median, not the mean: the runs of a race follow one another, and a burst of
    # another process's work during one run would otherwise weigh on that run alone
    return statistics.median(b - a for a, b in zip([0.0, *run.seconds], run.seconds))


def relative_cost(runs: Mapping[str, Run], baseline: str, target: float) -> dict[str, dict]:
    """For each run, its steps and seconds to ``target`` divided by ``baseline``'s (None
    where either run never reached it), and its median seconds per step relative to the
    baseline's (an optimizer that refreshes a preconditioner every k > 2 steps is then
    priced at its ordinary step)."""
    check_real("target", target)
    if baseline not in runs:
        raise ValueError(f"Invalid baseline: {baseline!r} (expected one of {list(runs)})")
    base = runs[baseline]
    out = {}
    for name, run in runs.items():
        s, b = run.steps_to(target), base.steps_to(target)
        ts, tb = run.seconds_to(target), base.seconds_to(target)
        out[name] = dict(
            steps=None if s is None or b is None else s / b,
            seconds=None if ts is None or tb is None else ts / tb,
            per_step=_median_step_seconds(run) / _median_step_seconds(base),
        )
    return out
