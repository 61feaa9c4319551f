"""Tests of lsdl_lab.optim.nadam: bit for bit torch.optim.NAdam (coupled and decoupled
weight decay, momentum warm-up), and the one documented difference under a float32 default
dtype."""

from __future__ import annotations

import torch
from hypothesis import strategies as st
from optim_helpers import (
    betas,
    eps,
    lr,
    ours,
    power_of_two_scaling_test,
    run,
    torch_reference_tests,
    torchs,
    weight_decay,
    zero_learning_rate_test,
)

from lsdl_lab import optim

HYPER = st.fixed_dictionaries(
    dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
         momentum_decay=st.sampled_from([0.0, 4e-3, 0.05]),
         decoupled_weight_decay=st.booleans())
)  # fmt: skip
FULL = dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=1e-2, momentum_decay=1e-2,
            decoupled_weight_decay=True)  # fmt: skip

(
    test_same_arguments_and_defaults_as_torch,
    test_matches_torch_optim,
    test_matches_torch_optim_on_a_resnet,
) = torch_reference_tests("NAdam", HYPER, FULL)
test_zero_learning_rate_leaves_parameters_unchanged = zero_learning_rate_test("NAdam", HYPER)
test_power_of_two_gradient_scaling_is_exact = power_of_two_scaling_test(
    "NAdam", dict(lr=1e-3, eps=0.0, weight_decay=0.1, decoupled_weight_decay=True), lambda c: {}
)


def test_edges_of_the_ranges_are_accepted():
    optim.NAdam([torch.zeros(2, requires_grad=True)], lr=0.0, betas=(0.0, 0.0), eps=0.0,
                weight_decay=0.0, momentum_decay=0.0)  # fmt: skip


def test_nadam_under_float32_default():
    # With float32 as the default dtype, torch.optim keeps NAdam's running product of mu_t
    # in float32 even for float64 parameters (until a load_state_dict casts it to float64);
    # ours keeps it in the parameter's dtype, so float64 results differ by that rounding only.
    a, _ = run(ours("NAdam", **FULL), dtype=torch.float64, scalar_dtype=torch.float32)
    b, opt = run(torchs("NAdam", **FULL), dtype=torch.float64, scalar_dtype=torch.float32)
    assert opt.state[next(b.parameters())]["mu_product"].dtype == torch.float32
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-8)
