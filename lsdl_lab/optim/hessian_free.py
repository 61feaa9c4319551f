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
- With ``cg_backtracking=True``, Martens's CG-iteration backtracking (Sec. 4.6): CG keeps
  its iterate :math:`\delta_k` at the iterations :math:`k = \lceil\gamma^j\rceil`,
  :math:`j = 0, 1, \dots` (:math:`\gamma = 1.3`, his value) and its last one; starting
  from the last, the loss :math:`f(w + \eta\delta_k)` is evaluated on the step's batch at each
  kept iterate in turn, going back while it decreases, and the step is the best one found.
  The quadratic model can be a poor guide to :math:`f` far from :math:`w`, and CG's later
  iterates, which minimize it better, can then be worse on :math:`f` than earlier, shorter
  ones (Martens: it also guards against overfitting the curvature mini-batch). As he does,
  the next CG run is warm-started from the last iterate, not the chosen one. The model's
  value at each kept iterate comes from CG's residual, :math:`\delta_k^\top(G + \lambda I)
  \delta_k = \delta_k^\top(-g - r_k)`, with no extra product (when the groups' learning
  rates differ, one product per kept iterate instead).
- :math:`\alpha` is 1, or with ``line_search=True`` the Armijo backtracking line search's
  (Nocedal & Wright, Alg. 3.1; Martens & Sutskever, 2012, Sec. 8.8: no step when it finds
  no decrease).
- ``adapt_damping`` (default on) applies the Levenberg-Marquardt rule above, with the
  reduction ratio :math:`\rho` of the step taken against the *undamped* quadratic model
  :math:`q` (Martens, 2010, Sec. 4.1; Martens & Sutskever, 2012, Sec. 8.5). ``damping``
  lives in the parameter groups, so the adapted value is in ``state_dict`` and a run
  resumes exactly; a damping of 0 stays 0.

**The variant, and where it departs from Martens (2010).** HF with Gauss-Newton products
(his Sec. 4.2), his Levenberg-Marquardt rule and constants (Sec. 4.1), his decayed warm
start (Sec. 4.5) and, optionally, his CG-iteration backtracking (Sec. 4.6); it departs from
his paper in three places:

- **no preconditioner for CG.** Martens preconditions CG by
  :math:`M = [\operatorname{diag}(\sum_i \nabla f_i \odot \nabla f_i) + \lambda I]^{3/4}`,
  a power of the empirical Fisher's diagonal (Sec. 4.7); CG here is unpreconditioned, so on
  a badly scaled problem it needs more products for the same residual;
- **no separate curvature mini-batches.** Martens computes the gradient on large batches
  (or the whole data set) and the curvature products on a smaller mini-batch, a different
  one at each step (Sec. 4.3); here the gradient, the products and the reduction ratio all
  use the closure's one batch (full-batch training, as in Lab 6, makes the two the same);
- **another stopping rule.** CG stops at the relative residual ``cg_tol`` or after the
  ``cg_iters`` products (50 by default), not by Martens's progress rule on the quadratic
  model: stop at iteration :math:`i` once :math:`i > k`, :math:`q(\delta_i) < 0` and
  :math:`(q(\delta_i) - q(\delta_{i-k}))/q(\delta_i) < k\epsilon`, with
  :math:`k = \max(10, 0.1\,i)` and :math:`\epsilon = 5\cdot10^{-4}` (Sec. 4.4), within a
  budget of up to 250 iterations.

The line search is Martens and Sutskever's (2012), not part of the 2010 paper.

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
plays the part of a weight penalty's curvature.

**What limits the model's size.** Not a matrix (unlike :class:`~lsdl_lab.optim.Newton`, HF
never forms one): memory. Beside the closure's graph (kept through the whole step, with the
graph of :math:`J^\top u` that the products differentiate), HF holds, at the peak of its
CG solve, vectors of the model's size: the gradient; CG's right-hand side, iterate,
residual, direction and product; two temporaries of a product; the damping vector; the warm
start and the saved direction (:data:`VECTORS`, 11), and with backtracking the kept
iterates (14 for ``cg_iters=50``). A first-order method holds two to
four such vectors (Adam: the gradient and two moments). HF refuses, when it is built, a
model whose vectors would not fit in ``max_bytes`` (default: the memory available on the
parameters' device at that moment, :func:`available_bytes`), and says how much they need,
rather than fail for memory in the middle of a step. Time is the other limit: each step costs
the closure, one gradient, up to ``cg_iters`` GGN products (about three backward passes
each) and one more evaluation of the loss (one per trial with the line search, one per kept
iterate tried with backtracking).
"""

from __future__ import annotations

import math
import os

import torch
from torch import Tensor

from .._util import check_bool, check_int, check_nonnegative, check_real, flatten, unflatten
from ..curvature import CurvatureOperator, Iterate, cg
from .second_order import SecondOrderOptimizer, loss_of

__all__ = ["HessianFree", "LossGGN", "available_bytes", "backtracking_iterations"]

BOOST, DROP = 3 / 2, 2 / 3  # Martens (2010), Sec. 4.1: lambda's factors ...
LOW, HIGH = 1 / 4, 3 / 4  # ... when rho < 1/4 and when rho > 3/4
GAMMA = 1.3  # Martens (2010), Sec. 4.6: CG's iterates kept at ceil(gamma^j)
VECTORS = 11  # model-sized vectors HF holds at once besides kept iterates (module docstring)


def backtracking_iterations(max_iters: int, gamma: float = GAMMA) -> list[int]:
    r"""The CG iterations whose iterates backtracking keeps, :math:`\lceil\gamma^j\rceil
    \le` ``max_iters`` (Martens, 2010, Sec. 4.6): 1, 2, 3, 4, 5, 7, 9, 11, 14, ... for
    :math:`\gamma = 1.3`; CG keeps its last iterate too."""
    out, j = [], 0
    while (k := math.ceil(gamma**j)) <= max_iters:
        if not out or k != out[-1]:
            out.append(k)
        j += 1
    return out


def available_bytes(device: torch.device) -> int:
    """The memory that can still be allocated on ``device``: CUDA's free memory, or on the
    CPU the kernel's estimate of the memory available without swapping (``MemAvailable``
    of /proc/meminfo; free physical pages where there is no such file)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


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
    Levenberg-Marquardt damping (see the module's docstring for the algorithm, the closure,
    and the three places where it departs from Martens, 2010: no CG preconditioner, one
    batch for the gradient and the curvature, a residual stopping rule instead of his
    progress rule on the quadratic model).

    ``lr`` scales the step (1: the CG solution); ``damping`` is the initial
    :math:`\lambda`, adapted from there; ``cg_iters`` is the products' budget and ``cg_tol``
    the relative residual at which CG stops; ``warm_start_decay`` is
    :math:`\zeta \in [0, 1]`; ``line_search``, ``adapt_damping`` and ``cg_backtracking``
    switch those on; ``max_bytes`` bounds the memory of HF's vectors (default: what the
    parameters' device has available). The state of each parameter is its part of the last
    CG solution, ``"direction"``. After a step, ``last`` holds what it did: the
    :class:`~lsdl_lab.curvature.CGInfo` of the solve, the CG iteration whose iterate was
    taken (``iteration``), the reduction ratio ``rho`` (NaN if not adapting) and the step
    length ``alpha``.
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
        cg_backtracking: bool = False,
        max_bytes: int | None = None,
        *,
        foreach: bool = True,
        compile: bool = False,
    ):
        defaults = dict(
            lr=lr, damping=damping, cg_iters=cg_iters, cg_tol=cg_tol,
            warm_start_decay=warm_start_decay, line_search=line_search,
            adapt_damping=adapt_damping, cg_backtracking=cg_backtracking, max_bytes=max_bytes,
        )  # fmt: skip
        super().__init__(params, defaults, foreach, compile)
        self.last: dict = {}

    shared = ("cg_iters", "cg_tol", "warm_start_decay", "line_search", "adapt_damping",
              "cg_backtracking", "max_bytes")  # fmt: skip

    def check(self, group):
        check_nonnegative("damping", group["damping"])
        check_int("cg_iters", group["cg_iters"], 1)
        check_real("cg_tol", group["cg_tol"], 0.0, 1.0)
        check_real("warm_start_decay", group["warm_start_decay"], 0.0, 1.0)
        check_bool("adapt_damping", group["adapt_damping"])
        check_bool("cg_backtracking", group["cg_backtracking"])
        if group["max_bytes"] is not None:
            check_int("max_bytes", group["max_bytes"], 1)
        if "params" in group:
            self.check_memory(group)
        self.check_shared(group)

    def check_memory(self, group: dict) -> None:
        """Refuse a model whose vectors (module docstring) would not fit in ``max_bytes``."""
        params = [p for g in self.param_groups for p in g["params"]]
        if not params:
            return
        size = sum(p.numel() for p in params)
        kept = 0
        if group["cg_backtracking"]:
            kept = len(backtracking_iterations(group["cg_iters"])) + 1
        need = (VECTORS + kept) * size * params[0].element_size()
        device = params[0].device
        limit = group["max_bytes"]
        limit = available_bytes(device) if limit is None else limit
        if need > limit:
            raise ValueError(
                f"Invalid params: {size:,} parameters: HessianFree would hold {VECTORS + kept} "
                f"vectors of that size (the gradient, CG's five, two temporaries of a product, "
                f"the damping, the warm start and the saved direction"
                + (f", {kept} kept CG iterates" if kept else "")
                + f"), {need / 2**30:.2f} GiB, more than the {limit / 2**30:.2f} GiB "
                + ("available on " + str(device) if group["max_bytes"] is None
                   else f"of max_bytes={limit:,}")
                + "; use a first-order method or K-FAC, or a smaller model"
            )  # fmt: skip

    def warm_start(self, params: list[Tensor], decay: float) -> Tensor | None:
        r""":math:`\zeta\,\delta_{t-1}` (zero where a parameter has none yet), or None."""
        if not decay or not any("direction" in self.state[p] for p in params):
            return None
        previous = [self.state[p].get("direction", torch.zeros_like(p)) for p in params]
        return decay * flatten(previous)

    @torch.no_grad()
    def step(self, closure=None):
        r"""One step: CG on :math:`(G + \lambda I)\delta = -g`, the move (after backtracking
        over CG's iterates, if on), then :math:`\lambda` by the reduction ratio."""
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
        keep = backtracking_iterations(first["cg_iters"]) if first["cg_backtracking"] else ()
        delta, info = cg(G, -g, max_iters=first["cg_iters"], tol=first["cg_tol"], x0=x0,
                         keep=keep)  # fmt: skip
        for p, part in zip(params, unflatten(delta, params)):
            self.state[p]["direction"] = part
        lr = self.per_coordinate(params, groups, "lr")
        candidates = info.iterates or (Iterate(info.iterations, delta, math.nan),)
        # the model's slope and curvature of each candidate step d = lr * delta_k, before the
        # moves below change the weights that G's graph was built on
        priced = [(c, *self.model_terms(G, g, c, lr)) for c in candidates]
        del G
        f0 = loss.item()
        iteration, d, slope, curvature, f_new = self.backtrack(closure, params, priced, lr)
        alpha, f_line = self.take_step(closure, params, unflatten(d, params), f0, slope,
                                       first["line_search"])  # fmt: skip
        f_new = f_line if first["line_search"] else f_new
        rho = math.nan
        if first["adapt_damping"]:
            if f_new is None:
                f_new = loss_of(closure()).item()
            rho = reduction_ratio(f_new - f0, alpha * slope + alpha**2 * curvature / 2)
            factor = BOOST if rho < LOW else DROP if rho > HIGH else 1.0
            for group in self.param_groups:
                group["damping"] *= factor
        self.last = dict(cg=info, iteration=iteration, rho=rho, alpha=alpha)
        return loss

    @staticmethod
    def model_terms(G: LossGGN, g: Tensor, c: Iterate, lr: Tensor) -> tuple[float, float]:
        r"""The slope :math:`g^\top d` and undamped curvature :math:`d^\top G d` of the step
        :math:`d = \eta\,\delta_k`; with one learning rate, the curvature is CG's
        :math:`\delta_k^\top(G + \Lambda)\delta_k` less the damping's part (no product)."""
        d = lr * c.x
        eta = lr[0].item()
        if not math.isnan(c.xAx) and bool((lr == eta).all()):
            return (g @ d).item(), eta**2 * (c.xAx - (c.x * G.damping) @ c.x).item()
        return (g @ d).item(), (d @ G.ggn(d)).item()

    def backtrack(self, closure, params: list[Tensor], priced: list, lr: Tensor):
        """Martens (2010), Sec. 4.6: from the last kept iterate back, the loss at each step
        ``lr * x_k`` while it decreases; (iteration, step, slope, curvature, loss there or None
        if not evaluated). With one candidate (no backtracking) nothing is evaluated; the
        weights are left where they started."""
        if len(priced) == 1:
            c, slope, curvature = priced[0]
            return c.k, lr * c.x, slope, curvature, None
        start = [p.detach().clone() for p in params]
        best = None
        for c, slope, curvature in reversed(priced):
            d = lr * c.x
            self.move(params, start, unflatten(d, params), 1.0)
            f = loss_of(closure()).item()
            if best is not None and not f < best[-1]:
                break
            best = (c.k, d, slope, curvature, f)
        torch._foreach_copy_(params, start)
        return best


def reduction_ratio(actual: float, predicted: float) -> float:
    r""":math:`\rho` = actual over predicted change; :math:`-\infty` when the model predicts no
    decrease (no step was taken, or CG found no descent): the damping then rises."""
    return actual / predicted if predicted < 0 else -math.inf
