r"""Adafactor (Shazeer and Stern, 2018, "Adafactor: Adaptive Learning Rates with Sublinear
Memory Cost"): Adam's second moment, factored. For an :math:`n \times m` weight it keeps a
running average of the row means :math:`R_t \in \mathbb{R}^n` and of the column means
:math:`C_t \in \mathbb{R}^m` of :math:`G_t^2` and rebuilds the second moment as their
rank-one product, so the state is :math:`n + m` numbers instead of Adam's :math:`2nm`.

.. math::
    \hat\beta_{2t} &= 1 - t^{c} \quad (c = \texttt{beta2\_decay} \in [-1, 0),
                      \text{the paper's } c = -0.8) \\
    \rho_t &= \min(\eta, 1/\sqrt t) \ \text{(relative step)} \quad\text{or}\quad \eta \\
    \alpha_t &= \max(\epsilon_2, \operatorname{RMS}(W_{t-1}))\, \rho_t
               \ \text{(parameter scale)} \quad\text{or}\quad \rho_t \\
    W_{t-1} &\leftarrow (1 - \eta\lambda)\, W_{t-1} \quad\text{(decoupled weight decay)} \\
    R_t &= \hat\beta_{2t} R_{t-1} + (1 - \hat\beta_{2t})\, \operatorname{mean}_j G_t^2, \qquad
    C_t = \hat\beta_{2t} C_{t-1} + (1 - \hat\beta_{2t})\, \operatorname{mean}_i G_t^2 \\
    \hat V_t &= R_t C_t / \max(\operatorname{mean}_i R_t, \epsilon_1) \quad
               (\text{a vector: } \hat V_t = \hat\beta_{2t} \hat V_{t-1}
               + (1 - \hat\beta_{2t})\, G_t^2) \\
    U_t &= G_t / \max(\sqrt{\hat V_t}, \epsilon_1), \qquad
    \hat U_t = U_t / \max(1, \operatorname{RMS}(U_t) / d) \quad\text{(update clipping)} \\
    M_t &= \beta_1 M_{t-1} + (1 - \beta_1)\, \hat U_t
           \quad (\text{only with } \beta_1; \text{ else } M_t = \hat U_t) \\
    W_t &= W_{t-1} - \alpha_t M_t

A tensor of order :math:`k > 2` is factored over its last two dimensions (a batch of
matrices: state :math:`\prod_{i<k-1} n_i \cdot (n_{k-1} + n_k)`); vectors and scalars keep
the full (unfactored) :math:`\hat V_t`.

**The variant, and how it differs.** With ``beta1=None``, ``relative_step=True`` and
``scale_parameter=True`` (the defaults) this is :class:`torch.optim.Adafactor`'s update (the
same names ``lr``, ``beta2_decay``, ``d``, ``weight_decay``, its ``eps=(eps1, eps2)`` as two
arguments ``eps1``, ``eps2``, and its state names), with its operations in its order except
two computed faster here: the row and column means of :math:`G_t^2` (torch.optim squares a
norm along the dimension, which rounds differently by an ulp or two) and the clipping factor
(0-d tensors on the device instead of Python numbers: no synchronization per tensor);
``tests/optim/test_adafactor.py`` checks that the two runs agree to rounding (float64: to
1e-10 after 100 steps). From the paper (its Algorithms 4 and 5 with update clipping, the
increasing decay rate and the relative step size) it differs where torch.optim does: the
relative step's cap is ``lr`` (the paper's constant 0.01, the default); weight decay, which
the paper leaves open, is decoupled and scaled by ``lr``; :math:`\epsilon_1` (default: the
dtype's machine epsilon) bounds :math:`\operatorname{mean}_i R_t` and :math:`\sqrt{\hat
V_t}` from below instead of being added to :math:`G_t^2` (the paper's :math:`\epsilon_1 =
10^{-30}`; here it is squared, and :math:`10^{-30}` squared is 0 in float32: a coordinate
whose gradient was always zero then gives :math:`0/0`); means instead of the paper's sums
(the same :math:`\hat V_t`).

Beyond torch.optim: update clipping accepts any :math:`d > 0` (torch requires
:math:`d \ge 1`; ``d=inf`` turns clipping off); ``beta1`` adds the first moment of the
paper's experiments (:math:`\beta_1 = 0.9` beside 0), here an average of the
*clipped* update :math:`\hat U_t` taken before the step size :math:`\alpha_t`, so that it
does not depend on the learning-rate schedule (it costs :math:`nm` more numbers);
``relative_step=False`` makes :math:`\rho_t = \eta` an absolute step size and
``scale_parameter=False`` drops the parameter scale (:math:`\alpha_t = \rho_t`).

optax's ``adafactor`` is a chain: the factored second moment with :math:`\epsilon_1 =
10^{-30}` added to :math:`G_t^2`, factoring the two *largest* dimensions and only when the
second largest has at least 128 entries (``min_dim_size_to_factor``), then block-RMS
clipping, the learning rate (a schedule gives the relative step), the parameter scale, an
optional momentum on the *scaled* update and weight decay not multiplied by the learning
rate. pytorch-optimizer's ``AdaFactor`` (the Big Vision variant) adds :math:`\epsilon_1 =
10^{-30}` to :math:`G_t^2`, caps :math:`\hat\beta_{2t}` by ``betas[1]``, ignores ``lr``
under ``relative_step`` (the cap is 0.01), keeps momentum on by default (``betas[0] =
0.9``, in bfloat16, on the update *after* the step size) and scales weight decay by
:math:`\alpha_t`. All of them, like this one, keep vectors unfactored.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._util import check_nonnegative, check_real
from .base import Optimizer
from .compiled import computed_once
from .pieces import smaller

__all__ = ["Adafactor"]


class Adafactor(Optimizer):
    """Adafactor with factored second moment, relative or absolute step size, parameter
    scaling, update clipping at RMS ``d``, optional first moment ``beta1`` and decoupled
    weight decay; with the defaults, :class:`torch.optim.Adafactor` (``eps=(eps1, eps2)``)."""

    def __init__(
        self,
        params,
        lr: float = 1e-2,
        beta2_decay: float = -0.8,
        eps1: float | None = None,
        eps2: float = 1e-3,
        d: float = 1.0,
        weight_decay: float = 0.0,
        beta1: float | None = None,
        relative_step: bool = True,
        scale_parameter: bool = True,
        *,
        foreach: bool = True,
        compile: bool = False,
    ):
        defaults = dict(
            lr=lr,
            beta2_decay=beta2_decay,
            eps1=eps1,
            eps2=eps2,
            d=d,
            weight_decay=weight_decay,
            beta1=beta1,
            relative_step=relative_step,
            scale_parameter=scale_parameter,
        )
        super().__init__(params, defaults, foreach, compile)

    def check(self, group):
        # c = -1 averages all squared gradients alike (1 - beta2_t = 1/t); c < -1 would weigh
        # the newest gradient less than the oldest, and c = 0 would keep no average at all
        check_real("beta2_decay value", group["beta2_decay"], -1.0, 0.0, high_open=True)
        if group["eps1"] is not None:
            check_nonnegative("eps1 value", group["eps1"])
        check_nonnegative("eps2 value", group["eps2"])
        check_real("d value", group["d"], 0.0, low_open=True, finite=False)  # inf: no clipping
        if group["beta1"] is not None:
            check_real("beta1 value", group["beta1"], 0.0, 1.0, high_open=True)

    def factors(self, p: Tensor) -> tuple[Tensor, Tensor]:
        """The row and column averages :math:`R` (shape ``[..., n, 1]``) and :math:`C`
        (``[..., 1, m]``) of the parameter ``p`` of shape ``[..., n, m]``."""
        state = self.state[p]
        if "row_var" not in state:
            state["row_var"] = p.new_zeros((*p.shape[:-1], 1))
            state["col_var"] = p.new_zeros((*p.shape[:-2], 1, p.shape[-1]))
        return state["row_var"], state["col_var"]

    def update(self, group, params, grads):
        r"""Adafactor's step (Shazeer and Stern, 2018, Algorithms 4 and 5, with update
        clipping and the relative step size; the variant of the module docstring):

        .. math::
            \hat\beta_{2t} &= 1 - t^{c}, \qquad
            \alpha_t = \max(\epsilon_2, \operatorname{RMS}(W_{t-1}))\,\min(\eta, 1/\sqrt t) \\
            W_{t-1} &\leftarrow (1 - \eta\lambda)\, W_{t-1} \\
            R_t &= \hat\beta_{2t} R_{t-1} + (1 - \hat\beta_{2t})\, \operatorname{mean}_j G_t^2,
            \qquad C_t = \hat\beta_{2t} C_{t-1} + (1 - \hat\beta_{2t})\,
            \operatorname{mean}_i G_t^2 \\
            \hat V_t &= R_t C_t / \max(\operatorname{mean}_i R_t, \epsilon_1)
            \quad\text{(a vector: } \hat V_t = \hat\beta_{2t} \hat V_{t-1}
            + (1 - \hat\beta_{2t})\, G_t^2) \\
            U_t &= G_t / \max(\sqrt{\hat V_t}, \epsilon_1), \qquad
            \hat U_t = U_t / \max(1, \operatorname{RMS}(U_t) / d) \\
            M_t &= \beta_1 M_{t-1} + (1 - \beta_1)\, \hat U_t \ (\text{or } M_t = \hat U_t),
            \qquad W_t = W_{t-1} - \alpha_t M_t
        """
        lr, c, eps2, d = group["lr"], group["beta2_decay"], group["eps2"], group["d"]
        beta1, lam = group["beta1"], group["weight_decay"]
        t = self.count_steps(params)
        # Layer by layer: each layer's arrays stay in the caches from its statistics to its
        # step, and compiled, each layer's RMS and factor means are reductions fused into the
        # loops that read G_t, where _foreach_norm and the _foreach operations with one
        # scalar per tensor are opaque calls that need their inputs stored first (compiled,
        # that form took 1.7x this one's time)
        for w, g, k in zip(params, grads, t, strict=True):
            eps1 = torch.finfo(w.dtype).eps if group["eps1"] is None else group["eps1"]
            alpha = smaller(lr, 1 / k**0.5) if group["relative_step"] else lr  # rho_t
            if group["scale_parameter"]:  # RMS(W_{t-1}), before the weight decay
                alpha = self.clamped_rms(w, 1.0, eps2) * alpha
            if lam:
                w.mul_(1 - lr * lam)  # decoupled weight decay
            u = self.second_moment(w, g, computed_once(k**c), eps1)  # V_hat, a new tensor
            # U_t = G_t / max(sqrt(V_hat), eps1), as rsqrt(max(V_hat, eps1^2)) (torch.optim's)
            u.clamp_min_(eps1 * eps1).rsqrt_().mul_(g)
            clip = computed_once(self.clamped_rms(u, d, 1.0))  # U_hat_t = U_t / clip
            if beta1 is not None:
                m = self.buffer([w], "exp_avg")[0]
                m.lerp_(u.div_(clip), 1 - beta1)
                w.sub_(torch.mul(m, computed_once(alpha), out=u))
            else:  # alpha_t U_hat_t in one pass over U_t (alpha_t = 0: a step of exactly 0)
                w.sub_(u.mul_(computed_once(alpha / clip)))  # a product: no division per element

    @staticmethod
    def clamped_rms(x: Tensor, d: float, low: float) -> Tensor:
        r""":math:`\max(\text{low}, \operatorname{RMS}(x) / d)`, a 0-d tensor on ``x``'s device:
        no synchronization with the host (torch.optim computes it as a Python number)."""
        # out of place: compiled, a value changed in place is not computed once (its readers
        # must see the change), and its square root and divisions would then be recomputed
        # for every element in the loops that read it
        return torch.linalg.vector_norm(x).div(x.numel() ** 0.5 * d).clamp_min(low)

    def second_moment(self, p: Tensor, g: Tensor, weight, eps1: float) -> Tensor:
        r""":math:`\hat V_t` of the parameter ``p``, a new tensor, after updating its state
        with weight :math:`1 - \hat\beta_{2t}`: factored for a matrix or an order-k tensor
        (:meth:`factored_second_moment`), the full average for a vector or a scalar."""
        if g.dim() > 1:
            return self.factored_second_moment([p], [g], [weight], [eps1])[0]
        v = self.buffer([p], "variance")[0]
        # the update is built in V_hat's memory: a copy, to keep the state
        return v.lerp_(g * g, weight).clone()

    def factored_second_moment(
        self, params: list[Tensor], grads: list[Tensor], weight: list[float], eps1: list[float]
    ) -> list[Tensor]:
        r""":math:`\hat V_t = R_t C_t / \max(\operatorname{mean}_i R_t, \epsilon_1)` for each
        matrix (or batch of matrices), after updating its factors :math:`R_t` and
        :math:`C_t` in place with weight :math:`1 - \hat\beta_{2t}`; new tensors.

        :math:`G_t^2` is formed once, in a temporary that then receives :math:`\hat V_t`:
        each new temporary the size of the model costs a pass of fresh memory (torch.optim
        avoids this one with ``torch.norm(g, dim)``, squared, which is slower along the
        columns on CPU (benchmarks/README.md) and rounds differently, by an ulp or two).
        """
        v_hat = []
        for p, g, w, e in zip(params, grads, weight, eps1, strict=True):
            r, c = self.factors(p)
            v = g * g  # G_t^2
            averaged_mean_(r, v, w, dim=-1)  # R_t
            averaged_mean_(c, v, w, dim=-2)  # C_t
            # R_t C_t / max(mean_i R_t, eps1), divided in the n-vector R_t: compiled, the loops
            # then divide nothing per element
            r_scaled = computed_once(r / r.mean(dim=-2, keepdim=True).clamp_min(e))
            v_hat.append(torch.mul(r_scaled, c, out=v))
        return v_hat


def averaged_mean_(avg: Tensor, v: Tensor, weight, dim: int) -> None:
    r""":math:`a \leftarrow a + w\,(\operatorname{mean}_{dim} v - a)`, in place: the running
    average ``avg`` of the means of ``v`` along ``dim`` (:math:`R_t` or :math:`C_t`).

    Compiled, it is computed as the mean of the averages, :math:`\operatorname{mean}_{dim}
    (a + w\,(v - a))`, the same number (rounded differently): the reduction's own output is
    then :math:`R_t`, a stored vector that the loops of :math:`U_t` read. As an average
    taken after the mean, TorchInductor inlines it into those loops, which then read six
    arrays (:math:`G_t`, the sums and the previous :math:`R, C`, the weight, the mean of
    :math:`R_t`): past its threshold of four (``realize_reads_threshold``) it stores
    :math:`U_t` instead, a temporary the size of the parameter on fresh pages every step
    (40 B/param instead of 28 on the 10M-parameter GPT, and with the loops' scalars
    computed once, 1.6x the step time). Eagerly, the average after the mean: the other
    order needs a temporary the size of the parameter.
    """
    if torch.compiler.is_compiling():
        avg.copy_(torch.lerp(avg, v, weight).mean(dim=dim, keepdim=True))
    else:
        avg.lerp_(v.mean(dim=dim, keepdim=True), weight)
