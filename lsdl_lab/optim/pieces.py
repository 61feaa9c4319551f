r"""The update pieces several optimizers share, each a small function on lists of tensors.

Each piece that torch.optim also computes performs its ``_multi_tensor_*`` operations in
torch.optim's order, so every optimizer built from them keeps agreeing with its torch.optim
namesake bit for bit. A piece whose name ends in ``_`` changes its first argument in place;
the others return new tensors (or, where they say so, update buffers given to them).

* :func:`coupled_weight_decay`: :math:`g + \lambda w` (L2 regularization, SGD, Adam, ...).
* :func:`decoupled_weight_decay_`: :math:`w \leftarrow (1 - \eta\lambda)\, w` (AdamW,
  Loshchilov and Hutter, 2019).
* :func:`momentum`: the heavy-ball or Nesterov direction from a momentum buffer (SGD, LARS).
* :func:`adam_moments_`: Adam's two exponential averages (Adam, NAdam, LAMB).
* :func:`decayed_adam_moments_`: weight decay, coupled or decoupled, then Adam's moments
  (Adam and AdamW, NAdam, Adam8bit).
* :func:`adam_denominator`: :math:`\sqrt{\hat v_t} + \epsilon` (Adam, NAdam, LAMB).
* :func:`adam_step_`: Adam's bias-corrected step from its moments (Adam and AdamW, Adam8bit,
  the AdamW groups of Muon).

And the operations whose scalars are per-step values (a learning rate, a bias correction):
on the compiled path (:mod:`lsdl_lab.optim.compiled`) these are 0-d tensors, which the
foreach operations' scalar arguments do not take, so they are applied by a product there,
which the compiler fuses into the same pass:

* :func:`add_scaled_`: :math:`x \leftarrow x + \alpha y`.
* :func:`addcdiv_`: :math:`x \leftarrow x + s\, y / z`.
* :func:`host_scalars`: scalars computed on the device, as the foreach operations take them.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .compiled import computed_once, map_once

__all__ = [
    "add_scaled_",
    "addcdiv_",
    "adam_denominator",
    "adam_moments_",
    "adam_step_",
    "coupled_weight_decay",
    "decayed_adam_moments_",
    "decoupled_weight_decay_",
    "host_scalars",
    "momentum",
    "reuse_memory",
    "smaller",
]


def add_scaled_(xs: list[Tensor], ys: list[Tensor], alpha) -> None:
    r""":math:`x \leftarrow x + \alpha\, y` for each pair, in place; ``alpha`` a number, or
    a 0-d tensor on the compiled path."""
    if isinstance(alpha, Tensor):
        torch._foreach_add_(xs, torch._foreach_mul(ys, alpha))
    else:
        torch._foreach_add_(xs, ys, alpha=alpha)


def addcdiv_(xs: list[Tensor], ys: list[Tensor], zs: list[Tensor], scalars) -> None:
    r""":math:`x \leftarrow x + s\, y / z` for each triple, in place; ``scalars`` one number
    or one per tensor, 0-d tensors on the compiled path."""
    if isinstance(scalars, Tensor) or (
        isinstance(scalars, list) and isinstance(scalars[0], Tensor)
    ):
        torch._foreach_addcdiv_(xs, torch._foreach_mul(ys, computed_once(scalars)), zs)
    else:
        torch._foreach_addcdiv_(xs, ys, zs, scalars)


def smaller(a, b):
    """The smaller of two numbers, or of 0-d tensors on the compiled path (where ``min``
    would compare them on the host)."""
    return torch.minimum(a, b) if isinstance(a, Tensor) else min(a, b)


def host_scalars(tensors: Tensor | list[Tensor]) -> list:
    """Scalars computed on the device (a 1-D tensor, or 0-d tensors), as the foreach
    operations take them: Python numbers eagerly (copied to the host at once: one copy, not
    one synchronization per tensor), the 0-d tensors themselves on the compiled path, where
    a copy to the host would end the graph."""
    if torch.compiler.is_compiling():
        return list(computed_once(tensors))
    return (tensors if isinstance(tensors, Tensor) else torch.stack(tensors)).tolist()


def coupled_weight_decay(grads: list[Tensor], params: list[Tensor], lam: float) -> list[Tensor]:
    r""":math:`g + \lambda w`, a new list (``grads`` itself when :math:`\lambda = 0`)."""
    return torch._foreach_add(grads, params, alpha=lam) if lam else grads


def decoupled_weight_decay_(params: list[Tensor], lr: float, lam: float) -> None:
    r""":math:`w \leftarrow (1 - \eta\lambda)\, w`, in place."""
    if lam:
        torch._foreach_mul_(params, computed_once(1 - lr * lam))


def momentum(
    b: list[Tensor], d: list[Tensor], mu: float, dampening: float, nesterov: bool, first: bool
) -> list[Tensor]:
    r"""The momentum direction from the buffers ``b``, updated in place:

    .. math::
        b_t = \mu\, b_{t-1} + (1 - \tau)\, d_t \quad (b_1 = d_1), \qquad
        \text{direction} = d_t + \mu\, b_t \ \text{(Nesterov)} \quad\text{or}\quad b_t

    ``first`` says that ``b`` was just created as a copy of ``d`` (torch.optim's undamped
    first buffer). With Nesterov the direction is built in ``d``'s own memory, as
    torch.optim does, where :func:`reuse_memory` allows it.
    """
    if not first:
        torch._foreach_mul_(b, mu)
        torch._foreach_add_(b, d, alpha=1 - dampening)
    if not nesterov:
        return b
    if not reuse_memory():
        return torch._foreach_add(d, b, alpha=mu)
    torch._foreach_add_(d, b, alpha=mu)
    return d


def reuse_memory() -> bool:
    """Whether an update should build a temporary in the memory of one it no longer needs
    (the direction in the gradient's memory): yes eagerly, where a new temporary the size of
    the model costs a full pass of fresh memory (measured 1.2-1.7x slower); no on the
    compiled path, where TorchInductor fuses a temporary into the loop that reads it (it is
    never stored) and writing into the gradient would add a store to that loop."""
    return not torch.compiler.is_compiling()


def adam_moments_(
    m: list[Tensor], v: list[Tensor], grads: list[Tensor], beta1: float, beta2: float
) -> None:
    r""":math:`m_t = \beta_1 m_{t-1} + (1-\beta_1) g_t` and
    :math:`v_t = \beta_2 v_{t-1} + (1-\beta_2) g_t^2`, in place."""
    torch._foreach_lerp_(m, grads, 1 - beta1)  # m += (1 - beta1) (g - m)
    torch._foreach_mul_(v, beta2)
    torch._foreach_addcmul_(v, grads, grads, 1 - beta2)


def decayed_adam_moments_(
    params: list[Tensor],
    grads: list[Tensor],
    m: list[Tensor],
    v: list[Tensor],
    beta1: float,
    beta2: float,
    *,
    lr: float,
    lam: float,
    decoupled: bool,
) -> list[Tensor]:
    r"""Weight decay, coupled (L2) or ``decoupled`` (Loshchilov and Hutter, 2019), then
    Adam's moments, in place:

    .. math::
        g_t &\leftarrow g_t + \lambda\, w_{t-1} \quad\text{(coupled)} \qquad
        w_{t-1} \leftarrow (1 - \eta\lambda)\, w_{t-1} \quad\text{(decoupled)} \\
        m_t &= \beta_1 m_{t-1} + (1-\beta_1)\, g_t, \qquad
        v_t = \beta_2 v_{t-1} + (1-\beta_2)\, g_t^2

    Returns the :math:`g_t` the moments took (a new list when coupled with
    :math:`\lambda \ne 0`). An update that no longer needs it drops it at once, so that
    its memory is free for the denominator (torch.optim frees it there too).
    """
    if decoupled:
        decoupled_weight_decay_(params, lr, lam)
    else:
        grads = coupled_weight_decay(grads, params, lam)
    adam_moments_(m, v, grads, beta1, beta2)
    return grads


def adam_denominator(v: list[Tensor], bc2: list[float], eps: float) -> list[Tensor]:
    r""":math:`\sqrt{v_t / c_2} + \epsilon`, a new list; ``bc2`` holds each tensor's bias
    correction :math:`c_2 = 1 - \beta_2^t` (or 1 for none).

    ``** 0.5`` (C pow), not ``math.sqrt``: torch.optim's choice; the two differ by one ulp for
    about one number in a thousand, and then so would the results.
    """
    denom = torch._foreach_sqrt(v)
    torch._foreach_div_(denom, map_once(lambda c: c**0.5, bc2))
    torch._foreach_add_(denom, eps)
    return denom


def adam_step_(
    params: list[Tensor],
    m: list[Tensor],
    v: list[Tensor],
    t: list[int],
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
) -> None:
    r""":math:`w_t = w_{t-1} - \frac{\eta}{1-\beta_1^t}\,
    \frac{m_t}{\sqrt{v_t / (1-\beta_2^t)} + \epsilon}`, in place: Adam's step from its
    moments (torch.optim's order: the denominator, then one ``addcdiv`` with the first
    moment's bias correction folded into the step size); ``t`` holds each tensor's step
    count."""
    denom = adam_denominator(v, map_once(lambda k: 1 - beta2**k, t), eps)
    addcdiv_(params, m, denom, map_once(lambda k: -lr / (1 - beta1**k), t))
