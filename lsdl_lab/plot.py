"""One figure style for the whole book, and the plots every lab needs.

``use_style()`` is called once by a page or lab (``lsdl_lab.setup`` does not touch
matplotlib, so a test without a display never imports it needlessly). The palette is
colour-blind safe (Okabe and Ito, 2008), so curves stay distinguishable in print.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import matplotlib as mpl
import matplotlib.pyplot as plt
import numpy as np

__all__ = ["PALETTE", "loglog_fit", "plot_histories", "plot_history", "use_style"]

# Okabe & Ito's colour-blind-safe palette, black last.
PALETTE = ["#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9", "#F0E442", "#000000"]

_LABELS = {
    "loss": "training loss",
    "eval_loss": "evaluation loss",
    "accuracy": "training accuracy",
    "eval_accuracy": "evaluation accuracy",
    "eval_perplexity": "evaluation perplexity",
    "lr": "learning rate",
    "grad_norm": "gradient norm ‖g‖₂",
    "examples_per_s": "examples per second",
    "step": "step",
    "time": "wall-clock time (s)",
    "epoch": "epoch",
}


def use_style() -> None:
    """Apply the book's style to matplotlib (idempotent)."""
    mpl.rcParams.update(
        {
            "figure.figsize": (6.4, 3.6),
            "figure.dpi": 110,
            "savefig.dpi": 150,
            "savefig.bbox": "tight",
            "axes.prop_cycle": mpl.cycler(color=PALETTE),
            "axes.grid": True,
            "grid.alpha": 0.3,
            "grid.linewidth": 0.6,
            "axes.spines.top": False,
            "axes.spines.right": False,
            "axes.titlesize": 11,
            "axes.labelsize": 10,
            "legend.fontsize": 9,
            "legend.frameon": False,
            "xtick.labelsize": 9,
            "ytick.labelsize": 9,
            "lines.linewidth": 1.8,
            "font.family": "DejaVu Sans",
        }
    )


def label(name: str) -> str:
    """The axis label the book uses for a metric name."""
    return _LABELS.get(name, name.replace("_", " "))


def plot_history(
    history,
    metrics: Sequence[str] = ("loss", "eval_accuracy"),
    x: str = "step",
    axes=None,
    name: str | None = None,
    **line_kwargs,
):
    """One panel per metric of a :class:`lsdl_lab.train.History`, against step or time.

    Returns the axes so several runs can be drawn into the same panels.
    """
    if axes is None:
        _, axes = plt.subplots(1, len(metrics), figsize=(3.4 * len(metrics), 3.0), squeeze=False)
        axes = axes[0]
    for ax, metric in zip(axes, metrics, strict=True):
        xs, ys = history.series(metric, x=x)
        ax.plot(xs, ys, label=name, **line_kwargs)
        ax.set_xlabel(label(x))
        ax.set_ylabel(label(metric))
        if metric in ("loss", "eval_loss", "eval_perplexity") and len(ys) and min(ys) > 0:
            ax.set_yscale("log")
    if name is not None:
        axes[0].legend()
    return axes


def plot_histories(
    histories: dict, metrics: Sequence[str] = ("loss", "eval_accuracy"), x: str = "step"
):
    """Several named runs in the same panels, one colour per run."""
    axes = None
    for name, history in histories.items():
        axes = plot_history(history, metrics, x=x, axes=axes, name=name)
    return axes


def loglog_fit(x: Iterable[float], y: Iterable[float]) -> tuple[float, float]:
    """Least-squares line through (log x, log y): returns (slope, intercept) so y ≈ e^b x^a."""
    x, y = np.asarray(list(x), float), np.asarray(list(y), float)
    if x.ndim != 1 or x.size < 2:
        raise ValueError(f"Invalid x: shape {x.shape} (expected at least two numbers in a row)")
    if y.shape != x.shape:
        raise ValueError(f"Invalid y: shape {y.shape} (expected the shape of x, {x.shape})")
    for name, values in (("x", x), ("y", y)):
        if not np.all(np.isfinite(values) & (values > 0)):
            raise ValueError(
                f"Invalid {name}: {values.tolist()} (expected positive, finite numbers)"
            )
    slope, intercept = np.polyfit(np.log(x), np.log(y), 1)
    return float(slope), float(intercept)
