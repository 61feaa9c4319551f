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
* **In place**: the step builds :math:`\tau_t d_t` in the gradient's own memory, so it
  leaves :math:`\tau_t (g_t + \lambda w_{t-1})` in ``p.grad`` (as pytorch-optimizer's LARS
  does); a copy the size of the model on every step was the slowest part of the update.
* **Excluded layers**: biases and normalization parameters are usually left out of the
  adaptation and the decay (the authors' TensorFlow LARS and LAMB exclude from adaptation
  what they exclude from weight decay; timm adapts only groups with weight decay;
  pytorch-optimizer adapts only tensors with two or more dimensions; optax takes masks).
  :func:`param_groups_for_layerwise` builds those groups; an excluded group takes plain
  SGD steps at the global rate.
"""

from __future__ import annotations

import torch
from torch import nn

from .base import Optimizer, check_beta, check_nonnegative
from .sgd import SGD

__all__ = ["LARS", "param_groups_for_layerwise"]


def check_bool(what: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"Invalid {what}: {value!r} (expected True or False)")


def check_positive(what: str, value) -> None:
    check_nonnegative(what, value)
    if value == 0:
        raise ValueError(f"Invalid {what}: {value!r} (expected a finite number > 0)")


def param_groups_for_layerwise(model: nn.Module, weight_decay: float = 0.0) -> list[dict]:
    """Parameter groups for :class:`LARS` and :class:`~lsdl_lab.optim.LAMB`: tensors with two
    or more dimensions (weight matrices, convolution kernels, embeddings) get ``weight_decay``
    and the trust ratio; the others (biases, BatchNorm and LayerNorm scales and shifts) get
    neither (``weight_decay=0``, ``trust=False``). Empty groups are left out."""
    check_nonnegative("weight_decay value", weight_decay)
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        dict(params=[p for p in params if p.ndim >= 2], weight_decay=weight_decay),
        dict(params=[p for p in params if p.ndim < 2], weight_decay=0.0, trust=False),
    ]
    return [g for g in groups if g["params"]]


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
        super().__init__(params, defaults, foreach)

    def check(self, group):
        check_beta("momentum value", group["momentum"])
        check_positive("trust_coefficient value", group["trust_coefficient"])
        check_bool("nesterov", group["nesterov"])
        check_bool("trust", group["trust"])
        if group["nesterov"] and group["momentum"] <= 0:
            raise ValueError("Nesterov momentum requires a momentum")

    def update(self, group, params, grads):
        lam = group["weight_decay"]
        eta, eps = group["trust_coefficient"], group["eps"]
        if group["trust"]:
            w_norm = torch.stack(torch._foreach_norm(params))
            g_norm = torch.stack(torch._foreach_norm(grads))
            denom = g_norm + lam * w_norm
            tau = eta * w_norm / (denom + eps)
            tau = torch.where((w_norm > 0) & (denom > 0), tau, 1.0)
            # In place, as pytorch-optimizer's LARS does (and torch.optim's Nesterov SGD):
            # d = tau (g + lam w) is built in the gradient's own memory, since a fresh copy
            # the size of the model every step cost more than both norms together
            # (benchmarks/README.md). The norms above were taken first, from g itself.
            d = grads
            if lam:
                torch._foreach_add_(d, params, alpha=lam)
            # One device-to-host copy per step: the ratios become per-tensor Python scalars.
            torch._foreach_mul_(d, tau.tolist())
        else:  # SGD's weight decay, operation for operation: p.grad is left as it was
            d = torch._foreach_add(grads, params, alpha=lam) if lam else grads
        # The rest is SGD's momentum step on d, undamped and without decay (already in d);
        # SGD.update needs only the state helpers every optimizer's base provides.
        SGD.update(self, {**group, "weight_decay": 0.0, "dampening": 0.0}, params, d)
