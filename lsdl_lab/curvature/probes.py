r"""Curvature probes: what an operator's spectrum looks like, from matrix-vector products alone.

Each probe is a short function of the products :math:`Av` of a symmetric operator, as in
PyHessian (Yao et al., 2020), and takes any :class:`~lsdl_lab.curvature.operators.CurvatureOperator`
(a network's Hessian, an explicit matrix, the curvature matrices of Chapter 6):

- :func:`top_eigenvalues`: power iteration with deflation, the sharpness :math:`\lambda_1`;
- :func:`lanczos` and :func:`lanczos_eigenvalues`: the Lanczos (1950) tridiagonalization and
  its Ritz values;
- :func:`trace`: Hutchinson's (1989) estimator :math:`\operatorname{tr}A = \mathbb E[v^\top Av]`;
- :func:`spectral_density`: stochastic Lanczos quadrature (Golub & Meurant, 2010; Ghorbani,
  Krishnan & Xiao, 2019), the whole eigenvalue density.

Unlike PyHessian 0.1 every random vector comes from a generator seeded by ``seed`` (on the
operator's device, in its dtype), and the tridiagonal matrix is diagonalized with ``eigh``
(real nodes and weights).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from .._util import check_choice, check_int, check_positive, check_real
from .operators import CurvatureOperator

__all__ = [
    "SpectralDensity",
    "lanczos",
    "lanczos_eigenvalues",
    "spectral_density",
    "top_eigenvalues",
    "trace",
]

DISTRIBUTIONS = ("rademacher", "gaussian")


def _check_operator(A) -> CurvatureOperator:
    if not isinstance(A, CurvatureOperator):
        raise TypeError(
            f"Invalid A: a {type(A).__name__} (expected a CurvatureOperator; wrap a matrix "
            "in DenseOperator)"
        )
    return A


def _generator(A: CurvatureOperator, seed: int) -> torch.Generator:
    """The probe's random stream, on the operator's device, where its vectors live."""
    return torch.Generator(device=A.device).manual_seed(check_int("seed", seed, 0))


def _rademacher(A: CurvatureOperator, gen: torch.Generator) -> torch.Tensor:
    v = torch.randint(0, 2, (A.dim,), generator=gen, device=A.device)
    return (2 * v - 1).to(A.dtype)


def top_eigenvalues(
    A: CurvatureOperator, k: int = 1, iters: int = 100, tol: float = 1e-6, seed: int = 0
) -> tuple[list[float], list[torch.Tensor]]:
    r"""The k eigenvalues of largest magnitude by power iteration with deflation (as PyHessian).

    Repeat :math:`v \leftarrow Av/\|Av\|` (with :math:`v` kept orthogonal to the eigenvectors
    already found) until the Rayleigh quotient :math:`\lambda = v^\top Av` changes by less than
    ``tol`` relative to itself, or for ``iters`` products. The error shrinks like
    :math:`|\lambda_{i+1}/\lambda_i|^{t}`, so close eigenvalues need many iterations; PyHessian's
    default ``tol=1e-3`` stops well before convergence. Returns eigenvalues and unit
    eigenvectors (flat).
    """
    _check_operator(A)
    check_int("k", k, 1)
    check_int("iters", iters, 1)
    check_real("tol", tol, 0.0)
    if k > A.dim:
        raise ValueError(f"Invalid k: {k} (expected at most A.dim = {A.dim} eigenvalues)")
    gen = _generator(A, seed)
    values, vectors = [], []
    for _ in range(k):
        v = torch.randn(A.dim, generator=gen, device=A.device, dtype=A.dtype)
        v /= v.norm()
        lam = None
        for _ in range(iters):
            for u in vectors:  # deflation: stay orthogonal to the eigenvectors found
                v -= (u @ v) * u
            v /= v.norm()
            Av = A @ v
            lam_new = (v @ Av).item()
            norm = Av.norm()
            if norm == 0:  # v lies in the null space: eigenvalue 0
                lam = lam_new
                break
            v = Av / norm
            converged = lam is not None and abs(lam_new - lam) <= tol * (abs(lam) + 1e-12)
            lam = lam_new
            if converged:
                break
        values.append(lam)
        vectors.append(v)
    return values, vectors


def _lanczos(A: CurvatureOperator, m: int, gen: torch.Generator):
    """Lanczos with full reorthogonalization from a Rademacher start; (alpha, beta, Q)."""
    m = min(m, A.dim)
    Q = torch.zeros(m, A.dim, dtype=A.dtype, device=A.device)
    q = _rademacher(A, gen)
    Q[0] = q / q.norm()
    alpha, beta = [], []
    for j in range(m):
        w = A @ Q[j]
        alpha.append((w @ Q[j]).item())
        if j == m - 1:
            break
        Aq_norm = w.norm()
        # Gram-Schmidt against every Lanczos vector, twice ("twice is enough"): in floating
        # point the three-term recurrence alone loses orthogonality and repeats Ritz values.
        for _ in range(2):
            w -= Q[: j + 1].T @ (Q[: j + 1] @ w)
        b = w.norm()
        if b <= torch.finfo(A.dtype).eps ** 0.5 * Aq_norm:
            # The Krylov space is invariant (exhausted): T splits into blocks. Go on from a
            # random direction orthogonal to it, with beta = 0 (the quadrature weights of the
            # new block are 0, its Ritz values are still eigenvalue estimates).
            b, w = torch.zeros(()), _rademacher(A, gen)
            for _ in range(2):
                w -= Q[: j + 1].T @ (Q[: j + 1] @ w)
        beta.append(b.item())
        Q[j + 1] = w / w.norm()
    return torch.tensor(alpha, dtype=torch.float64), torch.tensor(beta, dtype=torch.float64), Q


def lanczos(A: CurvatureOperator, m: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    r"""m steps of Lanczos (1950): the tridiagonal :math:`T = Q^\top A Q` of the Krylov space.

    From a random unit :math:`q_1` (Rademacher, normalized), :math:`\beta_j q_{j+1} =
    Aq_j - \alpha_j q_j - \beta_{j-1}q_{j-1}` with :math:`\alpha_j = q_j^\top Aq_j`; every new
    vector is reorthogonalized against all previous ones. Returns ``alpha`` (diagonal, length
    m) and ``beta`` (off-diagonal, length m - 1) in float64. ``m`` is capped at ``A.dim``.
    If the Krylov space closes (an invariant subspace), Lanczos goes on from a new random
    direction with a zero ``beta``.
    """
    _check_operator(A)
    check_int("m", m, 1)
    alpha, beta, _ = _lanczos(A, m, _generator(A, seed))
    return alpha, beta


def _tridiagonal(alpha: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    return torch.diag(alpha) + torch.diag(beta, 1) + torch.diag(beta, -1)


def lanczos_eigenvalues(
    A: CurvatureOperator, k: int = 1, m: int | None = None, seed: int = 0
) -> list[float]:
    """The k largest eigenvalues, approximated by the largest Ritz values of m Lanczos steps.

    Extreme eigenvalues converge first, in far fewer products than power iteration needs
    when the top eigenvalues are close. ``m`` defaults to ``max(40, 2 k)``.
    """
    _check_operator(A)
    check_int("k", k, 1)
    m = max(40, 2 * k) if m is None else check_int("m", m, 1)
    if k > min(m, A.dim):
        raise ValueError(f"Invalid k: {k} (expected at most min(m, A.dim) Ritz values)")
    alpha, beta = lanczos(A, m, seed)
    ritz = torch.linalg.eigvalsh(_tridiagonal(alpha, beta))
    return ritz.flip(0)[:k].tolist()


def trace(
    A: CurvatureOperator, samples: int = 100, seed: int = 0, distribution: str = "rademacher"
) -> tuple[float, float]:
    r"""Hutchinson's (1989) estimate of :math:`\operatorname{tr}A` and its standard error.

    For random :math:`v` with :math:`\mathbb E[vv^\top] = I`,
    :math:`\mathbb E[v^\top Av] = \operatorname{tr}(A\,\mathbb E[vv^\top]) = \operatorname{tr}A`.
    Rademacher entries (:math:`\pm1`) give the smallest variance,
    :math:`2\sum_{i\ne j}A_{ij}^2`; Gaussian ones add :math:`2\sum_i A_{ii}^2`. Returns
    the mean of ``samples`` draws and the standard error of that mean.
    """
    _check_operator(A)
    check_int("samples", samples, 2)
    check_choice("distribution", distribution, DISTRIBUTIONS)
    gen = _generator(A, seed)
    vhv = []
    for _ in range(samples):
        if distribution == "rademacher":
            v = _rademacher(A, gen)
        else:
            v = torch.randn(A.dim, generator=gen, device=A.device, dtype=A.dtype)
        vhv.append((v @ (A @ v)).item())
    vhv = torch.tensor(vhv, dtype=torch.float64)
    return vhv.mean().item(), (vhv.std() / math.sqrt(samples)).item()


class SpectralDensity(NamedTuple):
    """A smoothed eigenvalue density on a grid, and the quadrature it was smoothed from."""

    grid: torch.Tensor  # eigenvalue axis
    density: torch.Tensor  # integrates to 1 over grid (trapezoid rule)
    nodes: torch.Tensor  # Ritz values of every run, concatenated
    weights: torch.Tensor  # their quadrature weights, divided by runs: they sum to 1


def _gaussian(t: torch.Tensor, mean: torch.Tensor, sigma: float) -> torch.Tensor:
    return torch.exp(-0.5 * ((t - mean) / sigma) ** 2) / (sigma * math.sqrt(2 * math.pi))


def spectral_density(
    A: CurvatureOperator,
    runs: int = 1,
    m: int = 80,
    seed: int = 0,
    grid: torch.Tensor | None = None,
    sigma: float | None = None,
) -> SpectralDensity:
    r"""The eigenvalue density by stochastic Lanczos quadrature (Ghorbani et al., 2019).

    The density :math:`\phi(t) = \frac1P\sum_i\delta(t-\lambda_i)` is approached by
    :math:`v^\top f(A)v` for random unit :math:`v` (Hutchinson again). Lanczos started at
    :math:`v` gives :math:`T = U\Theta U^\top`; the Gauss quadrature of :math:`v`'s spectral
    measure (Golub & Meurant, 2010) has nodes :math:`\theta_j` and weights
    :math:`\tau_j = U_{1j}^2`, exact for polynomials of degree :math:`< 2m`. Averaging ``runs``
    quadratures and replacing each delta by a Gaussian of width ``sigma``,

    .. math:: \phi_\sigma(t) = \frac{1}{\text{runs}}\sum_{r}\sum_{j}\tau_{rj}\,
              \mathcal N(t;\,\theta_{rj},\sigma^2).

    ``sigma`` defaults to PyHessian's :math:`\sqrt{10^{-5}\max(1, \theta_{\max}-\theta_{\min})}`;
    the default grid reaches 5 sigma beyond the extreme nodes with a spacing of sigma / 4.
    The density is normalized to integrate to 1 over ``grid``.
    """
    _check_operator(A)
    check_int("runs", runs, 1)
    check_int("m", m, 1)
    if sigma is not None:
        check_positive("sigma", sigma)
    gen = _generator(A, seed)
    nodes, weights = [], []
    for _ in range(runs):
        alpha, beta, _ = _lanczos(A, m, gen)
        theta, U = torch.linalg.eigh(_tridiagonal(alpha, beta))
        nodes.append(theta)
        weights.append(U[0].square() / runs)
    nodes, weights = torch.cat(nodes), torch.cat(weights)
    lo, hi = nodes.min().item(), nodes.max().item()
    sigma = math.sqrt(1e-5 * max(1.0, hi - lo)) if sigma is None else sigma
    if grid is None:
        points = min(100_000, max(1_000, math.ceil((hi - lo + 10 * sigma) / (sigma / 4))))
        grid = torch.linspace(lo - 5 * sigma, hi + 5 * sigma, points, dtype=torch.float64)
    grid = torch.as_tensor(grid, dtype=torch.float64)
    density = sum(  # a block of nodes at a time: the grid can be long
        _gaussian(grid[:, None], th, sigma) @ w
        for th, w in zip(nodes.split(256), weights.split(256))
    )
    density /= torch.trapezoid(density, grid)
    return SpectralDensity(grid, density, nodes, weights)
