"""Tests of lsdl_lab.optim.rmsprop: bit for bit torch.optim.RMSprop (centered, momentum,
weight decay), its step bound, and its ranges (momentum in [0, 1), stricter than torch)."""

from __future__ import annotations

import math

import pytest
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
    dict(lr=st.floats(1e-4, 1e-2), alpha=st.floats(0.5, 0.999), eps=eps,
         weight_decay=weight_decay, momentum=maybe(st.floats(0.0, 0.95)),
         centered=st.booleans())
)  # fmt: skip
FULL = dict(lr=1e-3, alpha=0.9, eps=1e-6, weight_decay=1e-3, momentum=0.5, centered=True)

(
    test_same_arguments_and_defaults_as_torch,
    test_matches_torch_optim,
    test_matches_torch_optim_on_a_resnet,
) = torch_reference_tests("RMSprop", HYPER, FULL)
test_zero_learning_rate_leaves_parameters_unchanged = zero_learning_rate_test("RMSprop", HYPER)
test_power_of_two_gradient_scaling_is_exact = power_of_two_scaling_test(
    "RMSprop", dict(lr=1e-3, eps=0.0, momentum=0.5, centered=True), lambda c: {}
)


def test_edges_of_the_ranges_are_accepted():
    optim.RMSprop([torch.zeros(2, requires_grad=True)], lr=0.0, alpha=1.0, eps=0.0,
                  momentum=0.0, weight_decay=0.0)  # fmt: skip


def test_centered_must_be_a_bool():
    with pytest.raises(TypeError, match="Invalid centered: 1"):
        optim.RMSprop([torch.zeros(2, requires_grad=True)], centered=1)


@settings(max_examples=40, deadline=None)
@given(gradients=gradient_sequences, alpha=st.floats(0.5, 0.999), eps=st.sampled_from([0, 1e-8]))
def test_rmsprop_step_bound(gradients, alpha, eps, device):
    # v_t >= (1 - alpha) g_t^2, so |Δw_t| = lr |g_t| / (sqrt(v_t) + eps) <= lr / sqrt(1 - alpha)
    p, opt = single("RMSprop", device=device, lr=1e-3, alpha=alpha, eps=eps)
    for _, g, _, dw in steps(opt, p, gradients, torch.float64):
        assert torch.all(dw * g < 0)
        assert torch.all(dw.abs() <= 1e-3 / math.sqrt(1 - alpha) * (1 + 1e-9))
