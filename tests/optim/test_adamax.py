"""Tests of lsdl_lab.optim.adamax: its step bound (bit for bit torch.optim.Adamax:
test_common.py)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from optim_helpers import (
    gradient_sequences,
    single,
    steps,
)


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
