r"""Checkers of Lab 6, second-order optimization: a conjugate-gradient step, a
Kronecker-factored solve, a matrix inverse root, Muon's Newton–Schulz iteration.

The references are the library's own pieces, so a student whose function passes has
rebuilt what the lab's optimizers run: one iteration of :func:`lsdl_lab.curvature.cg`
(Hestenes & Stiefel, 1952), the solve at the heart of K-FAC (Martens & Grosse, 2015;
:func:`lsdl_lab.optim.kfac.kfac_precondition`), and Shampoo's inverse root (Gupta et al.,
2018; :func:`lsdl_lab.optim.shampoo.inverse_root`), and the quintic Newton–Schulz
iteration of Muon (Jordan et al., 2024; :func:`lsdl_lab.optim.muon.newton_schulz`, in the
matrix's own dtype). When a function fails, the checker looks for the usual slips (the
old residual in the new direction's coefficient, the factors swapped or transposed, an
elementwise power instead of a matrix power, no floor on the eigenvalues, no Frobenius
normalization, a tall matrix's result left transposed, the cubic iteration) and names the
one it finds.

Two checks go beyond the values, because a right value can come from the wrong cost:

- ``cg_step`` gets :math:`A` as an operator (:class:`lsdl_lab.curvature.DenseOperator`,
  which counts its products, as HF's Gauss-Newton operator does) and must ask it for
  exactly one product :math:`Ap` per iteration: the product is CG's whole cost.
- ``kron_solve`` runs under a counter of the tensors its torch operations return
  (:class:`LargestTensor`) and must stay within a memory budget: no tensor holding more
  numbers than :math:`A`, :math:`G` and :math:`V` together. A solve through the Kronecker
  product (``torch.kron``, an outer product by ``einsum`` or by broadcasting), whose
  :math:`mn \times mn` matrix holds :math:`(mn)^2` numbers, is refused.
- ``newton_schulz`` runs under the same counter on a tall and a wide matrix and must never
  make a tensor larger than the matrix itself: the Gram matrix :math:`XX^\top` must be the
  smaller one, :math:`\min(m, n)^2`, which for a tall matrix means working on its
  transpose (the values are the same either way; the cost is not).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

from ..check import CheckFailed, check_function, exercise, with_hints
from ..curvature import DenseOperator
from ..optim.muon import NS_COEFFICIENTS
from ..optim.muon import newton_schulz as muon_newton_schulz
from ..optim.shampoo import inverse_root as shampoo_inverse_root

__all__ = ["LargestTensor", "cg_step", "inverse_root", "kron_solve", "newton_schulz"]


def cg_step(A: Tensor, x: Tensor, r: Tensor, p: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    r"""One iteration of conjugate gradients on :math:`Ax = b` (Hestenes & Stiefel, 1952),
    from the iterate ``x``, its residual :math:`r = b - Ax` and the search direction ``p``:

    .. math:: \alpha = \frac{r^\top r}{p^\top A p},\quad x' = x + \alpha p,\quad
              r' = r - \alpha A p,\quad p' = r' + \frac{r'^\top r'}{r^\top r}\,p.

    Returns ``(x', r', p')``: one product :math:`Ap`, as in :func:`lsdl_lab.curvature.cg`."""
    Ap = A @ p
    rr = r @ r
    alpha = rr / (p @ Ap)
    x_new = x + alpha * p
    r_new = r - alpha * Ap
    p_new = r_new + (r_new @ r_new) / rr * p
    return x_new, r_new, p_new


def kron_solve(A: Tensor, G: Tensor, V: Tensor) -> Tensor:
    r""":math:`(A \otimes G)^{-1}\operatorname{vec}(V) = \operatorname{vec}(G^{-1} V A^{-1})`
    for symmetric positive definite ``A`` (``n x n``, the layer's input factor) and ``G``
    (``m x m``, its output-gradient factor) and ``V`` (``m x n``, a weight-shaped
    gradient), :math:`\operatorname{vec}` stacking columns. Two small solves instead of one
    of size :math:`mn`: what makes K-FAC's step affordable (Martens & Grosse, 2015, Sec. 3)."""
    return torch.linalg.solve(G, torch.linalg.solve(A, V.mT).mT)


def inverse_root(H: Tensor, p: float, epsilon: float) -> Tensor:
    r""":math:`H^{-p}` of a symmetric positive semi-definite ``H`` by its eigendecomposition
    :math:`H = Q\Lambda Q^\top`: :math:`Q \max(\Lambda, \epsilon)^{-p} Q^\top`, computed in
    float64 and returned in ``H``'s dtype (Shampoo's :math:`L^{-1/4}` is ``p = 1/4``)."""
    return shampoo_inverse_root(H, p, epsilon)


def newton_schulz(G: Tensor, steps: int = 5) -> Tensor:
    r"""Muon's quintic Newton–Schulz iteration (Jordan et al., 2024), in ``G``'s dtype:

    .. math::
        X_0 = G / \|G\|_F, \qquad A_j = X_j X_j^\top, \qquad
        X_{j+1} = a X_j + (b A_j + c A_j^2)\, X_j

    with :math:`(a, b, c) = (3.4445, -4.7750, 2.0315)`, on :math:`G^\top` (and the result
    transposed back) when ``G`` has more rows than columns. Nearly the orthogonal factor
    :math:`UV^\top` of :math:`G = U\Sigma V^\top`."""
    return muon_newton_schulz(G, steps, dtype=None)


# -- the checks -------------------------------------------------------------------------


def _spd(n: int, condition: float, seed: int, dtype=torch.float64) -> Tensor:
    """A symmetric positive definite n x n matrix with eigenvalues from 1 to ``condition``."""
    g = torch.Generator().manual_seed(seed)
    Q, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    lam = torch.logspace(0, torch.log10(torch.tensor(condition)).item(), n, dtype=torch.float64)
    return ((Q * lam) @ Q.T).to(dtype)


def _vector(n: int, seed: int, dtype=torch.float64) -> Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _matrix(m: int, n: int, seed: int, dtype=torch.float64) -> Tensor:
    return torch.randn(m, n, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _matches(student, reference, args) -> bool:
    try:
        got = student(*args)
    except Exception:
        return False
    expected = reference(*args)
    if isinstance(expected, tuple):
        return (
            isinstance(got, (tuple, list))
            and len(got) == len(expected)
            and all(
                isinstance(a, Tensor)
                and a.shape == b.shape
                and torch.allclose(a, b, atol=1e-8, equal_nan=True)
                for a, b in zip(got, expected)
            )
        )
    return (
        isinstance(got, Tensor)
        and got.shape == expected.shape
        and torch.allclose(got, expected, rtol=1e-6, atol=1e-8, equal_nan=True)
    )


def _check(student_fn, reference, cases, name, slips, rtol, atol) -> None:
    """check_function, and on a failure the hints of the slips the student's function
    matches: ``slips`` holds (slip, case, hint) triples."""
    try:
        check_function(student_fn, reference, cases, name=name, rtol=rtol, atol=atol)
    except CheckFailed as failure:
        hints = [hint for slip, case, hint in slips if _matches(student_fn, slip, case)]
        raise with_hints(failure, hints) from None


def _cg_start(A: Tensor, b: Tensor, iterations: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(A, x_k, r_k, p_k) after ``iterations`` reference steps from x = 0."""
    x, r, p = torch.zeros_like(b), b.clone(), b.clone()
    for _ in range(iterations):
        x, r, p = cg_step(A, x, r, p)
    return A, x, r, p


def _cg_slip_old_beta(A, x, r, p):
    Ap = A @ p
    alpha = (r @ r) / (p @ Ap)
    r_new = r - alpha * Ap
    return x + alpha * p, r_new, r_new + (r_new @ r_new) / (r_new @ r_new) * p


def _cg_slip_steepest(A, x, r, p):
    Ap = A @ p
    alpha = (r @ r) / (p @ Ap)
    r_new = r - alpha * Ap
    return x + alpha * p, r_new, r_new


def _cg_slip_alpha(A, x, r, p):
    Ap = A @ p
    alpha = (r @ r) / (r @ (A @ r))
    r_new = r - alpha * Ap
    return x + alpha * p, r_new, r_new + (r_new @ r_new) / (r @ r) * p


@exercise("lab06.cg_step")
def check_cg_step(student_fn) -> None:
    A, b = _spd(6, 100.0, 0), _vector(6, 1)
    cases = [
        _cg_start(A, b, 0),  # the first step: p = r = b
        _cg_start(A, b, 2),  # later steps: p is no longer r
        _cg_start(_spd(12, 1e3, 2), _vector(12, 3), 4),
        _cg_start(
            torch.diag(torch.tensor([1.0, 4.0, 9.0], dtype=torch.float64)),
            torch.ones(3, dtype=torch.float64),
            1,
        ),  # fmt: skip
    ]
    later = cases[1]
    _check(student_fn, cg_step, cases, "cg_step", [
        (_cg_slip_old_beta, later, "beta is (r'ᵀr') / (rᵀr): the NEW residual over the OLD one"),
        (_cg_slip_steepest, later, "the new direction keeps beta p: p' = r' + beta p (without "
         "it, this is steepest descent, not CG)"),
        (_cg_slip_alpha, later, "alpha = (rᵀr) / (pᵀAp): the curvature along p, not along r"),
    ], rtol=1e-7, atol=1e-9)  # fmt: skip
    # n steps of the student's CG solve an n x n system (exact arithmetic; float64 here),
    # with A an operator that counts the products asked of it: one per step.
    A, b = _spd(8, 50.0, 4), _vector(8, 5)
    op = DenseOperator(A)
    x, r, p = torch.zeros_like(b), b.clone(), b.clone()
    for k in range(1, 9):
        try:
            x, r, p = student_fn(op, x, r, p)
        except Exception as exc:
            raise CheckFailed(
                f"your cg_step raised {type(exc).__name__}: {exc} when A was an operator (a "
                "DenseOperator, like HF's Gauss-Newton): use A only through the product A @ p"
            ) from None
        if op.products != k:
            raise CheckFailed(
                f"your cg_step asked A for {op.products - k + 1} products A @ v in one "
                "iteration; CG needs exactly one, A @ p, and reuses it for alpha and for the "
                "new residual (each product is a Gauss-Newton product in HF: the whole cost "
                "of an iteration)"
            )
    error = (torch.linalg.solve(A, b) - x).norm() / torch.linalg.solve(A, b).norm()
    if not error < 1e-8:
        raise CheckFailed(f"8 of your steps on an 8 x 8 system leave a relative error {error:.2e}")
    print(
        "✔ cg_step: equals one iteration of lsdl_lab.curvature.cg, with one product A @ p, "
        "and 8 steps solve 8 x 8"
    )


class LargestTensor(TorchFunctionMode):
    """Within ``with LargestTensor() as seen:``, ``seen.numel`` is the number of entries of
    the largest tensor a torch function or tensor method returned, and ``seen.where`` the
    name of that function: a counter of what a computation materializes (the tensors made
    inside one torch operation, such as a solver's workspace, are not seen; the results
    of every operation called from Python are)."""

    def __init__(self):
        super().__init__()
        self.numel, self.where = 0, None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in _tensors(out):
            if t.numel() > self.numel:
                self.numel, self.where = t.numel(), getattr(func, "__name__", str(func))
        return out


def _tensors(out) -> list[Tensor]:
    if isinstance(out, Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for item in out for t in _tensors(item)]
    return []


def _kron_slip_swapped(A, G, V):
    return torch.linalg.solve(G, torch.linalg.solve(A, V).mT).mT


def _kron_slip_inverse_missing(A, G, V):
    return G @ V @ A


def _kron_slip_one_side(A, G, V):
    return torch.linalg.solve(G, V)


@exercise("lab06.kron_solve")
def check_kron_solve(student_fn) -> None:
    cases = [
        (_spd(3, 10.0, 0), _spd(4, 10.0, 1), _matrix(4, 3, 2)),  # a 4-out, 3-in layer
        (_spd(5, 1e3, 3), _spd(2, 5.0, 4), _matrix(2, 5, 5)),
        (_spd(4, 20.0, 6), _spd(4, 30.0, 7), _matrix(4, 4, 8)),  # square: a swap would fit
        (
            torch.eye(3, dtype=torch.float64),
            2 * torch.eye(2, dtype=torch.float64),
            _matrix(2, 3, 9),
        ),  # fmt: skip
    ]
    square = cases[2]
    _check(student_fn, kron_solve, cases, "kron_solve", [
        (_kron_slip_swapped, square, "the factors are swapped: G (m x m) acts on V's rows, "
         "A (n x n) on its columns: G^{-1} V A^{-1}"),
        (_kron_slip_inverse_missing, square, "that is (A ⊗ G) vec(V), the product; the "
         "solve needs the inverses (torch.linalg.solve, not @)"),
        (_kron_slip_one_side, square, "both factors must be inverted: G^{-1} V A^{-1}"),
    ], rtol=1e-6, atol=1e-9)  # fmt: skip
    # The identity itself: against the dense (A ⊗ G)^{-1} vec(V), vec stacking columns.
    A, G, V = cases[1]
    dense = torch.linalg.solve(torch.kron(A, G), V.mT.reshape(-1))
    got = student_fn(A, G, V).mT.reshape(-1)
    if not torch.allclose(got, dense, rtol=1e-6, atol=1e-9):
        raise CheckFailed("your result is not (A ⊗ G)^{-1} vec(V) computed densely")
    # The cost: a 12-out, 20-in layer, whose A ⊗ G (240 x 240, 57,600 numbers) is 73 times
    # A, G and V together (784): the budget, which two small solves never exceed.
    m, n = 12, 20
    A, G, V = _spd(n, 10.0, 10), _spd(m, 10.0, 11), _matrix(m, n, 12)
    budget = A.numel() + G.numel() + V.numel()
    with LargestTensor() as seen:
        got = student_fn(A, G, V)
    if seen.numel > budget:
        raise CheckFailed(
            f"for a {m} x {n} gradient your kron_solve made a tensor of {seen.numel:,} numbers "
            f"(by {seen.where}), more than A, G and V hold together ({budget:,}); "
            f"(A ⊗ G) would hold {(m * n) ** 2:,}: solve with the two factors, G^{{-1}} V "
            "A^{-1}, and never form the Kronecker product"
        )
    if not torch.allclose(got, kron_solve(A, G, V), rtol=1e-6, atol=1e-9):
        raise CheckFailed(f"your kron_solve differs from G^{{-1}} V A^{{-1}} on a {m} x {n} V")
    print(
        "✔ kron_solve: equals the dense (A ⊗ G)^{-1} vec(V), with no tensor larger than "
        "A, G and V together"
    )


def _root_slip_elementwise(H, p, epsilon):
    return H.clamp(min=epsilon).pow(-p)


def _root_slip_no_floor(H, p, epsilon):
    lam, Q = torch.linalg.eigh(H.to(torch.float64))
    return ((Q * lam.pow(-p)) @ Q.T).to(H.dtype)


def _root_slip_sign(H, p, epsilon):
    return shampoo_inverse_root(H, -p, epsilon)


@exercise("lab06.inverse_root")
def check_inverse_root(student_fn) -> None:
    rank_two = _matrix(5, 2, 3) @ _matrix(5, 2, 3).T  # eigenvalues 0, 0, 0 and two others
    cases = [
        (_spd(4, 100.0, 0), 0.25, 1e-12),  # Shampoo's L^{-1/4}
        (_spd(6, 1e4, 1), 0.5, 1e-12),  # full-matrix Adagrad's H^{-1/2}
        (_spd(3, 10.0, 2), 1 / 6, 1e-12),  # an order-3 tensor: -1/(2k)
        (rank_two, 0.25, 1e-6),  # singular: the floor keeps it finite
        (_spd(4, 100.0, 4, torch.float32), 0.25, 1e-6),  # float32 in, float32 out
    ]
    _check(student_fn, inverse_root, cases, "inverse_root", [
        (_root_slip_elementwise, cases[0], "H ** -p raises each ENTRY to a power; the "
         "matrix power acts on the eigenvalues: Q diag(λ^-p) Qᵀ"),
        (_root_slip_no_floor, cases[3], "floor the eigenvalues at epsilon before the "
         "power: a singular H has eigenvalues 0 (or -1e-16 by rounding)"),
        (_root_slip_sign, cases[0], "the exponent is -p: an INVERSE root"),
    ], rtol=1e-5, atol=1e-6)  # fmt: skip
    H = _spd(5, 1e3, 5)
    R = student_fn(H, 0.25, 1e-12)
    four = torch.linalg.matrix_power(R, 4) @ H
    if not torch.allclose(four, torch.eye(5, dtype=H.dtype), atol=1e-8):
        raise CheckFailed("your H^{-1/4} to the fourth power times H is not the identity")
    print("✔ inverse_root: equals Shampoo's float64 eigendecomposition root, floor included")


def _ns_slip_no_normalization(G, steps=5):
    a, b, c = NS_COEFFICIENTS
    X = G.T if G.size(0) > G.size(1) else G
    for _ in range(steps):
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return X.T if G.size(0) > G.size(1) else X


def _ns_slip_not_transposed_back(G, steps=5):
    return muon_newton_schulz(G.T if G.size(0) > G.size(1) else G, steps, dtype=None)


def _ns_slip_cubic(G, steps=5):
    X = G / G.norm()
    for _ in range(steps):
        X = 1.5 * X - 0.5 * X @ X.T @ X
    return X


@exercise("lab06.newton_schulz")
def check_newton_schulz(student_fn) -> None:
    wide, tall, square = _matrix(4, 7, 0), _matrix(9, 5, 1), _matrix(6, 6, 2)
    cases = [
        (wide, 5),
        (tall, 5),  # more rows than columns: the iteration runs on the transpose
        (square, 5),
        (3.0 * _matrix(5, 8, 3), 3),  # a norm above the polynomial's range, and 3 steps
        (_matrix(3, 6, 4, torch.float32), 5),  # float32 in, float32 out
    ]
    # tolerances for float32, whose rounding depends on the order of the products
    _check(
        student_fn,
        newton_schulz,
        cases,
        "newton_schulz",
        [
            (
                _ns_slip_no_normalization,
                cases[3],
                "divide G by its Frobenius norm first: the "
                "polynomial keeps only singular values in (0, 1] in a band around 1; larger ones "
                "blow up",
            ),
            (
                _ns_slip_not_transposed_back,
                cases[1],
                "for a tall G you iterate on Gᵀ: transpose the result back to G's shape",
            ),
            (
                _ns_slip_cubic,
                cases[0],
                "that is the cubic iteration 1.5 X - 0.5 X Xᵀ X; Muon's is "
                "quintic: a X + (b A + c A²) X with A = X Xᵀ and (a, b, c) = (3.4445, -4.7750, "
                "2.0315)",
            ),
        ],
        rtol=1e-5,
        atol=1e-6,
    )
    # The cost: the Gram matrix must be the smaller one, min(m, n)^2 numbers; on a 64 x 4
    # matrix XXᵀ would be 64 x 64, sixteen times the matrix itself.
    for G in (_matrix(64, 4, 5), _matrix(4, 64, 6)):
        with LargestTensor() as seen:
            got = student_fn(G, 5)
        if seen.numel > G.numel():
            raise CheckFailed(
                f"on a {G.size(0)} x {G.size(1)} matrix your newton_schulz made a tensor of "
                f"{seen.numel:,} numbers (by {seen.where}), more than the matrix itself "
                f"({G.numel():,}): form the smaller Gram matrix, min(m, n)², by iterating on "
                "Gᵀ when G has more rows than columns"
            )
        if not torch.allclose(got, newton_schulz(G, 5), rtol=1e-5, atol=1e-6):
            raise CheckFailed(f"your newton_schulz differs on a {G.size(0)} x {G.size(1)} matrix")
    # What Muon runs: the library's iteration, in float32 here
    G = _matrix(8, 12, 7, torch.float32)
    if not torch.allclose(student_fn(G, 5), muon_newton_schulz(G, 5, dtype=torch.float32),
                          rtol=1e-4, atol=1e-5):  # fmt: skip
        raise CheckFailed("your newton_schulz differs from lsdl_lab.optim.muon's in float32")
    print(
        "✔ newton_schulz: equals Muon's quintic iteration (lsdl_lab.optim.muon), tall and "
        "wide, with the smaller Gram matrix"
    )
