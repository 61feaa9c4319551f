r"""Adadelta (Zeiler, 2012, Algorithm 1): RMSprop's running average of squared gradients,
with the learning rate replaced by a running root mean square of past updates, so the
update carries the units of the weights.

.. math::
    g_t &\leftarrow g_t + \lambda\, w_{t-1} \\
    v_t &= \rho\, v_{t-1} + (1 - \rho)\, g_t^2 \\
    \Delta w_t &= \frac{\sqrt{u_{t-1} + \epsilon}}{\sqrt{v_t + \epsilon}}\; g_t \\
    u_t &= \rho\, u_{t-1} + (1 - \rho)\, \Delta w_t^2 \\
    w_t &= w_{t-1} - \eta\, \Delta w_t

The paper has no learning rate (:math:`\eta = 1`, torch.optim's default); here, as in
the paper and unlike Adam or RMSprop, :math:`\epsilon` sits *inside* both square roots,
which also seeds the very first step (:math:`u_0 = 0`).
"""

from __future__ import annotations

import torch

from .._util import check_fraction
from .base import Optimizer
from .pieces import add_scaled_, coupled_weight_decay

__all__ = ["Adadelta"]


class Adadelta(Optimizer):
    """Adadelta with a learning-rate multiplier and coupled weight decay."""

    def __init__(
        self,
        params,
        lr: float = 1.0,
        rho: float = 0.9,
        eps: float = 1e-6,
        weight_decay: float = 0.0,
        *,
        foreach: bool = True,
        compile: bool = False,
    ):
        defaults = dict(lr=lr, rho=rho, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults, foreach, compile)

    def check(self, group):
        check_fraction("rho value", group["rho"], closed=True)

    def update(self, group, params, grads):
        r"""Adadelta's step (Zeiler, 2012, Algorithm 1), with a learning-rate multiplier
        :math:`\eta` (1 in the paper) and coupled weight decay:

        .. math::
            g_t &\leftarrow g_t + \lambda\, w_{t-1} \\
            v_t &= \rho\, v_{t-1} + (1 - \rho)\, g_t^2 \\
            \Delta w_t &= \frac{\sqrt{u_{t-1} + \epsilon}}{\sqrt{v_t + \epsilon}}\; g_t \\
            u_t &= \rho\, u_{t-1} + (1 - \rho)\, \Delta w_t^2 \\
            w_t &= w_{t-1} - \eta\, \Delta w_t
        """
        lr, rho, eps, lam = group["lr"], group["rho"], group["eps"], group["weight_decay"]
        v = self.buffer(params, "square_avg")
        u = self.buffer(params, "acc_delta")
        self.count_steps(params)
        grads = coupled_weight_decay(grads, params, lam)
        torch._foreach_mul_(v, rho)
        torch._foreach_addcmul_(v, grads, grads, 1 - rho)
        std = torch._foreach_add(v, eps)
        torch._foreach_sqrt_(std)
        delta = torch._foreach_add(u, eps)
        torch._foreach_sqrt_(delta)
        torch._foreach_div_(delta, std)
        torch._foreach_mul_(delta, grads)
        torch._foreach_mul_(u, rho)
        torch._foreach_addcmul_(u, delta, delta, 1 - rho)
        add_scaled_(params, delta, -lr)
