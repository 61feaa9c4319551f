"""Tests of lsdl_lab.schedules.

* Exact values of every rule and schedule at its boundaries.
* Properties (hypothesis): warmups rise, decays fall, all stay in [end_factor, 1]; warmup
  composed with a decay is continuous at the end of warmup.
* LambdaLR: the learning rate an optimizer actually uses at step t is base_lr * f(t).
* Bad input: a ValueError (TypeError for a wrong type) naming the argument and its range.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lsdl_lab import optim
from lsdl_lab.schedules import (
    batch_size_schedule,
    constant,
    cosine_decay,
    linear_scaling,
    linear_warmup,
    lr_at,
    polynomial_decay,
    sqrt_scaling,
    step_decay,
    warmup_then,
)

# -- exact values ---------------------------------------------------------------------------


def test_scaling_rules():
    # Goyal et al.: 0.1 per 256 examples; You et al. (LAMB): sqrt scaling from batch 512
    assert linear_scaling(0.1, 256, 8192) == pytest.approx(3.2, rel=1e-15)
    assert linear_scaling(0.1, 256, 256) == 0.1
    assert sqrt_scaling(1e-3, 512, 32768) == pytest.approx(8e-3, rel=1e-15)
    assert sqrt_scaling(0.5, 64, 16) == 0.25
    assert linear_scaling(0.0, 1, 10) == 0.0


def test_constant():
    f = constant()
    assert [f(t) for t in (0, 1, 10**9)] == [1.0, 1.0, 1.0]


def test_linear_warmup_values():
    assert lr_at(linear_warmup(4), 6) == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert lr_at(linear_warmup(4, start_factor=0.2), 5) == pytest.approx([0.4, 0.6, 0.8, 1, 1])
    assert lr_at(linear_warmup(0), 3) == [1.0, 1.0, 1.0]
    assert lr_at(linear_warmup(1), 2) == [1.0, 1.0]


def test_step_decay_values():
    f = step_decay([3, 6], gamma=0.1)
    assert lr_at(f, 8) == [1.0] * 3 + [0.1] * 3 + [0.1**2] * 2
    assert lr_at(step_decay([], 0.5), 3) == [1.0] * 3
    assert step_decay([2], gamma=1.0)(5) == 1.0


def test_polynomial_decay_values():
    f = polynomial_decay(10)
    assert [f(0), f(5), f(10), f(11), f(10**6)] == [1.0, 0.5, 0.0, 0.0, 0.0]
    assert polynomial_decay(10, power=2.0)(5) == 0.25
    g = polynomial_decay(10, end_factor=0.1)
    assert [g(0), g(10), g(20)] == [1.0, 0.1, 0.1]
    assert g(5) == pytest.approx(0.55, rel=1e-15)
    assert f.total_steps == 10


def test_cosine_decay_values():
    f = cosine_decay(10)
    assert [f(0), f(10), f(15)] == [1.0, 0.0, 0.0]
    assert f(5) == pytest.approx(0.5, abs=1e-15)
    g = cosine_decay(4, end_factor=0.2)
    assert g(0) == 1.0 and g(4) == pytest.approx(0.2, abs=1e-15) and g(2) == pytest.approx(0.6)


def test_warmup_then_values():
    f = warmup_then(3, polynomial_decay(4))
    assert lr_at(f, 9) == pytest.approx([1 / 3, 2 / 3, 1.0, 1.0, 0.75, 0.5, 0.25, 0.0, 0.0])
    assert f.total_steps == 7
    assert warmup_then(2, step_decay([1], 0.5)).total_steps is None
    assert lr_at(warmup_then(0, cosine_decay(2)), 3) == pytest.approx([1.0, 0.5, 0.0])
    g = warmup_then(2, constant(), start_factor=0.5)
    assert lr_at(g, 3) == [0.75, 1.0, 1.0]


def test_lr_at():
    assert lr_at(linear_warmup(2), range(3), base_lr=0.2) == [0.1, 0.2, 0.2]
    assert lr_at(constant(), [5, 0]) == [1.0, 1.0]
    assert lr_at(constant(), 0) == []


def test_batch_size_schedule_values():
    # Smith et al.: batch x5 at epochs 60, 120, 160, capped
    b = batch_size_schedule(128, [60, 120, 160], factor=5, max_batch=10_000)
    assert [b(e) for e in (0, 59, 60, 119, 120, 159, 160, 10**6)] == [
        128, 128, 640, 640, 3200, 3200, 10_000, 10_000
    ]  # fmt: skip
    assert batch_size_schedule(32, [1], 2)(7) == 64


# -- properties -----------------------------------------------------------------------------

steps = st.integers(0, 10_000)
ends = st.floats(0.0, 1.0)


@st.composite
def decays(draw):
    kind = draw(st.sampled_from(["poly", "cosine", "step", "constant"]))
    if kind == "poly":
        total, power = draw(st.integers(1, 2000)), draw(st.floats(0.1, 4.0))
        return polynomial_decay(total, power, draw(ends)), f"poly({total}, {power})"
    if kind == "cosine":
        total = draw(st.integers(1, 2000))
        return cosine_decay(total, draw(ends)), f"cosine({total})"
    if kind == "step":
        ms = sorted(draw(st.sets(st.integers(1, 3000), max_size=4)))
        return step_decay(ms, draw(st.floats(0.01, 1.0))), f"step({ms})"
    return constant(), "constant"


@settings(max_examples=60, deadline=None)
@given(decay=decays(), a=steps, b=steps)
def test_decays_fall_and_stay_in_range(decay, a, b):
    f, _ = decay
    a, b = min(a, b), max(a, b)
    assert f(0) == 1.0
    assert 1.0 >= f(a) >= f(b) >= 0.0


@settings(max_examples=60, deadline=None)
@given(W=st.integers(0, 500), s=ends, a=steps, b=steps)
def test_warmup_rises_to_one(W, s, a, b):
    f = linear_warmup(W, s)
    a, b = min(a, b), max(a, b)
    assert s <= f(a) <= f(b) <= 1.0
    assert f(max(W - 1, 0)) == 1.0 and f(W) == 1.0


@settings(max_examples=60, deadline=None)
@given(W=st.integers(1, 500), decay=decays(), k=st.integers(0, 3000))
def test_warmup_then_is_continuous_and_counts_decay_from_warmup_end(W, decay, k):
    d, _ = decay
    f = warmup_then(W, d)
    # the last warmup step and the first decay step both use the full rate
    assert f(W - 1) == 1.0 == f(W) == d(0)
    assert f(W + k) == d(k)
    assert f(0) == 1 / W


# -- LambdaLR -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make_opt", [lambda p: optim.SGD(p, lr=0.4), lambda p: torch.optim.SGD(p, lr=0.4)]
)
def test_lambda_lr_uses_base_lr_times_factor(make_opt):
    schedule = warmup_then(5, cosine_decay(10, end_factor=0.1))
    w = torch.zeros(1, dtype=torch.float64, requires_grad=True)
    opt = make_opt([w])
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    for t in range(20):
        assert opt.param_groups[0]["lr"] == 0.4 * schedule(t)
        before = w.detach().clone()
        w.grad = torch.ones(1, dtype=torch.float64)
        opt.step()
        scheduler.step()
        # with gradient 1, plain SGD moves the weight by exactly the rate it used
        assert (before - w.detach()).item() == pytest.approx(0.4 * schedule(t), rel=1e-12)


def test_lambda_lr_drives_lamb():
    # LAMB's step norm is lr * ||w|| (trust ratio), so the scheduled rate shows in the step
    schedule = warmup_then(3, polynomial_decay(5))
    w = torch.full((4, 4), 0.5, dtype=torch.float64)
    w.requires_grad_(True)
    opt = optim.LAMB([w], lr=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    g = torch.Generator().manual_seed(0)
    for t in range(10):
        before = w.detach().clone()
        w.grad = torch.randn(4, 4, generator=g, dtype=torch.float64)
        opt.step()
        scheduler.step()
        step = (w.detach() - before).norm().item()
        assert step == pytest.approx(0.01 * schedule(t) * before.norm().item(), rel=1e-10)


# -- bad input ------------------------------------------------------------------------------

BAD = [
    (lambda: linear_scaling(0.1, 0, 10), "Invalid base_batch: 0 (expected an int >= 1)"),
    (lambda: linear_scaling(0.1, 10, -4), "Invalid batch: -4 (expected an int >= 1)"),
    (lambda: sqrt_scaling(-0.1, 10, 10), "Invalid base_lr: -0.1 (expected a finite number >= 0)"),
    (lambda: linear_warmup(-1), "Invalid warmup_steps: -1 (expected an int >= 0)"),
    (lambda: linear_warmup(5, start_factor=1.5),
     "Invalid start_factor: 1.5 (expected a finite number in [0, 1])"),
    (lambda: linear_warmup(5)(-1), "Invalid step: -1 (expected an int >= 0)"),
    (lambda: constant()(-3), "Invalid step: -3 (expected an int >= 0)"),
    (lambda: cosine_decay(10)(-1), "Invalid step: -1 (expected an int >= 0)"),
    (lambda: step_decay([5, 3]), "Invalid milestones: [5, 3] (expected strictly increasing ints)"),
    (lambda: step_decay([3, 3]), "Invalid milestones: [3, 3] (expected strictly increasing ints)"),
    (lambda: step_decay([0]), "Invalid milestones: 0 (expected an int >= 1)"),
    (lambda: step_decay([3], gamma=0.0), "Invalid gamma: 0.0 (expected a finite number in (0, 1])"),
    (lambda: step_decay([3], gamma=1.5), "Invalid gamma: 1.5 (expected a finite number in (0, 1])"),
    (lambda: step_decay([3], gamma=math.nan),
     "Invalid gamma: nan (expected a finite number in (0, 1])"),
    (lambda: polynomial_decay(0), "Invalid total_steps: 0 (expected an int >= 1)"),
    (lambda: polynomial_decay(10, power=0.0), "Invalid power: 0.0 (expected a finite number > 0)"),
    (lambda: polynomial_decay(10, power=math.inf),
     "Invalid power: inf (expected a finite number > 0)"),
    (lambda: polynomial_decay(10, end_factor=-0.1),
     "Invalid end_factor: -0.1 (expected a finite number in [0, 1])"),
    (lambda: cosine_decay(-5), "Invalid total_steps: -5 (expected an int >= 1)"),
    (lambda: warmup_then(-1, constant()), "Invalid warmup_steps: -1 (expected an int >= 0)"),
    (lambda: warmup_then(100, constant(), total_steps=100),
     "Invalid warmup_steps: 100 (expected an int in [0, 99]: the warmup must end before "
     "total_steps=100)"),
    (lambda: warmup_then(10, cosine_decay(100), total_steps=100),
     "Invalid decay: it lasts 100 steps, but total_steps - warmup_steps = 90"),
    (lambda: batch_size_schedule(0, [1], 2), "Invalid base_batch: 0 (expected an int >= 1)"),
    (lambda: batch_size_schedule(-8, [1], 2), "Invalid base_batch: -8 (expected an int >= 1)"),
    (lambda: batch_size_schedule(8, [2, 1], 2),
     "Invalid milestones: [2, 1] (expected strictly increasing ints)"),
    (lambda: batch_size_schedule(8, [1], 0), "Invalid factor: 0 (expected an int >= 1)"),
    (lambda: batch_size_schedule(8, [1], 2, max_batch=4),
     "Invalid max_batch: 4 (expected an int >= 8)"),
    (lambda: batch_size_schedule(8, [1], 2)(-1), "Invalid epoch: -1 (expected an int >= 0)"),
]  # fmt: skip


@pytest.mark.parametrize("call, message", BAD)
def test_bad_input_raises_value_error_naming_argument_and_range(call, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        call()


@pytest.mark.parametrize(
    "call",
    [
        lambda: linear_warmup(2.5),
        lambda: linear_warmup(2)(1.0),
        lambda: polynomial_decay(10, power="2"),
        lambda: warmup_then(2, "cosine"),
        lambda: batch_size_schedule(8, [1], 2.5),
        lambda: linear_warmup(True),
        lambda: step_decay([True]),
        lambda: sqrt_scaling(0.1, True, 4),
        lambda: cosine_decay(10, end_factor="0"),
    ],
)
def test_wrong_types_raise_type_error(call):
    with pytest.raises(TypeError, match="Invalid"):
        call()
