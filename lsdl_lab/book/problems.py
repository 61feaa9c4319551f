r"""Two-dimensional test problems, and the paths optimizers take on them.

A 2-D problem shows in one picture what an optimizer does: where it oscillates, where it
crawls, where it overshoots. Each :class:`Problem` is a function
:math:`f: \mathbb{R}^2 \to \mathbb{R}` with a known global minimizer, a plotting window and
a default starting point:

* :func:`quadratic`: :math:`f(w) = \tfrac12 w^\top A w` with eigenvalues 1 and
  :math:`\kappa`, the model of every smooth problem near its minimum, whose condition
  number :math:`\kappa` sets the speed of gradient descent (about :math:`\kappa` steps per
  digit of accuracy) and of momentum (about :math:`\sqrt\kappa`);
* :func:`rosenbrock`: Rosenbrock's (1960) curved valley, non-convex and ill-conditioned;
* :func:`badly_scaled`: a round bowl seen through a bad choice of units, one coordinate's
  curvature ``scale**2`` times the other's, where per-coordinate (adaptive) step sizes
  help and a single global step size cannot;
* :func:`saddle`: a saddle point at the origin between two minima.

:func:`trajectory` runs any ``torch.optim.Optimizer`` (the book's or torch's) from the
starting point and returns the points it visits; :func:`reddi_counterexample` runs the
one-dimensional online problem of Reddi et al. (2018) on which Adam converges to the
worst point. :func:`plot_problem` and :func:`plot_trajectories` draw them in the book's
style.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from .._util import check_bool, check_int, check_positive, check_real

__all__ = [
    "PROBLEMS",
    "Problem",
    "badly_scaled",
    "plot_problem",
    "plot_trajectories",
    "quadratic",
    "reddi_counterexample",
    "rosenbrock",
    "saddle",
    "trajectory",
]

Point = tuple[float, float]


@dataclass(frozen=True)
class Problem:
    """A function of two variables with a known global minimizer.

    ``f`` maps a tensor of shape ``(..., 2)`` (any floating dtype) to shape ``(...)``, so
    the same function evaluates one point, a path or a whole plotting grid.
    """

    name: str
    f: Callable[[Tensor], Tensor]
    minimum: Point  # a global minimizer
    bounds: tuple[Point, Point]  # ((x_min, x_max), (y_min, y_max)): the plotting window
    start: Point  # the default starting point

    @property
    def f_min(self) -> float:
        """The minimum value, ``f(minimum)``."""
        return float(self.f(torch.tensor(self.minimum, dtype=torch.float64)))


def _point(name: str, value) -> Point:
    """A pair of finite numbers (a tuple, a list, an array or a tensor of two)."""
    if isinstance(value, (Tensor, np.ndarray)):
        value = value.tolist()
    try:
        x, y = value
    except (TypeError, ValueError) as error:
        raise type(error)(
            f"Invalid {name}: {value!r} (expected a pair of numbers (x, y))"
        ) from None
    return check_real(f"{name}[0]", x), check_real(f"{name}[1]", y)


def _check_problem(problem) -> Problem:
    if not isinstance(problem, Problem):
        raise TypeError(f"Invalid problem: a {type(problem).__name__} (expected a Problem)")
    return problem


def _check_optimizer(optimizer) -> None:
    if not callable(optimizer):
        raise TypeError(
            f"Invalid optimizer: {optimizer!r} (expected an optimizer class or a function "
            "that builds one from a parameter list)"
        )


# ---------------------------------------------------------------------------------------
# the problems


def quadratic(condition: float = 10.0, rotation: float = 0.0) -> Problem:
    r""":math:`f(w) = \tfrac12 w^\top A w` with :math:`A = R\,\mathrm{diag}(1, \kappa)\,R^\top`.

    ``condition`` is :math:`\kappa = L/\mu`, the ratio of the largest to the smallest
    curvature (``condition < 1`` makes the first axis the steep one); ``rotation`` turns
    the eigenvectors by that angle in radians, so that the valley is not aligned with the
    coordinate axes. Gradient descent converges for step sizes below :math:`2/L`.
    """
    kappa = check_positive("condition", condition)
    theta = check_real("rotation", rotation)
    c, s = math.cos(theta), math.sin(theta)
    # A = R diag(1, kappa) R^T written out, so f works for any dtype and device
    a11, a12, a22 = c * c + kappa * s * s, (1.0 - kappa) * c * s, s * s + kappa * c * c

    def f(w: Tensor) -> Tensor:
        x, y = w[..., 0], w[..., 1]
        return 0.5 * (a11 * x * x + 2.0 * a12 * x * y + a22 * y * y)

    return Problem(
        name=f"quadratic (κ = {kappa:g})",
        f=f,
        minimum=(0.0, 0.0),
        bounds=((-3.5, 3.5), (-2.0, 2.0)),
        start=(-3.0, 1.0),
    )


def rosenbrock(a: float = 1.0, b: float = 100.0) -> Problem:
    r"""Rosenbrock's valley :math:`f(x, y) = (a - x)^2 + b\,(y - x^2)^2`, minimum at
    :math:`(a, a^2)`.

    The minimum lies at the end of a narrow, curved, nearly flat valley: easy to reach
    the valley floor, slow to travel along it. At :math:`(1, 1)` with :math:`b = 100` the
    Hessian has condition number about 2,500.
    """
    a = check_real("a", a)
    b = check_positive("b", b)
    s = max(1.0, abs(a))

    def f(w: Tensor) -> Tensor:
        x, y = w[..., 0], w[..., 1]
        return (a - x) ** 2 + b * (y - x * x) ** 2

    return Problem(
        name=f"Rosenbrock (a = {a:g}, b = {b:g})",
        f=f,
        minimum=(a, a * a),
        bounds=((-2.0 * s, 2.0 * s), (-1.0 * s, s * s + 2.0 * s)),
        start=(-1.2 * s, 1.0 * s),  # the classic start, on the far side of the valley
    )


def badly_scaled(scale: float = 100.0) -> Problem:
    r"""The round bowl :math:`\tfrac12(x^2 + u^2)` in the units :math:`u = \text{scale}\cdot y`:

    .. math:: f(x, y) = \tfrac12\,\bigl(x^2 + (\text{scale}\cdot y)^2\bigr).

    The curvature along :math:`y` is ``scale**2`` times that along :math:`x`, so a step
    size small enough for :math:`y` (below :math:`2/\text{scale}^2`) barely moves
    :math:`x`, and one that moves :math:`x` makes :math:`y` diverge. A per-coordinate
    step size, as Adam's, undoes the scaling. The plotting window is scaled with the
    problem: :math:`y` spans ``±5/scale``, wide enough to show the first, overshooting
    steps of the adaptive methods.
    """
    scale = check_positive("scale", scale)

    def f(w: Tensor) -> Tensor:
        x, y = w[..., 0], w[..., 1]
        return 0.5 * (x * x + (scale * y) ** 2)

    return Problem(
        name=f"badly scaled bowl (scale = {scale:g})",
        f=f,
        minimum=(0.0, 0.0),
        bounds=((-3.0, 3.0), (-5.0 / scale, 5.0 / scale)),
        start=(-2.5, 2.0 / scale),
    )


def saddle() -> Problem:
    r""":math:`f(x, y) = \tfrac12 x^2 - y^2 + \tfrac14 y^4`: a saddle at the origin between
    the two minima :math:`(0, \pm\sqrt2)`, where :math:`f = -1`.

    The Hessian at the saddle is :math:`\mathrm{diag}(1, -2)`. Started near the
    :math:`x`-axis, gradient descent slides towards the saddle and leaves it only as fast
    as the tiny :math:`y` component grows, by a factor :math:`1 + 2\eta` a step.
    """

    def f(w: Tensor) -> Tensor:
        x, y = w[..., 0], w[..., 1]
        return 0.5 * x * x - y * y + 0.25 * y**4

    return Problem(
        name="saddle",
        f=f,
        minimum=(0.0, math.sqrt(2.0)),
        bounds=((-2.0, 2.0), (-2.0, 2.0)),
        start=(-1.8, 0.01),
    )


PROBLEMS: dict[str, Callable[..., Problem]] = {
    "quadratic": quadratic,
    "rosenbrock": rosenbrock,
    "badly_scaled": badly_scaled,
    "saddle": saddle,
}


# ---------------------------------------------------------------------------------------
# running an optimizer


def trajectory(
    problem: Problem,
    optimizer: type | Callable,
    steps: int,
    start: Point | None = None,
    **hyperparameters,
) -> Tensor:
    """The points visited by ``optimizer([w], **hyperparameters)`` minimizing ``problem.f(w)``.

    Returns a float64 tensor of shape ``(steps + 1, 2)``: the starting point, then the
    point after each step. ``optimizer`` is any ``torch.optim.Optimizer`` class (or a
    function that builds one from a parameter list); each step is taken with a closure,
    so optimizers that re-evaluate the loss (L-BFGS, SAM) work too.

    **A diverging run stops early.** When a step produces a non-finite point (the
    iterates overflowed), that point is dropped and the run stops: the result then has
    *fewer* than ``steps + 1`` rows, all finite. ``len(path) < steps + 1`` is how a caller
    tells that the optimizer diverged.
    """
    _check_problem(problem)
    _check_optimizer(optimizer)
    steps = check_int("steps", steps, 1)
    start = _point("start", problem.start if start is None else start)

    w = torch.tensor(start, dtype=torch.float64, requires_grad=True)
    opt = optimizer([w], **hyperparameters)

    def closure() -> Tensor:
        opt.zero_grad()
        loss = problem.f(w)
        loss.backward()
        return loss

    path = torch.empty(steps + 1, 2, dtype=torch.float64)
    path[0] = w.detach()
    for t in range(1, steps + 1):
        opt.step(closure)
        if not bool(torch.isfinite(w).all()):
            return path[:t].clone()
        path[t] = w.detach()
    return path


def reddi_counterexample(
    optimizer: type | Callable,
    steps: int,
    C: float = 3.0,
    period: int = 3,
    start: float = 0.0,
    decay: bool = False,
    **hyperparameters,
) -> Tensor:
    r"""Reddi et al.'s (2018, Section 3) online problem on which Adam fails to converge.

    At step :math:`t = 1, 2, \dots` the loss is :math:`f_t(x) = C x` when
    :math:`t \bmod \text{period} = 1` and :math:`f_t(x) = -x` otherwise, on the interval
    :math:`[-1, 1]`: each step the optimizer sees the gradient :math:`C` or :math:`-1` and
    its iterate is projected back onto the interval. With :math:`C > \text{period} - 1`
    the average loss is minimized at :math:`x = -1`. With ``decay=True`` the step size
    is :math:`\eta_t = \eta/\sqrt t`, as in the paper's Theorem 1.

    Returns the iterates :math:`x_0, \dots, x_T` as a float64 tensor of shape
    ``(steps + 1,)``.
    """
    _check_optimizer(optimizer)
    steps = check_int("steps", steps, 1)
    C = check_positive("C", C)
    period = check_int("period", period, 2)
    start = check_real("start", start, -1.0, 1.0)
    check_bool("decay", decay)

    x = torch.tensor([start], dtype=torch.float64, requires_grad=True)
    opt = optimizer([x], **hyperparameters)
    base_lrs = [group["lr"] for group in opt.param_groups]
    path = torch.empty(steps + 1, dtype=torch.float64)
    path[0] = start
    for t in range(1, steps + 1):
        if decay:
            for group, lr in zip(opt.param_groups, base_lrs):
                group["lr"] = lr / math.sqrt(t)
        x.grad = torch.tensor([C if t % period == 1 else -1.0], dtype=torch.float64)
        opt.step()
        with torch.no_grad():
            x.clamp_(-1.0, 1.0)  # the projection onto the feasible set [-1, 1]
        path[t] = x.detach()[0]
    return path


# ---------------------------------------------------------------------------------------
# plotting


def _axes(ax):
    if ax is None:
        import matplotlib.pyplot as plt

        _, ax = plt.subplots(figsize=(4.6, 3.6))
    return ax


def plot_problem(problem: Problem, ax=None, levels: int = 30):
    """Filled contours of ``f - f_min`` at log-spaced levels, the minimum marked with a star.

    Draws into ``ax`` (a new figure when None) and returns it, with the axes limited to
    ``problem.bounds``.
    """
    import matplotlib as mpl

    _check_problem(problem)
    levels = check_int("levels", levels, 2)
    ax = _axes(ax)
    (x0, x1), (y0, y1) = problem.bounds
    n = 160
    xs = torch.linspace(x0, x1, n, dtype=torch.float64)
    ys = torch.linspace(y0, y1, n, dtype=torch.float64)
    grid = torch.stack(torch.meshgrid(xs, ys, indexing="xy"), dim=-1)
    with torch.no_grad():
        z = (problem.f(grid) - problem.f_min).clamp_min(0).numpy()
    positive = z[z > 0]
    low = max(positive.min(), positive.max() * 1e-6) if positive.size else 1e-8
    high = max(z.max(), low * 10)
    bounds = np.geomspace(low, high, levels)
    z = np.clip(z, low, high)
    # light greys, darker uphill: the coloured paths drawn on top stay readable
    cmap = mpl.colors.LinearSegmentedColormap.from_list("lsdl_contours", ["#ffffff", "#c4c4c4"])
    norm = mpl.colors.LogNorm(vmin=low, vmax=high)
    ax.contourf(xs.numpy(), ys.numpy(), z, levels=bounds, cmap=cmap, norm=norm)
    ax.contour(
        xs.numpy(), ys.numpy(), z, levels=bounds, colors="#666666", linewidths=0.3, alpha=0.5
    )
    ax.plot(*problem.minimum, marker="*", color="black", markersize=11, linestyle="none")
    ax.set_xlim(x0, x1)
    ax.set_ylim(y0, y1)
    ax.set_xlabel("$w_1$")
    ax.set_ylabel("$w_2$")
    ax.set_title(problem.name)
    ax.grid(False)
    return ax


def _clip(path: np.ndarray, bounds) -> np.ndarray:
    """The path up to where it leaves a box ten windows wide, ending on that box's edge.

    Matplotlib clips lines to the axes itself, but cannot draw points at 1e300; cutting
    the leaving segment at the box (rather than clamping its end) keeps its direction.
    """
    (x0, x1), (y0, y1) = bounds
    wx, wy = x1 - x0, y1 - y0
    lo = np.array([x0 - 10 * wx, y0 - 10 * wy])
    hi = np.array([x1 + 10 * wx, y1 + 10 * wy])
    outside = np.flatnonzero(np.any((path < lo) | (path > hi), axis=1))
    if outside.size == 0:
        return path
    k = int(outside[0])
    if k == 0:
        return path[:1]
    a, b = path[k - 1], path[k]
    with np.errstate(divide="ignore", invalid="ignore"):
        s_hi = np.where(b > hi, (hi - a) / (b - a), 1.0)
        s_lo = np.where(b < lo, (lo - a) / (b - a), 1.0)
    s = float(np.nanmin(np.concatenate([s_hi, s_lo])))
    return np.vstack([path[:k], a + s * (b - a)])


def plot_trajectories(problem: Problem, trajectories: dict[str, Tensor], ax=None):
    """Draw each named path over the problem: a line with small dots at the points visited,
    a hollow circle at the start and a filled one at the end, and a legend.

    With ``ax=None`` a new figure is made and the problem's contours are drawn first; with
    an ``ax`` the paths are drawn onto it as it is (call :func:`plot_problem` on it first
    for the contours). Paths are clipped to the window; returns the axes.
    """
    from .. import plot

    _check_problem(problem)
    if not isinstance(trajectories, dict):
        raise TypeError(
            f"Invalid trajectories: a {type(trajectories).__name__} "
            "(expected a dict {name: (n, 2) tensor})"
        )
    if ax is None:
        ax = plot_problem(problem)
    for i, (name, path) in enumerate(trajectories.items()):
        points = torch.as_tensor(path).detach().double().cpu().numpy()
        if points.ndim != 2 or points.shape[1] != 2 or len(points) == 0:
            raise ValueError(
                f"Invalid trajectories[{name!r}]: shape {points.shape} (expected (n, 2), n >= 1)"
            )
        points = _clip(points, problem.bounds)
        color = plot.PALETTE[i % len(plot.PALETTE)]
        many = len(points) > 60
        ax.plot(
            points[:, 0],
            points[:, 1],
            color=color,
            linewidth=1.3,
            marker=None if many else "o",
            markersize=2.2,
            label=name,
        )
        ax.plot(*points[0], marker="o", markersize=6, markerfacecolor="white", color=color)
        ax.plot(*points[-1], marker="o", markersize=5, color=color)
    (x0, x1), (y0, y1) = problem.bounds
    ax.set_xlim(x0, x1)
    ax.set_ylim(y0, y1)
    if trajectories:
        ax.legend(loc="best", frameon=True, framealpha=0.85)
    return ax
