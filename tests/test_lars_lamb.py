"""Tests of lsdl_lab.optim.LARS and lsdl_lab.optim.LAMB.

* Properties any correct implementation has (hypothesis, on explicit gradients): LAMB's
  step of a layer has norm lr * ||w|| and LARS's first step lr * eta * ||w||, whatever
  the gradient's scale; without weight decay, multiplying a layer's gradients by a
  positive constant leaves every update unchanged (up to epsilon); a layer with zero
  weights (or zero steps) gets trust ratio 1; ``clamp`` bounds phi(||w||).
* Reductions, bit for bit: ``trust=False`` is SGD with momentum (LARS) and AdamW / Adam
  (LAMB), both lsdl_lab's and torch.optim's.
* foreach=False equals foreach=True, resume from ``state_dict`` is exact, bad
  hyperparameters raise ValueError, ``param_groups_for_layerwise`` splits as documented.
* Reference: pytorch-optimizer's ``Lamb`` and ``LARS`` (skipped when not installed).
"""

from __future__ import annotations

import io
import re

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from lsdl_lab import optim
from lsdl_lab.models import MLP, ResNet
from lsdl_lab.optim.lars import param_groups_for_layerwise

EXACT = dict(rtol=0.0, atol=0.0)
SHAPES = [(6, 5), (5,), (3, 2, 2), (4, 4)]

# -- explicit parameters and gradients ------------------------------------------------------


def tensors(seed: int, scale=1.0, shapes=SHAPES):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g, dtype=torch.float64) * scale for s in shapes]


def params_like(seed=0, shapes=SHAPES):
    return [w.requires_grad_() for w in tensors(seed, shapes=shapes)]


def run_grads(opt, params, grads_per_step):
    """Apply the given gradients, one list per step; return each step's update."""
    updates = []
    for grads in grads_per_step:
        before = [p.detach().clone() for p in params]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
        updates.append([p.detach() - b for p, b in zip(params, before)])
    return updates


log_scale = st.floats(-6.0, 6.0).map(lambda e: 10.0**e)


@settings(max_examples=25, deadline=None)
@given(scales=st.lists(log_scale, min_size=4, max_size=4), lam=st.sampled_from([0.0, 0.01, 1.0]),
       lr=st.floats(1e-4, 0.1),
       betas=st.tuples(st.floats(0.0, 0.99), st.floats(0.5, 0.999)))  # fmt: skip
def test_lamb_step_norm_is_lr_times_weight_norm(scales, lam, lr, betas):
    params = params_like()
    opt = optim.LAMB(params, lr=lr, betas=betas, weight_decay=lam)
    for s in range(1, 4):  # every step, not only the first
        weights = [p.detach().clone() for p in params]
        grads = [g * c for g, c in zip(tensors(s), scales)]
        for w, u in zip(weights, run_grads(opt, params, [grads])[0]):
            assert u.norm().item() == pytest.approx(lr * w.norm().item(), rel=1e-9)


@settings(max_examples=25, deadline=None)
@given(scales=st.lists(log_scale, min_size=4, max_size=4), lr=st.floats(0.1, 10.0),
       eta=st.floats(1e-4, 0.1), momentum=st.floats(0.0, 0.95))  # fmt: skip
def test_lars_first_step_norm_is_lr_eta_weight_norm(scales, lr, eta, momentum):
    params = params_like()
    weights = [p.detach().clone() for p in params]
    opt = optim.LARS(params, lr=lr, momentum=momentum, trust_coefficient=eta, eps=0.0)
    grads = [g * c for g, c in zip(tensors(1), scales)]
    for w, u in zip(weights, run_grads(opt, params, [grads])[0]):
        assert u.norm().item() == pytest.approx(lr * eta * w.norm().item(), rel=1e-9)


@pytest.mark.parametrize("name", ["LARS", "LAMB"])
@settings(max_examples=15, deadline=None)
@given(scales=st.lists(st.floats(-3.0, 3.0).map(lambda e: 10.0**e), min_size=4, max_size=4),
       nesterov=st.booleans())  # fmt: skip
def test_without_weight_decay_updates_ignore_each_layers_gradient_scale(name, scales, nesterov):
    kw = dict(lr=0.5, momentum=0.9, nesterov=nesterov) if name == "LARS" else dict(lr=0.01)
    steps = [tensors(s) for s in range(1, 6)]
    runs = []
    for c in ([1.0] * 4, scales):  # each layer's gradients times its own constant, every step
        params = params_like()
        opt = getattr(optim, name)(params, eps=0.0, **kw)  # with eps, invariant up to eps
        runs.append(run_grads(opt, params, [[g * k for g, k in zip(gs, c)] for gs in steps]))
    for step_a, step_b in zip(*runs):
        for a, b in zip(step_a, step_b):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=0.0)


def test_zero_norm_layers_get_trust_ratio_one():
    w, b = torch.zeros(3, 4, dtype=torch.float64), torch.zeros(4, dtype=torch.float64)
    g, h = tensors(1, shapes=[(3, 4), (4,)])
    # LARS: zero weights, so tau = 1 and the first step is -lr * g (d = g + lam * 0)
    p, q = w.clone().requires_grad_(), b.clone().requires_grad_()
    opt = optim.LARS([p, q], lr=0.1, weight_decay=0.1)
    (u, v), = run_grads(opt, [p, q], [[g, h]])  # fmt: skip
    torch.testing.assert_close(u, -0.1 * g, **EXACT)
    torch.testing.assert_close(v, -0.1 * h, **EXACT)
    # LAMB: tau = 1 is AdamW's step (up to rounding: LAMB folds the bias corrections into
    # other operations than AdamW does), with weight decay and without
    for lam in (0.1, 0.0):
        p, q = w.clone().requires_grad_(), b.clone().requires_grad_()
        p2, q2 = w.clone().requires_grad_(), b.clone().requires_grad_()
        lamb = optim.LAMB([p, q], lr=0.1, weight_decay=lam)
        ours = run_grads(lamb, [p, q], [[g, h]])
        adamw = optim.AdamW([p2, q2], lr=0.1, eps=1e-6, weight_decay=lam)
        theirs = run_grads(adamw, [p2, q2], [[g, h]])
        for a, c in zip(ours[0], theirs[0]):
            torch.testing.assert_close(a, c, rtol=1e-14, atol=0.0)
    assert ours[0][0].abs().min() > 0.09  # it moved: |m_hat / sqrt(v_hat)| = 1 at step 1


@pytest.mark.parametrize("name, kw", [("LARS", dict(eps=0.0)), ("LAMB", dict())])
def test_zero_gradient_without_decay_gives_a_zero_finite_step(name, kw):
    # LARS: 0 / (0 + 0) would be NaN; LAMB: r = 0 / (0 + eps) = 0, so ||u|| = 0
    p = torch.ones(3, 3, dtype=torch.float64, requires_grad=True)
    opt = getattr(optim, name)([p], lr=0.1, **kw)
    (u,) = run_grads(opt, [p], [[torch.zeros(3, 3, dtype=torch.float64)]])[0]
    assert torch.equal(u, torch.zeros(3, 3, dtype=torch.float64))


def test_lamb_clamp_bounds_phi():
    shapes = [(4, 4), (4, 4), (4, 4)]
    params = [w * c for w, c in zip(tensors(0, shapes=shapes), (0.01, 1.0, 100.0))]
    params = [w.requires_grad_() for w in params]
    weights = [p.detach().clone() for p in params]
    opt = optim.LAMB(params, lr=0.01, clamp=(0.5, 10.0))
    for w, u in zip(weights, run_grads(opt, params, [tensors(1, shapes=shapes)])[0]):
        phi = min(max(w.norm().item(), 0.5), 10.0)
        assert u.norm().item() == pytest.approx(0.01 * phi, rel=1e-9)


# -- trust=False: SGD with momentum and AdamW, bit for bit ----------------------------------

STEPS = 40


def batch(t: int):
    g = torch.Generator().manual_seed(1000 + t)
    return torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)


def make_model():
    torch.manual_seed(0)
    return MLP(6, 3, hidden=12, depth=2)


def train(model, opt, steps=range(STEPS)):
    for t in steps:
        x, y = batch(t)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return model, opt


def run(make_opt, steps=STEPS):
    model = make_model()
    return train(model, make_opt(model), range(steps))


def assert_same_params(a, b, **tol):
    for pa, pb in zip(a[0].parameters(), b[0].parameters(), strict=True):
        torch.testing.assert_close(pa, pb, **(tol or EXACT))


SGD_CASES = [
    dict(lr=0.1, momentum=0.9),
    dict(lr=0.05, momentum=0.5, weight_decay=1e-2),
    dict(lr=0.05, momentum=0.9, weight_decay=1e-3, nesterov=True),
    dict(lr=0.1, momentum=0.0, weight_decay=1e-2),
]


@pytest.mark.parametrize("kw", SGD_CASES)
def test_lars_without_trust_is_sgd_with_momentum(kw):
    ours = run(lambda m: optim.LARS(m.parameters(), trust=False, **kw))
    assert_same_params(ours, run(lambda m: optim.SGD(m.parameters(), **kw)))
    assert_same_params(ours, run(lambda m: torch.optim.SGD(m.parameters(), foreach=True, **kw)))


ADAM_CASES = [
    dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.1),
    dict(lr=3e-3, betas=(0.5, 0.9), eps=1e-8, weight_decay=0.0),
]


@pytest.mark.parametrize("kw", ADAM_CASES)
def test_lamb_without_trust_is_adamw(kw):
    ours = run(lambda m: optim.LAMB(m.parameters(), trust=False, **kw))
    assert_same_params(ours, run(lambda m: optim.AdamW(m.parameters(), **kw)))
    assert_same_params(ours, run(lambda m: torch.optim.AdamW(m.parameters(), foreach=True, **kw)))
    if not kw["weight_decay"]:
        assert_same_params(ours, run(lambda m: torch.optim.Adam(m.parameters(), **kw)))


# -- foreach, resume ------------------------------------------------------------------------

FULL = {
    "LARS": dict(lr=2.0, momentum=0.9, weight_decay=1e-3, nesterov=True),
    "LAMB": dict(lr=1e-2, betas=(0.8, 0.99), weight_decay=0.01, clamp=(0.0, 10.0)),
}


def layerwise(name, foreach=True):
    def make(model):
        groups = param_groups_for_layerwise(model, FULL[name]["weight_decay"])
        kw = {k: v for k, v in FULL[name].items() if k != "weight_decay"}
        return getattr(optim, name)(groups, **kw, foreach=foreach)

    return make


@pytest.mark.parametrize("name", ["LARS", "LAMB"])
def test_foreach_false_equals_foreach_true(name):
    a = run(layerwise(name, foreach=True))
    b = run(layerwise(name, foreach=False))
    assert_same_params(a, b)
    for pa, pb in zip(a[0].parameters(), b[0].parameters()):
        for key, value in a[1].state[pa].items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(b[1].state[pb][key]))


@pytest.mark.parametrize("name", ["LARS", "LAMB"])
def test_resume_from_state_dict_is_exact(name):
    uninterrupted = run(layerwise(name))
    model = make_model()
    opt = layerwise(name)(model)
    train(model, opt, range(STEPS // 2))
    buffer = io.BytesIO()
    torch.save(dict(model=model.state_dict(), opt=opt.state_dict()), buffer)
    buffer.seek(0)
    saved = torch.load(buffer)
    torch.manual_seed(123)
    model = MLP(6, 3, hidden=12, depth=2)
    model.load_state_dict(saved["model"])
    opt = getattr(optim, name)(param_groups_for_layerwise(model), lr=123.0)
    opt.load_state_dict(saved["opt"])
    assert opt.param_groups[0]["lr"] == FULL[name]["lr"]
    assert opt.param_groups[1]["trust"] is False
    assert_same_params(train(model, opt, range(STEPS // 2, STEPS)), uninterrupted)


def test_resnet_trains_with_layerwise_groups():
    # conv kernels, BatchNorm scales and shifts, a linear layer: loss falls with both
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 1, 8, 8, generator=g), torch.randint(0, 10, (32,), generator=g)
    for make in (lambda m: optim.LARS(param_groups_for_layerwise(m, 1e-4), lr=5.0),
                 lambda m: optim.LAMB(param_groups_for_layerwise(m, 1e-2), lr=0.02)):  # fmt: skip
        torch.manual_seed(0)
        model = ResNet(8, 4, 10, 1)
        opt = make(model)
        losses = []
        for _ in range(15):
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        assert losses[-1] < 0.7 * losses[0], losses


# -- parameter groups -----------------------------------------------------------------------


def test_param_groups_for_layerwise():
    model = ResNet(8, 4, 10, 1)
    next(model.parameters()).requires_grad_(False)  # frozen parameters are left out
    decayed, excluded = param_groups_for_layerwise(model, 5e-4)
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert {id(p) for p in decayed["params"] + excluded["params"]} == {id(p) for p in trainable}
    assert len(decayed["params"]) + len(excluded["params"]) == len(trainable)
    assert all(p.ndim >= 2 for p in decayed["params"]) and decayed["weight_decay"] == 5e-4
    assert "trust" not in decayed  # the optimizer's default
    assert all(p.ndim == 1 for p in excluded["params"])
    assert excluded["weight_decay"] == 0.0 and excluded["trust"] is False
    assert len(param_groups_for_layerwise(torch.nn.Linear(3, 2, bias=False))) == 1


# -- bad input ------------------------------------------------------------------------------

nan, inf = float("nan"), float("inf")
BAD = [
    *[(n, dict(lr=-1.0), "Invalid learning rate: -1.0") for n in ("LARS", "LAMB")],
    *[(n, dict(lr=nan), "Invalid learning rate: nan") for n in ("LARS", "LAMB")],
    *[(n, dict(weight_decay=-0.1), "Invalid weight_decay value: -0.1") for n in ("LARS", "LAMB")],
    *[(n, dict(eps=-1e-8), "Invalid epsilon value: -1e-08") for n in ("LARS", "LAMB")],
    *[(n, dict(trust="yes"), "Invalid trust: 'yes' (expected True or False)")
      for n in ("LARS", "LAMB")],
    ("LARS", dict(momentum=1.0), "Invalid momentum value: 1.0 (expected a number in [0, 1))"),
    ("LARS", dict(momentum=-0.1), "Invalid momentum value: -0.1"),
    ("LARS", dict(trust_coefficient=0.0),
     "Invalid trust_coefficient value: 0.0 (expected a finite number > 0)"),
    ("LARS", dict(trust_coefficient=inf), "Invalid trust_coefficient value: inf"),
    ("LARS", dict(momentum=0.0, nesterov=True), "Nesterov momentum requires a momentum"),
    ("LAMB", dict(betas=(1.0, 0.999)), "Invalid beta parameter at index 0: 1.0"),
    ("LAMB", dict(betas=(0.9, nan)), "Invalid beta parameter at index 1: nan"),
    ("LAMB", dict(bias_correction=1), "Invalid bias_correction: 1 (expected True or False)"),
    *[("LAMB", dict(clamp=c), f"Invalid clamp: {c!r} (expected None or a pair (lower, upper)")
      for c in [(1.0, 0.5), (-1.0, 2.0), (1.0,), 10.0, (inf, inf), (0.0, nan)]],
]  # fmt: skip


@pytest.mark.parametrize("name, kw, message", BAD)
def test_bad_hyperparameters_raise_value_error(name, kw, message):
    cls = getattr(optim, name)
    kw = {"lr": 0.1, **kw}
    with pytest.raises(ValueError, match=re.escape(message)):
        cls([torch.zeros(2, requires_grad=True)], **kw)
    opt = cls([torch.zeros(2, requires_grad=True)], lr=0.1)  # and in a group added later
    with pytest.raises(ValueError, match=re.escape(message)):
        opt.add_param_group(dict(params=[torch.zeros(3, requires_grad=True)], **kw))
    assert len(opt.param_groups) == 1


def test_lars_needs_a_learning_rate():
    with pytest.raises(TypeError):
        optim.LARS([torch.zeros(2, requires_grad=True)])


# -- reference: pytorch-optimizer -----------------------------------------------------------


def test_matches_pytorch_optimizer_lamb():
    po = pytest.importorskip("pytorch_optimizer")
    # Its Lamb: no bias correction inside the ratio, the step divided by 1 - beta1^t after
    # it, ||w|| clamped at 10, its eps added to ||u||, decay inside the ratio with
    # weight_decouple=False. So: ours with bias_correction=False, clamp=(0, 10) and the
    # learning rate lr / (1 - beta1^t), equal up to eps (1e-10 here, in both).
    lr, betas, lam, eps = 1e-2, (0.9, 0.99), 0.01, 1e-10
    model = make_model().double()
    theirs = po.Lamb(model.parameters(), lr=lr, betas=betas, weight_decay=lam,
                     weight_decouple=False, eps=eps)  # fmt: skip
    ref = make_model().double()
    ours = optim.LAMB(ref.parameters(), lr=lr, betas=betas, weight_decay=lam, eps=eps,
                      bias_correction=False, clamp=(0.0, 10.0))  # fmt: skip
    for t in range(STEPS):
        ours.param_groups[0]["lr"] = lr / (1 - betas[0] ** (t + 1))
        x, y = batch(t)
        for m, o in ((model, theirs), (ref, ours)):
            o.zero_grad()
            F.cross_entropy(m(x.double()), y).backward()
            o.step()
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-7, atol=1e-10)


def test_matches_pytorch_optimizer_lars():
    po = pytest.importorskip("pytorch_optimizer")
    # Its LARS adapts tensors with ndim > 1 only and gives the others plain SGD steps without
    # weight decay: our param_groups_for_layerwise; no eps in its ratio: eps=0.
    kw = dict(lr=2.0, momentum=0.9, trust_coefficient=0.01)
    a = run(lambda m: po.LARS(m.parameters(), weight_decay=1e-3, **kw))
    b = run(lambda m: optim.LARS(param_groups_for_layerwise(m, 1e-3), eps=0.0, **kw))
    assert_same_params(a, b)
