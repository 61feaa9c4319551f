"""The checkers of Lab 4b accept the reference solutions and reject the usual mistakes, each
with the hint that names it."""

from __future__ import annotations

import math

import pytest
import torch

from lsdl_lab import check, schedules
from lsdl_lab.check import CheckFailed
from lsdl_lab.exercises import lab04b
from lsdl_lab.optim import LAMB


def check_trust(fn):
    check.checker("lab04b.trust_ratio")(fn)


def check_schedule(fn):
    check.checker("lab04b.warmup_polynomial_lr")(fn)


# -- the references ----------------------------------------------------------------------------


def test_the_checkers_accept_the_references(capsys):
    check_trust(lab04b.trust_ratio)
    check_schedule(lab04b.warmup_polynomial_lr)
    assert capsys.readouterr().out.count("✔") == 3


@pytest.mark.parametrize("clamp", [None, (0.5, 10.0)])
def test_trust_ratio_is_the_ratio_lamb_applies(clamp):
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(5, 3, generator=gen, dtype=torch.float64) * s for s in (0.01, 1, 50)]
    weights.append(torch.zeros(4, dtype=torch.float64))
    grads = [torch.randn(w.shape, generator=gen, dtype=torch.float64) for w in weights]
    steps = {}
    for trust in (True, False):
        params = [w.clone().requires_grad_() for w in weights]
        opt = LAMB(params, lr=0.1, weight_decay=0.01, trust=trust, clamp=clamp)
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        opt.step()
        steps[trust] = [w - p.detach() for w, p in zip(weights, params, strict=True)]
    for w, on, off in zip(weights, steps[True], steps[False], strict=True):
        tau = lab04b.trust_ratio(w, off / 0.1, clamp=clamp)
        assert math.isclose(tau, (on.norm() / off.norm()).item(), rel_tol=1e-9)


def test_warmup_polynomial_lr_is_the_library_schedule():
    for peak, W, T, p, end in [(0.5, 7, 31, 1.0, 0.0), (2.0, 0, 12, 2.0, 0.1), (1.0, 3, 4, 0.5, 0)]:
        rule = schedules.warmup_then(W, schedules.polynomial_decay(T - W, p, end / peak))
        for t in range(T + 5):
            expected = peak * rule(t)
            assert math.isclose(lab04b.warmup_polynomial_lr(t, peak, W, T, p, end), expected)


# -- trust ratio mistakes ----------------------------------------------------------------------


def _norms(w, u, clamp):
    w_norm, u_norm = w.norm(), u.norm()
    return (w_norm.clamp(*clamp) if clamp else w_norm), u_norm


def upside_down(weight, update, clamp=None):
    return (update.norm() / weight.norm()).item()


def no_zero_convention(weight, update, clamp=None):
    phi, u_norm = _norms(weight, update, clamp)
    return (phi / u_norm).item()


def clamps_the_ratio(weight, update, clamp=None):
    if weight.norm() == 0 or update.norm() == 0:
        return 1.0
    ratio = (weight.norm() / update.norm()).item()
    return min(max(ratio, clamp[0]), clamp[1]) if clamp else ratio


def ignores_clamp(weight, update, clamp=None):
    return lab04b.trust_ratio(weight, update)


def divides_python_floats(weight, update, clamp=None):
    phi, u_norm = _norms(weight, update, clamp)
    return 1.0 if weight.norm() == 0 else phi.item() / u_norm.item()


def returns_a_tensor(weight, update, clamp=None):
    return torch.tensor(lab04b.trust_ratio(weight, update, clamp))


@pytest.mark.parametrize(
    "wrong, words",
    [
        (upside_down, "upside down"),
        (no_zero_convention, "ratio is 1 by convention"),
        (divides_python_floats, "ratio is 1 by convention"),
        (clamps_the_ratio, "clips the weight norm"),
        (ignores_clamp, "is ignored"),
        (returns_a_tensor, ".item()"),
    ],
)
def test_trust_ratio_mistakes_get_their_hint(wrong, words):
    with pytest.raises(CheckFailed) as info:
        check_trust(wrong)
    assert words in str(info.value)


def test_stubs_are_reported_as_not_implemented():
    def trust_ratio(weight, update, clamp=None):
        raise NotImplementedError("Exercise: write your solution here")

    def warmup_polynomial_lr(step, peak_lr, warmup_steps, total_steps, power=1.0, end_lr=0.0):
        raise NotImplementedError("Exercise: write your solution here")

    with pytest.raises(NotImplementedError, match="not implemented yet"):
        check_trust(trust_ratio)
    with pytest.raises(NotImplementedError, match="not implemented yet"):
        check_schedule(warmup_polynomial_lr)


# -- schedule mistakes -------------------------------------------------------------------------


def right(step, peak_lr, warmup_steps, total_steps, power=1.0, end_lr=0.0):
    return lab04b.warmup_polynomial_lr(step, peak_lr, warmup_steps, total_steps, power, end_lr)


def warmup_from_zero(step, peak_lr, warmup_steps, total_steps, power=1.0, end_lr=0.0):
    if step < warmup_steps:
        return peak_lr * step / warmup_steps
    return right(step, peak_lr, warmup_steps, total_steps, power, end_lr)


def decay_from_step_zero(step, peak_lr, warmup_steps, total_steps, power=1.0, end_lr=0.0):
    if step < warmup_steps:
        return peak_lr * (step + 1) / warmup_steps
    return end_lr + (peak_lr - end_lr) * (1 - min(step, total_steps) / total_steps) ** power


def no_floor_after_the_end(step, peak_lr, warmup_steps, total_steps, power=1.0, end_lr=0.0):
    if step < warmup_steps:
        return peak_lr * (step + 1) / warmup_steps
    progress = (step - warmup_steps) / (total_steps - warmup_steps)
    return end_lr + (peak_lr - end_lr) * (1 - progress) ** power


def decays_to_zero(step, peak_lr, warmup_steps, total_steps, power=1.0, end_lr=0.0):
    return right(step, peak_lr, warmup_steps, total_steps, power, 0.0)


def power_on_the_progress(step, peak_lr, warmup_steps, total_steps, power=1.0, end_lr=0.0):
    if step < warmup_steps:
        return peak_lr * (step + 1) / warmup_steps
    progress = min(step - warmup_steps, total_steps - warmup_steps) / (total_steps - warmup_steps)
    return end_lr + (peak_lr - end_lr) * (1 - progress**power)


def returns_a_tensor_lr(step, peak_lr, warmup_steps, total_steps, power=1.0, end_lr=0.0):
    return torch.tensor(right(step, peak_lr, warmup_steps, total_steps, power, end_lr))


@pytest.mark.parametrize(
    "wrong, words",
    [
        (warmup_from_zero, "starts one step late"),
        (decay_from_step_zero, "counted from step 0"),
        (no_floor_after_the_end, "must stay at end_lr"),
        (decays_to_zero, "ends at end_lr, not at 0"),
        (power_on_the_progress, "not to the progress"),
        (returns_a_tensor_lr, ".item()"),
    ],
)
def test_schedule_mistakes_get_their_hint(wrong, words):
    with pytest.raises(CheckFailed) as info:
        check_schedule(wrong)
    assert words in str(info.value)


def test_a_schedule_that_raises_is_reported_with_its_arguments():
    def crashes(step, peak_lr, warmup_steps, total_steps, power=1.0, end_lr=0.0):
        fraction = (step + 1) / warmup_steps  # ZeroDivisionError without warmup
        return (
            peak_lr * fraction
            if step < warmup_steps
            else right(step, peak_lr, warmup_steps, total_steps, power, end_lr)
        )

    with pytest.raises(CheckFailed, match="warmup_steps=0.*raised ZeroDivisionError"):
        check_schedule(crashes)


def test_checkers_refuse_what_is_not_a_function():
    with pytest.raises(TypeError, match="must be a function"):
        check_trust(0.5)
    with pytest.raises(TypeError, match="must be a function"):
        check_schedule("lr")
