import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from lsdl_lab import plot  # noqa: E402
from lsdl_lab.train import History  # noqa: E402


@settings(max_examples=30, deadline=None)
@given(st.floats(-3, 3), st.floats(-5, 5))
def test_loglog_fit_recovers_power_laws(a, b):
    x = np.array([1, 2, 4, 8, 16, 32.0])
    slope, intercept = plot.loglog_fit(x, np.exp(b) * x**a)
    assert slope == pytest.approx(a, abs=1e-9) and intercept == pytest.approx(b, abs=1e-9)


@pytest.mark.parametrize(
    "x,y,match",
    [
        ([1], [1], r"Invalid x: shape \(1,\) \(expected at least two"),
        ([1, 2], [1, 2, 3], r"Invalid y: shape \(3,\) \(expected the shape of x"),
        ([1, 2], [0, 1], r"Invalid y: \[0.0, 1.0\] \(expected positive, finite"),
        ([-1, 2], [1, 1], r"Invalid x: \[-1.0, 2.0\] \(expected positive, finite"),
        ([1, np.inf], [1, 1], "Invalid x:"),
    ],
)
def test_loglog_fit_rejects_bad_points_naming_the_argument(x, y, match):
    with pytest.raises(ValueError, match=match):
        plot.loglog_fit(x, y)


def test_style_and_history_plot():
    plot.use_style()
    assert matplotlib.rcParams["axes.spines.top"] is False
    h = History(
        train=[{"step": s, "time": s / 10, "loss": 1 / s} for s in range(1, 6)],
        eval=[{"step": 5, "time": 0.5, "eval_accuracy": 0.9}],
    )
    axes = plot.plot_histories({"a": h, "b": h}, metrics=("loss", "eval_accuracy"), x="time")
    assert axes[0].get_xlabel() == "wall-clock time (s)"
    assert axes[0].get_yscale() == "log" and len(axes[0].lines) == 2
    assert axes[1].get_ylabel() == "evaluation accuracy"
    plt.close("all")
