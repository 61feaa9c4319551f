r"""What LARS and LAMB share: the layer-wise trust ratio and the layer-wise parameter groups.

Both optimizers rescale each layer's (each parameter tensor's) step by a *trust ratio*
that makes it a fixed fraction of the layer's weight norm (You, Gitman and Ginsburg, 2017;
You et al., 2020), in one form that covers both papers (:func:`ratio_of_norms`, from the
layers' norms), for a list of layers in one multi-tensor pass (:func:`trust_ratio`: LARS and
the Lab 4b checker); LAMB, whose update runs layer by layer, applies :func:`ratio_of_norms`
to the norms of a run of layers at once.
:func:`param_groups_for_layerwise` leaves biases and normalization parameters out of the
adaptation and the decay.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor, nn

from .._util import check_nonnegative
from .pieces import host_scalars

__all__ = ["param_groups_for_layerwise", "ratio_of_norms", "trust_ratio"]


def trust_ratio(
    weights: list[Tensor],
    updates: list[Tensor],
    clamp: tuple[float, float] | None = None,
    *,
    trust_coefficient: float = 1.0,
    weight_decay: float = 0.0,
    eps: float = 0.0,
) -> list[float]:
    """The trust ratio of each layer (:func:`ratio_of_norms`), as Python floats (one
    device-to-host copy)."""
    w_norm = torch.stack(torch._foreach_norm(weights))
    u_norm = torch.stack(torch._foreach_norm(updates))
    tau = ratio_of_norms(w_norm, u_norm, clamp, trust_coefficient, weight_decay, eps)
    return host_scalars(tau)


def ratio_of_norms(
    w_norm: Tensor,
    u_norm: Tensor,
    clamp: tuple[float, float] | None = None,
    trust_coefficient: float = 1.0,
    weight_decay: float = 0.0,
    eps: float = 0.0,
) -> Tensor:
    r"""The trust ratio from the norms :math:`\|w\|` and :math:`\|u\|` of a layer's
    weights and step (tensors of any shape, elementwise):

    .. math::
        \tau = \frac{\eta\, \phi(\|w\|)}{\|u\| + \lambda \|w\| + \epsilon}
        \qquad (\tau = 1 \text{ if } \|w\| = 0 \text{ or } \|u\| + \lambda\|w\| = 0)

    with :math:`\phi` the identity, or :math:`\min(\max(z, \gamma_l), \gamma_u)` with
    ``clamp=(lower, upper)``. LAMB (You et al., 2020, Algorithm 2) takes its step :math:`u`
    (which holds the weight decay) and the defaults: :math:`\tau = \phi(\|w\|)/\|u\|`. LARS
    (You, Gitman and Ginsburg, 2017, Algorithm 1) takes the gradient :math:`u = g`, its
    trust coefficient :math:`\eta`, weight decay :math:`\lambda` and guard :math:`\epsilon`.
    A zero layer (a zero-initialized bias) or a zero step gets :math:`\tau = 1`, as in
    optax, timm and pytorch-optimizer: a ratio proportional to :math:`\|w\| = 0` would never
    let it move.
    """
    phi = w_norm.clamp(*clamp) if clamp is not None else w_norm
    denom = u_norm + weight_decay * w_norm
    tau = trust_coefficient * phi / (denom + eps)
    return torch.where((w_norm > 0) & (denom > 0), tau, 1.0)


def param_groups_for_layerwise(
    parameters: nn.Module | Iterable[Tensor] | Iterable[tuple[str, Tensor]],
    weight_decay: float = 0.0,
) -> list[dict]:
    """Parameter groups for :class:`~lsdl_lab.optim.LARS` and :class:`~lsdl_lab.optim.LAMB`,
    from a module, its ``named_parameters()`` (or any (name, parameter) pairs) or a list of
    parameters: tensors with two or more dimensions (weight matrices, convolution kernels,
    embeddings) get ``weight_decay`` and the trust ratio; the others (biases, BatchNorm and
    LayerNorm scales and shifts) get neither (``weight_decay=0``, ``trust=False``).

    Frozen parameters (``requires_grad=False``) and empty groups are left out. Named
    parameters stay named, so the optimizer's ``state_dict`` records their names (torch.optim's
    ``param_names``); a module gives its named parameters.
    """
    check_nonnegative("weight_decay value", weight_decay)
    if isinstance(parameters, nn.Module):
        parameters = parameters.named_parameters()
    items = [x for x in parameters if (x[1] if isinstance(x, tuple) else x).requires_grad]

    def ndim(x) -> int:
        return (x[1] if isinstance(x, tuple) else x).ndim

    groups = [
        dict(params=[x for x in items if ndim(x) >= 2], weight_decay=weight_decay),
        dict(params=[x for x in items if ndim(x) < 2], weight_decay=0.0, trust=False),
    ]
    return [g for g in groups if g["params"]]
