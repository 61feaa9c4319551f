r"""Hessian-free optimization (Martens, 2010; Martens & Sutskever, 2012): a damped Gauss-Newton
step solved by conjugate gradients on curvature-vector products, never forming a matrix.

Each step, with :math:`G` the generalized Gauss-Newton of the batch's loss
(:math:`G = J^\top H_\ell J`, positive semi-definite for a loss convex in the outputs;
Schraudolph, 2002) and :math:`\lambda` the damping:

.. math::
    \delta &\approx \arg\min_\delta\ q(\delta) + \tfrac{\lambda}{2}\|\delta\|^2, \qquad
    q(\delta) = f(w) + g^\top\delta + \tfrac12\,\delta^\top G\,\delta \\
    &\quad\text{(CG on } (G + \lambda I)\,\delta = -g
    \text{, from } \delta_0 = \zeta\,\delta_{t-1}) \\
    w &\leftarrow w + \alpha\,\eta\,\delta \\
    \rho &= \frac{f(w_{\text{new}}) - f(w)}{q(\alpha\eta\delta) - q(0)}, \qquad
    \lambda \leftarrow \tfrac32\lambda \ \text{ if } \rho < \tfrac14, \qquad
    \lambda \leftarrow \tfrac23\lambda \ \text{ if } \rho > \tfrac34

- CG (:func:`lsdl_lab.curvature.cg`) makes at most ``cg_iters`` products and stops at a
  relative residual ``cg_tol``; it is warm-started from the previous solution decayed by
  :math:`\zeta` = ``warm_start_decay`` (Martens, 2010, Sec. 4.5: 0.95; 0 starts from zero).
  Martens stops CG by the progress of :math:`q` instead (Sec. 4.4); the residual rule here
  is :func:`~lsdl_lab.curvature.cg`'s. Martens's CG-backtracking (Sec. 4.6: keep some
  iterates, take the best on the loss) is not implemented: :func:`~lsdl_lab.curvature.cg`
  returns its last iterate only.
- :math:`\alpha` is 1, or with ``line_search=True`` the Armijo backtracking line search's
  (Nocedal & Wright, Alg. 3.1; Martens & Sutskever, 2012, Sec. 8.8: no step when it finds
  no decrease).
- ``adapt_damping`` (default on) applies the Levenberg-Marquardt rule above, with the
  reduction ratio :math:`\rho` of the step taken against the *undamped* quadratic model
  :math:`q` (Martens, 2010, Sec. 4.1; Martens & Sutskever, 2012, Sec. 8.5). ``damping``
  lives in the parameter groups, so the adapted value is in ``state_dict`` and a run
  resumes exactly; a damping of 0 stays 0.

The closure returns **the loss and the model's outputs**, both with their graph, and does
not call ``backward`` (pytorch-hessianfree's closure, by F. Meirinhos, also returns the loss
and the outputs, after its own ``backward(create_graph=True)``)::

    opt = HessianFree(model.parameters(), damping=1.0, cg_iters=50)
    for x, y in batches:
        def closure():
            out = model(x)
            return F.cross_entropy(out, y), out
        loss = opt.step(closure)

:math:`Gv = J^\top H_\ell J v` is computed on that graph (:class:`LossGGN`): the curvature
of what the loss does to the outputs, so a term of the loss that does not pass through the
outputs (an explicit weight penalty) is in the gradient but not in :math:`G`; HF's damping
plays the part of a weight penalty's curvature. The memory is the closure's graph and a few
vectors of the model's size, as for a first-order method, so unlike
:class:`~lsdl_lab.optim.Newton` no model is too large for it; each step costs the closure,
one gradient, up to ``cg_iters`` GGN products (about three backward passes each) and one
more evaluation of the loss (one per trial with the line search).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .._util import check_bool, check_int, check_nonnegative, check_real, flatten, unflatten
from ..curvature import CurvatureOperator, cg
from .second_order import SecondOrderOptimizer, loss_of

__all__ = ["HessianFree", "LossGGN"]

BOOST, DROP = 3 / 2, 2 / 3  # Martens (2010), Sec. 4.1: lambda's factors ...
LOW, HIGH = 1 / 4, 3 / 4  # ... when rho < 1/4 and when rho > 3/4


class LossGGN(CurvatureOperator):
    r"""The generalized Gauss-Newton of a loss at the current weights,
    :math:`v \mapsto (J^\top H_\ell J + \operatorname{diag}(\Lambda))\,v`, on the graph of the
    closure's ``loss`` and ``outputs`` (BackPACK's ``ggn_vector_product`` builds it the same
    way, Dangel et al., 2020).

    :math:`Jv` is a forward-mode product obtained from two reverse-mode ones (the "double
    backward" trick: :math:`J^\top u` is linear in a dummy :math:`u`, and its gradient in
    :math:`u` along :math:`v` is :math:`Jv`); :math:`H_\ell (Jv)` differentiates the loss's
    gradient in the outputs; :math:`J^\top(\cdot)` is a backward pass. ``damping`` is a vector
    :math:`\Lambda` (one :math:`\lambda` per coordinate).
    """

    def __init__(self, loss: Tensor, outputs: Tensor, params: list[Tensor], damping: Tensor):
        self.outputs, self.params, self.damping = outputs, params, damping
        self.dim = sum(p.numel() for p in params)
        self.dtype, self.device = params[0].dtype, params[0].device
        with torch.enable_grad():
            (self.loss_grad,) = torch.autograd.grad(loss, outputs, create_graph=True)
            self.u = torch.zeros_like(outputs, requires_grad=True)
            Jtu = torch.autograd.grad(outputs, params, self.u, create_graph=True, allow_unused=True)
        # A parameter the outputs do not depend on has J = 0 there
        self.reached = [i for i, t in enumerate(Jtu) if t is not None]
        self.Jtu = [Jtu[i] for i in self.reached]

    def ggn(self, v: Tensor) -> Tensor:
        """J^T H_l J v, undamped, for a flat vector."""
        vs = unflatten(v, self.params)
        Jv = torch.autograd.grad(self.Jtu, self.u, [vs[i] for i in self.reached],
                                 retain_graph=True)[0]  # fmt: skip
        if self.loss_grad.requires_grad:
            (HJv,) = torch.autograd.grad(self.loss_grad, self.outputs, Jv, retain_graph=True)
        else:  # a loss linear in the outputs has no curvature there
            HJv = torch.zeros_like(Jv)
        JtHJv = torch.autograd.grad(
            self.outputs, self.params, HJv, retain_graph=True, allow_unused=True,
            materialize_grads=True,
        )  # fmt: skip
        return flatten(JtHJv)

    def _matvec(self, v: Tensor) -> Tensor:
        return self.ggn(v) + self.damping * v


class HessianFree(SecondOrderOptimizer):
    r"""Hessian-free optimization with GGN products, CG with a budget and a warm start, and
    Levenberg-Marquardt damping (see the module's docstring for the algorithm and the
    closure).

    ``lr`` scales the step (1: the CG solution); ``damping`` is the initial
    :math:`\lambda`, adapted from there; ``cg_iters`` is the products' budget and ``cg_tol``
    the relative residual at which CG stops; ``warm_start_decay`` is
    :math:`\zeta \in [0, 1]`; ``line_search`` and ``adapt_damping`` switch those on. The
    state of each parameter is its part of the last CG solution, ``"direction"``. After a
    step, ``last`` holds what it did: the :class:`~lsdl_lab.curvature.CGInfo` of the solve,
    the reduction ratio ``rho`` (NaN if not adapting) and the step length ``alpha``.
    """

    def __init__(
        self,
        params,
        lr: float = 1.0,
        damping: float = 1.0,
        cg_iters: int = 50,
        cg_tol: float = 1e-4,
        warm_start_decay: float = 0.95,
        line_search: bool = False,
        adapt_damping: bool = True,
        *,
        foreach: bool = True,
    ):
        defaults = dict(
            lr=lr, damping=damping, cg_iters=cg_iters, cg_tol=cg_tol,
            warm_start_decay=warm_start_decay, line_search=line_search,
            adapt_damping=adapt_damping,
        )  # fmt: skip
        super().__init__(params, defaults, foreach)
        self.last: dict = {}

    shared = ("cg_iters", "cg_tol", "warm_start_decay", "line_search", "adapt_damping")

    def check(self, group):
        check_nonnegative("damping", group["damping"])
        check_int("cg_iters", group["cg_iters"], 1)
        check_real("cg_tol", group["cg_tol"], 0.0, 1.0)
        check_real("warm_start_decay", group["warm_start_decay"], 0.0, 1.0)
        check_bool("adapt_damping", group["adapt_damping"])
        self.check_shared(group)

    def warm_start(self, params: list[Tensor], decay: float) -> Tensor | None:
        r""":math:`\zeta\,\delta_{t-1}` (zero where a parameter has none yet), or None."""
        if not decay or not any("direction" in self.state[p] for p in params):
            return None
        previous = [self.state[p].get("direction", torch.zeros_like(p)) for p in params]
        return decay * flatten(previous)

    @torch.no_grad()
    def step(self, closure=None):
        r"""One step: CG on :math:`(G + \lambda I)\delta = -g`, the move, then :math:`\lambda`
        by the reduction ratio."""
        params, groups = self.trainable()
        result, loss = self.evaluate(closure)
        if not (isinstance(result, tuple) and len(result) == 2):
            raise TypeError(
                f"Invalid closure: it returned a {type(result).__name__} (expected (loss, "
                "outputs): HessianFree's Gauss-Newton products need the model's outputs)"
            )
        params, groups, grads = self.gradient(loss, params, groups, create_graph=False)
        if not params:
            return loss
        first = groups[0]
        G = LossGGN(loss, result[1], params, self.per_coordinate(params, groups, "damping"))
        g = flatten(grads)
        x0 = self.warm_start(params, first["warm_start_decay"])
        delta, info = cg(G, -g, max_iters=first["cg_iters"], tol=first["cg_tol"], x0=x0)
        for p, part in zip(params, unflatten(delta, params)):
            self.state[p]["direction"] = part
        d = delta * self.per_coordinate(params, groups, "lr")
        slope, curvature = (g @ d).item(), (d @ G.ggn(d)).item()
        del G  # the graph: the moves below change the weights it was built on
        f0 = loss.item()
        alpha, f_new = self.take_step(closure, params, unflatten(d, params), f0, slope,
                                      first["line_search"])  # fmt: skip
        rho = math.nan
        if first["adapt_damping"]:
            if f_new is None:
                f_new = loss_of(closure()).item()
            rho = reduction_ratio(f_new - f0, alpha * slope + alpha**2 * curvature / 2)
            factor = BOOST if rho < LOW else DROP if rho > HIGH else 1.0
            for group in self.param_groups:
                group["damping"] *= factor
        self.last = dict(cg=info, rho=rho, alpha=alpha)
        return loss


def reduction_ratio(actual: float, predicted: float) -> float:
    r""":math:`\rho` = actual over predicted change; :math:`-\infty` when the model predicts no
    decrease (no step was taken, or CG found no descent): the damping then rises."""
    return actual / predicted if predicted < 0 else -math.inf
