r"""SOAP: Adam in the eigenbasis of Shampoo's preconditioner.

Vyas et al. (2024, "SOAP: Improving and Stabilizing Shampoo using Adam", arXiv:2409.11321;
ICLR 2025) observe that Shampoo with the exponent 1/2 is Adafactor run in the eigenbasis of
its preconditioner, and run Adam there instead. For a weight :math:`W \in \mathbb{R}^{m
\times n}` with gradient :math:`G_t`, Shampoo's statistics are exponential averages,

.. math::
    L_t = \beta_s L_{t-1} + (1-\beta_s)\, G_t G_t^\top, \qquad
    R_t = \beta_s R_{t-1} + (1-\beta_s)\, G_t^\top G_t \qquad (L_0 = R_0 = 0),

their eigenvectors :math:`Q_L, Q_R` (columns in decreasing order of the eigenvalues) are
refreshed every ``precondition_frequency`` steps, and Adam runs on the rotated gradient,
its moments kept in the rotated basis:

.. math::
    G'_t &= Q_L^\top G_t Q_R \\
    M'_t &= \beta_1 M'_{t-1} + (1-\beta_1)\, G'_t, \qquad
    V'_t = \beta_2 V'_{t-1} + (1-\beta_2)\, G'^2_t \\
    W_t &= (1 - \eta\lambda)\, W_{t-1} - \frac{\eta}{1-\beta_1^\tau}\,
           Q_L \left(\frac{M'_t}{\sqrt{V'_t / (1-\beta_2^\tau)} + \epsilon}\right) Q_R^\top

with :math:`\tau` Adam's step count. Between refreshes this is exactly Adam on the
rotated parameter :math:`Q_L^\top W Q_R` (tested); the rotation makes Adam's diagonal
second moment see the gradient's correlations that Shampoo's full-matrix statistics hold.
An order-:math:`k` tensor gets one statistic and one basis per dimension (the mode-:math:`i`
unfolding's :math:`G_{(i)} G_{(i)}^\top`, as in :mod:`lsdl_lab.optim.shampoo`); a vector,
a scalar, and every dimension longer than ``max_precond_dim`` keep the identity basis, so
a tensor with no rotated dimension (every bias and gain) gets plain AdamW, bit for bit
:class:`~lsdl_lab.optim.AdamW` (tested).

**The variant, against the authors' reference** (github.com/nikhilvyas/SOAP, ``soap.py``,
read and not copied), with its defaults: ``lr=3e-3``, ``betas=(0.95, 0.95)``,
``shampoo_beta`` :math:`\beta_s` equal to :math:`\beta_2` unless given, ``eps=1e-8``,
``weight_decay=0.01``, ``precondition_frequency=10``, ``max_precond_dim=10000``.

* **The first step of a rotated tensor only gathers statistics** (the reference's:
  "so that we never use the current gradients in the projection"): it builds
  :math:`L_1, R_1` and their bases and leaves the weight alone; Adam's count :math:`\tau`
  starts at the second step. The statistics are updated *after* each step's update, so no
  gradient enters the basis that rotates it.
* **The first moment lives in the rotated basis**, as in the reference (its commit
  "momentum change"; the paper's Algorithm 3 keeps :math:`M` unrotated and rotates it every
  step): at a refresh it is rotated back with the old bases and into the new ones,
  :math:`M' \leftarrow Q_L^{\prime\top} (Q_L M' Q_R^\top) Q'_R`. The reference rotates it
  back and forth after every step, the identity between refreshes up to rounding; here only
  at a refresh.
* **The second moment is not rotated** (it is a diagonal in the old basis, which no
  rotation carries over): as in the reference, at a refresh the old basis vectors are
  ordered by their Rayleigh quotients :math:`\operatorname{diag}(Q_L^\top L_t Q_L)`
  (largest first) and :math:`V'` is permuted along each dimension in that order, so that
  its entries follow their directions into the new basis, whose vectors are in decreasing
  order of eigenvalue.
* **The bases come from** ``torch.linalg.eigh`` **at every refresh**, in float64 (the
  paper and the reference take one eigendecomposition at the start, then one step of power
  iteration :math:`L_t Q_L` followed by a QR decomposition, which is cheaper and tracks the
  eigenvectors to within one power step; the exact eigenbasis is the fixed point that
  iteration approaches). A failed decomposition keeps the last basis (the identity before
  the first), as :class:`~lsdl_lab.optim.Shampoo` keeps its last root.
* **Epsilon and weight decay are AdamW's** (:class:`~lsdl_lab.optim.AdamW`, torch.optim's):
  :math:`\epsilon` after the bias-corrected square root (the reference adds it to
  :math:`\sqrt{V'}` and folds :math:`\sqrt{1-\beta_2^\tau}` into the step size, a
  difference of :math:`\epsilon` in scale), and the decay :math:`1-\eta\lambda` before the
  update (the reference decays the updated weight, a difference of order
  :math:`\eta^2\lambda`).
* Not offered: the reference's ``merge_dims`` (reshaping a kernel into fewer, larger
  dimensions), ``precondition_1d`` (a full basis for vectors), ``normalize_grads`` and
  ``correct_bias=False``.

**Memory and cost.** Adam's two moments (8 bytes per float32 parameter), plus per rotated
dimension of size :math:`n` a statistic and a basis, :math:`2n^2` numbers: for an
:math:`m \times n` matrix :math:`2(m^2 + n^2)`, 4 numbers per parameter more for a square
matrix (16 bytes in float32: 24 in all, against AdamW's 8). A step costs four matrix
products per matrix (the rotation there and back, :math:`4mn(m+n)` FLOPs) and two for the
statistics; a refresh adds the eigendecompositions, :math:`O(m^3 + n^3)`, every
``precondition_frequency`` steps. Like Muon's, the rotation needs each matrix whole: under
ZeRO or FSDP one all-gather per matrix.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._util import check_int, check_real
from .base import Optimizer
from .compiled import map_once
from .pieces import adam_denominator, adam_moments_, addcdiv_, decoupled_weight_decay_

__all__ = ["SOAP", "eigenbasis", "rotate"]


def eigenbasis(H: Tensor) -> Tensor:
    """The eigenvectors of a symmetric ``H`` as columns, in decreasing order of their
    eigenvalues, computed in float64 and returned in ``H``'s dtype."""
    _, Q = torch.linalg.eigh(H.to(torch.float64))
    return Q.flip(1).to(H.dtype)


def rotate(X: Tensor, bases: list[Tensor | None], back: bool = False) -> Tensor:
    r"""``X`` in the basis ``bases`` (one matrix, or None for the identity, per dimension):
    :math:`X \times_1 Q_1^\top \cdots \times_k Q_k^\top`, for a matrix
    :math:`Q_L^\top X Q_R`; with ``back``, :math:`X \times_1 Q_1 \cdots \times_k Q_k`, for a
    matrix :math:`Q_L X Q_R^\top`."""
    for Q in bases:  # contracting dimension 0 each time cycles back to the order
        if Q is None:
            X = X.movedim(0, -1)
        else:
            X = torch.tensordot(X, Q, dims=([0], [1 if back else 0]))
    return X


def _others(k: int, i: int) -> list[int]:
    return [j for j in range(k) if j != i]


class SOAP(Optimizer):
    r"""SOAP (Vyas et al., 2024): AdamW in the eigenbasis of Shampoo's statistics, refreshed
    every ``precondition_frequency`` steps; plain AdamW for the tensors with no dimension
    to rotate (vectors, scalars, dimensions longer than ``max_precond_dim``).

    ``shampoo_beta`` :math:`\beta_s \in [0, 1)` averages the statistics (``None``: Adam's
    :math:`\beta_2`, the reference's default); ``precondition_frequency`` and
    ``max_precond_dim`` are ints >= 1.
    """

    not_compilable = (
        "its update builds the eigenbases on a tensor's first step and refreshes them every "
        "precondition_frequency steps, branches on the step count, and keeps the last basis "
        "when an eigendecomposition fails (an exception): control flow that one graph "
        "cannot hold"
    )

    def __init__(
        self,
        params,
        lr: float = 3e-3,
        betas=(0.95, 0.95),
        shampoo_beta: float | None = None,
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        precondition_frequency: int = 10,
        max_precond_dim: int = 10000,
        *,
        foreach: bool = True,
        compile: bool = False,
    ):
        defaults = dict(
            lr=lr,
            betas=betas,
            shampoo_beta=shampoo_beta,
            eps=eps,
            weight_decay=weight_decay,
            precondition_frequency=precondition_frequency,
            max_precond_dim=max_precond_dim,
        )
        super().__init__(params, defaults, foreach, compile)

    def check(self, group):
        if group["shampoo_beta"] is not None:
            check_real("shampoo_beta value", group["shampoo_beta"], 0.0, 1.0, high_open=True)
        check_int("precondition_frequency", group["precondition_frequency"], 1)
        check_int("max_precond_dim", group["max_precond_dim"], 1)

    @staticmethod
    def rotated_dims(group: dict, p: Tensor) -> list[bool]:
        """Which dimensions of ``p`` get a basis: those of a tensor of order 2 or more
        that are at most ``max_precond_dim`` long."""
        return [p.dim() >= 2 and n <= group["max_precond_dim"] for n in p.shape]

    def statistics_(self, group: dict, p: Tensor, G: Tensor) -> None:
        r""":math:`H^{(i)} \leftarrow \beta_s H^{(i)} + (1-\beta_s)\, G_{(i)} G_{(i)}^\top`
        for each rotated dimension :math:`i` (created as zeros on the first step)."""
        beta_s = group["shampoo_beta"]
        beta_s = group["betas"][1] if beta_s is None else beta_s
        state, k = self.state[p], G.dim()
        if "statistics" not in state:
            state["statistics"] = [
                G.new_zeros(n, n) if rotated else None
                for n, rotated in zip(G.shape, self.rotated_dims(group, p))
            ]
        for i, H in enumerate(state["statistics"]):
            if H is not None:
                H.lerp_(torch.tensordot(G, G, dims=(_others(k, i), _others(k, i))), 1 - beta_s)

    def refresh_(self, p: Tensor) -> None:
        r"""New bases from the statistics: :math:`Q \leftarrow` the eigenvectors of
        :math:`H` (decreasing eigenvalues); :math:`M'` rotated from the old bases into the
        new ones; :math:`V'` permuted along each dimension in the order of the old basis
        vectors' Rayleigh quotients :math:`\operatorname{diag}(Q^\top H Q)` (largest first).
        The first call makes the bases (and has no moments to carry)."""
        state = self.state[p]
        old = state.get("bases")
        new = []
        for i, H in enumerate(state["statistics"]):
            if H is None:
                new.append(None)
                continue
            Q = None if old is None else old[i]
            if Q is not None:
                order = torch.argsort(torch.diagonal(Q.T @ H @ Q), descending=True)
                state["exp_avg_sq"].copy_(state["exp_avg_sq"].index_select(i, order))
            try:
                new.append(eigenbasis(H))
            except torch.linalg.LinAlgError:  # keep the last basis, as Shampoo its last root
                new.append(Q if Q is not None else torch.eye(len(H), dtype=H.dtype,
                                                             device=H.device))  # fmt: skip
        if old is not None:
            m = state["exp_avg"]
            m.copy_(rotate(rotate(m, old, back=True), new))
        state["bases"] = new

    def update(self, group, params, grads):
        r"""SOAP's step on each tensor (Vyas et al., 2024), AdamW's in the rotated basis:

        .. math::
            G'_t &= Q_L^\top G_t Q_R \quad\text{(each rotated dimension; } G'_t = G_t
            \text{ for a tensor with none)} \\
            W_{t-1} &\leftarrow (1 - \eta\lambda)\, W_{t-1} \\
            M'_t &= \beta_1 M'_{t-1} + (1-\beta_1)\, G'_t, \qquad
            V'_t = \beta_2 V'_{t-1} + (1-\beta_2)\, G'^2_t \\
            W_t &= W_{t-1} - \frac{\eta}{1-\beta_1^\tau}\,
            Q_L \frac{M'_t}{\sqrt{V'_t/(1-\beta_2^\tau)} + \epsilon} Q_R^\top \\
            L_t &= \beta_s L_{t-1} + (1-\beta_s)\, G_t G_t^\top, \qquad
            R_t = \beta_s R_{t-1} + (1-\beta_s)\, G_t^\top G_t

        then, when :math:`\tau` is a multiple of ``precondition_frequency``, the bases are
        refreshed (:meth:`refresh_`). On a rotated tensor's first step only :math:`L_1,
        R_1` and their bases are made; :math:`\tau = t - 1` there, :math:`\tau = t` for
        the tensors with no rotated dimension.
        """
        (beta1, beta2), lr, eps = group["betas"], group["lr"], group["eps"]
        m = self.buffer(params, "exp_avg")
        v = self.buffer(params, "exp_avg_sq")
        t = self.count_steps(params)
        # a rotated tensor's first step: its statistics and bases, no update
        for p, g in zip(params, grads):
            if "bases" not in self.state[p] and any(self.rotated_dims(group, p)):
                self.statistics_(group, p, g)
                self.refresh_(p)
        active = [i for i, k in enumerate(t) if not (k == 1 and "bases" in self.state[params[i]])]
        params, grads, m, v = ([xs[i] for i in active] for xs in (params, grads, m, v))
        bases = [self.state[p].get("bases") for p in params]
        tau = [t[i] - 1 if b is not None else t[i] for i, b in zip(active, bases)]
        if not params:
            return
        decoupled_weight_decay_(params, lr, group["weight_decay"])
        rotated = [g if b is None else rotate(g, b) for g, b in zip(grads, bases)]
        adam_moments_(m, v, rotated, beta1, beta2)
        del rotated
        denom = adam_denominator(v, map_once(lambda k: 1 - beta2**k, tau), eps)
        steps = map_once(lambda k: -lr / (1 - beta1**k), tau)
        plain = [i for i, b in enumerate(bases) if b is None]
        if plain:  # Adam's own line, bit for bit AdamW's
            addcdiv_(*([xs[i] for i in plain] for xs in (params, m, denom, steps)))
        for i, b in enumerate(bases):
            if b is not None:
                params[i].add_(rotate(m[i] / denom[i], b, back=True), alpha=steps[i])
                self.statistics_(group, params[i], grads[i])
                if tau[i] % group["precondition_frequency"] == 0:
                    self.refresh_(params[i])
