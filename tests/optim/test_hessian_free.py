"""HessianFree: its Gauss-Newton products against curvature.GGNOperator and a dense
J^T H J, CG solving (G + lambda I) delta = -g to its tolerance inside a step, the budget and
the warm start, Levenberg-Marquardt damping on constructed good and bad steps, and Newton
and HF against gradient descent in iterations to a target loss (measured). The optimizer
contract (foreach, exact resume, groups, bad hyperparameters) is in test_contract.py. The
tests of a step run on every device of the ``device`` fixture (models and data made on the
CPU from their seeds, then moved); the race to a target loss and the refusals stay on the
CPU."""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lsdl_lab import curvature, optim
from lsdl_lab.models import MLP
from lsdl_lab.optim.hessian_free import LossGGN


def classifier(device="cpu"):
    torch.manual_seed(0)
    model = MLP(5, 3, hidden=6, depth=1).double()
    x, y = torch.randn(24, 5, dtype=torch.float64), torch.randint(0, 3, (24,))
    model, x, y = model.to(device), x.to(device), y.to(device)

    def closure():
        out = model(x)
        return F.cross_entropy(out, y), out

    return model, x, y, closure


def test_gauss_newton_products_equal_ggn_operator_and_dense_jthj(device):
    model, x, y, closure = classifier(device)
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    loss, out = closure()
    eye = torch.eye(n, dtype=torch.float64, device=device)
    G = LossGGN(loss, out, params, torch.full((n,), 0.5, dtype=torch.float64, device=device))
    dense = torch.stack([G.ggn(e) for e in eye])
    reference = curvature.GGNOperator(model, F.cross_entropy, [(x, y)])
    torch.testing.assert_close(dense, torch.stack([reference @ e for e in eye]))
    # and J^T H_l J from the Jacobian and the loss's Hessian in the outputs, formed densely
    names = [name for name, _ in model.named_parameters()]

    def outputs(flat):
        shaped = dict(zip(names, torch.split(flat, [p.numel() for p in params])))
        shaped = {k: v.view_as(p) for (k, v), p in zip(shaped.items(), params)}
        return torch.func.functional_call(model, shaped, (x,)).flatten()

    flat = torch.cat([p.detach().flatten() for p in params])
    J = torch.func.jacrev(outputs)(flat)
    f = out.detach().flatten()
    H_l = torch.func.hessian(lambda f: F.cross_entropy(f.view(24, 3), y))(f)
    torch.testing.assert_close(dense, J.T @ H_l @ J)
    v = torch.randn(n, dtype=torch.float64).to(device)
    torch.testing.assert_close(G @ v, J.T @ H_l @ J @ v + 0.5 * v)


def test_cg_inside_a_step_solves_the_damped_system_to_its_tolerance(device):
    model, x, y, closure = classifier(device)
    params = list(model.parameters())
    loss = F.cross_entropy(model(x), y)
    g = torch.cat([t.flatten() for t in torch.autograd.grad(loss, params)])
    before = copy.deepcopy(model)  # GGNOperator's products use the weights of their time
    G = curvature.GGNOperator(before, F.cross_entropy, [(x, y)])
    opt = optim.HessianFree(model.parameters(), damping=0.1, cg_iters=500, cg_tol=1e-9)
    opt.step(closure)
    delta = torch.cat([opt.state[p]["direction"].flatten() for p in params])
    residual = G @ delta + 0.1 * delta + g  # (G + lambda I) delta - (-g), at the old weights
    assert opt.last["cg"].converged and residual.norm() <= 2e-9 * g.norm()
    # the budget: 2 products leave the residual far above the tolerance
    model, x, y, closure = classifier(device)
    opt = optim.HessianFree(model.parameters(), damping=0.1, cg_iters=2, cg_tol=1e-9)
    opt.step(closure)
    info = opt.last["cg"]
    assert info.iterations == 2 and not info.converged and info.residual_norms[-1] > 1e-3


def test_cg_starts_from_the_decayed_previous_solution(device):
    model, x, y, closure = classifier(device)
    params = list(model.parameters())
    opt = optim.HessianFree(model.parameters(), damping=0.5, cg_iters=5, adapt_damping=False)
    opt.step(closure)
    previous = torch.cat([opt.state[p]["direction"].flatten() for p in params])
    loss = F.cross_entropy(model(x), y)
    g = torch.cat([t.flatten() for t in torch.autograd.grad(loss, params)])
    G = curvature.GGNOperator(model, F.cross_entropy, [(x, y)])
    x0 = 0.95 * previous
    expected = (-g - (G @ x0 + 0.5 * x0)).norm().item()  # the residual CG starts from
    opt.step(closure)
    assert opt.last["cg"].residual_norms[0] == pytest.approx(expected, rel=1e-10)
    # warm_start_decay=0: CG starts from zero, where the residual is the gradient
    model, x, y, closure = classifier(device)
    cold = optim.HessianFree(model.parameters(), damping=0.5, cg_iters=5, warm_start_decay=0.0)
    cold.step(closure)
    loss = F.cross_entropy(model(x), y)
    g = torch.cat([t.flatten() for t in torch.autograd.grad(loss, list(model.parameters()))])
    cold.step(closure)
    assert cold.last["cg"].residual_norms[0] == pytest.approx(g.norm().item(), rel=1e-12)


def sine_problem(target: float, damping: float, device="cpu"):
    """f(w) = 1/2 (sin w - target)^2 from w = 0: the Gauss-Newton model (cos^2 w = 1) is exact
    at first order, and wrong when the step is long (sin bends)."""
    w = nn.Parameter(torch.zeros(1, dtype=torch.float64, device=device))

    def closure():
        out = torch.sin(w)
        return 0.5 * ((out - target) ** 2).sum(), out

    opt = optim.HessianFree([w], damping=damping)
    return w, opt, closure


@pytest.mark.parametrize(("target", "factor"), [(0.5, 2 / 3), (3.0, 3 / 2)], ids=["good", "bad"])
def test_levenberg_marquardt_damping_follows_the_reduction_ratio(target, factor, device):
    lam = 1e-3
    w, opt, closure = sine_problem(target, lam, device)
    opt.step(closure)
    delta = target / (1 + lam)  # (G + lambda) delta = -g with g = -target, G = 1
    predicted = -target * delta + delta**2 / 2  # q(delta) - q(0), undamped
    actual = 0.5 * (math.sin(delta) - target) ** 2 - 0.5 * target**2
    rho = actual / predicted
    assert opt.last["rho"] == pytest.approx(rho, rel=1e-9)
    assert (rho > 3 / 4) if factor < 1 else (rho < 1 / 4)  # the constructed cases
    assert opt.param_groups[0]["damping"] == pytest.approx(lam * factor, rel=1e-12)
    assert w.item() == pytest.approx(delta)  # without a line search the step is taken


def test_the_line_search_backs_off_a_step_that_raises_the_loss(device):
    # target 4: the Gauss-Newton step w = 4 lands where sin w < 0, a higher loss; half of it
    # (w = 2) decreases the loss enough; rho measures that half step against the model
    lam = 1e-3
    w, opt, closure = sine_problem(4.0, lam, device)
    opt.param_groups[0]["line_search"] = True
    opt.step(closure)
    step = 0.5 * 4.0 / (1 + lam)
    assert opt.last["alpha"] == 0.5 and w.item() == pytest.approx(step)
    predicted = -4.0 * step + step**2 / 2
    actual = 0.5 * (math.sin(step) - 4.0) ** 2 - 8.0
    assert opt.last["rho"] == pytest.approx(actual / predicted, rel=1e-9)
    assert 1 / 4 < opt.last["rho"] < 3 / 4 and opt.param_groups[0]["damping"] == lam


def two_sines(lrs: tuple[float, float], backtracking: bool, lam: float = 1e-3, device="cpu"):
    """f(w) = 1/2 sum_i c_i (sin w_i - t_i)^2 from w = 0, c = (10, 1), t = (0.5, 4), each w_i
    a parameter in its own group with learning rate lrs[i]. At w = 0 the Gauss-Newton matrix
    is diag(c), so CG ends in two iterations, at the Gauss-Newton step w = t, where sin 4 < 0:
    a higher loss than at w = 0. CG's first iterate, a shorter step along -g, is better."""
    w = [nn.Parameter(torch.zeros(1, dtype=torch.float64, device=device)) for _ in range(2)]
    c, t = torch.tensor([10.0, 1.0], dtype=torch.float64), torch.tensor([0.5, 4.0]).double()
    c, t = c.to(device), t.to(device)

    def f(z):
        return 0.5 * (c * (torch.sin(z) - t) ** 2).sum()

    def closure():
        out = torch.sin(torch.cat(w))
        return 0.5 * (c * (out - t) ** 2).sum(), out

    groups = [dict(params=[p], lr=lr) for p, lr in zip(w, lrs)]
    opt = optim.HessianFree(groups, damping=lam, cg_iters=10, cg_tol=1e-12,
                            cg_backtracking=backtracking)  # fmt: skip
    # CG's iterates by hand on (diag(c) + lam I) x = c t, from x = 0
    b, A = c * t, c + lam
    x1 = (b @ b) / (b @ (A * b)) * b
    x2 = b / A
    return w, opt, closure, f, c, t, (x1, x2)


@pytest.mark.parametrize("lrs", [(1.0, 1.0), (1.0, 0.5)], ids=["one-lr", "two-lrs"])
def test_cg_backtracking_takes_the_best_kept_iterate_on_the_loss(lrs, device):
    # Martens (2010), Sec. 4.6: from the last CG iterate back while the loss decreases
    w, opt, closure, f, c, t, (x1, x2) = two_sines(lrs, backtracking=True, device=device)
    eta = torch.tensor(lrs, dtype=torch.float64, device=device)
    d1, d2 = eta * x1, eta * x2
    f0, f1, f2 = f(torch.zeros(2, dtype=torch.float64, device=device)), f(d1), f(d2)
    opt.step(closure)
    assert [it.k for it in opt.last["cg"].iterates] == [1, 2]
    # one learning rate: the last iterate overshoots (f2 > f0) and the first is taken;
    # with 0.5 on the second coordinate the last is better than the first and is kept
    chosen, f_chosen = (1, d1) if f1 < f2 else (2, d2)
    assert (chosen == 1) == (lrs == (1.0, 1.0)), (f0, f1, f2)
    assert opt.last["iteration"] == chosen
    torch.testing.assert_close(torch.cat(w).detach(), f_chosen, rtol=1e-12, atol=1e-14)
    d = f_chosen
    predicted = -(c * t) @ d + 0.5 * d @ (c * d)  # the undamped model, q(d) - q(0)
    rho = (f(d) - f0) / predicted
    assert opt.last["rho"] == pytest.approx(rho.item(), rel=1e-9)
    # the next CG run starts from the last iterate, as Martens does, not the chosen one
    direction = torch.cat([opt.state[p]["direction"] for p in w])
    torch.testing.assert_close(direction, x2, rtol=1e-12, atol=1e-14)
    # without backtracking: the last iterate, whatever the loss there
    w, opt, closure, *_ = two_sines(lrs, backtracking=False, device=device)
    opt.step(closure)
    assert opt.last["iteration"] == 2
    torch.testing.assert_close(torch.cat(w).detach(), d2, rtol=1e-12, atol=1e-14)


def test_a_model_whose_vectors_do_not_fit_is_refused_with_the_reason():
    model = MLP(64, 10, hidden=128, depth=1)  # 8,320 + 1,290 = 9,610 float32 parameters
    need = 11 * 9_610 * 4  # the gradient, CG's five, ..., the warm start, the saved direction
    reason = r"9,610 parameters: HessianFree would hold 11 vectors .* of max_bytes=400,000"
    with pytest.raises(ValueError, match=reason):
        optim.HessianFree(model.parameters(), max_bytes=400_000)
    optim.HessianFree(model.parameters(), max_bytes=need)  # exactly enough
    # backtracking keeps 14 iterates more at 50 CG iterations (1, 2, 3, 4, 5, 7, 9, 11, 14,
    # 18, 24, 31, 40, and the last)
    assert optim.hessian_free.backtracking_iterations(50) == [
        1, 2, 3, 4, 5, 7, 9, 11, 14, 18, 24, 31, 40
    ]  # fmt: skip
    with pytest.raises(ValueError, match=r"25 vectors .*14 kept CG iterates"):
        optim.HessianFree(model.parameters(), max_bytes=need, cg_backtracking=True)
    optim.HessianFree(model.parameters(), max_bytes=25 * 9_610 * 4, cg_backtracking=True)
    # by default the limit is the memory available on the device: a huge model is refused
    huge = [torch.empty(2**62 // 11 // 4 + 1, device="meta", requires_grad=True)]
    with pytest.raises(ValueError, match=r"available on meta"):
        optim.HessianFree(huge)
    # a group added later counts with the others
    first = optim.HessianFree(model.net[1].parameters(), max_bytes=need - 1290 * 44)
    with pytest.raises(ValueError, match="HessianFree would hold"):
        first.add_param_group(dict(params=model.net[3].parameters()))
    assert len(first.param_groups) == 1


def test_resume_restores_the_adapted_damping_and_the_direction(device):
    model, x, y, closure = classifier(device)
    opt = optim.HessianFree(model.parameters(), damping=1.0, cg_iters=5)
    for _ in range(3):
        opt.step(closure)
    buffer = io.BytesIO()
    torch.save(dict(model=model.state_dict(), opt=opt.state_dict()), buffer)
    buffer.seek(0)
    saved = torch.load(buffer)
    assert saved["opt"]["param_groups"][0]["damping"] != 1.0  # it was adapted
    for _ in range(3):
        opt.step(closure)  # the uninterrupted run

    resumed, x, y, resumed_closure = classifier(device)  # the same data; weights loaded below
    resumed.load_state_dict(saved["model"])
    again = optim.HessianFree(resumed.parameters(), damping=7.0, cg_iters=5)
    again.load_state_dict(saved["opt"])
    for _ in range(3):
        again.step(resumed_closure)
    for p, q in zip(model.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(p, q)
    assert again.param_groups[0]["damping"] == opt.param_groups[0]["damping"]


def test_the_closure_must_give_the_outputs():
    model, x, y, _ = classifier()
    opt = optim.HessianFree(model.parameters())
    with pytest.raises(TypeError, match=r"expected \(loss, outputs\)"):
        opt.step(lambda: F.cross_entropy(model(x), y))


# -- Newton and Hessian-free against gradient descent ----------------------------------------


def regression():
    """A small tanh MLP fitting a smooth teacher, float64: loss from 2.06 down to about 1e-4."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(128, 4, generator=g, dtype=torch.float64)
    teacher = torch.randn(4, 3, generator=g, dtype=torch.float64)
    y = torch.tanh(x @ teacher).sum(1, keepdim=True)
    y += 0.01 * torch.randn(128, 1, generator=g, dtype=torch.float64)
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).double()
    return model, x, y


def iterations_to(target: float, make, closure_of, budget: int) -> float:
    """The iterations an optimizer needs to bring the loss to ``target`` (inf if more than
    ``budget``)."""
    model, x, y = regression()
    opt = make(model.parameters())
    closure = closure_of(model, opt, x, y)
    for i in range(1, budget + 1):
        opt.step(closure)
        with torch.no_grad():
            if F.mse_loss(model(x), y).item() <= target:
                return i
    return math.inf


def first_order(model, opt, x, y):
    def closure():
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        return loss

    return closure


def test_newton_and_hf_need_far_fewer_iterations_than_gradient_descent():
    # Measured (1 CPU thread): to a loss of 1e-3 gradient descent needs 1306, 438 and 246
    # iterations at lr 0.1, 0.3, 0.5 and diverges at 0.7 and above; Newton (damping 1e-2,
    # line search) 13, Hessian-free (damping 1, 50 CG products) 11. In time: 0.65 s, 0.21 s
    # and 0.38 s.
    target = 1e-3
    gd = min(
        iterations_to(target, lambda p, lr=lr: torch.optim.SGD(p, lr=lr), first_order, 600)
        for lr in (0.1, 0.3, 0.5, 0.7)
    )
    newton = iterations_to(
        target, lambda p: optim.Newton(p, damping=1e-2, line_search=True),
        lambda m, o, x, y: lambda: F.mse_loss(m(x), y), 100,
    )  # fmt: skip

    def with_outputs(model, opt, x, y):
        def closure():
            out = model(x)
            return F.mse_loss(out, y), out

        return closure

    hf = iterations_to(target, lambda p: optim.HessianFree(p, cg_iters=50), with_outputs, 100)
    assert 200 < gd < math.inf
    assert newton * 5 < gd and hf * 5 < gd, (newton, hf, gd)
