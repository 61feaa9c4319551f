"""The checkers of Lab 4a accept right answers, reject the usual wrong ones with a hint that
names the mistake, and pass the exercise stub's NotImplementedError through."""

from __future__ import annotations

import math

import pytest

from lsdl_lab import check, schedules
from lsdl_lab.check import PLACEHOLDER_MESSAGE, CheckFailed
from lsdl_lab.exercises import lab04a


def check_scaled_lr(fn):
    check.checker("lab04a.scaled_lr")(fn)


def check_warmup_lr(fn):
    check.checker("lab04a.warmup_lr")(fn)


# -- the references are the library -------------------------------------------------------


@pytest.mark.parametrize("batch", [1, 128, 256, 1000, 8192])
def test_scaled_lr_reference_is_the_library(batch):
    assert lab04a.scaled_lr(0.1, 256, batch) == schedules.linear_scaling(0.1, 256, batch)
    assert lab04a.scaled_lr(0.1, 256, batch, "sqrt") == schedules.sqrt_scaling(0.1, 256, batch)
    with pytest.raises(ValueError, match="Invalid rule: 'cubic'"):
        lab04a.scaled_lr(0.1, 256, batch, "cubic")


def test_warmup_lr_reference_follows_goyal_et_al():
    # From 0.1 to 3.2 over 780 steps: the first step already moves, step 779 is the peak.
    assert lab04a.warmup_lr(0, 3.2, 780, 0.1) == pytest.approx(0.1 + 3.1 / 780)
    assert lab04a.warmup_lr(779, 3.2, 780, 0.1) == pytest.approx(3.2)
    assert lab04a.warmup_lr(10_000, 3.2, 780, 0.1) == 3.2
    assert lab04a.warmup_lr(5, 0.5, 0) == 0.5


# -- right answers pass --------------------------------------------------------------------


def test_right_answers_pass(capsys):
    def scaled_lr(base_lr, base_batch, batch, rule="linear"):
        if rule == "linear":
            return base_lr * batch / base_batch
        if rule == "sqrt":
            return base_lr * math.sqrt(batch / base_batch)
        raise ValueError(f"unknown rule {rule}")

    def warmup_lr(step, peak_lr, warmup_steps, start_lr=0.0):
        if step >= warmup_steps:
            return peak_lr
        return start_lr + (peak_lr - start_lr) * (step + 1) / warmup_steps

    check_scaled_lr(scaled_lr)
    check_warmup_lr(warmup_lr)
    out = capsys.readouterr().out
    assert "✔ scaled_lr: both rules equal" in out
    assert "✔ warmup_lr: Goyal et al.'s 780-step warmup" in out


def test_the_references_pass_their_own_checkers():
    check_scaled_lr(lab04a.scaled_lr)
    check_warmup_lr(lab04a.warmup_lr)


# -- wrong answers fail, with the hint that names the mistake ------------------------------


def swapped(base_lr, base_batch, batch, rule="linear"):
    ratio = batch / base_batch
    return base_lr * (math.sqrt(ratio) if rule == "linear" else ratio)


def upside_down(base_lr, base_batch, batch, rule="linear"):
    ratio = base_batch / batch
    return base_lr * (ratio if rule == "linear" else math.sqrt(ratio))


def integer_division(base_lr, base_batch, batch, rule="linear"):
    ratio = batch // base_batch
    return base_lr * (ratio if rule == "linear" else math.sqrt(ratio))


def root_of_batch(base_lr, base_batch, batch, rule="linear"):
    return base_lr * (batch / base_batch if rule == "linear" else math.sqrt(batch) / base_batch)


def no_error_for_unknown_rules(base_lr, base_batch, batch, rule="linear"):
    ratio = batch / base_batch
    return base_lr * (math.sqrt(ratio) if rule == "sqrt" else ratio)


def wrong_error_for_unknown_rules(base_lr, base_batch, batch, rule="linear"):
    ratio = batch / base_batch
    return base_lr * {"linear": ratio, "sqrt": math.sqrt(ratio)}[rule]  # KeyError


@pytest.mark.parametrize(
    "fn, hint",
    [
        (swapped, "the two rules are swapped"),
        (upside_down, "the ratio is upside down"),
        (integer_division, "integer division"),
        (root_of_batch, "the root is of the ratio B/B0"),
        (no_error_for_unknown_rules, "should raise ValueError"),
        (wrong_error_for_unknown_rules, "raised KeyError"),
    ],
)
def test_scaled_lr_mistakes_are_named(fn, hint):
    with pytest.raises(CheckFailed, match=hint):
        check_scaled_lr(fn)


def one_step_late(step, peak_lr, warmup_steps, start_lr=0.0):
    if step >= warmup_steps:
        return peak_lr
    return start_lr + (peak_lr - start_lr) * step / warmup_steps


def from_zero(step, peak_lr, warmup_steps, start_lr=0.0):
    return peak_lr if step >= warmup_steps else peak_lr * (step + 1) / warmup_steps


def adds_the_whole_peak(step, peak_lr, warmup_steps, start_lr=0.0):
    return peak_lr if step >= warmup_steps else start_lr + peak_lr * (step + 1) / warmup_steps


def keeps_rising(step, peak_lr, warmup_steps, start_lr=0.0):
    return start_lr + (peak_lr - start_lr) * (step + 1) / max(warmup_steps, 1)


def divides_by_zero(step, peak_lr, warmup_steps, start_lr=0.0):
    ramp = start_lr + (peak_lr - start_lr) * (step + 1) / warmup_steps
    return ramp if step < warmup_steps else peak_lr


@pytest.mark.parametrize(
    "fn, hint",
    [
        (one_step_late, "reaches the peak one step late"),
        (from_zero, "start_lr is ignored"),
        (adds_the_whole_peak, "it should cover peak - start"),
        (keeps_rising, "after the warmup"),
        (divides_by_zero, "warmup_steps = 0 means no warmup"),
    ],
)
def test_warmup_lr_mistakes_are_named(fn, hint):
    with pytest.raises(CheckFailed, match=hint):
        check_warmup_lr(fn)


def test_a_special_case_for_the_cases_is_caught_by_the_full_warmup():
    cases = {(0, 3.2, 780, 0.1), (389, 3.2, 780, 0.1), (779, 3.2, 780, 0.1)}

    def only_the_cases(step, peak_lr, warmup_steps, start_lr=0.0):
        if (step, peak_lr, warmup_steps, start_lr) in cases or warmup_steps != 780:
            return lab04a.warmup_lr(step, peak_lr, warmup_steps, start_lr)
        return peak_lr

    with pytest.raises(CheckFailed, match="step 1 of Goyal et al.'s warmup"):
        check_warmup_lr(only_the_cases)


# -- the exercise stub -------------------------------------------------------------------


@pytest.mark.parametrize("name", ["lab04a.scaled_lr", "lab04a.warmup_lr"])
def test_the_stub_asks_for_a_solution(name):
    def stub(*args, **kwargs):
        raise NotImplementedError(PLACEHOLDER_MESSAGE)

    with pytest.raises(NotImplementedError, match="not implemented yet"):
        check.checker(name)(stub)
