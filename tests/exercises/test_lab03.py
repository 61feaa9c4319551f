"""The checkers of Lab 3 reject the usual wrong update rules, on the cases or on a rollout
against the library's optimizer."""

from __future__ import annotations

import pytest

from lsdl_lab import check
from lsdl_lab.exercises import lab03


def ema_momentum(w, g, buf, lr, momentum):
    buf = g.clone() if buf is None else momentum * buf + (1 - momentum) * g
    return w - lr * buf, buf


def ascent(w, g, buf, lr, momentum):
    buf = g.clone() if buf is None else momentum * buf + g
    return w + lr * buf, buf


def heavy_ball_for_nesterov(w, g, buf, lr, momentum):
    return lab03.momentum_step(w, g, buf, lr, momentum)


def no_bias_correction(w, g, m, v, t, lr, beta1, beta2, eps):
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    return w - lr * m / (v.sqrt() + eps), m, v


def eps_inside_the_root(w, g, m, v, t, lr, beta1, beta2, eps):
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    m_hat, v_hat = m / (1 - beta1**t), v / (1 - beta2**t)
    return w - lr * m_hat / (v_hat + eps).sqrt(), m, v


@pytest.mark.parametrize(
    "name,wrong,message",
    [
        ("momentum_step", ema_momentum, "case 2 of 7"),
        ("momentum_step", ascent, r"output\[0\]: 5 of 5 values differ"),
        ("nesterov_step", heavy_ball_for_nesterov, "case 1 of 7"),
        ("adam_step", no_bias_correction, "case 1 of 7"),
        ("adam_step", eps_inside_the_root, "case 6 of 7"),  # a gradient next to eps
    ],
)
def test_wrong_update_rules_are_caught(name, wrong, message):
    with pytest.raises(check.CheckFailed, match=message):
        check.checker(f"lab03.{name}")(wrong)
