"""Interactive explorers for the labs (ipywidgets), each built on a plain drawing function.

:func:`optimizer_explorer` lets a reader pick a 2-D problem (:mod:`lsdl_lab.book.problems`) and
an optimizer (:mod:`lsdl_lab.optim`), move sliders for the learning rate, the momentum and
the two decay rates, and watch the path the optimizer takes on the contour plot::

    from lsdl_lab.book import widgets
    widgets.optimizer_explorer()

The picture itself is drawn by :func:`draw`, an ordinary function of the slider values and
a matplotlib ``Axes``, so it can be tested, and used in a static figure, without a browser.
The explorer renders each picture to a PNG and puts it in an ``Output`` widget, so the
last picture is kept in the notebook's widget state; the explorer's display data also carry
that PNG beside the widget view, so a static page without the widget JavaScript shows it.

ipywidgets is an optional dependency (``pip install lsdl_lab[widgets]``; Colab has it);
only :func:`optimizer_explorer` needs it.
"""

from __future__ import annotations

import base64
import inspect
import io
import math
from collections.abc import Callable
from functools import partial

import torch

from .. import optim
from .._util import check_choice, check_int
from . import problems as _problems

__all__ = [
    "default_optimizers",
    "default_problems",
    "draw",
    "optimizer_arguments",
    "optimizer_explorer",
    "suggested_lr",
]


def default_problems() -> dict[str, _problems.Problem]:
    """The problems the explorer offers: an ill-conditioned rotated quadratic,
    Rosenbrock's valley, the badly scaled bowl and the saddle."""
    return {
        "quadratic": _problems.quadratic(condition=25, rotation=math.pi / 6),
        "rosenbrock": _problems.rosenbrock(),
        "badly_scaled": _problems.badly_scaled(),
        "saddle": _problems.saddle(),
    }


def default_optimizers() -> dict[str, Callable]:
    """The optimizers the explorer offers, by name: classes of :mod:`lsdl_lab.optim`, or
    partial applications of them for a variant (Nesterov, AMSGrad)."""
    return {
        "SGD": optim.SGD,
        "SGD (Nesterov)": partial(optim.SGD, nesterov=True),
        "Adagrad": optim.Adagrad,
        "RMSprop": optim.RMSprop,
        "Adadelta": optim.Adadelta,
        "Adam": optim.Adam,
        "AMSGrad": partial(optim.Adam, amsgrad=True),
        "AdamW": optim.AdamW,
        "Adamax": optim.Adamax,
        "NAdam": optim.NAdam,
    }


# A step size that shows each kind of optimizer at work on each problem in about 200 steps
# with the sliders' other defaults (chosen from a sweep of 29 step sizes). Gradient descent
# is limited by the largest curvature (below 2/L), the adaptive methods by the distance to
# travel, since their steps are about lr long whatever the gradient.
_SUGGESTED_LR = {
    "sgd": {"quadratic": 0.02, "rosenbrock": 1e-3, "badly_scaled": 1e-4, "saddle": 0.1},
    "adagrad": {"quadratic": 1.0, "rosenbrock": 1.0, "badly_scaled": 0.5, "saddle": 0.5},
    "rmsprop": {"quadratic": 0.01, "rosenbrock": 0.01, "badly_scaled": 0.005, "saddle": 0.01},
    "adadelta": {"quadratic": 30.0, "rosenbrock": 20.0, "badly_scaled": 0.5, "saddle": 3.0},
    "adam": {"quadratic": 0.1, "rosenbrock": 0.2, "badly_scaled": 0.05, "saddle": 0.05},
    "adamax": {"quadratic": 1.0, "rosenbrock": 1.0, "badly_scaled": 0.1, "saddle": 0.3},
    # NAdam's look-ahead makes it erratic on the badly scaled bowl above lr = 0.02.
    "nadam": {"quadratic": 0.1, "rosenbrock": 0.2, "badly_scaled": 0.02, "saddle": 0.05},
}


def _kind(optimizer: Callable) -> str:
    cls = optimizer.func if isinstance(optimizer, partial) else optimizer
    return {
        "SGD": "sgd",
        "Adagrad": "adagrad",
        "RMSprop": "rmsprop",
        "Adadelta": "adadelta",
        "Adamax": "adamax",
        "NAdam": "nadam",
    }.get(getattr(cls, "__name__", ""), "adam")


def suggested_lr(problem_name: str, optimizer: Callable) -> float:
    """A learning rate that shows ``optimizer`` at work on the problem named ``problem_name``
    in a few hundred steps (0.01 for a problem the table does not know)."""
    return _SUGGESTED_LR[_kind(optimizer)].get(problem_name, 0.01)


def optimizer_arguments(
    optimizer: Callable, lr: float, momentum: float, beta1: float, beta2: float
) -> dict:
    """The keyword arguments the sliders mean for ``optimizer``, read off its signature.

    ``momentum`` goes to the optimizers that take a ``momentum`` (SGD, RMSprop); ``beta1``
    and ``beta2`` to those that take ``betas`` (the Adam family). ``beta2`` is also the
    decay rate of the squared-gradient average where an optimizer names it otherwise
    (RMSprop's ``alpha``, Adadelta's ``rho``). A slider an optimizer has no use for is
    ignored (Adagrad takes only the learning rate).
    """
    parameters = inspect.signature(optimizer).parameters
    kwargs = {"lr": lr}
    if "momentum" in parameters:
        kwargs["momentum"] = momentum
    if "betas" in parameters:
        kwargs["betas"] = (beta1, beta2)
    for name in ("alpha", "rho"):  # RMSprop's and Adadelta's name for beta2
        if name in parameters:
            kwargs[name] = beta2
    return kwargs


def draw(
    problem_name: str,
    optimizer_name: str,
    lr: float,
    momentum: float,
    beta1: float,
    beta2: float,
    steps: int,
    ax,
    problems: dict | None = None,
    optimizers: dict | None = None,
) -> torch.Tensor:
    """Run the optimizer on the problem and draw its path on the contour plot in ``ax``.

    The slider values are mapped onto the optimizer's own arguments by
    :func:`optimizer_arguments`. Returns the path, a ``(n, 2)`` float64 tensor: the start
    and the point after each step, cut short where the iterates overflowed
    (:func:`lsdl_lab.book.problems.trajectory`). The title reports the final gap
    :math:`f(w_T) - f^\\star` or the step at which the run diverged.
    """
    problems = default_problems() if problems is None else problems
    optimizers = default_optimizers() if optimizers is None else optimizers
    check_choice("problem_name", problem_name, list(problems))
    check_choice("optimizer_name", optimizer_name, list(optimizers))
    steps = check_int("steps", steps, 1)
    problem, optimizer = problems[problem_name], optimizers[optimizer_name]
    kwargs = optimizer_arguments(optimizer, lr, momentum, beta1, beta2)
    path = _problems.trajectory(problem, optimizer, steps, **kwargs)

    _problems.plot_problem(problem, ax)
    shown = ", ".join(
        f"{k}={v[0]:g}/{v[1]:g}" if k == "betas" else f"{k}={v:.3g}" for k, v in kwargs.items()
    )
    _problems.plot_trajectories(problem, {f"{optimizer_name} ({shown})": path}, ax)
    if len(path) < steps + 1:
        outcome = f"diverged at step {len(path)}"
    else:
        gap = float(problem.f(path[-1])) - problem.f_min
        outcome = f"after {steps} steps: f − f* = {gap:.3g}"
    ax.set_title(f"{problem.name}\n{outcome}", fontsize=10)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), frameon=False, fontsize=8)
    return path


def _png(fig) -> str:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100, bbox_inches="tight")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def optimizer_explorer(problems: dict | None = None, optimizers: dict | None = None):
    """An explorer of optimizer paths on 2-D problems: returns an ipywidgets ``HBox``.

    Dropdowns choose the problem (from ``problems``, name to
    :class:`~lsdl_lab.book.problems.Problem`; default :func:`default_problems`) and the
    optimizer (from ``optimizers``, name to an optimizer class; default
    :func:`default_optimizers`); sliders set the learning rate (log scale), momentum,
    :math:`\\beta_1`, :math:`\\beta_2` and the number of steps. Choosing another problem or
    optimizer resets the learning rate to :func:`suggested_lr`. Each change redraws the
    picture. The box holds the controls on the left and the picture on the right;
    ``box.controls`` maps the names of :func:`draw`'s arguments to their widgets,
    ``box.output`` is the ``Output`` widget that shows the latest picture and
    ``box.redraws`` counts the pictures drawn.
    """
    import ipywidgets as widgets
    from matplotlib.figure import Figure

    problems_ = default_problems() if problems is None else dict(problems)
    optimizers = default_optimizers() if optimizers is None else dict(optimizers)
    for name, choices in (("problems", problems_), ("optimizers", optimizers)):
        if not choices:
            raise ValueError(f"Invalid {name}: empty (expected at least one)")

    style = {"description_width": "110px"}
    layout = widgets.Layout(width="420px")
    first_problem, first_optimizer = next(iter(problems_)), next(iter(optimizers))
    controls = {
        "problem_name": widgets.Dropdown(
            options=list(problems_), value=first_problem, description="problem", style=style
        ),
        "optimizer_name": widgets.Dropdown(
            options=list(optimizers), value=first_optimizer, description="optimizer", style=style
        ),
        "lr": widgets.FloatLogSlider(
            value=suggested_lr(first_problem, optimizers[first_optimizer]),
            base=10,
            min=-5,
            max=2,
            step=0.05,
            readout_format=".2e",
            description="learning rate",
            continuous_update=False,
            style=style,
            layout=layout,
        ),
        "momentum": widgets.FloatSlider(
            value=0.9, min=0.0, max=0.99, step=0.01, description="momentum",
            continuous_update=False, style=style, layout=layout,
        ),
        "beta1": widgets.FloatSlider(
            value=0.9, min=0.0, max=0.99, step=0.01, description="β₁",
            continuous_update=False, style=style, layout=layout,
        ),
        "beta2": widgets.FloatSlider(
            value=0.999, min=0.5, max=0.9999, step=0.0001, readout_format=".4f",
            description="β₂ (α, ρ)", continuous_update=False, style=style, layout=layout,
        ),
        "steps": widgets.IntSlider(
            value=200, min=10, max=1000, step=10, description="steps",
            continuous_update=False, style=style, layout=layout,
        ),
    }  # fmt: skip
    output = widgets.Output()
    box = widgets.HBox(  # the picture wraps below the controls on a narrow page
        [widgets.VBox(list(controls.values())), output], layout=widgets.Layout(flex_flow="row wrap")
    )
    box.controls, box.output, box.redraws = controls, output, 0
    resetting = False

    def redraw(_=None):
        if resetting:
            return
        values = {name: control.value for name, control in controls.items()}
        fig = Figure(figsize=(5.4, 4.6))
        ax = fig.subplots()
        try:
            draw(**values, ax=ax, problems=problems_, optimizers=optimizers)
        except ValueError as error:  # e.g. Nesterov without momentum: say so in the picture
            ax.clear()
            ax.text(0.5, 0.5, str(error), ha="center", va="center", wrap=True)
            ax.set_axis_off()
        output.outputs = (
            {
                "output_type": "display_data",
                "data": {"image/png": _png(fig), "text/plain": "<optimizer path>"},
                "metadata": {},
            },
        )
        box.redraws += 1

    def reset_lr(_=None):
        nonlocal resetting
        problem_name = controls["problem_name"].value
        optimizer = optimizers[controls["optimizer_name"].value]
        resetting = True  # one picture for the whole change, not one per control
        try:
            controls["lr"].value = suggested_lr(problem_name, optimizer)
        finally:
            resetting = False
        redraw()

    for name, control in controls.items():
        if name in ("problem_name", "optimizer_name"):
            control.observe(reset_lr, names="value")
        else:
            control.observe(redraw, names="value")
    redraw()

    widget_bundle = box._repr_mimebundle_

    def bundle(**kwargs):
        # The widget view needs a kernel or the widget JavaScript; a page without them (the
        # book's HTML, served with no network) renders the last picture from this PNG.
        data = widget_bundle(**kwargs)
        if data is not None and output.outputs:
            data = {**data, "image/png": output.outputs[0]["data"]["image/png"]}
        return data

    box._repr_mimebundle_ = bundle
    return box
