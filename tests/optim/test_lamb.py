"""Tests of lsdl_lab.optim.lamb.

* Algorithm 2 of You et al. (2020), written out per tensor in float64 here, is what
  ``LAMB.update`` computes (to rounding), with and without weight decay, bias correction
  and clamp.
* Properties (hypothesis, explicit gradients): every step of a layer has norm
  lr * phi(||w||) whatever the gradient's scale; without weight decay, multiplying a
  layer's gradients by a constant changes nothing; zero weights or a zero step get trust
  ratio 1; ``clamp`` bounds phi(||w||).
* ``trust=False`` is AdamW (Adam without decay), bit for bit, lsdl_lab's and torch.optim's.
* Reference: pytorch-optimizer's ``Lamb`` (skipped when not installed).

The tests that step take the ``device`` fixture: parameters and gradients live there (drawn
on the CPU, the same numbers on every device).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from layerwise_helpers import params_like, resnet_losses, run_grads, tensors
from optim_helpers import assert_same, batch, make_model, ours, run, torchs

from lsdl_lab import optim
from lsdl_lab.optim.lamb import layer_runs

EXACT = dict(rtol=0.0, atol=0.0)
log_scale = st.floats(-6.0, 6.0).map(lambda e: 10.0**e)


def algorithm_2(w, g, m, v, t, lr, beta1, beta2, eps, lam, bias_correction, clamp):
    """One step of the paper's Algorithm 2 on one tensor, plainly; returns (w, m, v)."""
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    m_hat = m / (1 - beta1**t) if bias_correction else m
    v_hat = v / (1 - beta2**t) if bias_correction else v
    r = m_hat / (v_hat.sqrt() + eps)
    u = r + lam * w
    phi = w.norm().clamp(*clamp) if clamp else w.norm()
    tau = phi / u.norm() if w.norm() > 0 and u.norm() > 0 else 1.0
    return w - lr * tau * u, m, v


@pytest.mark.parametrize(
    "kw",
    [dict(), dict(weight_decay=0.1), dict(weight_decay=0.01, bias_correction=False),
     dict(weight_decay=0.01, clamp=(0.5, 2.0), betas=(0.8, 0.9), eps=1e-3)],
)  # fmt: skip
def test_update_is_algorithm_2(kw, device):
    settings_ = dict(lr=0.01, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0,
                     bias_correction=True, clamp=None) | kw  # fmt: skip
    params = params_like(device=device)
    params[1].detach().zero_()  # a zero-initialized bias: tau = 1
    opt = optim.LAMB(params, **settings_)
    expected = [(p.detach().clone(), torch.zeros_like(p), torch.zeros_like(p)) for p in params]
    (beta1, beta2), lr = settings_.pop("betas"), settings_.pop("lr")
    for t in range(1, 6):
        grads = tensors(t, device=device)
        run_grads(opt, params, [grads])
        expected = [
            algorithm_2(w, g, m, v, t, lr, beta1, beta2, lam=settings_["weight_decay"],
                        **{k: settings_[k] for k in ("eps", "bias_correction", "clamp")})
            for (w, m, v), g in zip(expected, grads)
        ]  # fmt: skip
        for p, (w, m, _) in zip(params, expected):
            torch.testing.assert_close(p.detach(), w, rtol=1e-13, atol=1e-15)
            torch.testing.assert_close(opt.state[p]["exp_avg"], m, rtol=1e-13, atol=1e-15)


@settings(max_examples=25, deadline=None)
@given(scales=st.lists(log_scale, min_size=4, max_size=4), lam=st.sampled_from([0.0, 0.01, 1.0]),
       lr=st.floats(1e-4, 0.1),
       betas=st.tuples(st.floats(0.0, 0.99), st.floats(0.5, 0.999)))  # fmt: skip
def test_step_norm_is_lr_times_weight_norm(scales, lam, lr, betas, device):
    params = params_like(device=device)
    opt = optim.LAMB(params, lr=lr, betas=betas, weight_decay=lam)
    for s in range(1, 4):  # every step, not only the first
        weights = [p.detach().clone() for p in params]
        grads = [g * c for g, c in zip(tensors(s), scales)]
        for w, u in zip(weights, run_grads(opt, params, [grads])[0]):
            assert u.norm().item() == pytest.approx(lr * w.norm().item(), rel=1e-9)


@settings(max_examples=15, deadline=None)
@given(scales=st.lists(st.floats(-3.0, 3.0).map(lambda e: 10.0**e), min_size=4, max_size=4))
def test_without_weight_decay_updates_ignore_each_layers_gradient_scale(scales, device):
    steps = [tensors(s) for s in range(1, 6)]
    runs = []
    for c in ([1.0] * 4, scales):  # each layer's gradients times its own constant, every step
        params = params_like(device=device)
        opt = optim.LAMB(params, lr=0.01, eps=0.0)  # with eps, invariant up to eps
        runs.append(run_grads(opt, params, [[g * k for g, k in zip(gs, c)] for gs in steps]))
    for step_a, step_b in zip(*runs):
        for a, b in zip(step_a, step_b):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=0.0)


def test_zero_norm_layers_get_trust_ratio_one(device):
    # tau = 1 is AdamW's step (up to rounding: r is built in other operations than AdamW's)
    g, h = tensors(1, shapes=[(3, 4), (4,)])
    for lam in (0.1, 0.0):
        p, q, p2, q2 = (torch.zeros(s, dtype=torch.float64, device=device, requires_grad=True)
                        for s in [(3, 4), (4,)] * 2)  # fmt: skip
        lamb = run_grads(optim.LAMB([p, q], lr=0.1, weight_decay=lam), [p, q], [[g, h]])
        adamw = optim.AdamW([p2, q2], lr=0.1, eps=1e-6, weight_decay=lam)
        for a, c in zip(lamb[0], run_grads(adamw, [p2, q2], [[g, h]])[0]):
            torch.testing.assert_close(a, c, rtol=1e-14, atol=0.0)
    assert lamb[0][0].abs().min() > 0.09  # it moved: |m_hat / sqrt(v_hat)| = 1 at step 1


def test_zero_gradient_without_decay_gives_a_zero_finite_step(device):
    # r = 0 / (0 + eps) = 0, so ||u|| = 0
    p = torch.ones(3, 3, dtype=torch.float64, device=device, requires_grad=True)
    (u,) = run_grads(optim.LAMB([p], lr=0.1), [p], [[torch.zeros(3, 3, dtype=torch.float64)]])[0]
    assert torch.equal(u, torch.zeros(3, 3, dtype=torch.float64, device=device))


def test_clamp_bounds_phi(device):
    shapes = [(4, 4), (4, 4), (4, 4)]
    params = [w * c for w, c in zip(tensors(0, shapes=shapes, device=device), (0.01, 1.0, 100.0))]
    params = [w.requires_grad_() for w in params]
    weights = [p.detach().clone() for p in params]
    opt = optim.LAMB(params, lr=0.01, clamp=(0.5, 10.0))
    for w, u in zip(weights, run_grads(opt, params, [tensors(1, shapes=shapes)])[0]):
        phi = min(max(w.norm().item(), 0.5), 10.0)
        assert u.norm().item() == pytest.approx(0.01 * phi, rel=1e-9)


ADAM_CASES = [
    dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.1),
    dict(lr=3e-3, betas=(0.5, 0.9), eps=1e-8, weight_decay=0.0),
]


@pytest.mark.parametrize("kw", ADAM_CASES)
def test_lamb_without_trust_is_adamw(kw, device):
    ours_ = run(ours("LAMB", trust=False, **kw), steps=40, device=device)
    assert_same(ours_, run(ours("AdamW", **kw), steps=40, device=device))
    assert_same(ours_, run(torchs("AdamW", **kw), steps=40, device=device))
    if not kw["weight_decay"]:
        assert_same(ours_, run(torchs("Adam", **kw), steps=40, device=device))


def test_flags_and_clamp_are_checked():
    w = [torch.zeros(2, requires_grad=True)]
    with pytest.raises(TypeError, match=r"Invalid bias_correction: 1 \(expected True or False\)"):
        optim.LAMB(w, bias_correction=1)
    with pytest.raises(TypeError, match="Invalid clamp: 10.0"):
        optim.LAMB(w, clamp=10.0)
    with pytest.raises(ValueError, match=r"Invalid clamp: \(1.0, 0.5\)"):
        optim.LAMB(w, clamp=(1.0, 0.5))
    assert optim.LAMB(w, clamp=[0.0, 10.0]).param_groups[0]["clamp"] == (0.0, 10.0)


def test_resnet_trains_with_layerwise_groups(device):
    losses = resnet_losses(lambda groups: optim.LAMB(groups, lr=0.02), 1e-2, device=device)
    assert losses[-1] < 0.7 * losses[0], losses


def test_matches_pytorch_optimizer_lamb(device):
    po = pytest.importorskip("pytorch_optimizer")
    # Its Lamb: no bias correction inside the ratio, the step divided by 1 - beta1^t after
    # it, ||w|| clamped at 10, its eps added to ||u||, decay inside the ratio with
    # weight_decouple=False. So: ours with bias_correction=False, clamp=(0, 10) and the
    # learning rate lr / (1 - beta1^t), equal up to eps (1e-10 here, in both).
    lr, betas, lam, eps = 1e-2, (0.9, 0.99), 0.01, 1e-10
    model = make_model(dtype=torch.float64, device=device)
    theirs = po.Lamb(model.parameters(), lr=lr, betas=betas, weight_decay=lam,
                     weight_decouple=False, eps=eps)  # fmt: skip
    ref = make_model(dtype=torch.float64, device=device)
    ours_ = optim.LAMB(ref.parameters(), lr=lr, betas=betas, weight_decay=lam, eps=eps,
                       bias_correction=False, clamp=(0.0, 10.0))  # fmt: skip
    for t in range(40):
        ours_.param_groups[0]["lr"] = lr / (1 - betas[0] ** (t + 1))
        x, y = batch(t)
        x, y = x.double().to(device), y.to(device)
        for m, o in ((model, theirs), (ref, ours_)):
            o.zero_grad()
            F.cross_entropy(m(x), y).backward()
            o.step()
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-7, atol=1e-10)


def test_layer_runs_group_consecutive_layers_up_to_a_size():
    params = [torch.zeros(n) for n in (3, 5, 10, 2, 1)]
    assert layer_runs(params, size=8) == [[0, 1], [2], [3, 4]]  # 10 > 8: a run of its own
    assert layer_runs(params, size=1) == [[0], [1], [2], [3], [4]]
    assert layer_runs([], size=8) == []
