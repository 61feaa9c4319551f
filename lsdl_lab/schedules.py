r"""Learning-rate rules and schedules, and batch-size schedules, for large-batch training.

Two kinds of objects live here.

*Scaling rules* say how the learning rate should grow with the batch size :math:`B`,
from a learning rate :math:`\eta_0` tuned at a batch size :math:`B_0`:

.. math::
    \eta = \eta_0\,\frac{B}{B_0} \quad\text{(linear; Goyal et al., 2017)} \qquad
    \eta = \eta_0\,\sqrt{\frac{B}{B_0}} \quad\text{(square root; Krizhevsky, 2014)}

*Schedules* are plain functions of the step :math:`t = 0, 1, 2, \dots` that return a
factor :math:`f(t)`; the learning rate at step :math:`t` is :math:`\eta\, f(t)`. That is
exactly what :class:`torch.optim.lr_scheduler.LambdaLR` computes, so a schedule plugs in
directly::

    schedule = warmup_then(500, cosine_decay(9_500))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)

Every decay starts at exactly 1 (``decay(0) == 1.0``) and ends at exactly its
``end_factor``, and a warmup's last step is at exactly 1 (each factor is written
:math:`e + (1 - e)\,x` with :math:`x` from 1 to 0, which rounds to the endpoints), so
:func:`warmup_then` is continuous. Decays that know their length carry it as the
attribute ``total_steps``.

Smith, Kindermans, Ying and Le (2018) showed that *increasing the batch size* by a factor
where one would *decay the learning rate* by it reaches the same accuracy in fewer
parameter updates: :func:`batch_size_schedule` does that, and
:class:`lsdl_lab.data.GrowingBatches` reads batches of the sizes it gives.
"""

from __future__ import annotations

import bisect
import math
import numbers
from collections.abc import Callable, Sequence

from ._util import check_int, check_nonnegative, check_positive, check_real

__all__ = [
    "batch_size_schedule",
    "constant",
    "cosine_decay",
    "linear_scaling",
    "linear_warmup",
    "lr_at",
    "polynomial_decay",
    "sqrt_scaling",
    "step_decay",
    "warmup_then",
]

Schedule = Callable[[int], float]


def _milestones(milestones: Sequence[int]) -> list[int]:
    """Steps or epochs at which a step schedule changes: strictly increasing ints >= 1."""
    milestones = list(milestones)
    for m in milestones:
        check_int("milestones", m, 1)
    if any(a >= b for a, b in zip(milestones, milestones[1:])):
        raise ValueError(f"Invalid milestones: {milestones!r} (expected strictly increasing ints)")
    return milestones


# -- scaling rules --------------------------------------------------------------------------


def linear_scaling(base_lr: float, base_batch: int, batch: int) -> float:
    r"""The linear scaling rule :math:`\eta = \eta_0 B / B_0` (Goyal et al., 2017).

    "When the minibatch size is multiplied by k, multiply the learning rate by k": k steps
    of SGD at batch :math:`B_0` then move the weights about as far as one step at
    :math:`kB_0`, as long as the gradient changes little over those k steps. It fails
    early in training (hence warmup) and beyond a critical batch size.
    """
    base_lr = check_nonnegative("base_lr", base_lr)
    return base_lr * check_int("batch", batch, 1) / check_int("base_batch", base_batch, 1)


def sqrt_scaling(base_lr: float, base_batch: int, batch: int) -> float:
    r"""The square-root scaling rule :math:`\eta = \eta_0 \sqrt{B / B_0}`.

    Keeps the variance of the update per example constant (Krizhevsky, 2014, "One weird
    trick"; Hoffer et al., 2017). You et al. (2020) use it for LAMB and other adaptive
    methods, whose normalized updates do not grow linearly with the gradient.
    """
    base_lr = check_nonnegative("base_lr", base_lr)
    ratio = check_int("batch", batch, 1) / check_int("base_batch", base_batch, 1)
    return base_lr * math.sqrt(ratio)


# -- factor schedules (for LambdaLR) --------------------------------------------------------


def constant() -> Schedule:
    """The factor 1 at every step."""

    def factor(t: int) -> float:
        check_int("step", t, 0)
        return 1.0

    return factor


def linear_warmup(warmup_steps: int, start_factor: float = 0.0) -> Schedule:
    r"""Gradual warmup (Goyal et al., 2017): a factor rising linearly to 1, then 1.

    .. math::
        f(t) = s + (1 - s)\,\frac{t + 1}{W} \quad (t < W), \qquad f(t) = 1 \quad (t \ge W)

    With the default :math:`s = 0` the factor is :math:`(t+1)/W`: the first step already
    moves (:math:`1/W`, not 0), and step :math:`W - 1`, the last of the warmup, is the first
    at the full rate. Goyal et al. start from the small-batch rate :math:`\eta_0 = \eta/k`:
    pass ``start_factor=1/k``. ``warmup_steps=0`` means no warmup.
    """
    W = check_int("warmup_steps", warmup_steps, 0)
    s = check_real("start_factor", start_factor, 0.0, 1.0)

    def factor(t: int) -> float:
        t = check_int("step", t, 0)
        return s + (1.0 - s) * ((t + 1) / W) if t < W else 1.0

    return factor


def step_decay(milestones: Sequence[int], gamma: float = 0.1) -> Schedule:
    r"""Multiply the factor by :math:`\gamma` at each milestone: :math:`f(t) = \gamma^{\#\{m_i
    \le t\}}`, as :class:`torch.optim.lr_scheduler.MultiStepLR` does (He et al., 2016 divide
    by 10 at fixed epochs)."""
    milestones = _milestones(milestones)
    gamma = check_real("gamma", gamma, 0.0, 1.0, low_open=True)

    def factor(t: int) -> float:
        return gamma ** bisect.bisect_right(milestones, check_int("step", t, 0))

    return factor


def polynomial_decay(total_steps: int, power: float = 1.0, end_factor: float = 0.0) -> Schedule:
    r"""Polynomial decay from 1 to ``end_factor`` over ``total_steps``, then constant:

    .. math::
        f(t) = e + (1 - e)\left(1 - \frac{\min(t, T)}{T}\right)^p

    :math:`p = 1` is the linear decay LAMB trains BERT with (You et al., 2020); LARS used
    :math:`p = 2` (You et al., 2017).
    """
    T = check_int("total_steps", total_steps, 1)
    p = check_positive("power", power)
    e = check_real("end_factor", end_factor, 0.0, 1.0)

    def factor(t: int) -> float:
        t = min(check_int("step", t, 0), T)
        return e + (1.0 - e) * ((1.0 - t / T) ** p)

    factor.total_steps = T
    return factor


def cosine_decay(total_steps: int, end_factor: float = 0.0) -> Schedule:
    r"""Cosine decay from 1 to ``end_factor`` over ``total_steps``, then constant (SGDR
    without restarts; Loshchilov and Hutter, 2017):

    .. math::
        f(t) = e + (1 - e)\,\frac{1 + \cos(\pi \min(t, T) / T)}{2}
    """
    T = check_int("total_steps", total_steps, 1)
    e = check_real("end_factor", end_factor, 0.0, 1.0)

    def factor(t: int) -> float:
        t = min(check_int("step", t, 0), T)
        return e + (1.0 - e) * (0.5 * (1.0 + math.cos(math.pi * t / T)))

    factor.total_steps = T
    return factor


def warmup_then(
    warmup_steps: int,
    decay: Schedule,
    *,
    start_factor: float = 0.0,
    total_steps: int | None = None,
) -> Schedule:
    r"""Linear warmup (:func:`linear_warmup`) for ``warmup_steps``, then ``decay`` counted
    from the end of warmup: :math:`f(t) = f_{\text{warmup}}(t)` for :math:`t < W` and
    :math:`f(t) = f_{\text{decay}}(t - W)` after.

    The warmup ends at 1 and every decay here starts at 1, so the factor is continuous.
    ``total_steps``, the length of the whole run, is optional: given, it is checked that the
    warmup fits in it and that a decay with a known length fills the rest (the usual
    mistake is ``cosine_decay(total)`` where ``cosine_decay(total - warmup)`` was meant).
    """
    if not callable(decay):
        raise TypeError(f"Invalid decay: {decay!r} (expected a schedule, a function of the step)")
    W = check_int("warmup_steps", warmup_steps, 0)
    warmup = linear_warmup(W, start_factor)
    length = getattr(decay, "total_steps", None)
    if total_steps is not None:
        total = check_int("total_steps", total_steps, 1)
        if W >= total:
            raise ValueError(
                f"Invalid warmup_steps: {W} (expected an int in [0, {total - 1}]: "
                f"the warmup must end before total_steps={total})"
            )
        if length is not None and W + length != total:
            raise ValueError(
                f"Invalid decay: it lasts {length} steps, but total_steps - warmup_steps = "
                f"{total - W} (the decay is counted from the end of warmup)"
            )

    def factor(t: int) -> float:
        t = check_int("step", t, 0)
        return warmup(t) if t < W else decay(t - W)

    factor.total_steps = None if length is None else W + length
    return factor


def lr_at(schedule: Schedule, steps, base_lr: float = 1.0) -> list[float]:
    """``base_lr * schedule(t)`` for each ``t`` in ``steps`` (an int ``n`` means ``range(n)``),
    ready to plot."""
    if isinstance(steps, numbers.Integral) and not isinstance(steps, bool):
        steps = range(check_int("steps", steps, 0))
    return [base_lr * schedule(t) for t in steps]


# -- batch-size schedules -------------------------------------------------------------------


def batch_size_schedule(
    base_batch: int, milestones: Sequence[int], factor: int, max_batch: int | None = None
) -> Callable[[int], int]:
    r"""The batch size as a function of the *epoch* (Smith, Kindermans, Ying and Le, 2018):

    .. math::
        B(e) = \min\!\left(B_0\, k^{\#\{m_i \le e\}},\ B_{\max}\right)

    "Don't decay the learning rate, increase the batch size": where a step schedule would
    divide the learning rate by :math:`k` at epoch :math:`m_i`, multiply the batch size by
    :math:`k` instead. The noise scale of SGD, :math:`\epsilon N / B`, falls the same way,
    with k times fewer parameter updates. Smith et al. decay the learning rate only once
    the batch has reached :math:`B_{\max}`.
    """
    base = check_int("base_batch", base_batch, 1)
    milestones = _milestones(milestones)
    k = check_int("factor", factor, 1)
    cap = check_int("max_batch", max_batch, base) if max_batch is not None else None

    def batch_size(epoch: int) -> int:
        b = base * k ** bisect.bisect_right(milestones, check_int("epoch", epoch, 0))
        return b if cap is None else min(b, cap)

    return batch_size
