"""Checkers of Lab 2, gradient noise."""

from __future__ import annotations

import torch

from .. import noise
from ..check import check_function, exercise


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
    for n, p, spread, offset in [
        (16, 10, 1.0, 0.1),
        (100, 7, 0.3, 0.5),
        (7, 300, 2.0, 0.0),
        (2, 3, 1.0, 1.0),
        (1, 5, 1.0, 0.2),
        (64, 33, 1e-3, 0.0),
    ]:
        mean = offset * torch.randn(p, generator=gen)
        cases.append((mean + spread * torch.randn(n, p, generator=gen),))
    cases.append((torch.ones(5, 4) * torch.arange(4.0),))  # every row the same: tr Σ = 0
    cases.append((torch.randn(40, 6, generator=gen, dtype=torch.float64),))
    return cases


@exercise("lab02.trace_covariance")
def check_trace_covariance(student_fn) -> None:
    check_function(student_fn, trace_covariance, _gradient_matrices(), rtol=1e-4, atol=1e-7)


def predicted_variance(
    trace_cov: float, batch_size: int, n: int, replacement: bool = True
) -> float:
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


def noise_scale_from_norms(
    norm_sq_small: float, norm_sq_big: float, b_small: int, b_big: int
) -> tuple[float, float]:
    r"""McCandlish et al.'s (2018, Appendix A.1) unbiased estimates of
    :math:`(\|g\|^2, \operatorname{tr}\Sigma)` from the mean squared norms of batch gradients
    at two batch sizes, solving :math:`\mathbb E\|g_B\|^2 = \|g\|^2 + \operatorname{tr}\Sigma/B`
    at ``b_small`` and ``b_big``; :func:`lsdl_lab.noise.noise_scale_from_norms` as a tuple."""
    estimate = noise.noise_scale_from_norms(norm_sq_small, norm_sq_big, b_small, b_big)
    return estimate.grad_norm_sq, estimate.trace_cov


def _two_size_cases() -> list[tuple[float, float, int, int]]:
    gen = torch.Generator().manual_seed(4)
    cases = []
    # Exact expectations E||g_B||^2 = G + S / B for a few (G, S) and pairs of sizes, so the
    # answer is (G, S) itself; the sizes are unequal in every way a formula can confuse.
    for b_small, b_big in [(1, 2), (8, 128), (32, 64), (3, 1000)]:
        g2 = round(0.01 + torch.rand(1, generator=gen).item(), 4)
        trace = round(1 + 50 * torch.rand(1, generator=gen).item(), 3)
        cases.append((g2 + trace / b_small, g2 + trace / b_big, b_small, b_big))
    # Measured norms are noisy: the estimate of ||g||^2 can come out negative, and an
    # unbiased estimator must return it as it is, not clamp it.
    cases.append((5.0, 2.4, 16, 32))
    cases.append((2.0, 2.0, 4, 8))  # no noise at all: tr Sigma = 0
    return cases


@exercise("lab02.noise_scale_from_norms")
def check_noise_scale_from_norms(student_fn) -> None:
    check_function(student_fn, noise_scale_from_norms, _two_size_cases(), rtol=1e-6, atol=1e-9)
