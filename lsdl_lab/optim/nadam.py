r"""NAdam (Dozat, 2016): Adam with Nesterov momentum, in torch.optim's form, with a
momentum coefficient that warms up over the steps.

.. math::
    g_t &\leftarrow g_t + \lambda\, w_{t-1}
        \quad\text{(or } w_{t-1} \leftarrow (1 - \eta\lambda)\, w_{t-1}
        \text{ when decoupled)} \\
    \mu_t &= \beta_1 \bigl(1 - \tfrac12\, 0.96^{\,t\psi}\bigr), \qquad
    \Pi_t = \textstyle\prod_{k=1}^{t} \mu_k \\
    m_t &= \beta_1 m_{t-1} + (1-\beta_1)\, g_t \\
    v_t &= \beta_2 v_{t-1} + (1-\beta_2)\, g_t^2 \\
    w_t &= w_{t-1} - \eta\,\Bigl(\frac{1-\mu_t}{1-\Pi_t}\, g_t
           + \frac{\mu_{t+1}}{1-\Pi_t\,\mu_{t+1}}\, m_t\Bigr)
           \Big/ \Bigl(\sqrt{v_t / (1-\beta_2^t)} + \epsilon\Bigr)

The look-ahead is Nesterov's: the step uses :math:`m_t` with the *next* step's momentum
coefficient :math:`\mu_{t+1}`, plus the current gradient. :math:`\psi` is the momentum
decay (``momentum_decay``, :math:`4\cdot10^{-3}` as in Dozat's paper), so
:math:`\mu_t` rises from about :math:`\beta_1/2` towards :math:`\beta_1`. The decoupled
weight decay is AdamW's (Loshchilov and Hutter, 2019).
"""

from __future__ import annotations

import torch

from .._util import check_nonnegative
from .base import Optimizer
from .compiled import computed_once
from .pieces import adam_denominator, addcdiv_, decayed_adam_moments_, host_scalars

__all__ = ["NAdam"]


class NAdam(Optimizer):
    """NAdam with momentum warm-up and coupled or decoupled weight decay."""

    def __init__(
        self,
        params,
        lr: float = 2e-3,
        betas=(0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        momentum_decay: float = 4e-3,
        decoupled_weight_decay: bool = False,
        *,
        foreach: bool = True,
        compile: bool = False,
    ):
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            momentum_decay=momentum_decay,
            decoupled_weight_decay=decoupled_weight_decay,
        )
        super().__init__(params, defaults, foreach, compile)

    def check(self, group):
        check_nonnegative("momentum_decay value", group["momentum_decay"])

    def mu_products(self, params):
        # Pi_t is a 0-dim tensor rounded to the parameter's dtype, not a Python float: torch.optim
        # keeps it so (in the default dtype, cast to the parameter's by load_state_dict), and
        # the products then round alike, so results agree bitwise. It lives on the parameter's
        # device, with the compiled path's factors mu_t (torch.optim starts it on the CPU, and
        # its load_state_dict moves it to the parameter's device, as it moves ours)
        for p in params:
            self.state[p].setdefault("mu_product", torch.ones((), dtype=p.dtype, device=p.device))
        return [self.state[p]["mu_product"] for p in params]

    def update(self, group, params, grads):
        r"""NAdam's step (Dozat, 2016) in torch.optim's form, with momentum warm-up and
        coupled or decoupled (Loshchilov and Hutter, 2019) weight decay:

        .. math::
            g_t &\leftarrow g_t + \lambda\, w_{t-1} \quad\text{(coupled)} \qquad
            w_{t-1} \leftarrow (1 - \eta\lambda)\, w_{t-1} \quad\text{(decoupled)} \\
            \mu_t &= \beta_1 \bigl(1 - \tfrac12\, 0.96^{\,t\psi}\bigr), \qquad
            \Pi_t = \textstyle\prod_{k=1}^{t} \mu_k \\
            m_t &= \beta_1 m_{t-1} + (1-\beta_1)\, g_t, \qquad
            v_t = \beta_2 v_{t-1} + (1-\beta_2)\, g_t^2 \\
            w_t &= w_{t-1} - \eta\,\Bigl(\frac{1-\mu_t}{1-\Pi_t}\, g_t
            + \frac{\mu_{t+1}}{1-\Pi_t\,\mu_{t+1}}\, m_t\Bigr)
            \Big/ \Bigl(\sqrt{v_t / (1-\beta_2^t)} + \epsilon\Bigr)
        """
        (beta1, beta2), lr, eps = group["betas"], group["lr"], group["eps"]
        lam, psi = group["weight_decay"], group["momentum_decay"]
        m = self.buffer(params, "exp_avg")
        v = self.buffer(params, "exp_avg_sq")
        t = self.count_steps(params)
        decoupled = group["decoupled_weight_decay"]
        grads = decayed_adam_moments_(
            params, grads, m, v, beta1, beta2, lr=lr, lam=lam, decoupled=decoupled
        )
        mu = [beta1 * (1.0 - 0.5 * 0.96 ** (k * psi)) for k in t]
        mu_next = [beta1 * (1.0 - 0.5 * 0.96 ** ((k + 1) * psi)) for k in t]
        mu_product = self.mu_products(params)
        torch._foreach_mul_(mu_product, mu)
        pi = host_scalars(mu_product)
        bc2 = [1 - beta2**k for k in t]
        s_g = [-lr * (1 - a) / (1 - b) for a, b in zip(mu, pi)]
        s_m = [-lr * a / (1 - b * a) for a, b in zip(mu_next, pi)]
        if not torch.compiler.is_compiling():  # torch.optim's two passes, in its order:
            denom = adam_denominator(v, bc2, eps)  # torch.optim.NAdam bit for bit
            addcdiv_(params, grads, denom, s_g)
            addcdiv_(params, m, denom, s_m)
            return
        # Compiled, one division per element instead of three (the fused loop is bound by the
        # divider, not by memory): the two terms share their denominator, taken times
        # sqrt(c2): sqrt(v_hat) + eps = (sqrt(v_t) + sqrt(c2) eps) / sqrt(c2)
        sqrt_c2 = [c**0.5 for c in bc2]
        step = torch._foreach_add(
            torch._foreach_mul(grads, computed_once([s * c for s, c in zip(s_g, sqrt_c2)])),
            torch._foreach_mul(m, computed_once([s * c for s, c in zip(s_m, sqrt_c2)])),
        )
        denom = torch._foreach_sqrt(v)
        torch._foreach_add_(denom, computed_once([eps * c for c in sqrt_c2]))
        torch._foreach_addcdiv_(params, step, denom)
