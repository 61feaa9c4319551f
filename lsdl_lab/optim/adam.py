r"""Adam (Kingma and Ba, 2015), with AMSGrad (Reddi et al., 2018) and AdamW's decoupled
weight decay (Loshchilov and Hutter, 2019).

.. math::
    m_t &= \beta_1 m_{t-1} + (1-\beta_1)\, g_t \\
    v_t &= \beta_2 v_{t-1} + (1-\beta_2)\, g_t^2 \\
    \hat v_t &= \max(\hat v_{t-1}, v_t) \quad\text{(AMSGrad; otherwise } \hat v_t = v_t) \\
    w_t &= w_{t-1} - \frac{\eta}{1-\beta_1^t}\,
           \frac{m_t}{\sqrt{\hat v_t / (1-\beta_2^t)} + \epsilon}

Weight decay :math:`\lambda` is *coupled* by default (added to the gradient,
:math:`g_t \leftarrow g_t + \lambda w_{t-1}`, so it is rescaled by the adaptive
denominator like the rest of the gradient) and *decoupled* with
``decoupled_weight_decay=True``, as in :class:`AdamW`
(:math:`w_{t-1} \leftarrow (1 - \eta\lambda)\, w_{t-1}` before the update, so every
weight decays at the same rate).

Variant choices, as in torch.optim so results agree: :math:`\epsilon` is added after the
bias-corrected square root (the paper's Algorithm 1); AMSGrad keeps the running maximum
of the raw second moment and applies the current step's bias correction to it.
"""

from __future__ import annotations

import torch

from .base import Optimizer
from .pieces import adam_step_, decayed_adam_moments_

__all__ = ["Adam", "AdamW"]


class Adam(Optimizer):
    """Adam with optional AMSGrad, and coupled (L2) or, with ``decoupled_weight_decay=True``
    (torch.optim's name for the flag), decoupled weight decay: AdamW."""

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas=(0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        *,
        foreach: bool = True,
        compile: bool = False,
        decoupled_weight_decay: bool = False,
    ):
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            decoupled_weight_decay=decoupled_weight_decay,
        )
        super().__init__(params, defaults, foreach, compile)

    def update(self, group, params, grads):
        r"""Adam's step (Kingma and Ba, 2015, Algorithm 1), with AMSGrad (Reddi et al., 2018)
        and coupled or decoupled weight decay (AdamW, Loshchilov and Hutter, 2019):

        .. math::
            g_t &\leftarrow g_t + \lambda\, w_{t-1} \quad\text{(coupled)} \qquad
            w_{t-1} \leftarrow (1 - \eta\lambda)\, w_{t-1} \quad\text{(decoupled)} \\
            m_t &= \beta_1 m_{t-1} + (1-\beta_1)\, g_t, \qquad
            v_t = \beta_2 v_{t-1} + (1-\beta_2)\, g_t^2 \\
            \hat v_t &= \max(\hat v_{t-1}, v_t) \quad\text{(AMSGrad; otherwise }
            \hat v_t = v_t) \\
            w_t &= w_{t-1} - \frac{\eta}{1-\beta_1^t}\,
            \frac{m_t}{\sqrt{\hat v_t / (1-\beta_2^t)} + \epsilon}
        """
        (beta1, beta2), lr, eps = group["betas"], group["lr"], group["eps"]
        lam, decoupled = group["weight_decay"], group["decoupled_weight_decay"]
        m = self.buffer(params, "exp_avg")
        v = self.buffer(params, "exp_avg_sq")
        t = self.count_steps(params)
        # The weight-decayed copy of g it returns is dropped at once, before denom is
        # allocated, as torch.optim frees it: denom then reuses its memory instead of touching
        # fresh pages (benchmarks/README.md measures what that saves).
        decayed_adam_moments_(
            params, grads, m, v, beta1, beta2, lr=lr, lam=lam, decoupled=decoupled
        )
        if group["amsgrad"]:
            v_max = self.buffer(params, "max_exp_avg_sq")
            torch._foreach_maximum_(v_max, v)
            v = v_max
        adam_step_(params, m, v, t, lr, beta1, beta2, eps)


class AdamW(Adam):
    """Adam with decoupled weight decay (Loshchilov and Hutter, 2019):
    ``Adam(..., decoupled_weight_decay=True)`` with torch.optim.AdamW's defaults."""

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas=(0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        foreach: bool = True,
        compile: bool = False,
    ):
        super().__init__(
            params, lr, betas, eps, weight_decay, amsgrad,
            foreach=foreach, compile=compile, decoupled_weight_decay=True,
        )  # fmt: skip
