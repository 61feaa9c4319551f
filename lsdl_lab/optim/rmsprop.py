r"""RMSprop (Tieleman and Hinton, 2012, Coursera lecture 6e): divide the gradient by a
running root mean square of recent gradients, with optional momentum and the centered
variant of Graves (2013, Eqs. 38–41).

.. math::
    g_t &\leftarrow g_t + \lambda\, w_{t-1} \\
    v_t &= \alpha\, v_{t-1} + (1 - \alpha)\, g_t^2 \\
    \bar g_t &= \alpha\, \bar g_{t-1} + (1 - \alpha)\, g_t \quad\text{(centered)} \\
    r_t &= \sqrt{v_t - \bar g_t^2} + \epsilon \quad\text{(centered)} \qquad
    r_t = \sqrt{v_t} + \epsilon \quad\text{(plain)} \\
    b_t &= \mu\, b_{t-1} + g_t / r_t, \qquad w_t = w_{t-1} - \eta\, b_t
    \quad\text{(momentum; otherwise } w_t = w_{t-1} - \eta\, g_t / r_t)

Unlike Adam there is no bias correction, so :math:`v_t` starts small and the first steps
are large; :math:`\epsilon` is added outside the square root, as in torch.optim. The
centered form divides by an estimate of the gradient's standard deviation rather than
its root mean square.
"""

from __future__ import annotations

import torch

from .._util import check_fraction, check_real
from .base import Optimizer
from .pieces import add_scaled_, addcdiv_, coupled_weight_decay

__all__ = ["RMSprop"]


class RMSprop(Optimizer):
    """RMSprop with optional momentum, centering and coupled weight decay."""

    def __init__(
        self,
        params,
        lr: float = 1e-2,
        alpha: float = 0.99,
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        momentum: float = 0.0,
        centered: bool = False,
        *,
        foreach: bool = True,
        compile: bool = False,
    ):
        defaults = dict(
            lr=lr,
            alpha=alpha,
            eps=eps,
            weight_decay=weight_decay,
            momentum=momentum,
            centered=centered,
        )
        super().__init__(params, defaults, foreach, compile)

    def check(self, group):
        # torch.optim accepts any alpha >= 0; above 1 the average is no longer an average
        check_fraction("alpha value", group["alpha"], closed=True)
        # torch.optim accepts any momentum >= 0; from 1 on the buffer grows without bound
        check_real("momentum value", group["momentum"], 0.0, 1.0, high_open=True)

    def update(self, group, params, grads):
        r"""RMSprop's step (Tieleman and Hinton, 2012), centered as in Graves (2013,
        Eqs. 38-41) and with momentum when asked, in torch.optim's form:

        .. math::
            g_t &\leftarrow g_t + \lambda\, w_{t-1} \\
            v_t &= \alpha\, v_{t-1} + (1 - \alpha)\, g_t^2, \qquad
            \bar g_t = \alpha\, \bar g_{t-1} + (1 - \alpha)\, g_t \quad\text{(centered)} \\
            r_t &= \sqrt{v_t - \bar g_t^2} + \epsilon \quad\text{(centered)} \qquad
            r_t = \sqrt{v_t} + \epsilon \\
            b_t &= \mu\, b_{t-1} + g_t / r_t, \quad w_t = w_{t-1} - \eta\, b_t
            \quad\text{(momentum; otherwise } w_t = w_{t-1} - \eta\, g_t / r_t)
        """
        lr, alpha, eps = group["lr"], group["alpha"], group["eps"]
        lam, mu = group["weight_decay"], group["momentum"]
        v = self.buffer(params, "square_avg")
        self.count_steps(params)
        grads = coupled_weight_decay(grads, params, lam)
        torch._foreach_mul_(v, alpha)
        torch._foreach_addcmul_(v, grads, grads, 1 - alpha)
        if group["centered"]:
            g_bar = self.buffer(params, "grad_avg")
            torch._foreach_lerp_(g_bar, grads, 1 - alpha)
            r = torch._foreach_addcmul(v, g_bar, g_bar, -1)
            torch._foreach_sqrt_(r)
        else:
            r = torch._foreach_sqrt(v)
        torch._foreach_add_(r, eps)
        if mu:
            b = self.buffer(params, "momentum_buffer")
            torch._foreach_mul_(b, mu)
            torch._foreach_addcdiv_(b, grads, r)
            add_scaled_(params, b, -lr)
        else:
            addcdiv_(params, grads, r, -lr)
