"""The labs' exercise checkers: a reference solution and test cases for each exercise.

A lab calls ``check.checker("lab01.top_k_accuracy")(top_k_accuracy)``; the checker runs
the student's function beside the reference below on every case and explains any
difference (:func:`lsdl_lab.check.check_function`). Cases are built from fixed seeds, so
every student sees the same ones.
"""

from __future__ import annotations

import torch
from torch import nn

from .check import check_function, exercise

# ---------------------------------------------------------------------------------------
# Lab 1, getting started


def top_k_accuracy(logits: torch.Tensor, labels: torch.Tensor, k: int = 1) -> float:
    """Fraction of rows whose label is among the k largest logits."""
    top = logits.topk(k, dim=1).indices
    return (top == labels[:, None]).any(dim=1).float().mean().item()


def _logit_cases():
    gen = torch.Generator().manual_seed(1)
    cases = []
    for n, classes, k in [(8, 10, 1), (50, 10, 3), (7, 4, 2), (32, 100, 5), (5, 3, 3)]:
        logits = torch.randn(n, classes, generator=gen)
        labels = torch.randint(classes, (n,), generator=gen)
        cases.append({"logits": logits, "labels": labels, "k": k})
    return cases


@exercise("lab01.top_k_accuracy")
def check_top_k_accuracy(student_fn) -> None:
    check_function(student_fn, top_k_accuracy, _logit_cases())


def training_state_bytes(model: nn.Module, states_per_parameter: int) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state (``states_per_parameter``
    tensors the size of each parameter, e.g. 1 for momentum SGD, 2 for Adam)."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return {
        "parameters": params,
        "gradients": params,
        "optimizer_state": states_per_parameter * params,
    }


@exercise("lab01.training_state_bytes")
def check_training_state_bytes(student_fn) -> None:
    torch.manual_seed(0)
    cases = [
        (nn.Linear(10, 3), 1),
        (nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)), 2),
        (nn.Conv2d(3, 16, 3).double(), 2),
        (nn.Linear(5, 5).half(), 0),
    ]
    check_function(student_fn, training_state_bytes, cases)


# ---------------------------------------------------------------------------------------
# Lab 2, gradient noise


def trace_covariance(per_example_grads: torch.Tensor) -> float:
    r"""tr Σ of the rows of an (N, P) matrix of per-example gradients:
    :math:`\frac1N \sum_i \|G_i - \bar G\|^2`, the data set's own covariance (divided by N)."""
    G = per_example_grads
    return (G - G.mean(dim=0)).square().sum(dim=1).mean().item()


def _gradient_matrices():
    gen = torch.Generator().manual_seed(2)
    cases = []
    # (N, P, spread, offset): a gradient-like matrix has rows spread widely around a small
    # mean; one row (nothing to spread), identical rows, and a float64 case are edge cases.
    for n, p, spread, offset in [(16, 10, 1.0, 0.1), (100, 7, 0.3, 0.5), (7, 300, 2.0, 0.0),
                                 (2, 3, 1.0, 1.0), (1, 5, 1.0, 0.2), (64, 33, 1e-3, 0.0)]:
        mean = offset * torch.randn(p, generator=gen)
        cases.append((mean + spread * torch.randn(n, p, generator=gen),))
    cases.append((torch.ones(5, 4) * torch.arange(4.0),))  # every row the same: tr Σ = 0
    cases.append((torch.randn(40, 6, generator=gen, dtype=torch.float64),))
    return cases


@exercise("lab02.trace_covariance")
def check_trace_covariance(student_fn) -> None:
    check_function(student_fn, trace_covariance, _gradient_matrices(), rtol=1e-4, atol=1e-7)


def predicted_variance(trace_cov: float, batch_size: int, n: int,
                       replacement: bool = True) -> float:
    """E||g_B - g||² for batches of ``batch_size`` of ``n`` (>= 2) examples: tr Σ / B, times
    the finite-population correction (n - B) / (n - 1) when drawn without replacement."""
    variance = trace_cov / batch_size
    if not replacement:
        variance *= (n - batch_size) / (n - 1)
    return variance


@exercise("lab02.predicted_variance")
def check_predicted_variance(student_fn) -> None:
    gen = torch.Generator().manual_seed(3)
    trace = [round(1 + 9 * torch.rand(1, generator=gen).item(), 3) for _ in range(4)]
    cases = [
        (trace[0], 1, 256, True),
        (trace[0], 1, 256, False),  # one example: the correction is 1
        (trace[0], 256, 256, True),
        (trace[0], 256, 256, False),  # the whole data set: no noise
        (trace[1], 64, 100, False),
        (trace[1], 64, 100, True),
        (trace[2], 1, 2, False),
        (trace[2], 2, 2, False),
        (trace[3], 3, 1000, False),
        (0.0, 4, 10, False),
        {"trace_cov": trace[3], "batch_size": 16, "n": 50},  # replacement by default
    ]
    check_function(student_fn, predicted_variance, cases)
