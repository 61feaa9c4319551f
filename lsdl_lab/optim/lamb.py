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
* **Excluded layers**: :func:`~lsdl_lab.optim.layerwise.param_groups_for_layerwise` puts biases
  and normalization parameters in a group with ``weight_decay=0`` and ``trust=False``
  (the authors' TensorFlow LAMB excludes from adaptation what it excludes from weight
  decay; timm and apex adapt only groups with weight decay, by default; optax's mask
  covers the decay only, pytorch-optimizer adapts every tensor). With ``trust=False`` the
  update is :class:`~lsdl_lab.optim.AdamW`'s (``Adam``'s when ``weight_decay=0``), bit for
  bit: the same shared pieces in the same order.
* **No gradient clipping**: timm's ``Lamb`` and apex's ``FusedLAMB`` (NVIDIA's variant)
  first divide all gradients by their global norm when it exceeds ``max_grad_norm=1``, by
  default; here clipping belongs to the training step
  (``fit(..., step=partial(train_step, clip_grad_norm=1.0))``).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import torch

from .base import Optimizer
from .compiled import computed_once
from .layerwise import ratio_of_norms
from .pieces import adam_denominator, adam_moments_, addcdiv_, decoupled_weight_decay_

__all__ = ["LAMB"]

# Elements in a run of layers whose trust ratios are computed together: its five arrays
# (w, g, m, v, u: 5 MiB in float32) stay in the caches from the moments to the step
RUN_SIZE = 2**18


def check_clamp(clamp) -> tuple[float, float] | None:
    """None, or a pair (lower, upper) with 0 <= lower <= upper (upper may be inf)."""
    expected = "expected None or a pair (lower, upper) with 0 <= lower <= upper, upper possibly inf"
    if clamp is None:
        return None
    pair = isinstance(clamp, Sequence) and not isinstance(clamp, (str, bytes))
    if not pair or not all(isinstance(c, numbers.Real) and not isinstance(c, bool) for c in clamp):
        raise TypeError(f"Invalid clamp: {clamp!r} ({expected})")
    if len(clamp) != 2 or not (math.isfinite(clamp[0]) and 0.0 <= clamp[0] <= clamp[1]):
        raise ValueError(f"Invalid clamp: {clamp!r} ({expected})")
    return float(clamp[0]), float(clamp[1])


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
        compile: bool = False,
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
        super().__init__(params, defaults, foreach, compile)

    def check(self, group):
        check_clamp(group["clamp"])

    def update(self, group, params, grads):
        r"""LAMB's step, the paper's Algorithm 2 line by line (You et al., 2020):

        .. math::
            m_t &= \beta_1 m_{t-1} + (1-\beta_1)\, g_t, \qquad
            v_t = \beta_2 v_{t-1} + (1-\beta_2)\, g_t^2 \\
            r_t &= \frac{m_t / (1-\beta_1^t)}{\sqrt{v_t / (1-\beta_2^t)} + \epsilon} \\
            u_t &= r_t + \lambda\, w_{t-1} \\
            \tau_t &= \phi(\|w_{t-1}\|) / \|u_t\| \\
            w_t &= w_{t-1} - \gamma_t\, \tau_t\, u_t

        per layer, with :math:`\tau_t = 1` for a zero layer or a zero :math:`u_t`;
        ``bias_correction=False`` drops both corrections. With ``trust=False``
        it is AdamW (:math:`\tau_t = 1`, the decay applied as AdamW applies it).
        """
        (beta1, beta2), lr, eps = group["betas"], group["lr"], group["eps"]
        lam = group["weight_decay"]
        m = self.buffer(params, "exp_avg")
        v = self.buffer(params, "exp_avg_sq")
        t = self.count_steps(params)
        bc1 = [1 - beta1**k if group["bias_correction"] else 1.0 for k in t]
        bc2 = [1 - beta2**k if group["bias_correction"] else 1.0 for k in t]
        if not group["trust"]:  # AdamW's pieces in AdamW's order: AdamW bit for bit
            adam_moments_(m, v, grads, beta1, beta2)  # m_t, v_t
            decoupled_weight_decay_(params, lr, lam)
            denom = adam_denominator(v, bc2, eps)
            addcdiv_(params, m, denom, [-lr / c for c in bc1])
            return
        # Layer by layer, as the paper writes it. Each layer's arrays stay in the caches from
        # its moments to its step (fewer trips to memory than a _foreach pass per line:
        # benchmarks/README.md), and compiled, each layer becomes two loops, the moments with
        # the two norms, then the step (u_t recomputed, never stored): the least traffic.
        # The trust ratios of a run of small consecutive layers are computed together, one
        # pass of small operations for the run instead of one per layer: on small layers the
        # fixed cost of each operation, not memory, sets the step's time.
        # r_t is computed as (sqrt(c2) / c1) m_t / (sqrt(v_t) + sqrt(c2) eps), the same
        # value with one division per element instead of two (v_t / c2 is gone)
        for run in layer_runs(params):
            ws, us = [params[i] for i in run], []
            for i in run:
                w, g, m_i, v_i, c1, c2 = params[i], grads[i], m[i], v[i], bc1[i], bc2[i]
                m_i.lerp_(g, 1 - beta1)  # m_t
                v_i.mul_(beta2).addcmul_(g, g, value=1 - beta2)  # v_t
                # sqrt(c2) (sqrt(v_hat) + eps)
                u = torch.sqrt(v_i).add_(computed_once(eps * c2**0.5))
                torch.div(m_i, u, out=u)  # in u's memory
                if group["bias_correction"]:
                    u.mul_(computed_once(c2**0.5 / c1))  # r_t = m_hat / (sqrt(v_hat) + eps)
                if lam:
                    u.add_(w, alpha=lam)  # u_t = r_t + lam w
                us.append(u)
            w_norm = torch.stack([torch.linalg.vector_norm(w) for w in ws])
            u_norm = torch.stack([torch.linalg.vector_norm(u) for u in us])
            tau = ratio_of_norms(w_norm, u_norm, group["clamp"])  # phi(||w||) / ||u||
            for w, u, tau_i in zip(ws, us, computed_once(tau).unbind(), strict=True):
                w.sub_(u.mul_(lr * tau_i))  # w -= lr tau u


def layer_runs(params: list[torch.Tensor], size: int = RUN_SIZE) -> list[list[int]]:
    """The indices of ``params`` in runs of consecutive tensors of at most ``size`` elements
    in all (a larger tensor is a run of its own)."""
    runs, run, n = [], [], 0
    for i, p in enumerate(params):
        if run and n + p.numel() > size:
            runs.append(run)
            run, n = [], 0
        run.append(i)
        n += p.numel()
    return [*runs, run] if run else runs
