import math

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from torch.autograd.functional import hessian  # noqa: E402

from lsdl_lab import optim  # noqa: E402
from lsdl_lab.book import problems  # noqa: E402
from lsdl_lab.book.problems import PROBLEMS, Problem  # noqa: E402

ALL = [factory() for factory in PROBLEMS.values()] + [
    problems.quadratic(1000.0, rotation=0.7),
    problems.rosenbrock(a=-2.0, b=5.0),
    problems.badly_scaled(7.0),
]


def gradient(problem: Problem, point, device="cpu") -> torch.Tensor:
    w = torch.tensor(point, dtype=torch.float64, device=device, requires_grad=True)
    (g,) = torch.autograd.grad(problem.f(w), w)
    return g


@pytest.mark.parametrize("problem", ALL, ids=lambda p: p.name)
def test_minimum_is_a_stationary_point_and_the_lowest_on_a_grid(problem, device):
    # f is written with Python numbers only, so it runs on any device
    g = gradient(problem, problem.minimum, device)
    assert torch.allclose(g, torch.zeros(2, dtype=torch.float64, device=device))
    (x0, x1), (y0, y1) = problem.bounds
    grid = torch.stack(
        torch.meshgrid(
            torch.linspace(x0, x1, 101, dtype=torch.float64),
            torch.linspace(y0, y1, 101, dtype=torch.float64),
            indexing="xy",
        ),
        dim=-1,
    ).to(device)
    values = problem.f(grid)
    assert values.shape == (101, 101)
    assert values.min().item() >= problem.f_min - 1e-12
    assert x0 < problem.start[0] < x1 and y0 < problem.start[1] < y1
    assert x0 <= problem.minimum[0] <= x1 and y0 <= problem.minimum[1] <= y1


@settings(max_examples=25, deadline=None)
@given(st.floats(0.01, 1e4), st.floats(-math.pi, math.pi))
def test_quadratic_hessian_has_eigenvalues_one_and_condition(condition, rotation):
    problem = problems.quadratic(condition, rotation)
    H = hessian(problem.f, torch.tensor([0.3, -0.2], dtype=torch.float64))
    eig = torch.linalg.eigvalsh(H)
    expected = torch.tensor(sorted([1.0, condition]), dtype=torch.float64)
    assert torch.allclose(eig, expected, rtol=1e-9, atol=1e-9)


def test_badly_scaled_curvature_ratio_is_scale_squared():
    H = hessian(problems.badly_scaled(30.0).f, torch.zeros(2, dtype=torch.float64))
    assert torch.allclose(H, torch.diag(torch.tensor([1.0, 900.0], dtype=torch.float64)))


def test_saddle_has_a_saddle_at_the_origin():
    H = hessian(problems.saddle().f, torch.zeros(2, dtype=torch.float64))
    assert torch.allclose(H, torch.diag(torch.tensor([1.0, -2.0], dtype=torch.float64)))
    assert problems.saddle().f_min == pytest.approx(-1.0)


def test_trajectory_shape_dtype_and_start():
    problem = problems.rosenbrock()
    path = problems.trajectory(problem, optim.SGD, 25, lr=1e-3)
    assert path.shape == (26, 2) and path.dtype == torch.float64
    assert tuple(path[0].tolist()) == problem.start
    other = problems.trajectory(problem, optim.SGD, 3, start=(0.5, 0.5), lr=1e-3)
    assert tuple(other[0].tolist()) == (0.5, 0.5)


def test_gradient_descent_with_step_one_over_L_converges_at_the_predicted_rate():
    kappa = 20.0
    problem = problems.quadratic(kappa, rotation=0.3)
    path = problems.trajectory(problem, optim.SGD, 400, lr=1 / kappa)
    f = problem.f(path)
    assert f[-1] < 1e-8 * f[0]
    # with step 1/L the slowest eigendirection contracts by 1 - 1/kappa a step
    assert torch.linalg.vector_norm(path[-1]) <= (1 - 1 / kappa) ** 400 * 3.2 * (1 + 1e-9)


def test_divergence_returns_a_truncated_finite_path():
    problem = problems.quadratic(10.0)
    path = problems.trajectory(problem, optim.SGD, 5000, lr=0.5)  # above 2/L = 0.2
    assert 1 < len(path) < 5001
    assert torch.isfinite(path).all()
    assert torch.linalg.vector_norm(path[-1]) > 1e100  # it did run away before stopping


def test_trajectory_matches_between_the_books_optimizers_and_torch_optim():
    problem = problems.rosenbrock()
    for ours, theirs, kw in [
        (optim.SGD, torch.optim.SGD, dict(lr=1e-3, momentum=0.9, nesterov=True)),
        (optim.Adam, torch.optim.Adam, dict(lr=0.05, amsgrad=True)),
    ]:
        a = problems.trajectory(problem, ours, 50, **kw)
        b = problems.trajectory(problem, theirs, 50, **kw)
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-12)


def test_trajectory_works_with_a_closure_optimizer_and_a_factory():
    problem = problems.quadratic(5.0)
    path = problems.trajectory(problem, torch.optim.LBFGS, 5, lr=1.0)
    assert problem.f(path[-1]) < 1e-8 * problem.f(path[0])
    path = problems.trajectory(problem, lambda params: optim.SGD(params, lr=0.1), 10)
    assert path.shape == (11, 2)


def test_reddi_counterexample_adam_goes_to_the_wrong_end_amsgrad_does_not():
    C = 3.0
    kw = dict(C=C, decay=True, lr=0.3, betas=(0.0, 1 / (1 + C**2)))  # Theorem 1's setting
    adam = problems.reddi_counterexample(optim.Adam, 600, **kw)
    ams = problems.reddi_counterexample(optim.Adam, 600, amsgrad=True, **kw)
    assert adam.shape == (601,) and adam.dtype == torch.float64
    assert adam[-3:].mean() > 0.9 and ams[-3:].mean() < -0.9  # averaged over one period
    assert (adam.abs() <= 1).all() and (ams.abs() <= 1).all()


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: problems.quadratic(0.0), "condition"),
        (lambda: problems.quadratic(-1.0), "condition"),
        (lambda: problems.quadratic(float("nan")), "condition"),
        (lambda: problems.quadratic(10.0, rotation=float("inf")), "rotation"),
        (lambda: problems.rosenbrock(b=0.0), "b"),
        (lambda: problems.badly_scaled(0.0), "scale"),
        (lambda: problems.trajectory(problems.saddle(), optim.SGD, 0, lr=0.1), "steps"),
        (lambda: problems.trajectory(problems.saddle(), optim.SGD, 2, start=(1,), lr=0.1), "start"),
        (
            lambda: problems.trajectory(problems.saddle(), optim.SGD, 2, start=(1, 2, 3), lr=0.1),
            "start",
        ),
        (
            lambda: problems.trajectory(problems.saddle(), optim.SGD, 2, start=(0, math.inf)),
            r"start\[1\]",
        ),
        (lambda: problems.reddi_counterexample(optim.Adam, 10, period=1), "period"),
        (lambda: problems.reddi_counterexample(optim.Adam, 10, start=2.0), "start"),
        (lambda: problems.reddi_counterexample(optim.Adam, 0), "steps"),
        (lambda: problems.plot_problem(problems.saddle(), levels=1), "levels"),
        (
            lambda: problems.plot_trajectories(problems.saddle(), {"x": torch.zeros(3)}),
            r"trajectories\['x'\]",
        ),
    ],
)
def test_bad_values_raise_value_errors_naming_the_argument(call, match):
    with pytest.raises(ValueError, match="Invalid " + match):
        call()


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: problems.quadratic("10"), "condition"),
        (lambda: problems.rosenbrock(a=None), "a"),
        (lambda: problems.trajectory("rosenbrock", optim.SGD, 3, lr=0.1), "problem"),
        (lambda: problems.trajectory(problems.saddle(), "SGD", 3), "optimizer"),
        (lambda: problems.trajectory(problems.saddle(), optim.SGD, 1.5, lr=0.1), "steps"),
        (lambda: problems.trajectory(problems.saddle(), optim.SGD, 2, start=1.0), "start"),
        (lambda: problems.trajectory(problems.saddle(), optim.SGD, 2, start=("0", 1)), "start"),
        (lambda: problems.reddi_counterexample(optim.Adam, 10, period=3.0), "period"),
        (lambda: problems.reddi_counterexample(optim.Adam, 10, decay=1), "decay"),
        (lambda: problems.plot_problem(problems.saddle(), levels=10.0), "levels"),
        (lambda: problems.plot_problem("saddle"), "problem"),
        (
            lambda: problems.plot_trajectories(problems.saddle(), [torch.zeros(3, 2)]),
            "trajectories",
        ),
    ],
)
def test_bad_types_raise_type_errors_naming_the_argument(call, match):
    with pytest.raises(TypeError, match="Invalid " + match):
        call()


def test_a_start_may_be_any_pair_of_numbers():
    problem = problems.saddle()
    for start in ((1, -1), [1.0, -1.0], torch.tensor([1.0, -1.0]), np.array([1.0, -1.0])):
        path = problems.trajectory(problem, optim.SGD, 1, start=start, lr=0.1)
        assert path[0].tolist() == [1.0, -1.0]


def test_plots_return_axes_with_paths_clipped_to_the_window():
    problem = problems.quadratic(10.0)
    ax = problems.plot_problem(problem)
    assert ax.get_xlim() == problem.bounds[0] and ax.get_ylim() == problem.bounds[1]
    paths = {
        "GD": problems.trajectory(problem, optim.SGD, 30, lr=0.1),
        "diverging": problems.trajectory(problem, optim.SGD, 3000, lr=0.5),
    }
    ax = problems.plot_trajectories(problem, paths, ax=ax)
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["GD", "diverging"]
    for line in ax.lines:
        x, y = line.get_data()
        assert max(abs(float(v)) for v in x) < 1e3 and max(abs(float(v)) for v in y) < 1e3
    ax = problems.plot_trajectories(problems.saddle(), {"x": paths["GD"]})  # makes its figure
    assert ax.get_title() == "saddle"
    plt.close("all")
