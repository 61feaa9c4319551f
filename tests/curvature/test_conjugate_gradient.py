"""Tests of lsdl_lab.curvature.conjugate_gradient.cg: dense systems with a known solution,
the damped Gauss-Newton system G v = -g of a small network, budget, warm start, an
indefinite operator, and bad arguments. The solves run on every device of the ``device``
fixture (matrices and models made on the CPU from their seeds, then moved there); the
bad-argument tests stay on the CPU."""

import pytest
import torch
import torch.nn.functional as F
from helpers import mlp, symmetric

from lsdl_lab import curvature as cv

pytestmark = pytest.mark.filterwarnings(
    "ignore:`torch.jit.script` is deprecated:DeprecationWarning"  # inside torch.func.jvp
)


def spd(n=30, condition=1e3, seed=0, device="cpu"):
    eigenvalues = torch.logspace(0, torch.log10(torch.tensor(condition)), n).double()
    return symmetric(eigenvalues, seed)[0].to(device)


@pytest.mark.parametrize("damping", [0.0, 0.5])
def test_cg_solves_a_dense_system_to_its_tolerance(damping, device):
    A = spd(device=device)
    op = cv.DenseOperator(A)
    b = torch.randn(30, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    b = b.to(device)
    x, info = cv.cg(op, b, damping=damping, tol=1e-8)
    M = A + damping * torch.eye(30, dtype=torch.float64, device=device)
    residual = (b - M @ x).norm() / b.norm()
    assert info.converged and not info.indefinite
    assert residual <= 1e-8 * 1.01
    assert info.residual_norms[-1] / b.norm() == pytest.approx(residual.item(), rel=1e-3)
    assert len(info.residual_norms) == info.iterations + 1 and op.products == info.iterations
    torch.testing.assert_close(x, torch.linalg.solve(M, b), rtol=1e-6, atol=0)


def test_cg_ends_in_as_many_steps_as_distinct_eigenvalues(device):
    A = symmetric(torch.tensor([1.0, 2.0, 5.0] * 4, dtype=torch.float64))[0].to(device)
    b = torch.ones(12, dtype=torch.float64, device=device)
    x, info = cv.cg(cv.DenseOperator(A), b, tol=1e-10)
    assert info.converged and info.iterations == 3


def test_cg_solves_the_damped_gauss_newton_system_of_a_network(device):
    """G v = -g, the Newton-like step of Hessian-free optimization (Martens, 2010)."""
    model, x, y = mlp(device=device)
    loss = F.cross_entropy(model(x), y)
    g = torch.cat([t.flatten() for t in torch.autograd.grad(loss, list(model.parameters()))])
    G = cv.GGNOperator(model, F.cross_entropy, [(x, y)])
    for damping, tol in [(1e-3, 1e-6), (1e-1, 1e-10)]:
        v, info = cv.cg(G, -g, damping=damping, tol=tol, max_iters=500)
        assert info.converged
        residual = (-g - (G @ v) - damping * v).norm() / g.norm()
        assert residual <= tol * 1.01


def test_budget_and_warm_start(device):
    A = spd(condition=1e4, device=device)
    op = cv.DenseOperator(A)
    b = torch.ones(30, dtype=torch.float64, device=device)
    x3, info3 = cv.cg(op, b, max_iters=3, tol=1e-12)
    assert info3.iterations == 3 and not info3.converged
    op.products = 0
    x, info = cv.cg(op, b, x0=x3, tol=1e-12)
    cold = cv.cg(cv.DenseOperator(A), b, tol=1e-12)[1]
    assert info.converged and info.residual_norms[0] == pytest.approx(info3.residual_norms[-1])
    assert op.products == info.iterations + 1  # the warm start's residual costs one product
    assert info.iterations <= cold.iterations
    _, at_solution = cv.cg(op, b, x0=x, tol=1e-6)
    assert at_solution.iterations == 0 and at_solution.converged


def test_kept_iterates_are_the_iterates_with_their_quadratic_form(device):
    A = spd(condition=1e2, device=device)
    op = cv.DenseOperator(A)
    b = torch.ones(30, dtype=torch.float64, device=device)
    x, info = cv.cg(op, b, damping=0.5, max_iters=9, tol=1e-14, keep=[1, 2, 5, 20])
    assert [it.k for it in info.iterates] == [1, 2, 5, 9]  # 20 never reached; the last kept
    assert torch.equal(info.iterates[-1].x, x)
    M = A + 0.5 * torch.eye(30, dtype=torch.float64, device=device)
    for it in info.iterates:
        again, _ = cv.cg(op, b, damping=0.5, max_iters=it.k, tol=1e-14)
        torch.testing.assert_close(it.x, again, rtol=1e-13, atol=1e-15)
        assert it.xAx == pytest.approx((it.x @ M @ it.x).item(), rel=1e-10)
    assert cv.cg(op, b, max_iters=3)[1].iterates == ()  # nothing kept unless asked


def test_cg_stops_on_an_indefinite_operator(device):
    A = symmetric(torch.tensor([3.0, 1.0, -2.0], dtype=torch.float64))[0].to(device)
    b = torch.tensor([1.0, 1.0, 1.0], dtype=torch.float64, device=device)
    _, info = cv.cg(cv.DenseOperator(A), b, max_iters=10, tol=1e-12, keep=range(1, 11))
    assert info.indefinite and not info.converged
    # the iterate kept last is the last that moved, not the product that met p^T A p <= 0
    assert info.iterates[-1].k == info.iterations - 1 == len(info.iterates)


@pytest.mark.parametrize(
    "kwargs, error, name",
    [
        (dict(damping=-1.0), ValueError, "damping"),
        (dict(max_iters=0), ValueError, "max_iters"),
        (dict(max_iters=2.5), TypeError, "max_iters"),
        (dict(tol=-1e-3), ValueError, "tol"),
        (dict(b=torch.ones(4, dtype=torch.float64)), ValueError, "b"),
        (dict(b=[1.0, 2.0, 3.0]), TypeError, "b"),
        (dict(x0=torch.ones(2, dtype=torch.float64)), ValueError, "x0"),
        (dict(A=torch.eye(3)), TypeError, "A"),
    ],
)
def test_bad_arguments_are_clear_errors(kwargs, error, name):
    args = {"A": cv.DenseOperator(torch.eye(3, dtype=torch.float64))}
    args["b"] = torch.ones(3, dtype=torch.float64)
    args |= kwargs
    with pytest.raises(error, match=f"Invalid {name}:"):
        cv.cg(args.pop("A"), args.pop("b"), **args)
