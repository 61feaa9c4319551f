"""Tests of lsdl_lab.optim.adamax: bit for bit torch.optim.Adamax, and its step bound."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from optim_helpers import (
    betas,
    eps,
    gradient_sequences,
    lr,
    power_of_two_scaling_test,
    single,
    steps,
    torch_reference_tests,
    weight_decay,
    zero_learning_rate_test,
)

from lsdl_lab import optim

HYPER = st.fixed_dictionaries(dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
FULL = dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=1e-3)

(
    test_same_arguments_and_defaults_as_torch,
    test_matches_torch_optim,
    test_matches_torch_optim_on_a_resnet,
) = torch_reference_tests("Adamax", HYPER, FULL)
test_zero_learning_rate_leaves_parameters_unchanged = zero_learning_rate_test("Adamax", HYPER)
test_power_of_two_gradient_scaling_is_exact = power_of_two_scaling_test(
    "Adamax", dict(lr=1e-3, eps=0.0), lambda c: {}
)


def test_edges_of_the_ranges_are_accepted():
    optim.Adamax([torch.zeros(2, requires_grad=True)], lr=0.0, betas=(0.0, 0.0), eps=0.0,
                 weight_decay=0.0)  # fmt: skip


@settings(max_examples=30, deadline=None)
@given(gradients=gradient_sequences, beta1=st.floats(0.0, 0.95), beta2=st.floats(0.5, 0.9999))
def test_adamax_step_bound(gradients, beta1, beta2, device):
    # u_t >= beta2^(t-k) |g_k|, so |m_t| <= u_t Σ_j (1-beta1) (beta1/beta2)^j; at beta1 = 0,
    # |Δw| <= lr exactly as the paper says
    p, opt = single("Adamax", device=device, lr=1e-3, betas=(beta1, beta2))
    for t, g, before, dw in steps(opt, p, gradients, torch.float64):
        bound = sum((1 - beta1) * (beta1 / beta2) ** j for j in range(t)) / (1 - beta1**t)
        assert torch.all(dw.abs() <= 1e-3 * bound * (1 + 1e-9))
        u = opt.state[p]["exp_inf"]
        assert torch.all(u >= g.abs()) and torch.all(u >= beta2 * before.get("exp_inf", 0 * u))
