r"""Conjugate gradients: solve :math:`(A + \lambda I)\,x = b` with products :math:`Av` alone.

Hessian-free optimization (Martens, 2010) needs the Newton-like step
:math:`(G + \lambda I)^{-1}(-g)` for a curvature matrix :math:`G` it cannot form; CG
(Hestenes & Stiefel, 1952) gets it from one product per iteration, and a few iterations,
warm-started from the previous step, are already a useful step.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import NamedTuple

import torch

from .._util import check_int, check_nonnegative, check_tensor
from .operators import CurvatureOperator

__all__ = ["CGInfo", "Iterate", "cg"]


class Iterate(NamedTuple):
    r"""An iterate :func:`cg` kept: its iteration ``k``, :math:`x_k`, and
    :math:`x_k^\top (A + \lambda I) x_k`, read off the residual as :math:`x_k^\top (b - r_k)`
    at no extra product (what Hessian-free needs to price the step, Martens, 2010, Sec. 4.6)."""

    k: int
    x: torch.Tensor
    xAx: float


class CGInfo(NamedTuple):
    """How a :func:`cg` solve went."""

    iterations: int  # products of A made by the iterations (a warm start adds one)
    residual_norms: list[float]  # ||b - (A + damping I) x_k||, k = 0 .. iterations
    converged: bool  # the last residual norm is at most tol * ||b||
    indefinite: bool  # stopped at a direction p with p^T (A + damping I) p <= 0
    iterates: tuple[Iterate, ...] = ()  # those asked for by ``keep``, and the last one


def cg(
    A: CurvatureOperator,
    b: torch.Tensor,
    *,
    damping: float = 0.0,
    max_iters: int | None = None,
    tol: float = 1e-5,
    x0: torch.Tensor | None = None,
    keep: Collection[int] = (),
) -> tuple[torch.Tensor, CGInfo]:
    r"""Conjugate gradients (Hestenes & Stiefel, 1952, the algorithm of their Sec. 3) for
    :math:`(A + \lambda I)x = b`, :math:`\lambda` = ``damping``, ``A`` a symmetric positive
    semi-definite :class:`~lsdl_lab.curvature.operators.CurvatureOperator` (a GGN, a Fisher,
    a matrix).

    From :math:`x_0` (``x0``, default 0), :math:`r_0 = p_0 = b - (A+\lambda I)x_0`; then

    .. math:: \alpha_k = \frac{r_k^\top r_k}{p_k^\top (A+\lambda I) p_k},\quad
              x_{k+1} = x_k + \alpha_k p_k,\quad r_{k+1} = r_k - \alpha_k (A+\lambda I) p_k,
              \quad p_{k+1} = r_{k+1} + \frac{r_{k+1}^\top r_{k+1}}{r_k^\top r_k}\,p_k,

    until :math:`\|r_k\| \le` ``tol`` :math:`\cdot\|b\|` or ``max_iters`` products (default
    ``10 * A.dim``: in exact arithmetic CG ends within ``dim`` steps, in floating point it
    loses the conjugacy of its directions and can need several times more; its error falls
    like :math:`((\sqrt\kappa-1)/(\sqrt\kappa+1))^k` for the condition number
    :math:`\kappa`). A warm start costs one more product (its residual). If
    :math:`p^\top(A+\lambda I)p \le 0` the operator is not positive definite along
    :math:`p`: CG stops there and says so (``info.indefinite``), as
    Hessian-free does with an indefinite Hessian. With ``keep`` (iteration numbers), a copy
    of :math:`x_k` at each of those iterations and of the last one is kept in
    ``info.iterates`` (an :class:`Iterate` each), for Hessian-free's backtracking over them.
    Returns :math:`x` and a :class:`CGInfo`.
    """
    if not isinstance(A, CurvatureOperator):
        raise TypeError(f"Invalid A: a {type(A).__name__} (expected a CurvatureOperator)")
    check_tensor("b", b, ndim=1)
    if b.shape != (A.dim,):
        raise ValueError(f"Invalid b: shape {tuple(b.shape)} (expected ({A.dim},))")
    damping = check_nonnegative("damping", damping)
    max_iters = 10 * A.dim if max_iters is None else check_int("max_iters", max_iters, 1)
    tol = check_nonnegative("tol", tol)

    def matvec(v):
        return A @ v + damping * v

    if x0 is None:
        x, r = torch.zeros_like(b), b.clone()
    else:
        check_tensor("x0", x0, ndim=1)
        if x0.shape != b.shape:
            raise ValueError(f"Invalid x0: shape {tuple(x0.shape)} (expected ({A.dim},))")
        x = x0.clone()
        r = b - matvec(x)
    p, rr = r.clone(), r @ r
    target = tol * b.norm().item()
    norms, indefinite, k = [rr.sqrt().item()], False, 0
    keep = set(keep)
    kept = []

    def store(k):
        kept.append(Iterate(k, x.clone(), (x @ (b - r)).item()))

    while norms[-1] > target and k < max_iters:
        Ap = matvec(p)
        k += 1
        pAp = p @ Ap
        if pAp <= 0:
            indefinite = True
            break
        alpha = rr / pAp
        x += alpha * p
        r -= alpha * Ap
        rr_new = r @ r
        p = r + (rr_new / rr) * p
        rr = rr_new
        norms.append(rr.sqrt().item())
        if k in keep:
            store(k)
    last = k - indefinite  # the iterations that moved x (not the one that met p^T A p <= 0)
    if keep and (not kept or kept[-1].k != last):
        store(last)
    return x, CGInfo(k, norms, norms[-1] <= target, indefinite, tuple(kept))
