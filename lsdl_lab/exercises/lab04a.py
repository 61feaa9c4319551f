"""Checkers of Lab 4a, the large-batch recipe: the scaling rules and gradual warmup.

The references are the library's own functions (:mod:`lsdl_lab.schedules`), so a student
whose function passes has reproduced what the lab's experiments used. When a function
fails, the checker looks for the usual slips (rules swapped, the ratio upside down, integer
division, a warmup that reaches its peak one step late) and names the one it finds.
"""

from __future__ import annotations

import math

from .. import schedules
from ..check import CheckFailed, check_function, exercise

RULES = ("linear", "sqrt")


def scaled_lr(base_lr: float, base_batch: int, batch: int, rule: str = "linear") -> float:
    r"""The learning rate for ``batch`` from ``base_lr`` tuned at ``base_batch``:
    :math:`\eta_0 B / B_0` by the linear rule (Goyal et al., 2017, Section 2.1) or
    :math:`\eta_0 \sqrt{B / B_0}` by the square-root rule (Krizhevsky, 2014); any other
    ``rule`` is a ``ValueError``."""
    rules = {"linear": schedules.linear_scaling, "sqrt": schedules.sqrt_scaling}
    if rule not in rules:
        raise ValueError(f"Invalid rule: {rule!r} (expected one of {', '.join(map(repr, RULES))})")
    return rules[rule](base_lr, base_batch, batch)


def warmup_lr(step: int, peak_lr: float, warmup_steps: int, start_lr: float = 0.0) -> float:
    r"""Gradual warmup (Goyal et al., 2017, Section 2.2) in the library's convention:

    .. math::
        \eta_t = \eta_s + (\eta_{\text{peak}} - \eta_s)\,\frac{t + 1}{W} \quad (t < W), \qquad
        \eta_t = \eta_{\text{peak}} \quad (t \ge W),

    that is ``peak_lr * schedules.linear_warmup(W, start_lr / peak_lr)(t)``: the first step
    already moves, and step :math:`W - 1` is the first at the peak."""
    return peak_lr * schedules.linear_warmup(warmup_steps, start_lr / peak_lr)(step)


def _call(fn, *args, **kwargs):
    """``fn``'s answer, or None when it raises: diagnostics must never mask the real failure."""
    try:
        return float(fn(*args, **kwargs))
    except Exception:
        return None


def _close(got, expected) -> bool:
    return got is not None and math.isclose(got, expected, rel_tol=1e-6, abs_tol=1e-12)


def _scaled_lr_hints(student_fn) -> list[str]:
    # Goyal et al.'s numbers: 0.1 at 256 examples, scaled to 1024 (k = 4) and to 128 (k = 1/2).
    linear, sqrt = (
        _call(student_fn, 0.1, 256, 1024, "linear"),
        _call(student_fn, 0.1, 256, 1024, "sqrt"),
    )
    hints = []
    if _close(linear, 0.2) and _close(sqrt, 0.4):
        hints.append("the two rules are swapped: linear multiplies by B/B0, sqrt by its root")
    if _close(linear, 0.025) or _close(sqrt, 0.05):
        hints.append("the ratio is upside down: a larger batch gets a larger rate, B/B0")
    if _close(_call(student_fn, 0.1, 256, 128, "linear"), 0.0) or _close(
        _call(student_fn, 0.1, 256, 128, "sqrt"), 0.0
    ):
        hints.append("B // B0 is integer division: 128 // 256 == 0; divide with /")
    if _close(sqrt, 0.1 * 1024**0.5 / 256) or _close(sqrt, 0.1 * 1024**0.5):
        hints.append("the root is of the ratio B/B0, not of B alone")
    return hints


@exercise("lab04a.scaled_lr")
def check_scaled_lr(student_fn) -> None:
    cases = [
        (0.1, 256, 8192, "linear"),  # Goyal et al.: 3.2 at 8k
        (0.1, 256, 8192, "sqrt"),
        (0.1, 256, 256, "linear"),  # k = 1: nothing changes
        (0.1, 256, 256, "sqrt"),
        (0.1, 256, 128, "linear"),  # a smaller batch: the rate shrinks too
        (0.1, 256, 128, "sqrt"),
        (0.04, 16, 1024, "linear"),  # this lab's cpu recipe
        (1e-3, 512, 32_768, "sqrt"),  # an Adam-like rate (You et al. scale LAMB this way)
        (0.1, 128, 1000, "linear"),  # a batch that is no power of two
        {"base_lr": 0.05, "base_batch": 64, "batch": 96},  # the linear rule by default
    ]
    try:
        check_function(student_fn, scaled_lr, cases, name="scaled_lr", rtol=1e-9, atol=0.0)
    except CheckFailed as failure:
        hints = "".join(f"\n  hint: {h}" for h in _scaled_lr_hints(student_fn))
        raise CheckFailed(f"{failure}{hints}") from None
    try:
        got = student_fn(0.1, 256, 1024, "cubic")
    except ValueError:
        pass
    except Exception as exc:
        raise CheckFailed(
            f"scaled_lr(0.1, 256, 1024, rule='cubic') raised {type(exc).__name__}: {exc}\n"
            "  hint: an unknown rule should raise ValueError naming it, as the library does"
        ) from None
    else:
        raise CheckFailed(
            f"scaled_lr(0.1, 256, 1024, rule='cubic') returned {got!r}\n"
            "  hint: an unknown rule should raise ValueError (a typo such as 'lienar' must not "
            "pass silently as one of the rules)"
        )
    print("✔ scaled_lr: both rules equal lsdl_lab.schedules.linear_scaling and sqrt_scaling")


def _warmup_hints(student_fn) -> list[str]:
    hints = []
    first, at_w = _call(student_fn, 0, 1.0, 10), _call(student_fn, 10, 1.0, 10)
    last_of_warmup = _call(student_fn, 9, 1.0, 10)
    if _close(first, 0.0) and _close(last_of_warmup, 0.9) and _close(at_w, 1.0):
        hints.append(
            "your warmup reaches the peak one step late: with the factor t/W, step 0 does not "
            "move at all. The library (like LambdaLR schedules commonly) uses (t + 1)/W, so "
            "the first step already moves and step W - 1 is the first at the peak"
        )
    if _close(_call(student_fn, 0, 1.0, 10, 0.5), 0.1):
        hints.append("start_lr is ignored: the ramp starts from start_lr, not from zero")
    if _close(_call(student_fn, 0, 1.0, 10, 0.5), 0.5 + 0.1):
        hints.append("the ramp adds peak_lr (t+1)/W to start_lr; it should cover peak - start")
    after = _call(student_fn, 25, 1.0, 10)
    if after is not None and not _close(after, 1.0):
        hints.append(f"after the warmup (t >= W) the rate stays at the peak; step 25 gave {after}")
    if _call(student_fn, 3, 0.5, 0) is None:
        hints.append("warmup_steps = 0 means no warmup: return peak_lr (test t >= W first)")
    return hints


@exercise("lab04a.warmup_lr")
def check_warmup_lr(student_fn) -> None:
    cases = [
        (0, 1.0, 10),
        (4, 1.0, 10),
        (9, 1.0, 10),  # the last step of the warmup is at the peak
        (10, 1.0, 10),
        (1000, 1.0, 10),
        (0, 3.2, 780, 0.1),  # Goyal et al.: from 0.1 to 3.2 over 5 epochs of 156 steps
        (389, 3.2, 780, 0.1),
        (779, 3.2, 780, 0.1),
        (780, 3.2, 780, 0.1),
        (0, 2.56, 40, 0.04),  # this lab's cpu recipe at B = 1024
        (0, 0.5, 1, 0.25),  # a one-step warmup is the peak at once
        (3, 0.5, 0),  # no warmup at all
        {"step": 2, "peak_lr": 0.3, "warmup_steps": 5},  # from zero by default
    ]
    try:
        check_function(student_fn, warmup_lr, cases, name="warmup_lr", rtol=1e-9, atol=1e-12)
    except CheckFailed as failure:
        hints = "".join(f"\n  hint: {h}" for h in _warmup_hints(student_fn))
        raise CheckFailed(f"{failure}{hints}") from None
    # The whole of Goyal et al.'s warmup, step by step, against the library's schedule.
    expected = schedules.lr_at(schedules.linear_warmup(780, 1 / 32), 800, base_lr=3.2)
    for t, e in enumerate(expected):
        got = float(student_fn(t, 3.2, 780, 0.1))
        if not math.isclose(got, e, rel_tol=1e-9):
            raise CheckFailed(
                f"warmup_lr matches the reference case by case, but step {t} of Goyal et al.'s "
                f"warmup (0.1 to 3.2 over 780 steps) gave {got}, expected {e}"
            )
    print("✔ warmup_lr: Goyal et al.'s 780-step warmup equals lsdl_lab.schedules.linear_warmup")
