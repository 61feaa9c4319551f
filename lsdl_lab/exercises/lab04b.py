"""Checkers of Lab 4b, LAMB and LARS."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable

import torch

from ..check import CheckFailed, check_function, exercise
from ..optim.layerwise import trust_ratio as layerwise_trust_ratio
from ..schedules import polynomial_decay, warmup_then


def trust_ratio(
    weight: torch.Tensor, update: torch.Tensor, clamp: tuple[float, float] | None = None
) -> float:
    r"""LAMB's layer-wise trust ratio (You et al., 2020, Algorithm 2), as
    :class:`lsdl_lab.optim.LAMB` computes it for one parameter tensor:

    .. math::
        \tau = \frac{\phi(\|w\|)}{\|u\|}, \qquad
        \phi(z) = z \ \text{or}\ \min(\max(z, \gamma_l), \gamma_u) \ \text{with clamp}

    and :math:`\tau = 1` when :math:`\|w\| = 0` or :math:`\|u\| = 0`: the library's
    :func:`lsdl_lab.optim.layerwise.trust_ratio` on a single tensor."""
    return layerwise_trust_ratio([weight], [update], clamp)[0]


def warmup_polynomial_lr(
    step: int,
    peak_lr: float,
    warmup_steps: int,
    total_steps: int,
    power: float = 1.0,
    end_lr: float = 0.0,
) -> float:
    r"""The learning rate at ``step`` (0 first) of LAMB's schedule (You et al., 2020, after
    BERT's recipe): linear warmup to ``peak_lr`` over ``warmup_steps``, then polynomial decay to
    ``end_lr`` at ``total_steps``, counted from the end of warmup, then ``end_lr``:

    .. math::
        \eta_t = \eta\,\frac{t + 1}{W} \ (t < W), \qquad
        \eta_t = \eta_e + (\eta - \eta_e)\left(1 - \frac{\min(t - W,\, T - W)}{T - W}\right)^p
        \ (t \ge W)

    which is ``peak_lr * warmup_then(W, polynomial_decay(T - W, p, end_lr / peak_lr))(t)``."""
    if step < warmup_steps:
        return peak_lr * (step + 1) / warmup_steps
    decay_steps = total_steps - warmup_steps
    progress = min(step - warmup_steps, decay_steps) / decay_steps
    return end_lr + (peak_lr - end_lr) * (1.0 - progress) ** power


# -- exercise 1: the trust ratio ---------------------------------------------------------------


def _trust_cases() -> list:
    gen = torch.Generator().manual_seed(41)

    def randn(*shape, scale=1.0, dtype=torch.float32):
        return scale * torch.randn(*shape, generator=gen, dtype=dtype)

    # A weight matrix, a kernel, a vector; small weights next to a large update (an
    # embedding at initialization) and the reverse; both clamp bounds active; the zero
    # conventions (a zero-initialized bias, a zero step, both); float64.
    return [
        (randn(8, 5), randn(8, 5)),
        (randn(4, 3, 3, 3), randn(4, 3, 3, 3, scale=0.1)),
        (randn(16, scale=0.02), randn(16)),
        (randn(6, 6, scale=30.0), randn(6, 6, scale=1e-3)),
        ((randn(5, 5, scale=0.01), randn(5, 5)), {"clamp": (0.5, 10.0)}),
        ((randn(5, 5, scale=50.0), randn(5, 5)), {"clamp": (0.0, 10.0)}),
        ((randn(5, 5), randn(5, 5)), {"clamp": (0.0, math.inf)}),
        (torch.zeros(7), randn(7)),
        (randn(3, 4), torch.zeros(3, 4)),
        (torch.zeros(2, 2), torch.zeros(2, 2)),
        ((torch.zeros(4), randn(4)), {"clamp": (0.5, 10.0)}),
        (randn(3, 3, dtype=torch.float64), randn(3, 3, dtype=torch.float64)),
    ]


def _norms(weight, update):
    return torch.linalg.vector_norm(weight).item(), torch.linalg.vector_norm(update).item()


# Wrong variants a student is likely to write, with the hint each deserves.
_TRUST_MISTAKES: list[tuple[str, Callable]] = [
    (
        "that is ||u|| / ||w||, the ratio upside down: the trust ratio scales the update so "
        "that its norm becomes ||w||, so ||w|| goes on top",
        lambda w, u, clamp=None: _norms(w, u)[1] / _norms(w, u)[0],
    ),
    (
        "with clamp=(lower, upper), phi clips the weight norm ||w|| before the division, not "
        "the ratio after it",
        lambda w, u, clamp=None: min(max(_norms(w, u)[0] / _norms(w, u)[1], clamp[0]), clamp[1]),
    ),
    (
        "clamp=(lower, upper) is ignored: phi(||w||) = min(max(||w||, lower), upper)",
        lambda w, u, clamp=None: _norms(w, u)[0] / _norms(w, u)[1],
    ),
]


def _trust_hint(got, w, u, kwargs) -> str | None:
    w_norm, u_norm = _norms(w, u)
    if w_norm == 0 or u_norm == 0:
        return (
            f"||w|| = {w_norm:g} and ||u|| = {u_norm:g}: when either norm is zero the trust "
            "ratio is 1 by convention (as in lsdl_lab.optim.LAMB, optax and timm); a "
            "zero-initialized bias with tau = ||w|| / ||u|| = 0 would never move"
        )
    for hint, mistake in _TRUST_MISTAKES:
        try:
            wrong = mistake(w, u, **kwargs)
        except (TypeError, ZeroDivisionError):
            continue
        if _is_number(got) and math.isclose(float(got), wrong, rel_tol=1e-4):
            return hint
    return None


def _is_number(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _trust_rollout(student_fn, clamp) -> None:
    """One step of lsdl_lab.optim.LAMB on a small layered model: the trust ratio it
    applied to each tensor (its step over the same step with trust=False, which is AdamW)
    must equal the student's trust_ratio(w, u), with u the untrusted step over -lr."""
    from ..optim import LAMB

    gen = torch.Generator().manual_seed(42)
    # Tensors of very different norms, and a zero one (a zero-initialized bias).
    scales = {(6, 4): 1.0, (4, 4): 0.05, (3, 4): 20.0, (4,): 0.0}
    weights = [
        s * torch.randn(shape, generator=gen, dtype=torch.float64) for shape, s in scales.items()
    ]
    grads = [torch.randn(w.shape, generator=gen, dtype=torch.float64) for w in weights]
    lr = 0.01
    steps = []
    for trust in (True, False):
        params = [w.clone().requires_grad_() for w in weights]
        opt = LAMB(params, lr=lr, weight_decay=0.1, trust=trust, clamp=clamp)
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
        steps.append([w - p.detach() for w, p in zip(weights, params)])
    for i, (w, on, off) in enumerate(zip(weights, *steps)):
        applied = (torch.linalg.vector_norm(on) / torch.linalg.vector_norm(off)).item()
        got = student_fn(w.clone(), off / lr, **({"clamp": clamp} if clamp else {}))
        if not _is_number(got) or not math.isclose(float(got), applied, rel_tol=1e-6):
            raise CheckFailed(
                f"trust_ratio matches the reference case by case, but not lsdl_lab.optim.LAMB "
                f"(clamp={clamp}) on tensor {i} of shape {tuple(w.shape)}: the optimizer "
                f"scaled its step by {applied:.6g}, your trust_ratio(w, u) gives {got!r}"
            )


@exercise("lab04b.trust_ratio")
def check_trust_ratio(student_fn) -> None:
    if not callable(student_fn):
        raise TypeError(f"student_fn must be a function, got {type(student_fn).__name__}")
    # First the mistakes that have a name, with a hint; then check_function for the rest.
    for i, case in enumerate(_trust_cases()):
        (w, u), kwargs = case if isinstance(case[1], dict) else (case, {})
        expected = trust_ratio(w, u, **kwargs)
        zero = 0.0 in _norms(w, u)
        try:
            got = student_fn(w.clone(), u.clone(), **kwargs)
        except NotImplementedError:
            break  # check_function tells a stub from an error
        except Exception as exc:
            if not zero:
                break
            got = f"{type(exc).__name__}: {exc}"
        if _is_number(got) and math.isclose(float(got), expected, rel_tol=1e-5):
            continue
        hint = _trust_hint(got, w, u, kwargs)
        if hint is None:
            break
        shown = "".join(f", {k}={v}" for k, v in kwargs.items())
        raise CheckFailed(
            f"trust_ratio does not match the reference on case {i + 1}: weight of shape "
            f"{tuple(w.shape)}, update of shape {tuple(u.shape)}{shown}\n"
            f"  got {got!r}, expected {expected:.6g}\n  hint: {hint}"
        )
    check_function(student_fn, trust_ratio, _trust_cases())
    _trust_rollout(student_fn, None)
    _trust_rollout(student_fn, (0.5, 10.0))
    print("✔ trust_ratio: equals the ratio lsdl_lab.optim.LAMB applies, with and without clamp")


# -- exercise 2: warmup, then polynomial decay -----------------------------------------------

# (peak_lr, warmup_steps, total_steps, power, end_lr): LAMB's linear decay, a longer warmup,
# no warmup at all, a warmup that ends one step before the end, powers 2 (LARS) and 0.5,
# and a floor end_lr > 0.
_SCHEDULE_CONFIGS = [
    (1e-3, 10, 100, 1.0, 0.0),
    (0.02, 25, 60, 1.0, 0.0),
    (5.0, 0, 30, 1.0, 0.0),
    (0.1, 9, 10, 1.0, 0.0),
    (2.0, 5, 40, 2.0, 0.0),
    (0.3, 4, 25, 0.5, 0.0),
    (1e-3, 8, 50, 1.0, 1e-4),
]

# Wrong variants: each is (hint, rule(t, peak, W, T, p, e)).
_SCHEDULE_MISTAKES: list[tuple[str, Callable]] = [
    (
        "the warmup starts one step late: step t of the warmup (t = 0 first) has rate "
        "peak_lr * (t + 1) / warmup_steps, so that the first step already moves and step "
        "warmup_steps - 1 is the first at the peak (lsdl_lab.schedules.linear_warmup)",
        lambda t, lr, W, T, p, e: lr * t / W if t < W else None,
    ),
    (
        "the decay is counted from step 0 (BERT's TensorFlow code does that, so its rate "
        "never quite reaches peak_lr); here it is counted from the end of warmup: "
        "progress = (t - warmup_steps) / (total_steps - warmup_steps)",
        lambda t, lr, W, T, p, e: e + (lr - e) * (1 - min(t, T) / T) ** p if t >= W else None,
    ),
    (
        "after total_steps the rate must stay at end_lr: clip the progress at 1 "
        "(min(t - warmup_steps, total_steps - warmup_steps))",
        lambda t, lr, W, T, p, e: e + (lr - e) * (1 - (t - W) / (T - W)) ** p if t > T else None,
    ),
    (
        "the decay ends at end_lr, not at 0: the rate is end_lr + (peak_lr - end_lr) x^power",
        lambda t, lr, W, T, p, e: lr * (1 - min(t - W, T - W) / (T - W)) ** p if t >= W else None,
    ),
    (
        "the power applies to the remaining fraction, (1 - progress)^power, not to the "
        "progress: 1 - progress^power decays differently for power != 1",
        lambda t, lr, W, T, p, e: (
            e + (lr - e) * (1 - (min(t - W, T - W) / (T - W)) ** p) if t >= W else None
        ),
    ),
]


def _real_or_none(rule: Callable, *args) -> float | None:
    """The value of a wrong rule, or None where the rule does not apply (it returns None
    there) or has no real value (a negative number to a fractional power)."""
    try:
        value = rule(*args)
    except (ZeroDivisionError, ValueError):
        return None
    return value if _is_number(value) else None


def _schedule_reference(t, lr, W, T, p, e) -> float:
    """The library's own rule, the one the book uses everywhere."""
    return lr * warmup_then(W, polynomial_decay(T - W, p, e / lr), total_steps=T)(t)


@exercise("lab04b.warmup_polynomial_lr")
def check_warmup_polynomial_lr(student_fn) -> None:
    if not callable(student_fn):
        raise TypeError(f"student_fn must be a function, got {type(student_fn).__name__}")
    n = 0
    for config in _SCHEDULE_CONFIGS:
        lr, W, T, p, e = config
        for t in range(T + 3):  # every step, and a few past the end
            expected = _schedule_reference(t, *config)
            args = (
                f"step={t}, peak_lr={lr}, warmup_steps={W}, total_steps={T}, power={p}, end_lr={e}"
            )
            try:
                got = student_fn(t, lr, W, T, power=p, end_lr=e)
            except NotImplementedError:
                # A clean message: the student needs the instruction, not the stack.
                raise NotImplementedError(
                    "warmup_polynomial_lr is not implemented yet: replace the "
                    "`raise NotImplementedError` line with your solution"
                ) from None
            except Exception as exc:
                raise CheckFailed(
                    f"warmup_polynomial_lr({args}) raised {type(exc).__name__}: {exc}"
                ) from exc
            if isinstance(got, torch.Tensor) and got.numel() == 1:
                raise CheckFailed(
                    f"warmup_polynomial_lr({args}) returned a tensor; return a float "
                    f"(hint: .item())"
                )
            if not _is_number(got):
                raise CheckFailed(
                    f"warmup_polynomial_lr({args}) returned {got!r}, expected a number"
                )
            n += 1
            if math.isclose(float(got), expected, rel_tol=1e-6, abs_tol=1e-12):
                continue
            where = "in the warmup" if t < W else ("in the decay" if t <= T else "past total_steps")
            message = (
                f"warmup_polynomial_lr({args}) returned {float(got):.6g}, expected "
                f"{expected:.6g} (step {t} is {where})"
            )
            for hint, mistake in _SCHEDULE_MISTAKES:
                wrong = _real_or_none(mistake, t, *config)
                if wrong is not None and math.isclose(float(got), wrong, rel_tol=1e-6):
                    message += f"\n  hint: {hint}"
                    break
            raise CheckFailed(message)
    print(
        f"✔ warmup_polynomial_lr: all {n} steps of {len(_SCHEDULE_CONFIGS)} schedules equal "
        "lsdl_lab.schedules.warmup_then(W, polynomial_decay(T - W, power, end_lr / peak_lr))"
    )
