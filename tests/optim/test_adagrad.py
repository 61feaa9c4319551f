"""Tests of lsdl_lab.optim.adagrad: bit for bit torch.optim.Adagrad, the accumulator's
initial value read per group, and a step that never grows."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from optim_helpers import (
    eps,
    gradient_sequences,
    maybe,
    power_of_two_scaling_test,
    single,
    steps,
    torch_reference_tests,
    weight_decay,
    zero_learning_rate_test,
)

from lsdl_lab import optim

HYPER = st.fixed_dictionaries(
    dict(lr=st.floats(1e-3, 0.3), lr_decay=maybe(st.floats(0.0, 0.1)),
         weight_decay=weight_decay, initial_accumulator_value=maybe(st.floats(0.0, 1.0)),
         eps=eps)
)  # fmt: skip
FULL = dict(lr=0.1, lr_decay=0.01, weight_decay=1e-3, initial_accumulator_value=0.1, eps=1e-8)

(
    test_same_arguments_and_defaults_as_torch,
    test_matches_torch_optim,
    test_matches_torch_optim_on_a_resnet,
    # torch.optim reads initial_accumulator_value from its constructor only (test below)
) = torch_reference_tests("Adagrad", HYPER, FULL, constructor_only=("initial_accumulator_value",))
test_zero_learning_rate_leaves_parameters_unchanged = zero_learning_rate_test("Adagrad", HYPER)
test_power_of_two_gradient_scaling_is_exact = power_of_two_scaling_test(
    "Adagrad", dict(lr=0.1, eps=0.0, lr_decay=0.1), lambda c: {}
)


def test_edges_of_the_ranges_are_accepted():
    optim.Adagrad([torch.zeros(2, requires_grad=True)], lr=0.0, lr_decay=0.0, weight_decay=0.0,
                  initial_accumulator_value=0.0, eps=0.0)  # fmt: skip


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
