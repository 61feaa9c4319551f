"""Tests of lsdl_lab.optim.lars.

* Properties (hypothesis, explicit gradients): the first step of a layer has norm
  lr * eta * ||w|| whatever the gradient's scale; without weight decay, multiplying a
  layer's gradients by a constant leaves every update unchanged; zero weights get trust
  ratio 1; a zero gradient gives a zero, finite step.
* ``trust=False`` is SGD with momentum, bit for bit (lsdl_lab's and torch.optim's).
* Reference: pytorch-optimizer's ``LARS`` (skipped when not installed).

The tests that step take the ``device`` fixture: parameters and gradients live there (drawn
on the CPU, the same numbers on every device).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from layerwise_helpers import params_like, resnet_losses, run_grads, tensors
from optim_helpers import assert_same, ours, run, torchs

from lsdl_lab import optim
from lsdl_lab.optim import param_groups_for_layerwise

EXACT = dict(rtol=0.0, atol=0.0)
log_scale = st.floats(-6.0, 6.0).map(lambda e: 10.0**e)


@settings(max_examples=25, deadline=None)
@given(scales=st.lists(log_scale, min_size=4, max_size=4), lr=st.floats(0.1, 10.0),
       eta=st.floats(1e-4, 0.1), momentum=st.floats(0.0, 0.95))  # fmt: skip
def test_first_step_norm_is_lr_eta_weight_norm(scales, lr, eta, momentum, device):
    params = params_like(device=device)
    weights = [p.detach().clone() for p in params]
    opt = optim.LARS(params, lr=lr, momentum=momentum, trust_coefficient=eta, eps=0.0)
    grads = [g * c for g, c in zip(tensors(1), scales)]
    for w, u in zip(weights, run_grads(opt, params, [grads])[0]):
        assert u.norm().item() == pytest.approx(lr * eta * w.norm().item(), rel=1e-9)


@settings(max_examples=15, deadline=None)
@given(scales=st.lists(st.floats(-3.0, 3.0).map(lambda e: 10.0**e), min_size=4, max_size=4),
       nesterov=st.booleans())  # fmt: skip
def test_without_weight_decay_updates_ignore_each_layers_gradient_scale(scales, nesterov, device):
    steps = [tensors(s) for s in range(1, 6)]
    runs = []
    for c in ([1.0] * 4, scales):  # each layer's gradients times its own constant, every step
        params = params_like(device=device)
        opt = optim.LARS(params, lr=0.5, momentum=0.9, nesterov=nesterov, eps=0.0)
        runs.append(run_grads(opt, params, [[g * k for g, k in zip(gs, c)] for gs in steps]))
    for step_a, step_b in zip(*runs):
        for a, b in zip(step_a, step_b):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=0.0)


def test_zero_norm_layers_get_trust_ratio_one(device):
    # zero weights, so tau = 1 and the first step is -lr * g (d = g + lam * 0)
    g, h = tensors(1, shapes=[(3, 4), (4,)], device=device)
    p = torch.zeros(3, 4, dtype=torch.float64, device=device, requires_grad=True)
    q = torch.zeros(4, dtype=torch.float64, device=device, requires_grad=True)
    opt = optim.LARS([p, q], lr=0.1, weight_decay=0.1)
    (u, v), = run_grads(opt, [p, q], [[g, h]])  # fmt: skip
    torch.testing.assert_close(u, -0.1 * g, **EXACT)
    torch.testing.assert_close(v, -0.1 * h, **EXACT)


def test_zero_gradient_without_decay_gives_a_zero_finite_step(device):
    # 0 / (0 + 0) would be NaN
    p = torch.ones(3, 3, dtype=torch.float64, device=device, requires_grad=True)
    opt = optim.LARS([p], lr=0.1, eps=0.0)
    (u,) = run_grads(opt, [p], [[torch.zeros(3, 3, dtype=torch.float64)]])[0]
    assert torch.equal(u, torch.zeros(3, 3, dtype=torch.float64, device=device))


SGD_CASES = [
    dict(lr=0.1, momentum=0.9),
    dict(lr=0.05, momentum=0.5, weight_decay=1e-2),
    dict(lr=0.05, momentum=0.9, weight_decay=1e-3, nesterov=True),
    dict(lr=0.1, momentum=0.0, weight_decay=1e-2),
]


@pytest.mark.parametrize("kw", SGD_CASES)
def test_lars_without_trust_is_sgd_with_momentum(kw, device):
    ours_ = run(ours("LARS", trust=False, **kw), steps=40, device=device)
    assert_same(ours_, run(ours("SGD", **kw), steps=40, device=device))
    assert_same(ours_, run(torchs("SGD", **kw), steps=40, device=device), state=False)


def test_trust_must_be_a_bool_and_momentum_below_one():
    # LARS raised ValueError for a non-bool flag, SAM TypeError: now both TypeError
    w = [torch.zeros(2, requires_grad=True)]
    with pytest.raises(TypeError, match=r"Invalid trust: 'yes' \(expected True or False\)"):
        optim.LARS(w, lr=0.1, trust="yes")
    with pytest.raises(TypeError, match="Invalid nesterov: 1"):
        optim.LARS(w, lr=0.1, nesterov=1)
    with pytest.raises(ValueError, match=r"Invalid momentum value: 1.0 \(expected"):
        optim.LARS(w, lr=0.1, momentum=1.0)


def test_lars_needs_a_learning_rate():
    with pytest.raises(TypeError):
        optim.LARS([torch.zeros(2, requires_grad=True)])


def test_resnet_trains_with_layerwise_groups(device):
    losses = resnet_losses(lambda groups: optim.LARS(groups, lr=5.0), 1e-4, device=device)
    assert losses[-1] < 0.7 * losses[0], losses


def test_matches_pytorch_optimizer_lars(device):
    po = pytest.importorskip("pytorch_optimizer")
    # Its LARS adapts tensors with ndim > 1 only and gives the others plain SGD steps without
    # weight decay: our param_groups_for_layerwise; no eps in its ratio: eps=0.
    kw = dict(lr=2.0, momentum=0.9, trust_coefficient=0.01)
    a = run(lambda m: po.LARS(m.parameters(), weight_decay=1e-3, **kw), steps=40, device=device)
    b = run(lambda m: optim.LARS(param_groups_for_layerwise(m, 1e-3), eps=0.0, **kw), steps=40,
            device=device)  # fmt: skip
    assert_same(a, b, state=False)
