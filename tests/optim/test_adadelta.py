"""Tests of lsdl_lab.optim.adadelta: bit for bit torch.optim.Adadelta, and its step bound."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from optim_helpers import (
    gradient_sequences,
    power_of_two_scaling_test,
    single,
    steps,
    torch_reference_tests,
    weight_decay,
    zero_learning_rate_test,
)

from lsdl_lab import optim

HYPER = st.fixed_dictionaries(
    dict(lr=st.floats(0.01, 1.0), rho=st.floats(0.0, 1.0),
         eps=st.sampled_from([1e-8, 1e-6, 1e-4]), weight_decay=weight_decay)
)  # fmt: skip
FULL = dict(lr=0.5, rho=0.8, eps=1e-5, weight_decay=1e-3)

(
    test_same_arguments_and_defaults_as_torch,
    test_matches_torch_optim,
    test_matches_torch_optim_on_a_resnet,
) = torch_reference_tests("Adadelta", HYPER, FULL)
test_zero_learning_rate_leaves_parameters_unchanged = zero_learning_rate_test("Adadelta", HYPER)
test_power_of_two_gradient_scaling_is_exact = power_of_two_scaling_test(
    "Adadelta", dict(lr=1.0, eps=1e-4), lambda c: dict(lr=1.0 / c, eps=1e-4 * c * c)
)


def test_edges_of_the_ranges_are_accepted():
    optim.Adadelta([torch.zeros(2, requires_grad=True)], lr=0.0, rho=1.0, eps=0.0,
                   weight_decay=0.0)  # fmt: skip


@settings(max_examples=40, deadline=None)
@given(gradients=gradient_sequences, rho=st.floats(0.0, 0.99), eps=st.sampled_from([1e-6, 1e-2]))
def test_adadelta_step_bound(gradients, rho, eps, device):
    # v_t >= (1 - rho) g_t^2, so |Δw_t| <= lr sqrt((u_{t-1} + eps) / (1 - rho))
    p, opt = single("Adadelta", device=device, lr=0.5, rho=rho, eps=eps)
    for _, g, before, dw in steps(opt, p, gradients, torch.float64):
        u = before.get("acc_delta", torch.zeros_like(p))
        assert torch.all(dw * g < 0)
        assert torch.all(dw.abs() <= 0.5 * ((u + eps) / (1 - rho)).sqrt() * (1 + 1e-9))
