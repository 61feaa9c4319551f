r"""The loss landscape around a trained network: sharpness, directions, slices and plots.

A minimum is called *sharp* when the loss rises quickly around it and *flat* when it does
not. This module measures that in the ways the generalization-gap literature does:

- :func:`epsilon_sharpness`: Keskar et al. (2017), Section 2.2.2, the largest relative
  rise of the loss in a small box around the weights;
- :func:`random_direction`, :func:`slice_1d`, :func:`slice_2d`: Li et al. (2018),
  loss along one or two filter-normalized random directions;
- :func:`interpolate`: Goodfellow, Vinyals & Saxe (2015), loss on the segment between
  two networks;
- :func:`rescale_relu_layers`: Dinh et al. (2017), a reparametrization that leaves the
  function unchanged but changes every curvature-based sharpness measure;
- :func:`plot_1d`, :func:`plot_contour`, :func:`plot_surface`: the figures, in the book's
  style (:mod:`lsdl_lab.plot`).

Conventions shared by every function:

- ``batches`` is one ``(x, y)`` pair or an iterable of them (a list, a DataLoader); the
  loss is the mean over all examples, :math:`\sum_b \frac{n_b}{N}\,
  \texttt{loss\_fn}(\texttt{model}(x_b), y_b)`, as in :mod:`lsdl_lab.curvature`. The
  batches are moved to the parameters' device once.
- The model is evaluated in **evaluation mode** (BatchNorm uses its running statistics,
  dropout is off), so the loss is a fixed function of the weights; each submodule's mode is
  restored afterwards.
- A *direction* is a list of tensors, one per tensor of ``model.parameters()`` (all of
  them, in that order), on the parameters' devices and dtypes.
- Functions that move the weights restore them exactly (a saved copy is written back, not
  the step subtracted) and never touch ``.grad``.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor, nn
from torch.optim.swa_utils import update_bn

from ._util import (
    LossFn,
    check_bool,
    check_choice,
    check_int,
    check_positive,
    device_of,
    eval_mode,
    flatten,
    unflatten,
    weighted_batches,
)
from .plot import PALETTE

__all__ = [
    "Interpolation",
    "Sharpness",
    "epsilon_sharpness",
    "interpolate",
    "loss_at",
    "plot_1d",
    "plot_contour",
    "plot_surface",
    "random_direction",
    "rescale_relu_layers",
    "slice_1d",
    "slice_2d",
]

IGNORE = ("biasbn", None)
METHODS = ("sign_ascent", "l-bfgs-b")
BATCHNORM = ("interpolate", "recompute")


# -- evaluating the loss ------------------------------------------------------------------


def _prepare(model: nn.Module, batches) -> tuple[list, list[float]]:
    """The batches as a list on the model's device, with their weights n_b / N."""
    device = device_of(model)
    batches, weights = weighted_batches(batches)
    return [(x.to(device), y.to(device)) for x, y in batches], weights


def _mean_loss(model, loss_fn, batches, weights) -> float:
    """The weighted mean loss; the caller has set eval mode and no_grad."""
    return sum(w * float(loss_fn(model(x), y)) for (x, y), w in zip(batches, weights))


def loss_at(model: nn.Module, loss_fn: LossFn, batches) -> float:
    """Mean loss of ``model`` over ``batches`` (a batch ``(x, y)`` or an iterable of them).

    Evaluation mode, no gradient; the model's mode is restored afterwards.
    """
    batches, weights = _prepare(model, batches)
    with eval_mode(model), torch.no_grad():
        return _mean_loss(model, loss_fn, batches, weights)


@contextmanager
def _restored(params: Sequence[Tensor]):
    """Inside the block the parameters may be moved freely; afterwards they are bit for bit
    what they were (a copy is written back: w + d - d is not always w in floating point)."""
    saved = [p.detach().clone() for p in params]
    try:
        yield saved
    finally:
        with torch.no_grad():
            torch._foreach_copy_(list(params), saved)


def _set(params: Sequence[Tensor], values: Sequence[Tensor]) -> None:
    with torch.no_grad():
        torch._foreach_copy_(list(params), list(values))


# -- Keskar et al. (2017): epsilon-sharpness -------------------------------------------------


@dataclass(frozen=True)
class Sharpness:
    """The result of :func:`epsilon_sharpness`.

    ``sharpness`` = 100 (``max_loss`` - ``loss``) / (1 + ``loss``), in percent;
    ``max_loss`` is the largest loss found in the box (a lower bound on the true maximum).
    """

    sharpness: float
    loss: float
    max_loss: float
    epsilon: float
    steps: int


def _loss_and_grad(model, loss_fn, params, batches, weights) -> tuple[float, list[Tensor]]:
    """The mean loss and its gradient, by autograd.grad so that ``.grad`` stays untouched."""
    loss, grads = 0.0, [torch.zeros_like(p) for p in params]
    for (x, y), w in zip(batches, weights):
        batch_loss = w * loss_fn(model(x), y)
        g = torch.autograd.grad(batch_loss, params, allow_unused=True, materialize_grads=True)
        torch._foreach_add_(grads, g)
        loss += batch_loss.item()
    return loss, grads


def _sign_ascent(f_and_grad, z, r, steps, step_size) -> float:
    """Projected sign-gradient ascent in the box |z| <= r (the l-infinity PGD of Madry et
    al., 2018, with the box scaled per coordinate); returns the largest loss seen."""
    best = -math.inf
    for _ in range(steps):
        loss, g = f_and_grad(z)
        best = max(best, loss)
        with torch.no_grad():
            for zi, gi, ri in zip(z, g, r):
                zi.addcmul_(gi.sign(), ri, value=step_size).clamp_(min=-ri, max=ri)
    loss, _ = f_and_grad(z)
    return max(best, loss)


def _lbfgsb(f_and_grad, z, r, steps) -> float:
    """SciPy's L-BFGS-B (Byrd et al., 1995) on -f in the box, as Keskar et al. did; at most
    ``steps`` iterations. Returns the largest loss of any point it evaluated."""
    from scipy.optimize import fmin_l_bfgs_b  # scipy comes with scikit-learn, a dependency

    like = z[0]
    bound = flatten(r).double().cpu().numpy()
    best = [-math.inf]

    def fun(flat: np.ndarray):
        t = torch.as_tensor(flat, dtype=like.dtype, device=like.device)
        loss, g = f_and_grad(unflatten(t, z))
        best[0] = max(best[0], loss)
        return -loss, -flatten(g).double().cpu().numpy()

    x0 = flatten(z).double().cpu().numpy()
    # minimize(method="L-BFGS-B") runs the same code with the same defaults, but SciPy
    # converts a box of n bounds in Python loops, and minimize converts it twice more: for
    # 4.2 M parameters (Lab 5's MLP at gpu) a minute of the run, 40% less here (measured).
    bounds = list(zip((-bound).tolist(), bound.tolist()))
    fmin_l_bfgs_b(fun, x0, bounds=bounds, maxiter=steps)
    return best[0]


def epsilon_sharpness(
    model: nn.Module,
    loss_fn: LossFn,
    batches,
    epsilon: float = 1e-3,
    steps: int = 20,
    seed: int = 0,
    *,
    method: str = "sign_ascent",
    step_size: float | None = None,
) -> Sharpness:
    r"""Keskar et al.'s (2017, Section 2.2.2 and Metric 2.1) :math:`\epsilon`-sharpness.

    In the full parameter space (:math:`A = I`), with :math:`f` the loss over ``batches``
    and :math:`x` the weights,

    .. math::
        \phi_{x,f}(\epsilon) = 100\,\frac{\max_{z\in\mathcal C_\epsilon} f(x+z) - f(x)}
        {1 + f(x)}, \qquad
        \mathcal C_\epsilon = \{z : |z_i| \le \epsilon(|x_i| + 1)\}.

    The box scales with each weight, so the measure does not depend on the units of a
    layer as a ball would. The maximization starts at a uniformly random point of the box
    (seeded by ``seed``; at a minimum the gradient is zero and an ascent could not leave
    it) and runs for ``steps`` gradient evaluations:

    - ``method="sign_ascent"`` (default, any device): projected gradient ascent with
      sign steps, :math:`z \leftarrow \Pi_{\mathcal C}(z + \eta\, r\odot\operatorname{sign}
      \nabla f(x+z))` with :math:`r_i = \epsilon(|x_i|+1)` and
      :math:`\eta` = ``step_size`` (default :math:`2.5/\text{steps}`, Madry et al.'s 2018
      rule, so the iterates can cross the box);
    - ``method="l-bfgs-b"``: SciPy's L-BFGS-B in the box, Keskar et al.'s own solver, at
      most ``steps`` iterations (float64 on the CPU side).

    Both give a lower bound on the maximum: ``max_loss`` is the largest loss of any point
    evaluated. Keskar et al. used 10 L-BFGS-B iterations; more give a larger value.
    Every trainable parameter is perturbed; buffers (BatchNorm's running statistics) are
    not, and the model is in evaluation mode. The parameters are restored exactly and
    ``.grad`` is not touched.
    """
    epsilon = check_positive("epsilon", epsilon)
    check_int("steps", steps, 1)
    check_int("seed", seed, 0)
    check_choice("method", method, METHODS)
    step_size = 2.5 / steps if step_size is None else check_positive("step_size", step_size)
    batches, weights = _prepare(model, batches)
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("Invalid model: no parameter requires a gradient")

    with eval_mode(model), _restored(params) as x:
        with torch.no_grad():
            loss = _mean_loss(model, loss_fn, batches, weights)
        r = [epsilon * (xi.abs() + 1) for xi in x]
        gen = torch.Generator().manual_seed(seed)
        # Drawn on the CPU so that a seed gives the same start on every device.
        z = [
            (2 * torch.rand(xi.shape, generator=gen, dtype=torch.float64) - 1).to(xi) * ri
            for xi, ri in zip(x, r)
        ]

        def f_and_grad(z):
            _set(params, torch._foreach_add(x, z))
            with torch.enable_grad():
                return _loss_and_grad(model, loss_fn, params, batches, weights)

        if method == "sign_ascent":
            max_loss = _sign_ascent(f_and_grad, z, r, steps, step_size)
        else:
            max_loss = _lbfgsb(f_and_grad, z, r, steps)
    max_loss = max(max_loss, loss)  # z = 0 is in the box
    return Sharpness(100 * (max_loss - loss) / (1 + loss), loss, max_loss, epsilon, steps)


# -- Li et al. (2018): filter-normalized directions and slices ------------------------------


def random_direction(
    model: nn.Module, seed: int = 0, filter_normalize: bool = True, ignore: str | None = "biasbn"
) -> list[Tensor]:
    r"""A Gaussian direction in weight space, filter-normalized (Li et al., 2018, Section 4).

    Each entry is drawn from :math:`\mathcal N(0, 1)` (on the CPU from ``seed``, then moved
    to the parameter's device and dtype, so a seed gives the same direction everywhere).
    With ``filter_normalize``, each *filter* :math:`d_{i}` of a parameter with two or more
    dimensions (a slice along dimension 0: a convolution's output channel, a linear
    layer's output row) is rescaled to the norm of the same filter of the weights,

    .. math:: d_{i} \leftarrow \frac{d_{i}}{\|d_{i}\|}\,\|\theta_{i}\|,

    so a direction moves every filter by the same *relative* amount, and slices of
    networks whose layers have different scales (BatchNorm makes a layer's scale
    arbitrary) become comparable. One-dimensional parameters (biases, BatchNorm's weight
    and bias) are set to zero with ``ignore="biasbn"`` (Li et al.'s choice in their code
    for the figures of the paper), or copied from the weights with ``ignore=None`` (Li et
    al.'s other option). With ``filter_normalize=False`` the raw Gaussian is returned
    (``ignore`` still applies to 1-D parameters).

    Returns one tensor per tensor of ``model.parameters()``, in that order. Scaling every
    weight by :math:`c > 0` scales a filter-normalized direction by :math:`c`.
    """
    check_choice("ignore", ignore, IGNORE)
    check_bool("filter_normalize", filter_normalize)
    gen = torch.Generator().manual_seed(check_int("seed", seed, 0))
    direction = []
    for p in model.parameters():
        w = p.detach()
        d = torch.randn(w.shape, generator=gen, dtype=torch.float64).to(w)
        if w.dim() <= 1:
            d = torch.zeros_like(w) if ignore == "biasbn" else w.clone()
        elif filter_normalize:
            shape = (-1,) + (1,) * (w.dim() - 1)
            d *= (w.flatten(1).norm(dim=1) / d.flatten(1).norm(dim=1)).view(shape)
        direction.append(d)
    return direction


def _check_direction(name: str, params: Sequence[Tensor], direction) -> list[Tensor]:
    expected = f"expected {len(params)} tensors shaped like model.parameters()"
    if isinstance(direction, Tensor) or not all(isinstance(d, Tensor) for d in direction):
        raise TypeError(f"Invalid {name}: a {type(direction).__name__} ({expected})")
    direction = list(direction)
    if [d.shape for d in direction] != [p.shape for p in params]:
        shapes = [tuple(d.shape) for d in direction]
        raise ValueError(f"Invalid {name}: tensors of shapes {shapes} ({expected})")
    return [d.to(p) for d, p in zip(direction, params)]


def _grid(model, loss_fn, batches, directions, coordinates) -> np.ndarray:
    """Loss at theta + sum_k c_k d_k for each tuple c of ``coordinates``."""
    params = list(model.parameters())
    directions = [_check_direction(f"d{k + 1}", params, d) for k, d in enumerate(directions)]
    batches, weights = _prepare(model, batches)
    losses = []
    with eval_mode(model), _restored(params) as theta, torch.no_grad():
        for c in coordinates:
            point = list(theta)
            for ck, d in zip(c, directions):
                point = torch._foreach_add(point, d, alpha=float(ck))
            _set(params, point)
            losses.append(_mean_loss(model, loss_fn, batches, weights))
    return np.array(losses)


def _as_array(name: str, values) -> np.ndarray:
    expected = "expected a non-empty sequence of finite numbers"
    try:
        array = np.asarray(values, dtype=float).reshape(-1)
    except (TypeError, ValueError):
        raise TypeError(f"Invalid {name}: {values!r} ({expected})") from None
    if array.size == 0 or not np.all(np.isfinite(array)):
        raise ValueError(f"Invalid {name}: {values!r} ({expected})")
    return array


def slice_1d(model: nn.Module, loss_fn: LossFn, batches, direction, alphas) -> np.ndarray:
    r"""The loss :math:`f(\theta + \alpha d)` for each :math:`\alpha` of ``alphas`` (Li et
    al., 2018, Section 3); a float64 array of ``len(alphas)``. The parameters are restored
    exactly afterwards."""
    alphas = _as_array("alphas", alphas)
    return _grid(model, loss_fn, batches, [direction], [(a,) for a in alphas])


def slice_2d(model: nn.Module, loss_fn: LossFn, batches, d1, d2, alphas, betas) -> np.ndarray:
    r"""The loss :math:`f(\theta + \alpha d_1 + \beta d_2)` on a grid (Li et al., 2018).

    Returns a float64 array of shape ``(len(betas), len(alphas))``, row ``j`` at
    ``betas[j]``, column ``i`` at ``alphas[i]``: the layout ``plt.contour(alphas, betas,
    grid)`` expects. The parameters are restored exactly afterwards.
    """
    alphas, betas = _as_array("alphas", alphas), _as_array("betas", betas)
    points = [(a, b) for b in betas for a in alphas]
    return _grid(model, loss_fn, batches, [d1, d2], points).reshape(len(betas), len(alphas))


# -- Goodfellow et al. (2015): linear interpolation between two networks -------------------


class Interpolation(NamedTuple):
    """The result of :func:`interpolate`: the loss (and ``metric``, or None) at each alpha."""

    alphas: np.ndarray
    losses: np.ndarray
    metrics: np.ndarray | None


def _check_same_architecture(model_a: nn.Module, model_b: nn.Module) -> None:
    for name, model in (("model_a", model_a), ("model_b", model_b)):
        if not isinstance(model, nn.Module):
            raise TypeError(f"Invalid {name}: a {type(model).__name__} (expected an nn.Module)")
    a, b = model_a.state_dict(), model_b.state_dict()
    if a.keys() != b.keys() or any(a[k].shape != b[k].shape for k in a):
        raise ValueError("Invalid model_b: its parameters and buffers differ from model_a's")


def interpolate(
    model_a: nn.Module,
    model_b: nn.Module,
    loss_fn: LossFn,
    batches,
    alphas,
    metric: Callable[[Tensor, Tensor], Tensor] | None = None,
    *,
    batchnorm: str = "interpolate",
) -> Interpolation:
    r"""Loss along the segment :math:`\theta(\alpha) = (1-\alpha)\theta_a + \alpha\theta_b`
    (Goodfellow, Vinyals & Saxe, 2015).

    ``alphas`` may leave :math:`[0, 1]` (the usual plot runs from -0.5 to 1.5). With
    ``metric`` (a function of ``(output, target)`` averaging over the batch, for example
    :func:`lsdl_lab.train.accuracy`) its mean over the examples is returned too. Neither
    model is changed: a copy of ``model_a`` is evaluated, in evaluation mode.

    **BatchNorm** (``batchnorm``):

    - ``"interpolate"`` (default): the floating-point buffers (running mean and variance)
      are interpolated like the parameters, so :math:`\alpha = 0` and :math:`1` give
      exactly ``model_a`` and ``model_b``. In between these are not the statistics the
      interpolated network has on data; beyond :math:`[0, 1]` an interpolated running
      variance can turn negative and is clipped at zero, and the loss there can explode
      (a channel divided by :math:`\sqrt{\text{eps}}`).
    - ``"recompute"``: at each :math:`\alpha` the running statistics are recomputed from
      ``batches`` (``torch.optim.swa_utils.update_bn``: one pass in training mode, a
      cumulative average; dropout is active during that pass), as in the mode-connectivity
      literature (Garipov et al., 2018). The loss is that of a network whose statistics
      fit the data at every :math:`\alpha`, also outside :math:`[0, 1]`; the end points
      are then ``model_a`` and ``model_b`` with recomputed statistics, not exactly them.

    Integer buffers (``num_batches_tracked``) are copied from ``model_a``.
    """
    _check_same_architecture(model_a, model_b)
    check_choice("batchnorm", batchnorm, BATCHNORM)
    alphas = _as_array("alphas", alphas)
    model = copy.deepcopy(model_a)
    batches, weights = _prepare(model, batches)
    a, b = model_a.state_dict(), model_b.state_dict()
    floating = [k for k in a if a[k].is_floating_point()]
    theta = dict(model.state_dict())  # the copy's own tensors, written in place
    losses, metrics = [], []
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    with eval_mode(model), torch.no_grad():
        for alpha in alphas:
            for k in floating:
                theta[k].copy_(torch.lerp(a[k], b[k].to(a[k].device), float(alpha)))
            for m in norms:
                if m.running_var is not None:
                    m.running_var.clamp_(min=0)
            if batchnorm == "recompute" and norms:
                update_bn(batches, model)  # restores the (evaluation) mode it found
            loss, value = 0.0, 0.0
            for (x, y), w in zip(batches, weights):
                out = model(x)
                loss += w * float(loss_fn(out, y))
                if metric is not None:
                    value += w * float(metric(out, y))
            losses.append(loss)
            metrics.append(value)
    return Interpolation(alphas, np.array(losses), None if metric is None else np.array(metrics))


# -- Dinh et al. (2017): sharpness is not invariant to reparametrization -------------------


def _layer(model: nn.Module, name: str, layer) -> nn.Module:
    """``layer`` (argument ``name``): a submodule of ``model`` with a weight, or its name."""
    if isinstance(layer, str):
        try:
            module = model.get_submodule(layer)
        except AttributeError:
            raise ValueError(
                f"Invalid {name}: {layer!r} (expected the name of a submodule of model)"
            ) from None
    elif isinstance(layer, nn.Module):
        module = layer
    else:
        raise TypeError(
            f"Invalid {name}: a {type(layer).__name__} (expected a submodule of model or its name)"
        )
    if not isinstance(getattr(module, "weight", None), Tensor):
        raise ValueError(f"Invalid {name}: {layer!r} (expected a module with a weight)")
    return module


@torch.no_grad()
def rescale_relu_layers(model: nn.Module, first, second, alpha: float) -> nn.Module:
    r"""Dinh et al.'s (2017, Section 4) :math:`\alpha`-scale transformation, in place.

    Multiply layer ``first``'s weight and bias by :math:`\alpha > 0` and layer ``second``'s
    weight by :math:`1/\alpha`. ReLU is positively homogeneous,
    :math:`\operatorname{relu}(\alpha u) = \alpha\operatorname{relu}(u)`, so when only
    ReLUs (or other positively homogeneous maps: max pooling, identity) lie between the
    two layers the network computes *the same function*; but the Hessian blocks of the two
    layers scale by :math:`1/\alpha^2` and :math:`\alpha^2`, so the top eigenvalue, the
    trace and :math:`\epsilon`-sharpness change, and can be made as large as one likes.
    Flatness measured this way is not a property of the function alone.

    ``first`` and ``second`` are submodules of ``model`` or their names (``"net.1"``,
    ``"net.3"`` in :class:`lsdl_lab.models.MLP`). Whether only positively homogeneous
    operations connect them is the caller's responsibility. Returns ``model``.
    """
    alpha = check_positive("alpha", alpha)
    first, second = _layer(model, "first", first), _layer(model, "second", second)
    first.weight.mul_(alpha)
    if getattr(first, "bias", None) is not None:
        first.bias.mul_(alpha)
    second.weight.div_(alpha)
    return model


# -- plots --------------------------------------------------------------------------------


def plot_1d(ax, alphas, losses, label: str | None = None, **line_kwargs):
    """A 1-D slice or interpolation: loss against alpha. Returns the list of Line2D."""
    lines = ax.plot(np.asarray(alphas), np.asarray(losses), label=label, **line_kwargs)
    ax.set_xlabel("α (step along the direction)")
    ax.set_ylabel("loss")
    if label is not None:
        ax.legend()
    return lines


def plot_contour(ax, alphas, betas, grid, levels=20, filled: bool = False, **kwargs):
    """Contours of a 2-D slice (``grid`` from :func:`slice_2d`), labelled, with the trained
    weights (0, 0) marked. Returns the ContourSet."""
    contour = (ax.contourf if filled else ax.contour)(
        np.asarray(alphas),
        np.asarray(betas),
        np.asarray(grid),
        levels=levels,
        cmap=kwargs.pop("cmap", "viridis"),
        **kwargs,
    )
    if not filled:
        ax.clabel(contour, inline=True, fontsize=7, fmt="%.2g")
    ax.plot([0], [0], marker="*", color=PALETTE[3], markersize=9, linestyle="none")
    ax.set_xlabel("α (direction 1)")
    ax.set_ylabel("β (direction 2)")
    ax.set_aspect("equal", adjustable="box")
    return contour


def plot_surface(ax3d, alphas, betas, grid, **kwargs):
    """A 2-D slice as a 3-D surface; ``ax3d`` from ``fig.add_subplot(projection="3d")``.
    Returns the Poly3DCollection."""
    A, B = np.meshgrid(np.asarray(alphas), np.asarray(betas))
    surface = ax3d.plot_surface(
        A,
        B,
        np.asarray(grid),
        cmap=kwargs.pop("cmap", "viridis"),
        linewidth=0,
        antialiased=True,
        **kwargs,
    )
    ax3d.set_xlabel("α")
    ax3d.set_ylabel("β")
    ax3d.set_zlabel("loss")
    return surface
