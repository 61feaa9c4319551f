r"""Newton's method for small models: the step :math:`-(H + \lambda I)^{-1} g`, damped, with an
optional backtracking line search (Nocedal & Wright, *Numerical Optimization*, 2006).

.. math::
    d_t = -(H_t + \lambda I)^{-1} g_t, \qquad w_{t+1} = w_t + \alpha_t\,\eta\, d_t

with :math:`g_t` and :math:`H_t` the gradient and the Hessian of the loss at :math:`w_t`,
:math:`\lambda` the damping (Levenberg, 1944), :math:`\eta` the learning rate (1 is Newton's
step; on a quadratic it lands on the minimum in one step) and :math:`\alpha_t` the line
search's step length (1 without a line search).

The closure **returns the loss with its graph and does not call** ``backward``: Newton
differentiates the loss twice itself (a backward pass would free the graph it needs)::

    opt = Newton(model.parameters(), damping=1e-3, line_search=True)
    for x, y in batches:
        loss = opt.step(lambda: F.mse_loss(model(x), y))

The parameters are those that require a gradient and that the loss depends on; the others
are skipped. With several parameter groups the system is solved over all of them at once
(the Hessian couples them); each group has its own damping on its diagonal block and its own
learning rate on its part of the step.

The dense Hessian has :math:`P^2` entries and its solve costs :math:`O(P^3)`: at
``method="exact"`` a model of more than ``max_params`` parameters (default 5,000: 200 MB in
float64, :math:`4\cdot 10^{10}` flops for the factorization and 5,000 Hessian-vector products
to build the matrix, each step) is refused. ``method="cg"`` solves the same system
with Hessian-vector products (Pearlmutter, 1994) and conjugate gradients
(:func:`lsdl_lab.curvature.cg`), without forming :math:`H` (Newton-CG, Nocedal & Wright,
Alg. 7.1); for large networks, :class:`~lsdl_lab.optim.HessianFree` is the method.

The Hessian of a network is indefinite away from a minimum, and then :math:`d_t` can point
uphill. What Newton does, per method:

- ``"exact"``: if :math:`H + \lambda I` is not positive definite (its Cholesky factorization
  fails), a multiple of the identity is added, :math:`\tau = \max(2\tau, \beta)`, doubling
  until the factorization succeeds (Nocedal & Wright, Alg. 3.3, "Cholesky with added
  multiple of the identity", with two choices of ours: :math:`\tau` starts from 0, not from
  :math:`\beta - \min_i H_{ii}`, and :math:`\beta = 10^{-3}\max_i |H_{ii}|` takes their
  :math:`10^{-3}` in the matrix's own scale, so the rule does not depend on the loss's units).
  The step is then a descent direction.
- ``"cg"``: conjugate gradients stop at the first direction of non-positive curvature and
  return the iterate reached; if that is the first iterate, the step is steepest descent,
  :math:`-g` (Nocedal & Wright, Alg. 7.1).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._util import check_choice, check_int, check_nonnegative, check_real, flatten, unflatten
from ..curvature import CurvatureOperator, cg
from .second_order import SecondOrderOptimizer

__all__ = ["LossHessian", "Newton"]

METHODS = ("exact", "cg")


class LossHessian(CurvatureOperator):
    r"""The Hessian of a loss at the current weights, :math:`v \mapsto Hv`, from the loss's
    own graph: :math:`g = \nabla L` is computed once with ``create_graph=True`` and each
    product is one backward pass through it, :math:`Hv = \nabla_w (g^\top v)` (Pearlmutter,
    1994). Damping :math:`\Lambda`, a vector (one :math:`\lambda` per coordinate), is added:
    the operator is :math:`H + \operatorname{diag}(\Lambda)`.

    ``grads`` are the gradients with their graph; ``params`` the tensors they belong to.
    """

    def __init__(self, grads: list[Tensor], params: list[Tensor], damping: Tensor):
        self.params, self.damping = params, damping
        with torch.enable_grad():  # keep the graph through the concatenation
            self.g = flatten(grads)
        self.dim, self.dtype, self.device = self.g.numel(), self.g.dtype, self.g.device

    def _rows(self, vs: Tensor) -> Tensor:
        """(H v_1, ..., H v_k) for the rows of ``vs``, one batched backward pass."""
        if not self.g.requires_grad:  # a loss linear in the weights has no curvature
            return torch.zeros_like(vs)
        rows = torch.autograd.grad(
            self.g, self.params, vs, retain_graph=True, is_grads_batched=True,
            allow_unused=True, materialize_grads=True,
        )  # fmt: skip
        return torch.cat([r.reshape(len(vs), -1) for r in rows], 1)

    def _matvec(self, v: Tensor) -> Tensor:
        return self._rows(v[None])[0] + self.damping * v

    def matrix(self, chunk: int = 256) -> Tensor:
        r"""The dense :math:`H + \operatorname{diag}(\Lambda)`, symmetrized (the two triangles
        differ by rounding), built ``chunk`` rows per backward pass."""
        eye = torch.eye(self.dim, dtype=self.dtype, device=self.device)
        H = torch.cat([self._rows(eye[i : i + chunk]) for i in range(0, self.dim, chunk)])
        self.products += self.dim
        return (H + H.mT) / 2 + torch.diag(self.damping)


class Newton(SecondOrderOptimizer):
    r"""Damped Newton's method, exact (a dense Hessian and its Cholesky factorization) or with
    conjugate gradients on Hessian-vector products, with an optional Armijo line search.

    ``lr`` scales the step (1 is Newton's step); ``damping`` :math:`\lambda \ge 0` is added
    to the Hessian's diagonal; ``method`` is ``"exact"`` or ``"cg"`` (then ``cg_iters``
    products at most, stopping at a relative residual ``cg_tol``); ``line_search``
    backtracks from the full step until the Armijo condition holds; ``max_params`` bounds
    the model at ``method="exact"``. ``step(closure)`` needs the closure (the loss with its
    graph, see the module's docstring) and returns the loss at the weights it started from.
    The per-parameter state is empty: each step starts afresh.
    """

    def __init__(
        self,
        params,
        lr: float = 1.0,
        damping: float = 0.0,
        method: str = "exact",
        cg_iters: int = 100,
        cg_tol: float = 1e-8,
        line_search: bool = False,
        max_params: int = 5000,
        *,
        foreach: bool = True,
        compile: bool = False,
    ):
        defaults = dict(
            lr=lr, damping=damping, method=method, cg_iters=cg_iters, cg_tol=cg_tol,
            line_search=line_search, max_params=max_params,
        )  # fmt: skip
        super().__init__(params, defaults, foreach, compile)

    shared = ("method", "cg_iters", "cg_tol", "line_search", "max_params")

    def check(self, group):
        check_nonnegative("damping", group["damping"])
        check_choice("method", group["method"], METHODS)
        check_int("cg_iters", group["cg_iters"], 1)
        check_real("cg_tol", group["cg_tol"], 0.0, 1.0)
        check_int("max_params", group["max_params"], 1)
        if "params" not in group:
            return  # the defaults, checked before any group exists
        size = sum(p.numel() for g in self.param_groups for p in g["params"])
        limit = group["max_params"]
        if group["method"] == "exact" and size > limit:
            raise ValueError(
                f"Invalid params: {size:,} parameters, more than max_params={limit:,}: "
                f"Newton's dense Hessian would hold {size**2:,} numbers "
                f"({size**2 * 8 / 2**30:.1f} GiB in float64) and its factorization cost about "
                f"{size**3 / 3:.1e} flops a step (O(P^3)); use method='cg' or HessianFree, "
                "or raise max_params"
            )
        self.check_shared(group)

    @torch.no_grad()
    def step(self, closure=None):
        r""":math:`d = -(H + \Lambda)^{-1} g`, then :math:`w \leftarrow w + \alpha\,\eta\,d`."""
        params, groups = self.trainable()
        _, loss = self.evaluate(closure)
        params, groups, grads = self.gradient(loss, params, groups, create_graph=True)
        if not params:
            return loss
        first = groups[0]
        H = LossHessian(grads, params, self.per_coordinate(params, groups, "damping"))
        g = H.g.detach()
        if first["method"] == "exact":
            d = self.exact_solve(H.matrix(), -g)
        else:
            d, info = cg(H, -g, max_iters=first["cg_iters"], tol=first["cg_tol"])
            if info.indefinite and info.iterations == 1:
                d = -g  # negative curvature at once: steepest descent (N&W, Alg. 7.1)
        del H, grads  # the graph: the line search moves the weights it was built on
        d = d * self.per_coordinate(params, groups, "lr")
        slope = (g @ d).item()
        self.take_step(closure, params, unflatten(d, params), loss.item(), slope,
                       first["line_search"])  # fmt: skip
        return loss

    @staticmethod
    def exact_solve(A: Tensor, b: Tensor) -> Tensor:
        r""":math:`(A + \tau I)^{-1} b` by Cholesky, with :math:`\tau = 0` when :math:`A` is
        positive definite and otherwise doubled from :math:`\beta = 10^{-3}\max_i|A_{ii}|`
        until the factorization succeeds (Nocedal & Wright, Alg. 3.3)."""
        if not torch.isfinite(A).all():
            raise RuntimeError("Newton: the Hessian has a NaN or an infinity (check the loss)")
        scale = A.diagonal().abs().max().item()
        if scale == 0:
            raise RuntimeError(
                "Newton: the Hessian's diagonal is zero and damping=0: the step is undefined "
                "(a loss linear in these weights?); give damping > 0"
            )
        eye = torch.eye(len(A), dtype=A.dtype, device=A.device)
        beta = 1e-3 * scale
        tau = 0.0
        while True:
            L, info = torch.linalg.cholesky_ex(A + tau * eye)
            if info == 0:
                return torch.cholesky_solve(b[:, None], L)[:, 0]
            tau = max(2 * tau, beta)
