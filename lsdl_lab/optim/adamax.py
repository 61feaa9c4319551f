r"""Adamax (Kingma and Ba, 2015, Section 7.1): Adam with the second moment's
:math:`L^2` norm replaced by the :math:`L^\infty` norm, a running maximum that needs no
bias correction.

.. math::
    g_t &\leftarrow g_t + \lambda\, w_{t-1} \\
    m_t &= \beta_1 m_{t-1} + (1-\beta_1)\, g_t \\
    u_t &= \max(\beta_2\, u_{t-1},\ |g_t| + \epsilon) \\
    w_t &= w_{t-1} - \frac{\eta}{1-\beta_1^t}\, \frac{m_t}{u_t}

The paper's Algorithm 2 has no :math:`\epsilon`; torch.optim adds it to :math:`|g_t|`
inside the maximum, so that :math:`u_t > 0` even for a coordinate whose gradients have
all been zero, and so does this module.
"""

from __future__ import annotations

import torch

from .base import Optimizer
from .compiled import map_once
from .pieces import addcdiv_, coupled_weight_decay

__all__ = ["Adamax"]


class Adamax(Optimizer):
    """Adamax with coupled (L2) weight decay."""

    def __init__(
        self,
        params,
        lr: float = 2e-3,
        betas=(0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        foreach: bool = True,
        compile: bool = False,
    ):
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
        )
        super().__init__(params, defaults, foreach, compile)

    def update(self, group, params, grads):
        r"""Adamax's step (Kingma and Ba, 2015, Section 7.1, Algorithm 2), with
        torch.optim's :math:`\epsilon` inside the maximum and coupled weight decay:

        .. math::
            g_t &\leftarrow g_t + \lambda\, w_{t-1} \\
            m_t &= \beta_1 m_{t-1} + (1-\beta_1)\, g_t \\
            u_t &= \max(\beta_2\, u_{t-1},\ |g_t| + \epsilon) \\
            w_t &= w_{t-1} - \frac{\eta}{1-\beta_1^t}\, \frac{m_t}{u_t}
        """
        (beta1, beta2), lr, eps = group["betas"], group["lr"], group["eps"]
        lam = group["weight_decay"]
        m = self.buffer(params, "exp_avg")
        u = self.buffer(params, "exp_inf")
        t = self.count_steps(params)
        grads = coupled_weight_decay(grads, params, lam)
        torch._foreach_lerp_(m, grads, 1 - beta1)
        torch._foreach_mul_(u, beta2)
        abs_g = torch._foreach_abs(grads)
        torch._foreach_add_(abs_g, eps)
        torch._foreach_maximum_(u, abs_g)
        addcdiv_(params, m, u, map_once(lambda k: -lr / (1 - beta1**k), t))
