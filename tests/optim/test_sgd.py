"""Tests of lsdl_lab.optim.sgd: bit for bit torch.optim.SGD (heavy ball, Nesterov, dampening,
weight decay), and its own properties. The contract (foreach, resume, groups, bad input)
is tested for every optimizer in test_contract.py."""

from __future__ import annotations

import pytest
import torch
from hypothesis import strategies as st
from optim_helpers import (
    maybe,
    power_of_two_scaling_test,
    single,
    torch_reference_tests,
    weight_decay,
    zero_learning_rate_test,
)

from lsdl_lab import optim

HYPER = st.one_of(
    st.fixed_dictionaries(
        dict(lr=st.floats(0.0, 0.1), momentum=maybe(st.floats(0.0, 0.99)),
             dampening=maybe(st.floats(0.0, 1.0)), weight_decay=weight_decay)
    ),
    st.fixed_dictionaries(
        dict(lr=st.floats(0.0, 0.1), momentum=st.floats(0.01, 0.99),
             nesterov=st.just(True), weight_decay=weight_decay)
    ),
)  # fmt: skip
FULL = dict(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=1e-3)

(
    test_same_arguments_and_defaults_as_torch,
    test_matches_torch_optim,
    test_matches_torch_optim_on_a_resnet,
) = torch_reference_tests("SGD", HYPER, FULL)
test_zero_learning_rate_leaves_parameters_unchanged = zero_learning_rate_test("SGD", HYPER)
test_power_of_two_gradient_scaling_is_exact = power_of_two_scaling_test(
    "SGD", dict(lr=0.01, momentum=0.9, dampening=0.1), lambda c: dict(lr=0.01 / c)
)


def test_edges_of_the_ranges_are_accepted():
    optim.SGD([torch.zeros(2, requires_grad=True)], lr=0.0, momentum=0.0, dampening=0.0)


def test_momentum_is_stricter_than_torch():
    # torch.optim accepts momentum 1 (a buffer that never forgets); the book's SGD does not
    w = [torch.zeros(2, requires_grad=True)]
    torch.optim.SGD(w, lr=0.1, momentum=1.0)
    with pytest.raises(ValueError, match=r"Invalid momentum value: 1.0 \(expected"):
        optim.SGD(w, lr=0.1, momentum=1.0)


def test_nesterov_must_be_a_bool():
    with pytest.raises(TypeError, match=r"Invalid nesterov: 'yes' \(expected True or False\)"):
        optim.SGD([torch.zeros(2, requires_grad=True)], momentum=0.9, nesterov="yes")


def test_heavy_ball_on_a_constant_gradient_is_a_geometric_sum(device):
    # b_t = sum_{k<t} mu^k g, so w_t - w_{t-1} = -lr g (1 - mu^t) / (1 - mu)
    p, opt = single("SGD", device=device, lr=0.5, momentum=0.5)
    g = torch.tensor([1.0, -2.0, 0.25, 4.0], dtype=torch.float64, device=device)
    for t in range(1, 6):
        before = p.detach().clone()
        p.grad = g.clone()
        opt.step()
        torch.testing.assert_close(p.detach() - before, -0.5 * g * (1 - 0.5**t) / 0.5)
