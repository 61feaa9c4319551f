"""The checkers of Lab 6 accept the reference solutions and reject the usual mistakes,
naming them; the references are what the library's optimizers compute."""

from __future__ import annotations

import pytest
import torch

from lsdl_lab import check, curvature
from lsdl_lab.exercises import lab06
from lsdl_lab.optim.kfac import kfac_precondition

f64 = torch.float64


def spd(n, seed):
    """A random symmetric positive definite matrix."""
    M = torch.randn(n, n, generator=torch.Generator().manual_seed(seed), dtype=f64)
    return M @ M.T + n * torch.eye(n, dtype=f64)


@pytest.mark.parametrize("name", ["cg_step", "kron_solve", "inverse_root"])
def test_reference_passes(name, capsys):
    check.checker(f"lab06.{name}")(getattr(lab06, name))
    assert "✔" in capsys.readouterr().out


def test_cg_step_is_one_iteration_of_the_library_cg():
    A, b = spd(7, 0), torch.randn(7, generator=torch.Generator().manual_seed(1), dtype=f64)
    x, r, p = torch.zeros(7, dtype=f64), b.clone(), b.clone()
    for k in range(1, 4):
        x, r, p = lab06.cg_step(A, x, r, p)
        ref, info = curvature.cg(curvature.DenseOperator(A), b, max_iters=k, tol=0.0)
        assert info.iterations == k
        torch.testing.assert_close(x, ref)
        torch.testing.assert_close(r.norm().item(), info.residual_norms[-1])


def test_kron_solve_is_kfac_preconditioning_without_damping():
    A, G = spd(3, 0), spd(4, 1)
    V = torch.randn(4, 3, generator=torch.Generator().manual_seed(2), dtype=f64)
    dA, QA = torch.linalg.eigh(A)
    dG, QG = torch.linalg.eigh(G)
    torch.testing.assert_close(lab06.kron_solve(A, G, V), kfac_precondition(V, QA, dA, QG, dG, 0.0))


def test_inverse_root_is_a_root():
    H = spd(5, 3)
    R = lab06.inverse_root(H, 0.5, 0.0)
    torch.testing.assert_close(R @ R @ H, torch.eye(5, dtype=f64))


# -- mistakes a student makes, written independently of the checker's own slips ----------


def beta_of_new_residuals(A, x, r, p):
    step = (r @ r) / (p @ (A @ p))
    r2 = r - step * (A @ p)
    return x + step * p, r2, r2 + p  # beta = (r2·r2)/(r2·r2) = 1


def no_beta(A, x, r, p):
    step = (r @ r) / (p @ (A @ p))
    r2 = r - step * (A @ p)
    return x + step * p, r2, r2.clone()


def alpha_along_r(A, x, r, p):
    step = (r @ r) / (r @ (A @ r))
    r2 = r - step * (A @ p)
    return x + step * p, r2, r2 + (r2 @ r2) / (r @ r) * p


def inverses_swapped(A, G, V):
    return torch.linalg.inv(A) @ V @ torch.linalg.inv(G)


def the_product(A, G, V):
    return G @ V @ A.T


def only_g_inverted(A, G, V):
    return torch.linalg.inv(G) @ V


def entrywise(H, p, epsilon):
    return torch.where(H > epsilon, H, torch.full_like(H, epsilon)) ** (-p)


def unfloored(H, p, epsilon):
    lam, Q = torch.linalg.eigh(H.to(f64))
    return (Q @ torch.diag(lam ** (-p)) @ Q.T).to(H.dtype)


def a_root_not_an_inverse_root(H, p, epsilon):
    lam, Q = torch.linalg.eigh(H.to(f64))
    return (Q @ torch.diag(lam.clamp(min=epsilon) ** p) @ Q.T).to(H.dtype)


@pytest.mark.parametrize(
    "name, wrong, message",
    [
        ("cg_step", beta_of_new_residuals, "NEW residual over the OLD"),
        ("cg_step", no_beta, "steepest descent"),
        ("cg_step", alpha_along_r, "curvature along p"),
        ("kron_solve", inverses_swapped, "swapped"),
        ("kron_solve", the_product, "the product"),
        ("kron_solve", only_g_inverted, "both factors"),
        ("inverse_root", entrywise, "ENTRY"),
        ("inverse_root", unfloored, "floor the eigenvalues"),
        ("inverse_root", a_root_not_an_inverse_root, "INVERSE root"),
    ],
)
def test_mistakes_are_named(name, wrong, message):
    with pytest.raises(check.CheckFailed, match=message):
        check.checker(f"lab06.{name}")(wrong)
