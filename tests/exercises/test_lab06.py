"""The checkers of Lab 6 accept the reference solutions and reject the usual mistakes,
naming them; the references are what the library's optimizers compute."""

from __future__ import annotations

import pytest
import torch

from lsdl_lab import check, curvature
from lsdl_lab.exercises import lab06
from lsdl_lab.optim.kfac import kfac_precondition


@pytest.mark.parametrize("name", ["cg_step", "kron_solve", "inverse_root"])
def test_reference_passes(name, capsys):
    check.checker(f"lab06.{name}")(getattr(lab06, name))
    assert "✔" in capsys.readouterr().out


def test_cg_step_is_one_iteration_of_the_library_cg():
    A = lab06._spd(7, 30.0, 0)
    b = lab06._vector(7, 1)
    x, r, p = torch.zeros(7, dtype=torch.float64), b.clone(), b.clone()
    for k in range(1, 4):
        x, r, p = lab06.cg_step(A, x, r, p)
        ref, info = curvature.cg(curvature.DenseOperator(A), b, max_iters=k, tol=0.0)
        assert info.iterations == k
        torch.testing.assert_close(x, ref)
        torch.testing.assert_close(r.norm().item(), info.residual_norms[-1])


def test_kron_solve_is_kfac_preconditioning_without_damping():
    A, G = lab06._spd(3, 10.0, 0), lab06._spd(4, 10.0, 1)
    V = lab06._matrix(4, 3, 2)
    dA, QA = torch.linalg.eigh(A)
    dG, QG = torch.linalg.eigh(G)
    torch.testing.assert_close(lab06.kron_solve(A, G, V), kfac_precondition(V, QA, dA, QG, dG, 0.0))


def test_inverse_root_is_a_root():
    H = lab06._spd(5, 100.0, 3)
    R = lab06.inverse_root(H, 0.5, 0.0)
    torch.testing.assert_close(R @ R @ H, torch.eye(5, dtype=H.dtype))


def _entrywise_power(H, p, epsilon):
    return H.clamp(min=epsilon).pow(-p)


def _no_floor(H, p, epsilon):
    lam, Q = torch.linalg.eigh(H.double())
    return ((Q * lam.pow(-p)) @ Q.T).to(H.dtype)


def _plain_power(H, p, epsilon):
    return lab06.inverse_root(H, -p, epsilon)


def _old_beta(A, x, r, p):
    return lab06._cg_slip_old_beta(A, x, r, p)


def _no_beta(A, x, r, p):
    return lab06._cg_slip_steepest(A, x, r, p)


def _alpha_along_r(A, x, r, p):
    return lab06._cg_slip_alpha(A, x, r, p)


def _swapped(A, G, V):
    return torch.linalg.solve(G, torch.linalg.solve(A, V).mT).mT


def _product(A, G, V):
    return G @ V @ A


def _one_side(A, G, V):
    return torch.linalg.solve(G, V)


@pytest.mark.parametrize(
    "name, wrong, message",
    [
        ("cg_step", _old_beta, "NEW residual over the OLD"),
        ("cg_step", _no_beta, "steepest descent"),
        ("cg_step", _alpha_along_r, "curvature along p"),
        ("kron_solve", _swapped, "swapped"),
        ("kron_solve", _product, "the product"),
        ("kron_solve", _one_side, "both factors"),
        ("inverse_root", _entrywise_power, "ENTRY"),
        ("inverse_root", _no_floor, "floor the eigenvalues"),
        ("inverse_root", _plain_power, "INVERSE root"),
    ],
)
def test_mistakes_are_named(name, wrong, message):
    with pytest.raises(check.CheckFailed, match=message):
        check.checker(f"lab06.{name}")(wrong)
