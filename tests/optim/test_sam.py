"""Tests of lsdl_lab.optim.sam, sharpness-aware minimization (Foret et al., 2021).

Equal to its base optimizer bit for bit when rho = 0; the perturbation has global norm rho
exactly; on a quadratic the step uses the gradient at w + rho g/||g|| (closed form), also
for ASAM; exact resume from state_dict with torch.optim and lsdl_lab bases; parameter
groups shared with the base optimizer; clear errors. The tests that step run on every
device of the ``device`` fixture (models and data made on the CPU from their seeds, then
moved there).
"""

import io

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from lsdl_lab import optim
from lsdl_lab.models import MLP

EXACT = dict(rtol=0.0, atol=0.0)


def data(step, n=32, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed * 1000 + step)
    x = torch.randn(n, 6, generator=gen)
    return x.to(device), (x[:, 0] + x[:, 1] > 0).long().to(device)


def make_model(seed=0, device="cpu"):
    torch.manual_seed(seed)
    return MLP(6, 2, hidden=12, depth=2).to(device)


def device_of(model):
    return next(model.parameters()).device


def sam_steps(model, opt, steps, start=0):
    """Steps of SAM's usual loop: gradient at w, then step(closure) at w + e(w)."""
    for t in range(start, start + steps):
        x, y = data(t, device=device_of(model))

        def closure(x=x, y=y):
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            return loss

        opt.zero_grad()
        closure()
        opt.step(closure)


def base_steps(model, opt, steps):
    for t in range(steps):
        x, y = data(t, device=device_of(model))
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()


def assert_same_params(a, b, **tol):
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, **(tol or EXACT))


BASES = [
    (torch.optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=1e-3, foreach=True)),
    (optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True)),
    (optim.Adam, dict(lr=1e-2, weight_decay=1e-2)),
]


@pytest.mark.parametrize("base,kwargs", BASES)
def test_rho_zero_is_the_base_optimizer_bit_for_bit(base, kwargs, device):
    a, b = make_model(device=device), make_model(device=device)
    sam_steps(a, optim.SAM(a.parameters(), base, rho=0.0, **kwargs), 10)
    base_steps(b, base(b.parameters(), **kwargs), 10)
    assert_same_params(a, b)


def test_parameter_groups_with_their_own_lr_pass_through(device):
    a, b = make_model(device=device), make_model(device=device)

    def groups(m):
        return [
            {"params": list(m.net[1].parameters()), "lr": 0.3},
            {"params": list(m.net[3].parameters())},
            {"params": list(m.net[5].parameters()), "lr": 0.01, "momentum": 0.5},
        ]

    sam = optim.SAM(groups(a), optim.SGD, rho=0.0, lr=0.1, momentum=0.9)
    assert sam.base_optimizer.param_groups is sam.param_groups
    assert [g["lr"] for g in sam.param_groups] == [0.3, 0.1, 0.01]
    assert all(g["rho"] == 0.0 and g["adaptive"] is False for g in sam.param_groups)
    scheduler = torch.optim.lr_scheduler.StepLR(sam, step_size=1, gamma=0.5)
    sam_steps(a, sam, 5)
    base_steps(b, optim.SGD(groups(b), lr=0.1, momentum=0.9), 5)
    assert_same_params(a, b)
    scheduler.step()  # acting on SAM's groups, it acts on the base optimizer's
    assert sam.base_optimizer.param_groups[0]["lr"] == 0.15


@settings(max_examples=25, deadline=None)
@given(rho=st.floats(1e-4, 10.0), seed=st.integers(0, 2**16))
def test_first_step_moves_by_rho_in_global_norm_along_the_gradient(rho, seed, device):
    model = make_model(seed, device).double()  # float64: (w + e) - w is e to ~1e-16
    params = list(model.parameters())
    sam = optim.SAM(
        [{"params": params[:2]}, {"params": params[2:]}], torch.optim.SGD, rho=rho, lr=0.1
    )
    x, y = data(seed, device=device)
    x = x.double()
    F.cross_entropy(model(x), y).backward()
    w = [p.detach().clone() for p in params]
    g = torch.cat([p.grad.reshape(-1) for p in params])
    sam.first_step()
    moved = torch.cat([(p.detach() - wi).reshape(-1) for p, wi in zip(params, w)])
    e = torch.cat([sam.state[p]["e_w"].reshape(-1) for p in params])
    torch.testing.assert_close(e, rho * g / g.norm())
    assert e.norm().item() == pytest.approx(rho, rel=1e-12)
    torch.testing.assert_close(moved, e, rtol=1e-9, atol=1e-15)
    F.cross_entropy(model(x), y).backward()
    sam.second_step()
    assert all("w" not in sam.state[p] for p in params)


def quadratic(seed=0, n=5, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    Q, _ = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))
    A = Q @ torch.diag(torch.linspace(0.5, 4.0, n, dtype=torch.float64)) @ Q.T
    w = nn.Parameter(torch.randn(n, generator=gen, dtype=torch.float64).to(device))
    return A.to(device), w


@pytest.mark.parametrize("adaptive", [False, True])
def test_on_a_quadratic_the_step_uses_the_gradient_at_the_perturbed_point(adaptive, device):
    A, w = quadratic(device=device)
    rho, lr = 0.3, 0.05
    w0 = w.detach().clone()
    g = A @ w0
    T = w0.abs() if adaptive else torch.ones_like(w0)
    e = rho * T**2 * g / (T * g).norm()  # Foret et al. Eq. 2; Kwon et al. Eq. 9
    expected = w0 - lr * (A @ (w0 + e))

    def closure():
        loss = 0.5 * w @ A @ w
        loss.backward()
        return loss

    sam = optim.SAM([w], optim.SGD, rho=rho, adaptive=adaptive, lr=lr)
    closure()
    loss = sam.step(closure)
    torch.testing.assert_close(w.detach(), expected, rtol=1e-13, atol=1e-14)
    # step returns the closure's loss: the loss at the perturbed weights
    assert loss.item() == pytest.approx((0.5 * (w0 + e) @ A @ (w0 + e)).item(), rel=1e-13)


def test_a_zero_gradient_leaves_the_weights_in_place(device):
    model = make_model(device=device)
    sam = optim.SAM(model.parameters(), torch.optim.SGD, lr=0.1)
    x, y = data(0, device=device)

    def closure():
        loss = 0.0 * model(x).sum()
        loss.backward()
        return loss

    before = [p.detach().clone() for p in model.parameters()]
    closure()
    sam.first_step()
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p, b) and torch.count_nonzero(sam.state[p]["e_w"]) == 0
    sam.second_step()
    closure()
    sam.step(closure)
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p, b)  # no NaN anywhere


@pytest.mark.parametrize("base,kwargs", BASES)
def test_state_dict_resume_is_exact(base, kwargs, device):
    straight = make_model(device=device)
    sam_steps(straight, optim.SAM(straight.parameters(), base, rho=0.05, **kwargs), 10)

    first = make_model(device=device)
    opt = optim.SAM(first.parameters(), base, rho=0.05, **kwargs)
    sam_steps(first, opt, 5)
    buffer = io.BytesIO()
    torch.save({"model": first.state_dict(), "optimizer": opt.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer)

    resumed = make_model(seed=1, device=device)  # other weights, overwritten by the checkpoint
    opt2 = optim.SAM(resumed.parameters(), base, rho=0.5, **kwargs)
    resumed.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["optimizer"])
    assert opt2.param_groups[0]["rho"] == 0.05
    assert opt2.base_optimizer.param_groups is opt2.param_groups
    sam_steps(resumed, opt2, 5, start=5)
    assert_same_params(resumed, straight)


def test_sam_trains(device):
    # SAM is an optimizer: a few dozen steps lower the training loss.
    model = make_model(device=device)
    x, y = data(0, n=256, device=device)
    before = F.cross_entropy(model(x), y).item()
    opt = optim.SAM(model.parameters(), torch.optim.SGD, rho=0.05, lr=0.2, momentum=0.9)
    for _ in range(40):

        def closure():
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            return loss

        opt.zero_grad()
        closure()
        opt.step(closure)
    assert F.cross_entropy(model(x), y).item() < 0.5 * before


def test_bad_arguments():
    params = list(make_model().parameters())
    with pytest.raises(ValueError, match="Invalid rho: -1"):
        optim.SAM(params, torch.optim.SGD, rho=-1, lr=0.1)
    with pytest.raises(ValueError, match="Invalid rho"):
        optim.SAM([{"params": params, "rho": float("nan")}], torch.optim.SGD, lr=0.1)
    with pytest.raises(TypeError, match="Invalid adaptive"):
        optim.SAM(params, torch.optim.SGD, adaptive=1, lr=0.1)
    with pytest.raises(TypeError, match="Invalid base_optimizer"):
        optim.SAM(params, torch.optim.SGD(params, lr=0.1))
    with pytest.raises(ValueError, match="Invalid learning rate"):
        optim.SAM(params, optim.Adam, lr=-1.0)  # the base optimizer's own validation
    sam = optim.SAM(params[:2], torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match="Invalid rho"):
        sam.add_param_group({"params": params[2:], "rho": -0.1})
    assert len(sam.param_groups) == 1 and len(sam.base_optimizer.param_groups) == 1
    sam.add_param_group({"params": params[2:], "lr": 0.2})
    assert sam.param_groups[1]["rho"] == 0.05 and sam.param_groups[1]["momentum"] == 0
    with pytest.raises(TypeError, match="needs a closure"):
        sam.step()
    with pytest.raises(RuntimeError, match="no gradient"):
        sam.first_step()
    with pytest.raises(ValueError, match="base_optimizer"):
        sam.load_state_dict(torch.optim.SGD(params, lr=0.1).state_dict())
