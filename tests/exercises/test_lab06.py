"""The checkers of Lab 6 accept the reference solutions and reject the usual mistakes,
naming them; the references are what the library's optimizers compute (Newton–Schulz:
Muon's iteration, and in float64 the quintic applied to each singular value)."""

from __future__ import annotations

import pytest
import torch

from lsdl_lab import check, curvature
from lsdl_lab.exercises import lab06
from lsdl_lab.optim.kfac import kfac_precondition
from lsdl_lab.optim.muon import newton_schulz

f64 = torch.float64


def spd(n, seed):
    """A random symmetric positive definite matrix."""
    M = torch.randn(n, n, generator=torch.Generator().manual_seed(seed), dtype=f64)
    return M @ M.T + n * torch.eye(n, dtype=f64)


@pytest.mark.parametrize("name", ["cg_step", "kron_solve", "inverse_root", "newton_schulz"])
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


def two_products(A, x, r, p):
    # right values, twice the cost: A @ p again for the residual
    alpha = (r @ r) / (p @ (A @ p))
    r2 = r - alpha * (A @ p)
    return x + alpha * p, r2, r2 + (r2 @ r2) / (r @ r) * p


def matrix_only(A, x, r, p):
    # right values with a matrix, but A used as one: A.mv is not an operator's product
    Ap = A.mv(p)
    alpha = (r @ r) / (p @ Ap)
    r2 = r - alpha * Ap
    return x + alpha * p, r2, r2 + (r2 @ r2) / (r @ r) * p


def dense_kron(A, G, V):
    # right values through the mn x mn Kronecker product
    x = torch.linalg.solve(torch.kron(A, G), V.mT.reshape(-1))
    return x.reshape(V.shape[1], V.shape[0]).mT


def dense_einsum(A, G, V):
    # the same Kronecker product without torch.kron: an outer product, reshaped
    m, n = V.shape
    K = torch.einsum("ij,kl->ikjl", A, G).reshape(n * m, n * m)
    return torch.linalg.solve(K, V.mT.reshape(-1)).reshape(n, m).mT


def inverse_then_products(A, G, V):
    # a correct solution by another route: the factors' inverses, never the product
    return torch.linalg.inv(G) @ V @ torch.linalg.inv(A)


@pytest.mark.parametrize("solution", [dense_kron, dense_einsum])
def test_dense_solutions_have_the_right_values(solution):
    A, G = spd(3, 0), spd(4, 1)
    V = torch.randn(4, 3, generator=torch.Generator().manual_seed(2), dtype=f64)
    torch.testing.assert_close(solution(A, G, V), lab06.kron_solve(A, G, V))


def test_two_products_have_the_right_values():
    A, b = spd(5, 4), torch.randn(5, generator=torch.Generator().manual_seed(5), dtype=f64)
    start = (A, torch.zeros(5, dtype=f64), b.clone(), b.clone())
    for got, expected in zip(two_products(*start), lab06.cg_step(*start)):
        torch.testing.assert_close(got, expected)


def test_a_solution_without_the_kronecker_product_passes(capsys):
    check.checker("lab06.kron_solve")(inverse_then_products)
    assert "✔ kron_solve: equals the dense" in capsys.readouterr().out


def test_largest_tensor_counts_what_operations_return():
    A, G = spd(3, 0), spd(4, 1)
    with lab06.LargestTensor() as seen:
        torch.kron(A, G)
    assert (seen.numel, seen.where) == (144, "kron")
    with lab06.LargestTensor() as seen:
        lab06.kron_solve(A, G, torch.ones(4, 3, dtype=f64))
    assert seen.numel == 12  # V's size: two small solves make nothing larger


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
        ("cg_step", two_products, "asked A for 2 products A @ v in one iteration"),
        ("cg_step", matrix_only, "use A only through the product A @ p"),
        ("kron_solve", dense_kron, r"made a tensor of 57,600 numbers \(by kron\)"),
        ("kron_solve", dense_einsum, "never form the Kronecker product"),
    ],
)
def test_mistakes_are_named(name, wrong, message):
    with pytest.raises(check.CheckFailed, match=message):
        check.checker(f"lab06.{name}")(wrong)


# -- Newton–Schulz (Muon) ---------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(4, 7), (9, 5), (6, 6)])
def test_newton_schulz_is_muons_iteration(shape):
    G = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(lab06.newton_schulz(G), newton_schulz(G, dtype=torch.float32))
    # in float64, each singular value goes through the quintic five times
    G = G.double()
    U, S, Vh = torch.linalg.svd(G, full_matrices=False)
    s = S / G.norm()
    for _ in range(5):
        s = 3.4445 * s - 4.7750 * s**3 + 2.0315 * s**5
    torch.testing.assert_close(lab06.newton_schulz(G), U @ torch.diag(s) @ Vh)


def unnormalized(G, steps=5):
    X = G.T if G.shape[0] > G.shape[1] else G
    for _ in range(steps):
        A = X @ X.T
        X = 3.4445 * X + (-4.7750 * A + 2.0315 * A @ A) @ X
    return X.T if G.shape[0] > G.shape[1] else X


def normalized_by_the_largest_entry(G, steps=5):
    # a norm, but not one that bounds the singular values by 1
    X = G.T if G.shape[0] > G.shape[1] else G
    X = X / X.abs().max()
    for _ in range(steps):
        A = X @ X.T
        X = 3.4445 * X + (-4.7750 * A + 2.0315 * A @ A) @ X
    return X.T if G.shape[0] > G.shape[1] else X


def tall_left_transposed(G, steps=5):
    X = G.T if G.shape[0] > G.shape[1] else G
    X = X / X.norm()
    for _ in range(steps):
        A = X @ X.T
        X = 3.4445 * X + (-4.7750 * A + 2.0315 * A @ A) @ X
    return X  # forgot: back to G's shape


def the_larger_gram_matrix(G, steps=5):
    # right values (the polynomial acts on the singular values either way), at the cost
    # of the larger Gram matrix for a tall G
    X = G / G.norm()
    for _ in range(steps):
        A = X @ X.T
        X = 3.4445 * X + (-4.7750 * A + 2.0315 * A @ A) @ X
    return X


def cubic(G, steps=5):
    X = G / G.norm()
    for _ in range(steps):
        X = 1.5 * X - 0.5 * X @ X.T @ X
    return X


def test_the_larger_gram_matrix_has_the_right_values():
    G = torch.randn(9, 5, generator=torch.Generator().manual_seed(1), dtype=f64)
    torch.testing.assert_close(the_larger_gram_matrix(G), lab06.newton_schulz(G))


@pytest.mark.parametrize(
    "wrong, message",
    [
        (unnormalized, "Frobenius norm first"),
        (tall_left_transposed, "transpose the result back"),
        (cubic, "cubic iteration"),
        (the_larger_gram_matrix, r"made a tensor of 4,096 numbers \(by matmul\)"),
    ],
)
def test_newton_schulz_mistakes_are_named(wrong, message):
    with pytest.raises(check.CheckFailed, match=message):
        check.checker("lab06.newton_schulz")(wrong)


def test_newton_schulz_other_norms_fail():
    with pytest.raises(check.CheckFailed, match="does not match"):
        check.checker("lab06.newton_schulz")(normalized_by_the_largest_entry)
