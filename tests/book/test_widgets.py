"""Tests of lsdl_lab.book.widgets: the drawing function for every optimizer on every problem,
the mapping of sliders onto optimizer arguments, and the explorer redrawing on change."""

from __future__ import annotations

import base64
from functools import partial

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402
import torch  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from lsdl_lab import optim  # noqa: E402
from lsdl_lab.book import problems, widgets  # noqa: E402

PROBLEMS = widgets.default_problems()
OPTIMIZERS = widgets.default_optimizers()


def new_axes():
    return Figure().subplots()


@pytest.mark.parametrize("problem_name", list(PROBLEMS))
@pytest.mark.parametrize("optimizer_name", list(OPTIMIZERS))
def test_draw_every_optimizer_on_every_problem(problem_name, optimizer_name):
    optimizer = OPTIMIZERS[optimizer_name]
    lr = widgets.suggested_lr(problem_name, optimizer)
    ax = new_axes()
    path = widgets.draw(problem_name, optimizer_name, lr, 0.9, 0.9, 0.999, 60, ax)
    assert path.shape == (61, 2), "the suggested learning rate must not diverge"
    assert torch.isfinite(path).all()
    start = torch.tensor(PROBLEMS[problem_name].start, dtype=path.dtype)
    assert torch.equal(path[0], start)
    assert not torch.equal(path[-1], path[0]), "the optimizer did not move"
    assert len(ax.lines) >= 3  # the minimum's star, the path, its start and end markers
    assert PROBLEMS[problem_name].name in ax.get_title()
    assert "after 60 steps" in ax.get_title()


def test_suggested_learning_rates_make_progress():
    # Not a benchmark: each suggestion must at least reduce f tenfold in 200 steps, except
    # SGD's on the badly scaled bowl: no step size can (that is the bowl's lesson), so
    # there it must only not diverge.
    for problem_name, problem in PROBLEMS.items():
        f0 = float(problem.f(torch.tensor(problem.start, dtype=torch.float64))) - problem.f_min
        for optimizer_name, optimizer in OPTIMIZERS.items():
            lr = widgets.suggested_lr(problem_name, optimizer)
            kwargs = widgets.optimizer_arguments(optimizer, lr, 0.9, 0.9, 0.999)
            path = problems.trajectory(problem, optimizer, 200, **kwargs)
            gap = float(problem.f(path[-1])) - problem.f_min
            hopeless = problem_name == "badly_scaled" and optimizer_name.startswith("SGD")
            target = f0 if hopeless else f0 / 10
            assert len(path) == 201 and gap < target, (problem_name, optimizer_name, gap, f0)


def test_draw_reports_divergence():
    ax = new_axes()
    path = widgets.draw("badly_scaled", "SGD", 0.1, 0.0, 0.9, 0.999, 300, ax)
    assert len(path) < 301 and torch.isfinite(path).all()
    assert "diverged at step" in ax.get_title()


@pytest.mark.parametrize(
    ("optimizer", "expected"),
    [
        (optim.SGD, {"lr": 0.1, "momentum": 0.8}),
        (partial(optim.SGD, nesterov=True), {"lr": 0.1, "momentum": 0.8}),
        (optim.RMSprop, {"lr": 0.1, "momentum": 0.8, "alpha": 0.99}),
        (optim.Adadelta, {"lr": 0.1, "rho": 0.99}),
        (optim.Adagrad, {"lr": 0.1}),
        (optim.Adam, {"lr": 0.1, "betas": (0.7, 0.99)}),
        (partial(optim.Adam, amsgrad=True), {"lr": 0.1, "betas": (0.7, 0.99)}),
        (optim.AdamW, {"lr": 0.1, "betas": (0.7, 0.99)}),
        (optim.Adamax, {"lr": 0.1, "betas": (0.7, 0.99)}),
        (optim.NAdam, {"lr": 0.1, "betas": (0.7, 0.99)}),
        (torch.optim.SGD, {"lr": 0.1, "momentum": 0.8}),
    ],
)
def test_sliders_map_onto_each_optimizers_arguments(optimizer, expected):
    assert widgets.optimizer_arguments(optimizer, 0.1, 0.8, 0.7, 0.99) == expected
    optimizer([torch.zeros(2, requires_grad=True)], **expected)  # all accepted


def test_slider_values_reach_the_optimizer():
    # The momentum slider changes SGD's path, and the betas change Adam's; momentum
    # leaves Adam's path alone, the betas leave SGD's.
    def path(name, momentum, beta1):
        return widgets.draw("quadratic", name, 0.01, momentum, beta1, 0.999, 30, new_axes())

    assert not torch.equal(path("SGD", 0.0, 0.9), path("SGD", 0.9, 0.9))
    assert torch.equal(path("SGD", 0.5, 0.9), path("SGD", 0.5, 0.1))
    assert not torch.equal(path("Adam", 0.5, 0.9), path("Adam", 0.5, 0.5))
    assert torch.equal(path("Adam", 0.0, 0.9), path("Adam", 0.9, 0.9))


def test_draw_same_as_trajectory():
    expected = problems.trajectory(
        PROBLEMS["rosenbrock"], optim.Adam, 40, lr=0.05, betas=(0.8, 0.99)
    )
    got = widgets.draw("rosenbrock", "Adam", 0.05, 0.9, 0.8, 0.99, 40, new_axes())
    assert torch.equal(got, expected)


def test_draw_bad_names_and_steps():
    with pytest.raises(ValueError, match="Invalid problem_name: 'nope' .*'quadratic'"):
        widgets.draw("nope", "SGD", 0.1, 0.0, 0.9, 0.999, 10, new_axes())
    with pytest.raises(ValueError, match="Invalid optimizer_name: 'nope' .*'Adam'"):
        widgets.draw("quadratic", "nope", 0.1, 0.0, 0.9, 0.999, 10, new_axes())
    with pytest.raises(ValueError, match="Invalid steps: 0"):
        widgets.draw("quadratic", "SGD", 0.1, 0.0, 0.9, 0.999, 0, new_axes())
    with pytest.raises(TypeError, match="Invalid steps: 10.5"):
        widgets.draw("quadratic", "SGD", 0.1, 0.0, 0.9, 0.999, 10.5, new_axes())


def test_draw_with_own_problems_and_optimizers():
    own = {"flat bowl": problems.quadratic(condition=2)}
    path = widgets.draw(
        "flat bowl", "GD", 0.1, 0.0, 0.9, 0.999, 20, new_axes(),
        problems=own, optimizers={"GD": torch.optim.SGD},
    )  # fmt: skip
    assert path.shape == (21, 2)


# --- the explorer ------------------------------------------------------------------------


def picture(box) -> bytes:
    (output,) = box.output.outputs
    return base64.b64decode(output["data"]["image/png"])


def controls(box) -> dict:
    """The explorer's controls by their label, found in the widget tree."""
    found, todo = {}, [box]
    while todo:
        widget = todo.pop()
        todo += getattr(widget, "children", ())
        if getattr(widget, "description", ""):
            found[widget.description] = widget
    return found


def test_explorer_builds_and_redraws_on_change():
    pytest.importorskip("ipywidgets")
    box = widgets.optimizer_explorer()
    c = controls(box)
    assert set(c) >= {"problem", "optimizer", "learning rate", "momentum", "β₁", "steps"}
    assert set(box.controls) == {
        "problem_name", "optimizer_name", "lr", "momentum", "beta1", "beta2", "steps"
    }  # fmt: skip
    assert box.output in box.children
    assert box.redraws == 1
    first = picture(box)
    assert first.startswith(b"\x89PNG")

    c["steps"].value = 50
    assert box.redraws == 2 and picture(box) != first
    c["momentum"].value = 0.0
    assert box.redraws == 3
    second = picture(box)
    c["learning rate"].value = 1e-3
    assert box.redraws == 4 and picture(box) != second


def test_explorer_resets_the_learning_rate_once_per_choice():
    pytest.importorskip("ipywidgets")
    box = widgets.optimizer_explorer()
    c = controls(box)
    c["optimizer"].value = "Adam"
    assert box.redraws == 2  # one picture, though both the optimizer and lr changed
    assert c["learning rate"].value == pytest.approx(
        widgets.suggested_lr(c["problem"].value, optim.Adam), rel=0.07
    )
    c["problem"].value = "badly_scaled"
    assert box.redraws == 3
    assert c["learning rate"].value == pytest.approx(
        widgets.suggested_lr("badly_scaled", optim.Adam), rel=0.07
    )


def test_explorer_shows_an_error_instead_of_raising():
    pytest.importorskip("ipywidgets")
    box = widgets.optimizer_explorer()
    c = controls(box)
    c["optimizer"].value = "SGD (Nesterov)"
    c["momentum"].value = 0.0  # Nesterov needs momentum: SGD raises ValueError
    assert box.redraws == 3 and picture(box).startswith(b"\x89PNG")


def test_explorer_with_own_choices():
    pytest.importorskip("ipywidgets")
    box = widgets.optimizer_explorer(
        problems={"bowl": problems.quadratic(condition=3)}, optimizers={"GD": optim.SGD}
    )
    assert controls(box)["problem"].options == ("bowl",)
    assert box.redraws == 1
    with pytest.raises(ValueError, match="Invalid problems: empty"):
        widgets.optimizer_explorer(problems={})
    with pytest.raises(ValueError, match="Invalid optimizers: empty"):
        widgets.optimizer_explorer(optimizers={})


def test_explorer_display_carries_the_last_picture_for_static_pages():
    pytest.importorskip("ipywidgets")
    box = widgets.optimizer_explorer()
    data = box._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in data  # interactive in Jupyter
    assert base64.b64decode(data["image/png"]) == picture(box)
    controls(box)["steps"].value = 50
    assert base64.b64decode(box._repr_mimebundle_()["image/png"]) == picture(box)
