r"""Adagrad (Duchi, Hazan and Singer, 2011): a per-coordinate learning rate that shrinks
with the sum of the squared gradients seen so far.

.. math::
    g_t &\leftarrow g_t + \lambda\, w_{t-1} \\
    s_t &= s_{t-1} + g_t^2 \qquad (s_0 = s_\text{init}) \\
    \eta_t &= \frac{\eta}{1 + (t - 1)\,\delta} \\
    w_t &= w_{t-1} - \eta_t\, \frac{g_t}{\sqrt{s_t} + \epsilon}

This is the paper's diagonal variant (its Section 6), with :math:`\epsilon` added outside
the square root and torch.optim's optional learning-rate decay :math:`\delta`
(``lr_decay``). Rarely updated coordinates keep a large step, which is why Adagrad
suits sparse features; on dense deep networks the ever-growing :math:`s_t` makes the
step fade, the weakness that RMSprop and Adadelta repair.
"""

from __future__ import annotations

import torch

from .._util import check_nonnegative
from .base import Optimizer
from .compiled import map_once
from .pieces import coupled_weight_decay

__all__ = ["Adagrad"]


class Adagrad(Optimizer):
    """Adagrad with coupled weight decay and learning-rate decay."""

    def __init__(
        self,
        params,
        lr: float = 1e-2,
        lr_decay: float = 0.0,
        weight_decay: float = 0.0,
        initial_accumulator_value: float = 0.0,
        eps: float = 1e-10,
        *,
        foreach: bool = True,
        compile: bool = False,
    ):
        defaults = dict(
            lr=lr,
            lr_decay=lr_decay,
            weight_decay=weight_decay,
            initial_accumulator_value=initial_accumulator_value,
            eps=eps,
        )
        super().__init__(params, defaults, foreach, compile)

    def check(self, group):
        check_nonnegative("lr_decay value", group["lr_decay"])
        check_nonnegative("initial_accumulator_value value", group["initial_accumulator_value"])

    def update(self, group, params, grads):
        r"""Adagrad's step (Duchi, Hazan and Singer, 2011, diagonal variant), with
        torch.optim's learning-rate decay :math:`\delta` and coupled weight decay:

        .. math::
            g_t &\leftarrow g_t + \lambda\, w_{t-1} \\
            s_t &= s_{t-1} + g_t^2 \\
            w_t &= w_{t-1} - \frac{\eta}{1 + (t - 1)\,\delta}\, \frac{g_t}{\sqrt{s_t} + \epsilon}
        """
        lr, delta, eps, lam = group["lr"], group["lr_decay"], group["eps"], group["weight_decay"]
        s = self.buffer(params, "sum", fill=group["initial_accumulator_value"])
        t = self.count_steps(params)
        grads = coupled_weight_decay(grads, params, lam)
        torch._foreach_addcmul_(s, grads, grads)
        std = torch._foreach_sqrt(s)
        torch._foreach_add_(std, eps)
        # -eta_t g_t is formed before dividing, as torch.optim does: addcdiv's own factor
        # multiplies after the division on CUDA, which would round differently
        step = torch._foreach_mul(grads, map_once(lambda k: -lr / (1 + (k - 1) * delta), t))
        torch._foreach_addcdiv_(params, step, std)
