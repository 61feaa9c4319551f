r"""Stochastic gradient descent, with heavy-ball or Nesterov momentum.

Gradient descent, mini-batch SGD and full-batch GD are one algorithm: what differs is the
batch the gradient :math:`g_t` was computed on (Robbins and Monro, 1951; Bottou et al.,
2018). With weight decay :math:`\lambda`, momentum :math:`\mu` and dampening :math:`\tau`:

.. math::
    d_t &= g_t + \lambda\, w_{t-1} \\
    b_t &= \mu\, b_{t-1} + (1 - \tau)\, d_t \qquad (b_1 = d_1) \\
    w_t &= w_{t-1} - \eta\,(d_t + \mu\, b_t) \quad\text{(Nesterov)} \qquad
           w_t = w_{t-1} - \eta\, b_t \quad\text{(heavy ball)}

Heavy ball is Polyak's (1964) method in the form torch.optim and most libraries use
(the learning rate multiplies the whole buffer, rather than only the new gradient);
Nesterov's look-ahead is written in the form of Sutskever et al. (2013), which
evaluates the gradient at the current weights. The first buffer is the first gradient
undamped, as in torch.optim, so that results agree step for step. Like torch.optim,
Nesterov's eager update leaves :math:`d_t` in the gradient buffer ``p.grad``; the compiled
one (``compile=True``) leaves ``p.grad`` as it was (:func:`~.pieces.reuse_memory`).
"""

from __future__ import annotations

from .._util import check_nonnegative, check_real
from .base import Optimizer
from .pieces import add_scaled_, coupled_weight_decay, momentum

__all__ = ["SGD"]


class SGD(Optimizer):
    r"""SGD with optional momentum (heavy ball or Nesterov), dampening and weight decay.

    ``momentum`` must lie in [0, 1), stricter than torch.optim, which accepts any momentum
    >= 0: with :math:`\mu \ge 1` the buffer is no longer an average and grows without bound.
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        *,
        foreach: bool = True,
        compile: bool = False,
    ):
        defaults = dict(
            lr=lr,
            momentum=momentum,
            dampening=dampening,
            weight_decay=weight_decay,
            nesterov=nesterov,
        )
        super().__init__(params, defaults, foreach, compile)

    def check(self, group):
        check_real("momentum value", group["momentum"], 0.0, 1.0, high_open=True)
        check_nonnegative("dampening value", group["dampening"])
        if group["nesterov"] and (group["momentum"] <= 0 or group["dampening"] != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")

    def update(self, group, params, grads):
        r"""SGD's step, heavy ball (Polyak, 1964) or Nesterov (Sutskever et al., 2013), in
        torch.optim's form:

        .. math::
            d_t &= g_t + \lambda\, w_{t-1} \\
            b_t &= \mu\, b_{t-1} + (1 - \tau)\, d_t \qquad (b_1 = d_1) \\
            w_t &= w_{t-1} - \eta\, b_t \quad\text{(heavy ball)} \qquad
            w_t = w_{t-1} - \eta\,(d_t + \mu\, b_t) \quad\text{(Nesterov)}

        Without momentum (:math:`\mu = 0`) it is :math:`w_t = w_{t-1} - \eta\, d_t`.
        """
        lr, mu, tau, lam = group["lr"], group["momentum"], group["dampening"], group["weight_decay"]
        d = coupled_weight_decay(grads, params, lam)
        if mu:
            first = not self.has_state(params, "momentum_buffer")
            b = self.buffer(params, "momentum_buffer", like=d)
            d = momentum(b, d, mu, tau, group["nesterov"], first)
        add_scaled_(params, d, -lr)
