"""Tests of lsdl_lab.optim.adagrad: the accumulator's initial value read per group, and a
step that never grows (bit for bit torch.optim.Adagrad: test_common.py)."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from optim_helpers import (
    gradient_sequences,
    single,
    steps,
)

from lsdl_lab import optim


def test_adagrad_initial_accumulator_value_per_group(device):
    # torch.optim's Adagrad fills every accumulator with the constructor's value, whatever
    # a group says, at construction (so a group added later has none); ours reads the group's.
    p, q, r = (torch.zeros(2, device=device, requires_grad=True) for _ in range(3))
    opt = optim.Adagrad([dict(params=[p]), dict(params=[q], initial_accumulator_value=3.0)],
                        initial_accumulator_value=1.0)  # fmt: skip
    opt.add_param_group(dict(params=[r], initial_accumulator_value=5.0))
    for x in (p, q, r):
        x.grad = torch.ones(2, device=device)
    opt.step()
    assert [opt.state[x]["sum"].tolist() for x in (p, q, r)] == [[2.0] * 2, [4.0] * 2, [6.0] * 2]


@settings(max_examples=40, deadline=None)
@given(
    gradients=gradient_sequences, lr_decay=st.sampled_from([0.0, 0.01, 1.0]),
    init=st.sampled_from([0.0, 0.1, 10.0]), eps=st.sampled_from([0.0, 1e-10, 1e-3]),
)  # fmt: skip
def test_adagrad_effective_step_never_increases(gradients, lr_decay, init, eps, device):
    p, opt = single("Adagrad", device=device, lr=0.1, lr_decay=lr_decay,
                    initial_accumulator_value=init, eps=eps)  # fmt: skip
    previous = torch.full((4,), math.inf, dtype=torch.float64, device=device)
    for _, g, before, dw in steps(opt, p, gradients, torch.float64):
        rate = -dw / g  # eta_t / (sqrt(s_t) + eps) per coordinate: positive, nonincreasing
        assert torch.all(rate > 0) and torch.all(rate <= previous * (1 + 1e-12))
        assert torch.all(opt.state[p]["sum"] >= before.get("sum", init))
        previous = rate
