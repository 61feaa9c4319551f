r"""Curvature probes: what an operator's spectrum looks like, from matrix-vector products alone.

Each probe is a short function of the products :math:`Av` of a symmetric operator, as in
PyHessian (Yao et al., 2020), and takes any :class:`~lsdl_lab.curvature.operators.CurvatureOperator`
(a network's Hessian, an explicit matrix, the curvature matrices of Chapter 6):

- :func:`top_eigenvalues`: the k eigenvalues of largest magnitude (the sharpness
  :math:`\lambda_1`) by Lanczos with a residual stopping rule, or by power iteration with
  deflation as PyHessian;
- :func:`lanczos` and :func:`lanczos_eigenvalues`: the Lanczos (1950) tridiagonalization and
  its Ritz values;
- :func:`trace`: Hutchinson's (1989) estimator :math:`\operatorname{tr}A = \mathbb E[v^\top Av]`,
  or Hutch++ (Meyer et al., 2021) and XTrace (Epperly et al., 2024), which take the top of
  the spectrum exactly and need far fewer products when it decays;
- :func:`spectral_density`: stochastic Lanczos quadrature (Golub & Meurant, 2010; Ghorbani,
  Krishnan & Xiao, 2019), the whole eigenvalue density.

Unlike PyHessian 0.1 every random vector comes from a generator seeded by ``seed`` (on the
operator's device, in its dtype), and the tridiagonal matrix is diagonalized with ``eigh``
(real nodes and weights). The Lanczos coefficients are numbers on the host (one per
product), so the tridiagonal matrix and what comes from it alone (Ritz values, quadrature
nodes and weights, the density) are small float64 tensors on the CPU; what meets the
operator's vectors (Ritz vectors) is moved to their device. benchmarks/README.md counts the
products each needs at equal error against PyHessian's.
"""

from __future__ import annotations

import math
from collections import deque
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
EIGEN_METHODS = ("lanczos", "power")
F64 = torch.float64
TRACE_METHODS = ("hutchinson", "hutch++", "xtrace")


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


def _power_iteration(A: CurvatureOperator, k: int, iters: int, tol: float, gen):
    """Power iteration with deflation (PyHessian's method): values and unit vectors."""
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


def _lanczos_top(A: CurvatureOperator, k: int, iters: int, tol: float, gen):
    """The k Ritz pairs of largest magnitude, Lanczos step by step until their residuals
    beta_j |s_ji| are at most tol |theta_i| (or iters products)."""
    for step in _lanczos_steps(A, iters, gen):
        alpha, beta, Q = step
        if len(alpha) < min(k, A.dim):
            continue
        T = _tridiagonal(torch.tensor(alpha, dtype=F64), torch.tensor(beta[:-1], dtype=F64))
        theta, S = torch.linalg.eigh(T)
        top = theta.abs().argsort(descending=True)[:k]
        residuals = beta[-1] * S[-1, top].abs()  # ||A y_i - theta_i y_i|| (Parlett, Sec. 13.2)
        if bool((residuals <= tol * theta[top].abs()).all()):
            break
    vectors = (S[:, top].T.to(Q) @ Q).unbind()  # S on the CPU, Q on the operator's device
    return theta[top].tolist(), [y / y.norm() for y in vectors]


def top_eigenvalues(
    A: CurvatureOperator,
    k: int = 1,
    iters: int = 100,
    tol: float = 1e-6,
    seed: int = 0,
    method: str = "lanczos",
) -> tuple[list[float], list[torch.Tensor]]:
    r"""The k eigenvalues of largest magnitude and their unit eigenvectors (flat).

    ``method="lanczos"`` (default): Lanczos (1950) with full reorthogonalization, one product
    per step, until each of the k Ritz pairs :math:`(\theta_i, y_i)` of largest magnitude has
    a residual :math:`\|Ay_i - \theta_i y_i\| = \beta_j|s_{ji}|` of at most
    ``tol`` :math:`\cdot|\theta_i|` (then an eigenvalue lies within that distance of
    :math:`\theta_i`, and within its square over the gap; Parlett, 1998, Sec. 11.7), or for
    ``iters`` products. Its error shrinks like :math:`\exp(-2t\sqrt{\gamma})` with the relative
    gap :math:`\gamma` (Kaniel-Paige-Saad), all k at once. It finds one copy of a repeated
    eigenvalue. Memory: one vector of ``A.dim`` entries per step taken (the basis it
    reorthogonalizes against), where power iteration keeps k.

    ``method="power"``: power iteration with deflation, as PyHessian: repeat
    :math:`v \leftarrow Av/\|Av\|` (orthogonal to the eigenvectors already found) until the
    Rayleigh quotient changes by less than ``tol`` relative to itself, or for ``iters``
    products, for each eigenvalue in turn. The error shrinks like
    :math:`|\lambda_{i+1}/\lambda_i|^{2t}`, so close eigenvalues need many products, and the
    stopping rule stops early when convergence is slow (PyHessian's default ``tol=1e-3``
    stops well before convergence). benchmarks/README.md measures both.
    """
    _check_operator(A)
    check_int("k", k, 1)
    check_int("iters", iters, 1)
    check_real("tol", tol, 0.0)
    check_choice("method", method, EIGEN_METHODS)
    if k > A.dim:
        raise ValueError(f"Invalid k: {k} (expected at most A.dim = {A.dim} eigenvalues)")
    if method == "lanczos" and iters < k:
        raise ValueError(f"Invalid iters: {iters} (expected at least k = {k} Lanczos steps)")
    search = _lanczos_top if method == "lanczos" else _power_iteration
    return search(A, k, iters, tol, _generator(A, seed))


def _orthogonalized(w: torch.Tensor, Q: torch.Tensor) -> torch.Tensor:
    # Gram-Schmidt against every Lanczos vector, twice ("twice is enough"): in floating
    # point the three-term recurrence alone loses orthogonality and repeats Ritz values.
    for _ in range(2):
        w = w - Q.T @ (Q @ w)
    return w


def _lanczos_steps(A: CurvatureOperator, m: int, gen: torch.Generator):
    """Lanczos with full reorthogonalization from a Rademacher start, one product a step.

    After step j it yields (alpha, beta, Q): alpha_0..alpha_j, beta_0..beta_j (beta_j the
    norm of the next residual, 0 where the Krylov space closed) and the j + 1 vectors."""
    m = min(m, A.dim)
    Q = torch.zeros(min(m, 32), A.dim, dtype=A.dtype, device=A.device)
    q = _rademacher(A, gen)
    Q[0] = q / q.norm()
    alpha, beta = [], []
    for j in range(m):
        w = A @ Q[j]
        alpha.append((w @ Q[j]).item())
        Aq_norm = w.norm()
        w = _orthogonalized(w, Q[: j + 1])
        b = w.norm().item()
        invariant = b <= torch.finfo(A.dtype).eps ** 0.5 * Aq_norm
        beta.append(0.0 if invariant else b)
        yield alpha, beta, Q[: j + 1]
        if j == m - 1:
            return
        if invariant:
            # The Krylov space is invariant (exhausted): T splits into blocks. Go on from a
            # random direction orthogonal to it, with beta = 0 (the quadrature weights of the
            # new block are 0, its Ritz values are still eigenvalue estimates).
            w = _orthogonalized(_rademacher(A, gen), Q[: j + 1])
        if j + 1 == len(Q):  # the basis is full: double it
            Q = torch.cat([Q, torch.zeros_like(Q[: min(len(Q), m - len(Q))])])
        Q[j + 1] = w / w.norm()


def _lanczos(A: CurvatureOperator, m: int, gen: torch.Generator):
    """m Lanczos steps: (alpha, beta) in float64 and the basis Q."""
    alpha, beta, Q = deque(_lanczos_steps(A, m, gen), maxlen=1)[0]
    return torch.tensor(alpha, dtype=F64), torch.tensor(beta[:-1], dtype=F64), Q


def lanczos(A: CurvatureOperator, m: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    r"""m steps of Lanczos (1950): the tridiagonal :math:`T = Q^\top A Q` of the Krylov space.

    From a random unit :math:`q_1` (Rademacher, normalized), :math:`\beta_j q_{j+1} =
    Aq_j - \alpha_j q_j - \beta_{j-1}q_{j-1}` with :math:`\alpha_j = q_j^\top Aq_j`; every new
    vector is reorthogonalized against all previous ones. Returns ``alpha`` (diagonal, length
    m) and ``beta`` (off-diagonal, length m - 1) in float64, on the CPU. ``m`` is capped at
    ``A.dim``.
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


def _probe(A: CurvatureOperator, gen: torch.Generator, distribution: str) -> torch.Tensor:
    if distribution == "rademacher":
        return _rademacher(A, gen)
    return torch.randn(A.dim, generator=gen, device=A.device, dtype=A.dtype)


def _probes(A: CurvatureOperator, n: int, gen, distribution: str) -> torch.Tensor:
    """n random vectors with E[v v^T] = I, as the columns of a (dim, n) matrix."""
    columns = [_probe(A, gen, distribution) for _ in range(n)]
    if not columns:
        return torch.zeros(A.dim, 0, dtype=A.dtype, device=A.device)
    return torch.stack(columns, 1)


def _apply(A: CurvatureOperator, V: torch.Tensor) -> torch.Tensor:
    return torch.stack([A @ v for v in V.T], 1) if V.shape[1] else torch.zeros_like(V)


def _mean_and_error(values: torch.Tensor) -> tuple[float, float]:
    """The mean of i.i.d. estimates and its standard error (NaN from a single one)."""
    values = values.to(torch.float64)
    n = len(values)
    se = (values.std() / math.sqrt(n)).item() if n > 1 else math.nan
    return values.mean().item(), se


def _quadratic_forms(A, n, gen, distribution, Q=None) -> torch.Tensor:
    """v^T P A P v for n random v, one at a time (memory: one vector); P = I - Q Q^T."""
    values = []
    for _ in range(n):
        v = _probe(A, gen, distribution)
        if Q is not None:
            v = v - Q @ (Q.T @ v)
        values.append(v @ (A @ v))
    return torch.stack(values)


def _hutchpp(A, samples, gen, distribution):
    """Hutch++ (Meyer et al., 2021, Alg. 1): (exact part, Hutchinson samples of the rest)."""
    k = samples // 3
    Q, _ = torch.linalg.qr(_apply(A, _probes(A, k, gen, distribution)))  # range of A S
    exact = (Q * _apply(A, Q)).sum()  # tr(Q^T A Q)
    return exact, _quadratic_forms(A, samples - 2 * k, gen, distribution, Q)


def _xtrace(A, samples, gen, distribution):
    """XTrace (Epperly, Tropp & Webber, 2024, Alg. 1 with their error estimate): the n
    exchangeable estimates, each Hutch++ with test vector i left out of the basis."""
    n = samples // 2
    W = _probes(A, n, gen, distribution)
    Y = _apply(A, W)
    Q, R = torch.linalg.qr(Y)
    Z = _apply(A, Q)
    # S's columns are the normalized columns of R^{-T}: the basis without w_i is Q (I - s s^T)
    S = torch.linalg.inv(R).T
    S = S / S.norm(dim=0)
    tr_Q = (Q * Z).sum()
    QtW, QtZ = Q.T @ W, Q.T @ Z
    dS = (S * (QtZ @ S)).sum(0)  # s_i^T Q^T A Q s_i
    # w_i^T (I - Q_i Q_i^T) A (I - Q_i Q_i^T) w_i with Q_i Q_i^T = Q (I - s_i s_i^T) Q^T
    c = QtW - S * (S * QtW).sum(0)  # (I - s_i s_i^T) Q^T w_i, column i
    AP_w = Y - Z @ c
    PAPw = AP_w - Q @ ((Q.T @ AP_w) - S * (S * (Q.T @ AP_w)).sum(0))
    return tr_Q - dS + (W * PAPw).sum(0)


def trace(
    A: CurvatureOperator,
    samples: int = 100,
    seed: int = 0,
    distribution: str = "rademacher",
    method: str = "hutchinson",
) -> tuple[float, float]:
    r"""An estimate of :math:`\operatorname{tr}A` from ``samples`` products, and its standard
    error.

    - ``"hutchinson"`` (default; Hutchinson, 1989): for random :math:`v` with
      :math:`\mathbb E[vv^\top] = I`, :math:`\mathbb E[v^\top Av] = \operatorname{tr}A`.
      Rademacher entries (:math:`\pm1`) give the smallest variance,
      :math:`2\sum_{i\ne j}A_{ij}^2`; Gaussian ones add :math:`2\sum_i A_{ii}^2`. The mean of
      ``samples`` draws and its standard error. Its error falls like
      :math:`1/\sqrt{m}` in the number of products :math:`m`.
    - ``"hutch++"`` (Meyer, Musco, Musco & Woodruff, 2021): a third of the products find the
      range :math:`Q` of :math:`AS` (S random), a third take the exact
      :math:`\operatorname{tr}(Q^\top AQ)` of the top of the spectrum, the rest run Hutchinson
      on the deflated :math:`(I-QQ^\top)A(I-QQ^\top)` (``samples - 2 (samples // 3)`` draws).
      Unbiased; for a PSD :math:`A` its error falls like :math:`1/m` instead of
      :math:`1/\sqrt m`, because what is left after deflation has a small Frobenius norm when
      the spectrum decays (Hessians' does). The standard error is the Hutchinson part's.
    - ``"xtrace"`` (Epperly, Tropp & Webber, 2024): ``samples // 2`` test vectors, each
      left out in turn from the basis of the others' products and used as the Hutchinson
      vector of the rest; the mean of these exchangeable estimates, and their standard
      deviation over the square root of their number as the error (their Sec. 2.3).
      ``samples`` must be even.

    Hutchinson stays the default: its draws are i.i.d., so its standard error is honest
    for any operator, and the labs' exercises reproduce its draws; Hutch++ and XTrace win
    when the spectrum decays, which benchmarks/README.md measures on the book's networks.
    """
    _check_operator(A)
    check_int("samples", samples, 2)
    check_choice("distribution", distribution, DISTRIBUTIONS)
    check_choice("method", method, TRACE_METHODS)
    if method == "xtrace" and samples % 2:
        raise ValueError(f"Invalid samples: {samples} (expected an even number for xtrace)")
    gen = _generator(A, seed)
    if method == "hutchinson":
        return _mean_and_error(_quadratic_forms(A, samples, gen, distribution))
    if method == "xtrace":
        return _mean_and_error(_xtrace(A, samples, gen, distribution))
    exact, rest = _hutchpp(A, samples, gen, distribution)
    mean, se = _mean_and_error(rest)
    return exact.item() + mean, se


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
    The density is normalized to integrate to 1 over ``grid``. Every tensor of the result
    is float64 on the CPU (a ``grid`` given on another device is copied there).
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
    grid = torch.as_tensor(grid, dtype=torch.float64, device=nodes.device)  # the CPU
    density = sum(  # a block of nodes at a time: the grid can be long
        _gaussian(grid[:, None], th, sigma) @ w
        for th, w in zip(nodes.split(256), weights.split(256))
    )
    density /= torch.trapezoid(density, grid)
    return SpectralDensity(grid, density, nodes, weights)
