"""Tests of lsdl_lab.optim.sgd: its own properties (momentum stricter than torch's,
``nesterov`` a bool, the heavy ball's geometric sum). Bit for bit torch.optim.SGD (heavy
ball, Nesterov, dampening, weight decay) and the common properties are tested in
test_common.py; the contract (foreach, resume, groups, bad input, edges of the ranges) for
every optimizer in test_contract.py."""

from __future__ import annotations

import pytest
import torch
from optim_helpers import (
    single,
)

from lsdl_lab import optim


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
