"""Tests of lsdl_lab.optim.adadelta: its step bound (bit for bit torch.optim.Adadelta:
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


@settings(max_examples=40, deadline=None)
@given(gradients=gradient_sequences, rho=st.floats(0.0, 0.99), eps=st.sampled_from([1e-6, 1e-2]))
def test_adadelta_step_bound(gradients, rho, eps, device):
    # v_t >= (1 - rho) g_t^2, so |Δw_t| <= lr sqrt((u_{t-1} + eps) / (1 - rho))
    p, opt = single("Adadelta", device=device, lr=0.5, rho=rho, eps=eps)
    for _, g, before, dw in steps(opt, p, gradients, torch.float64):
        u = before.get("acc_delta", torch.zeros_like(p))
        assert torch.all(dw * g < 0)
        assert torch.all(dw.abs() <= 0.5 * ((u + eps) / (1 - rho)).sqrt() * (1 + 1e-9))
