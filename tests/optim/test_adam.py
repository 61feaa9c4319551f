"""Tests of lsdl_lab.optim.adam: AdamW as Adam with ``decoupled_weight_decay=True`` (and that
flag against torch's), and Adam's own properties: step bounds and the AMSGrad maximum. Bit
for bit torch.optim.Adam and AdamW (AMSGrad, coupled and decoupled weight decay):
test_common.py."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from optim_helpers import (
    FULL,
    assert_same,
    gradient_sequences,
    ours,
    run,
    single,
    steps,
    torchs,
)

from lsdl_lab import optim


def test_adamw_is_adam_with_decoupled_weight_decay(device):
    a = run(ours("AdamW", **FULL["AdamW"]), device=device)
    b = run(ours("Adam", **FULL["AdamW"], decoupled_weight_decay=True), device=device)
    assert_same(a, b)
    assert a[1].param_groups[0]["decoupled_weight_decay"] is True
    assert not hasattr(optim.Adam, "decoupled")  # one way to say it: the flag


def test_adam_decoupled_weight_decay_matches_torch(device):
    kw = dict(lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True)
    assert_same(run(ours("Adam", **kw), device=device), run(torchs("Adam", **kw), device=device))


def test_amsgrad_and_the_decay_flag_must_be_bools():
    w = [torch.zeros(2, requires_grad=True)]
    with pytest.raises(TypeError, match=r"Invalid amsgrad: 1 \(expected True or False\)"):
        optim.Adam(w, amsgrad=1)
    with pytest.raises(TypeError, match="Invalid decoupled_weight_decay: 'no'"):
        optim.Adam(w, decoupled_weight_decay="no")


def test_adam_bias_correction_rounds_like_torch(device):
    # sqrt(1 - 0.5**53) correctly rounded is one ulp away from torch's (1 - 0.5**53) ** 0.5
    kw = dict(lr=2**-6, betas=(0.0, 0.5))
    assert_same(run(ours("Adam", **kw), dtype=torch.float64, device=device),
                run(torchs("Adam", **kw), dtype=torch.float64, device=device))  # fmt: skip


def adam_bound(t, beta1, beta2):
    """Cauchy–Schwarz bound on Adam's |Δw_t| / lr, for any gradients and ε >= 0:
    |m_t| <= sqrt(Σ_k (1-β1)² β1^{2(t-k)} / ((1-β2) β2^{t-k})) · sqrt(v_t). It is 1 at t = 1;
    Adam's "|Δw| <= lr" holds only there, not in general (see the next test)."""
    s = sum((beta1**2 / beta2) ** j for j in range(t))
    return (1 - beta1) / (1 - beta1**t) * math.sqrt((1 - beta2**t) / (1 - beta2) * s)


@settings(max_examples=40, deadline=None)
@given(
    gradients=gradient_sequences, beta1=st.floats(0.0, 0.95), beta2=st.floats(0.5, 0.9999),
    eps=st.sampled_from([0.0, 1e-12, 1e-8]), amsgrad=st.booleans(),
)  # fmt: skip
def test_adam_step_bound(gradients, beta1, beta2, eps, amsgrad, device):
    lr = 1e-3
    p, opt = single("Adam", device=device, lr=lr, betas=(beta1, beta2), eps=eps, amsgrad=amsgrad)
    for t, g, _, dw in steps(opt, p, gradients, torch.float64):
        if t == 1:  # the first step is lr · g / (|g| + ε): about lr · sign(g)
            torch.testing.assert_close(dw, -lr * g / (g.abs() + eps), rtol=1e-12, atol=0)
            assert torch.all(dw.abs() <= lr * (1 + 1e-12)) and torch.all(dw * g < 0)
        assert torch.all(dw.abs() <= lr * adam_bound(t, beta1, beta2) * (1 + 1e-9))


def test_adam_step_can_exceed_lr(device):
    # Small gradients, then a large one: v_t has not caught up, and |Δw| is ~3.3 lr.
    p, opt = single("Adam", device=device, lr=1e-3, betas=(0.0, 0.999))
    *_, (t, _, _, dw) = steps(opt, p, [[1e-3] * 4] * 10 + [[1.0] * 4], torch.float64)
    assert torch.all(dw.abs() > 3 * 1e-3) and torch.all(dw.abs() <= 1e-3 * adam_bound(t, 0, 0.999))


@settings(max_examples=30, deadline=None)
@given(gradients=gradient_sequences, beta1=st.floats(0.0, 0.95), beta2=st.floats(0.5, 0.9999))
def test_amsgrad_keeps_the_running_maximum_of_the_raw_second_moment(
    gradients, beta1, beta2, device
):
    p, opt = single("Adam", device=device, lr=1e-3, betas=(beta1, beta2), amsgrad=True)
    running_max = torch.zeros(4, dtype=torch.float64, device=device)
    for _ in steps(opt, p, gradients, torch.float64):
        state = opt.state[p]
        running_max = torch.maximum(running_max, state["exp_avg_sq"])
        assert torch.equal(state["max_exp_avg_sq"], running_max)  # never decreases
