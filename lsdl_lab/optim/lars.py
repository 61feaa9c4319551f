r"""LARS, layer-wise adaptive rate scaling (You, Gitman and Ginsburg, 2017).

At large batch sizes one global learning rate is too large for some layers and too small
for others: the ratio :math:`\|w\| / \|g\|` varies by orders of magnitude between layers
(and over training). LARS gives each layer (each parameter tensor) its own *local*
learning rate, the trust ratio :math:`\tau`, so that the step of a layer is a fixed
fraction :math:`\eta` of its weights' norm, whatever the scale of its gradient. With
global learning rate :math:`\gamma_t`, trust coefficient :math:`\eta`, weight decay
:math:`\lambda` and momentum :math:`\mu`:

.. math::
    d_t &= g_t + \lambda\, w_{t-1} \\
    \tau_t &= \frac{\eta\, \|w_{t-1}\|}{\|g_t\| + \lambda \|w_{t-1}\| + \epsilon}
            \qquad (\tau_t = 1 \text{ if } \|w_{t-1}\| = 0
            \text{ or } \|g_t\| + \lambda\|w_{t-1}\| = 0) \\
    b_t &= \mu\, b_{t-1} + \tau_t\, d_t \qquad (b_1 = \tau_1 d_1) \\
    w_t &= w_{t-1} - \gamma_t\, b_t \quad\text{(heavy ball)} \qquad
           w_t = w_{t-1} - \gamma_t\,(\tau_t d_t + \mu\, b_t) \quad\text{(Nesterov)}

Variant choices, and how they compare:

* **Weight decay** enters the gradient *before* the trust ratio (the paper's Algorithm 1;
  optax's ``lars`` chains ``add_decayed_weights`` before ``scale_by_trust_ratio``), so the
  decay is rescaled with the rest of the step.
* **The denominator** is the paper's :math:`\|g\| + \lambda\|w\|` (also pytorch-optimizer's
  ``LARS``, timm's ``Lars`` and NVIDIA apex's ``LARC``); optax divides by
  :math:`\|g + \lambda w\|`, which is smaller unless :math:`g` and :math:`w` point the same
  way. :math:`\epsilon` (timm's default 1e-8; none in the paper and pytorch-optimizer, 0 in
  optax) only guards the division.
* **The zero-norm case**: a layer whose weights are all zero (a bias initialized to zero)
  would never move under :math:`\tau \propto \|w\|`; it gets :math:`\tau = 1`, as in
  optax, timm and pytorch-optimizer. So does a layer with nothing to scale
  (:math:`\|g\| + \lambda\|w\| = 0`, pytorch-optimizer's test; timm tests :math:`\|g\| = 0`).
* **Momentum** is torch.optim's form: the buffer accumulates :math:`\tau d`, and the
  global rate multiplies it when applied. The paper puts :math:`\gamma_t` inside the
  buffer (:math:`v_t = \mu v_{t-1} + \gamma_t \tau_t d_t`, as optax does); the two agree
  for a constant rate, and under a schedule ours is the paper's with Goyal et al.'s (2017)
  *momentum correction*. With ``trust=False`` the update is :class:`~lsdl_lab.optim.SGD`
  with momentum and weight decay, operation for operation.
* **In place**: the eager step builds :math:`\tau_t d_t` in the gradient's own memory, so
  it leaves :math:`\tau_t (g_t + \lambda w_{t-1})` in ``p.grad`` (as pytorch-optimizer's
  LARS does); a copy the size of the model on every step was the slowest part of the
  update. The compiled step (``compile=True``) leaves ``p.grad`` as it was: there the
  temporary is fused away, and writing ``p.grad`` would cost a store.
* **Excluded layers**: biases and normalization parameters are usually left out of the
  adaptation and the decay (the authors' TensorFlow LARS and LAMB exclude from adaptation
  what they exclude from weight decay; timm adapts only groups with weight decay;
  pytorch-optimizer adapts only tensors with two or more dimensions; optax takes masks).
  :func:`~lsdl_lab.optim.layerwise.param_groups_for_layerwise` builds those groups; an
  excluded group takes plain SGD steps at the global rate.
"""

from __future__ import annotations

import torch

from .._util import check_positive, check_real
from .base import Optimizer
from .layerwise import trust_ratio
from .pieces import add_scaled_, coupled_weight_decay, momentum, reuse_memory

__all__ = ["LARS"]


class LARS(Optimizer):
    """SGD with momentum and a per-layer trust ratio (You, Gitman and Ginsburg, 2017)."""

    def __init__(
        self,
        params,
        lr: float,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        trust_coefficient: float = 0.001,
        eps: float = 1e-8,
        nesterov: bool = False,
        trust: bool = True,
        *,
        foreach: bool = True,
        compile: bool = False,
    ):
        defaults = dict(
            lr=lr,
            momentum=momentum,
            weight_decay=weight_decay,
            trust_coefficient=trust_coefficient,
            eps=eps,
            nesterov=nesterov,
            trust=trust,
        )
        super().__init__(params, defaults, foreach, compile)

    def check(self, group):
        check_real("momentum value", group["momentum"], 0.0, 1.0, high_open=True)
        check_positive("trust_coefficient value", group["trust_coefficient"])
        if group["nesterov"] and group["momentum"] <= 0:
            raise ValueError("Nesterov momentum requires a momentum")

    def update(self, group, params, grads):
        r"""LARS's step (You, Gitman and Ginsburg, 2017, Algorithm 1) with torch.optim's
        momentum, heavy ball or Nesterov; ``trust=False`` is :class:`~lsdl_lab.optim.SGD`:

        .. math::
            \tau_t &= \frac{\eta\, \|w_{t-1}\|}{\|g_t\| + \lambda \|w_{t-1}\| + \epsilon}
            \quad (\tau_t = 1 \text{ without trust}) \\
            d_t &= \tau_t\, (g_t + \lambda\, w_{t-1}) \\
            b_t &= \mu\, b_{t-1} + d_t \qquad (b_1 = d_1) \\
            w_t &= w_{t-1} - \gamma_t\, b_t \quad\text{(heavy ball)} \qquad
            w_t = w_{t-1} - \gamma_t\,(d_t + \mu\, b_t) \quad\text{(Nesterov)}
        """
        lr, mu, lam = group["lr"], group["momentum"], group["weight_decay"]
        if group["trust"]:
            # The norms first, from g itself: d is then built in the gradient's own memory, as
            # pytorch-optimizer's LARS does (and torch.optim's Nesterov SGD), since a fresh
            # copy the size of the model every step cost more than both norms together
            # (benchmarks/README.md). All layers' ratios in one multi-tensor pass (a few
            # kernels for the whole model), not a pass of its own per layer.
            tau = trust_ratio(
                params, grads, trust_coefficient=group["trust_coefficient"],
                weight_decay=lam, eps=group["eps"],
            )  # fmt: skip
            if reuse_memory():
                d = grads
                if lam:
                    torch._foreach_add_(d, params, alpha=lam)
                torch._foreach_mul_(d, tau)
            else:
                d = torch._foreach_mul(coupled_weight_decay(grads, params, lam), tau)
        else:  # SGD's weight decay, operation for operation: p.grad is left as it was
            d = coupled_weight_decay(grads, params, lam)
        if mu:
            first = not self.has_state(params, "momentum_buffer")
            b = self.buffer(params, "momentum_buffer", like=d)
            d = momentum(b, d, mu, 0.0, group["nesterov"], first)
        add_scaled_(params, d, -lr)
