"""Tests of lsdl_lab.optim.rmsprop: its step bound, and ``centered`` must be a bool (bit for
bit torch.optim.RMSprop, centered, with momentum and weight decay: test_common.py; momentum
in [0, 1), stricter than torch: test_contract.py)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from optim_helpers import (
    gradient_sequences,
    single,
    steps,
)

from lsdl_lab import optim


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
