r"""LAMB, layer-wise adaptive moments for batch training (You et al., ICLR 2020, Algorithm 2).

LAMB is to Adam what LARS is to SGD: the Adam direction, plus weight decay, is rescaled
per layer (per parameter tensor) so that each layer's step is a fixed fraction of its
weights' norm. It trained BERT with batches of 32k-64k sequences. With learning rate
:math:`\gamma_t`, weight decay :math:`\lambda` and scaling function :math:`\phi`:

.. math::
    m_t &= \beta_1 m_{t-1} + (1-\beta_1)\, g_t, \qquad
    v_t = \beta_2 v_{t-1} + (1-\beta_2)\, g_t^2 \\
    r_t &= \frac{m_t / (1-\beta_1^t)}{\sqrt{v_t / (1-\beta_2^t)} + \epsilon} \\
    u_t &= r_t + \lambda\, w_{t-1} \\
    \tau_t &= \frac{\phi(\|w_{t-1}\|)}{\|u_t\|} \qquad
             (\tau_t = 1 \text{ if } \|w_{t-1}\| = 0 \text{ or } \|u_t\| = 0) \\
    w_t &= w_{t-1} - \gamma_t\, \tau_t\, u_t

So every step of an adapted layer has norm exactly :math:`\gamma_t\, \phi(\|w_{t-1}\|)`,
whatever the scale of its gradient.

Variant choices, and how they compare:

* **Weight decay** is added to the Adam ratio *before* the trust ratio, as in the paper,
  optax's ``lamb`` (``scale_by_adam``, ``add_decayed_weights``, ``scale_by_trust_ratio``)
  and timm; it is decoupled from the adaptive denominator, as in AdamW, but scaled by
  :math:`\tau` with the rest of the step. pytorch-optimizer's ``Lamb`` by default decays
  the weights outside the ratio (``weight_decouple=True``); its ``weight_decouple=False``
  is ours.
* **Bias correction** is on, as in the paper's Algorithm 2, optax, timm and NVIDIA's
  apex. Without weight decay the trust ratio cancels any per-layer factor, so correction
  then only changes the effective :math:`\epsilon`; with weight decay it keeps the balance
  between :math:`r_t` and :math:`\lambda w`: uncorrected, :math:`|r_1| \approx
  (1-\beta_1)/\sqrt{1-\beta_2} \approx 3.2` (default betas) instead of 1.
  ``bias_correction=False`` drops both corrections. (pytorch-optimizer's ``Lamb`` corrects
  neither moment inside the ratio but divides the *step* by :math:`1-\beta_1^t` after it,
  so its first step has norm :math:`\gamma\,\phi(\|w\|)/(1-\beta_1)`.)
* **The scaling function** :math:`\phi` is the identity by default (optax, timm, apex);
  the paper allows :math:`\phi(z) = \min(\max(z, \gamma_l), \gamma_u)`, which
  ``clamp=(lower, upper)`` gives (pytorch-optimizer clamps at 10: ``clamp=(0, 10)``).
  There is no :math:`\epsilon` in the ratio (optax's default; pytorch-optimizer adds its
  Adam :math:`\epsilon` to :math:`\|u_t\|`).
* **The zero-norm case**: a layer with zero weights (a zero-initialized bias) or a zero
  step gets :math:`\tau = 1`, as in optax, timm and pytorch-optimizer.
* **Excluded layers**: :func:`~lsdl_lab.optim.lars.param_groups_for_layerwise` puts biases
  and normalization parameters in a group with ``weight_decay=0`` and ``trust=False``
  (the authors' TensorFlow LAMB excludes from adaptation what it excludes from weight
  decay; timm and apex adapt only groups with weight decay, by default; optax's mask
  covers the decay only, pytorch-optimizer adapts every tensor). With ``trust=False`` the
  update is :class:`~lsdl_lab.optim.AdamW` (``Adam`` when ``weight_decay=0``), operation
  for operation.
* **No gradient clipping**: timm's ``Lamb`` and apex's ``FusedLAMB`` (NVIDIA's variant)
  first divide all gradients by their global norm when it exceeds ``max_grad_norm=1``, by
  default; here clipping belongs to the training loop (``fit(..., clip_grad_norm=1.0)``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .base import Optimizer
from .lars import check_bool

__all__ = ["LAMB"]


def check_clamp(clamp) -> None:
    ok = clamp is None or (
        isinstance(clamp, Sequence)
        and len(clamp) == 2
        and all(isinstance(c, (int, float)) and not isinstance(c, bool) for c in clamp)
        and math.isfinite(clamp[0])
        and 0.0 <= clamp[0] <= clamp[1]
    )
    if not ok:
        raise ValueError(
            f"Invalid clamp: {clamp!r} (expected None or a pair (lower, upper) with "
            "0 <= lower <= upper, upper possibly inf)"
        )


class LAMB(Optimizer):
    """Adam with decoupled weight decay and a per-layer trust ratio (You et al., 2020)."""

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas=(0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
        bias_correction: bool = True,
        trust: bool = True,
        clamp: tuple[float, float] | None = None,
        *,
        foreach: bool = True,
    ):
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            bias_correction=bias_correction,
            trust=trust,
            clamp=tuple(clamp) if isinstance(clamp, list) else clamp,
        )
        super().__init__(params, defaults, foreach)

    def check(self, group):
        check_bool("bias_correction", group["bias_correction"])
        check_bool("trust", group["trust"])
        check_clamp(group["clamp"])

    def update(self, group, params, grads):
        (beta1, beta2), lr, eps = group["betas"], group["lr"], group["eps"]
        lam, clamp = group["weight_decay"], group["clamp"]
        m, v = self.buffers(params, "exp_avg", "exp_avg_sq")
        t = self.count_steps(params)
        correct = group["bias_correction"]
        bc1 = [1 - beta1**k if correct else 1.0 for k in t]
        bc2_sqrt = [(1 - beta2**k) ** 0.5 if correct else 1.0 for k in t]
        torch._foreach_lerp_(m, grads, 1 - beta1)  # m += (1 - beta1) (g - m)
        torch._foreach_mul_(v, beta2)
        torch._foreach_addcmul_(v, grads, grads, 1 - beta2)
        if not group["trust"]:
            # AdamW's operations, one for one, so trust=False is AdamW bit for bit
            denom = torch._foreach_sqrt(v)
            torch._foreach_div_(denom, bc2_sqrt)
            torch._foreach_add_(denom, eps)  # sqrt(v_hat) + eps
            if lam:
                torch._foreach_mul_(params, 1 - lr * lam)
            torch._foreach_addcdiv_(params, m, denom, [-lr / c for c in bc1])
            return
        # The step is tau u itself, so u is built once and applied (as optax and
        # pytorch-optimizer do) instead of recomputing m / denom: a third less memory
        # traffic than AdamW's operations plus u. The bias corrections are folded into
        # scalars: u' = m / (sqrt(v) + eps sqrt(1 - beta2^t)) = r c with
        # c = (1 - beta1^t) / sqrt(1 - beta2^t).
        c = [b1 / b2 for b1, b2 in zip(bc1, bc2_sqrt)]
        u = torch._foreach_sqrt(v)  # the one model-sized temporary, as in AdamW
        torch._foreach_add_(u, [eps * b for b in bc2_sqrt])
        torch._foreach_reciprocal_(u)  # in place: a second temporary m / denom cost more
        torch._foreach_mul_(u, m)  # than this extra rounding (page faults on fresh memory)
        if lam:
            torch._foreach_div_(u, c)  # r
            torch._foreach_add_(u, params, alpha=lam)  # u = r + lam w
            c = [1.0] * len(params)
        # else u = r c, and tau u = phi r / ||r|| does not depend on c: no pass to remove it
        w_norm = torch.stack(torch._foreach_norm(params))
        u_norm = torch.stack(torch._foreach_norm(u))
        phi = w_norm.clamp(*clamp) if clamp is not None else w_norm
        no_ratio = 1.0 / torch.tensor(c, dtype=u_norm.dtype, device=u_norm.device)
        # One device-to-host copy per step: the ratios become per-tensor Python scalars.
        tau = torch.where((w_norm > 0) & (u_norm > 0), phi / u_norm, no_ratio).tolist()
        torch._foreach_mul_(u, [-lr * s for s in tau])
        torch._foreach_add_(params, u)
