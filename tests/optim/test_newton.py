"""Newton: one step on a quadratic, its Hessian against curvature.hessian_matrix, damping, the
indefinite cases (an added multiple of the identity; steepest descent at negative curvature),
the Armijo line search, and the refusals (a model too large, a closure that calls backward).
The optimizer contract (foreach, exact resume, groups, bad hyperparameters) is in
test_contract.py; the race against gradient descent in test_hessian_free.py. The tests that
step run on every device of the ``device`` fixture (matrices made on the CPU, then moved)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lsdl_lab import curvature, optim
from lsdl_lab.models import MLP
from lsdl_lab.optim.newton import LossHessian
from lsdl_lab.optim.second_order import backtracking_line_search


def quadratic(A: torch.Tensor, b: torch.Tensor):
    """f(w) = 1/2 w^T A w - b^T w on a parameter w (float64, on b's device), and its closure."""
    w = nn.Parameter(torch.zeros(len(b), dtype=torch.float64, device=b.device))
    return w, lambda: 0.5 * w @ A @ w - b @ w


def spd(n: int, seed: int, low: float = 0.1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    Q, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    return Q @ torch.diag(torch.linspace(low, 10.0, n, dtype=torch.float64)) @ Q.T


@pytest.mark.parametrize("method", ["exact", "cg"])
def test_one_step_on_a_quadratic_lands_on_the_minimum(method, device):
    A, b = spd(12, 0), torch.randn(12, generator=torch.Generator().manual_seed(1)).double()
    A, b = A.to(device), b.to(device)
    w, f = quadratic(A, b)
    opt = optim.Newton([w], method=method, cg_iters=12, cg_tol=1e-14)
    loss = opt.step(f)
    assert loss.item() == 0.0  # the loss where the step started, w = 0
    w_star = torch.linalg.solve(A, b)
    torch.testing.assert_close(w.detach(), w_star, rtol=1e-12, atol=1e-12)
    assert (A @ w.detach() - b).norm() < 1e-11 * b.norm()  # the gradient vanishes


def test_damping_gives_the_damped_step_and_lr_scales_it(device):
    A, b = spd(8, 2).to(device), torch.ones(8, dtype=torch.float64, device=device)
    w, f = quadratic(A, b)
    optim.Newton([w], lr=0.5, damping=0.3).step(f)
    expected = 0.5 * torch.linalg.solve(A + 0.3 * torch.eye(8).to(A), b)
    torch.testing.assert_close(w.detach(), expected, rtol=1e-12, atol=1e-14)


def test_groups_solve_one_system_with_their_own_damping_and_lr(device):
    A, b = spd(6, 3).to(device), torch.arange(1.0, 7.0, dtype=torch.float64, device=device)
    w, u = (nn.Parameter(torch.zeros(3, dtype=torch.float64, device=device)) for _ in range(2))

    def f():
        z = torch.cat([w, u])
        return 0.5 * z @ A @ z - b @ z

    opt = optim.Newton([dict(params=[w], damping=1.0, lr=0.5), dict(params=[u])], damping=0.1)
    opt.step(f)
    Lam = torch.diag(torch.tensor([1.0] * 3 + [0.1] * 3, dtype=torch.float64, device=device))
    d = torch.linalg.solve(A + Lam, b)
    torch.testing.assert_close(torch.cat([w, u]).detach(), torch.cat([0.5 * d[:3], d[3:]]))
    with pytest.raises(ValueError, match=r"Invalid method: 'cg' \(expected 'exact', as in"):
        opt.add_param_group(dict(params=[nn.Parameter(torch.zeros(1))], method="cg"))


def test_the_hessian_is_curvature_hessian_matrix(device):
    torch.manual_seed(0)
    model = MLP(5, 3, hidden=6, depth=1).double()
    x, y = torch.randn(20, 5, dtype=torch.float64), torch.randint(0, 3, (20,))
    model, x, y = model.to(device), x.to(device), y.to(device)
    params = list(model.parameters())
    grads = torch.autograd.grad(F.cross_entropy(model(x), y), params, create_graph=True)
    n = sum(p.numel() for p in params)
    damping = torch.full((n,), 0.25, dtype=torch.float64, device=device)
    H = LossHessian(list(grads), params, damping)
    reference = curvature.hessian_matrix(model, F.cross_entropy, [(x, y)])
    eye = torch.eye(n, dtype=torch.float64, device=device)
    torch.testing.assert_close(H.matrix(chunk=7), reference + 0.25 * eye)
    v = torch.randn(n, dtype=torch.float64).to(device)
    torch.testing.assert_close(H @ v, reference @ v + 0.25 * v)


def test_an_indefinite_hessian_gets_a_multiple_of_the_identity(device):
    # f = 1/2 w^T A w - b^T w with eigenvalues -1 and 2: the pure Newton step goes to the
    # saddle; Nocedal & Wright's Alg. 3.3 adds tau I until Cholesky succeeds
    A = torch.diag(torch.tensor([-1.0, 2.0], dtype=torch.float64, device=device))
    b = torch.tensor([1.0, 1.0], dtype=torch.float64, device=device)
    w, f = quadratic(A, b)
    optim.Newton([w]).step(f)
    d = w.detach()
    assert b @ d > 0  # a descent direction: the gradient at 0 is -b
    tau = 1.0 / d[0] + 1.0  # d_0 = 1 / (tau - 1) solves for tau ...
    assert tau > 1.0
    torch.testing.assert_close(d[1], 1.0 / (2.0 + tau))  # ... and the same tau shifts d_1
    tau_seen = tau.item() / (1e-3 * 2.0)  # tau = beta 2^k with beta = 1e-3 max |A_ii|
    assert abs(tau_seen - 2 ** round(torch.tensor(tau_seen).log2().item())) < 1e-9
    assert f().item() < 0.0


def test_cg_at_negative_curvature_takes_steepest_descent(device):
    A = -torch.eye(3, dtype=torch.float64, device=device)  # concave: negative curvature at once
    b = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64, device=device)
    w, f = quadratic(A, b)
    optim.Newton([w], lr=0.1, method="cg").step(f)
    torch.testing.assert_close(w.detach(), 0.1 * b)  # -lr g, g = -b


def test_armijo_backtracking_takes_the_first_sufficient_step():
    trials = []

    def f(alpha):  # f(alpha) = (alpha - 0.2)^2 along a direction with slope -0.4 at 0
        trials.append(alpha)
        return (alpha - 0.2) ** 2

    alpha, value = backtracking_line_search(f, 0.04, -0.4)
    assert trials == [1.0, 0.5, 0.25] and alpha == 0.25 and value == pytest.approx(0.0025)
    # an ascent direction never satisfies Armijo: no step
    assert backtracking_line_search(lambda a: 1.0 + a, 1.0, 1.0, max_backtracks=3) == (0.0, 1.0)


def test_the_line_search_stops_an_overshooting_newton_step(device):
    # f(w) = sqrt(1 + w^2): Newton's step from w = 2 jumps to -8 (pure Newton diverges
    # here); the line search halves it until the loss decreases enough
    w = nn.Parameter(torch.tensor([2.0], dtype=torch.float64, device=device))

    def f():
        return torch.sqrt(1 + w @ w)

    values = [f().item()]
    opt = optim.Newton([w], line_search=True)
    for _ in range(6):
        opt.step(f)
        values.append(f().item())
    assert all(b < a for a, b in zip(values[:4], values[1:4]))  # then at 1 to rounding
    assert abs(w.item()) < 1e-6 and values[-1] == 1.0
    w.data.fill_(2.0)
    optim.Newton([w]).step(f)
    assert w.item() == pytest.approx(-8.0)  # without the line search: w - (1 + w^2) w


def test_a_model_too_large_is_refused_with_the_reason():
    model = MLP(70, 10, hidden=64, depth=1)  # 4,544 + 650 = 5,194 parameters
    reason = r"5,194 parameters, more than max_params=5,000.*0\.2 GiB.*O\(P\^3\)"
    with pytest.raises(ValueError, match=reason):
        optim.Newton(model.parameters())
    optim.Newton(model.parameters(), max_params=6000)
    optim.Newton(model.parameters(), method="cg")  # products only: no dense Hessian
    first = optim.Newton(model.net[1].parameters())  # the first layer alone fits
    with pytest.raises(ValueError, match=reason):
        first.add_param_group(dict(params=model.net[3].parameters()))
    assert len(first.param_groups) == 1


def test_the_closure_must_return_the_loss_with_its_graph():
    w, f = quadratic(spd(3, 4), torch.ones(3, dtype=torch.float64))
    opt = optim.Newton([w])
    with pytest.raises(RuntimeError, match="needs a closure"):
        opt.step()

    def backward_first():
        loss = f()
        loss.backward()
        return loss

    with pytest.raises(RuntimeError, match="must not call backward"):
        opt.step(backward_first)
    with pytest.raises(TypeError, match="Invalid closure: it returned a float"):
        opt.step(lambda: 1.0)
