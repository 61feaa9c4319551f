"""The checkers of Lab 2 reject the usual wrong answers, naming where they differ."""

from __future__ import annotations

import pytest
import torch

from lsdl_lab import check
from lsdl_lab.exercises import lab02


def unbiased(G):
    return G.var(dim=0).sum().item()  # divides by N - 1, not N


def no_centering(G):
    return G.square().sum(dim=1).mean().item()


def per_coordinate(G):
    return (G - G.mean(dim=0)).square().mean(dim=0)


@pytest.mark.parametrize(
    "wrong,message",
    [
        (unbiased, "case 1 of 8"),
        (no_centering, "case 1 of 8"),
        (per_coordinate, "expected a number"),
    ],
)
def test_trace_covariance_mistakes_are_caught(wrong, message):
    with pytest.raises(check.CheckFailed, match=message):
        check.checker("lab02.trace_covariance")(wrong)


def without_correction(trace_cov, batch_size, n, replacement=True):
    return trace_cov / batch_size


def correction_always(trace_cov, batch_size, n, replacement=True):
    return trace_cov / batch_size * (n - batch_size) / (n - 1)


def batch_squared(trace_cov, batch_size, n, replacement=True):
    variance = trace_cov / batch_size**2
    return variance if replacement else variance * (n - batch_size) / (n - 1)


@pytest.mark.parametrize(
    "wrong,message",
    [
        (without_correction, "case 4 of 11"),  # the whole data set: no noise
        (correction_always, "case 3 of 11"),
        (batch_squared, "case 3 of 11"),
    ],
)
def test_predicted_variance_mistakes_are_caught(wrong, message):
    with pytest.raises(check.CheckFailed, match=message):
        check.checker("lab02.predicted_variance")(wrong)


def test_trace_covariance_is_the_mean_squared_distance_to_the_mean():
    G = torch.tensor([[0.0, 0.0], [2.0, 0.0], [1.0, 3.0], [1.0, -3.0]])
    # mean (1, 0); squared distances 1, 1, 9, 9
    assert lab02.trace_covariance(G) == pytest.approx(5.0)


def clamped(norm_sq_small, norm_sq_big, b_small, b_big):
    g2, trace = lab02.noise_scale_from_norms(norm_sq_small, norm_sq_big, b_small, b_big)
    return max(g2, 0.0), trace  # an unbiased estimate may be negative


def unweighted(norm_sq_small, norm_sq_big, b_small, b_big):
    trace = (norm_sq_small - norm_sq_big) / (1 / b_small - 1 / b_big)
    return norm_sq_big, trace  # ||g_B||^2 at the big size still holds tr Sigma / B


def sizes_swapped(norm_sq_small, norm_sq_big, b_small, b_big):
    return lab02.noise_scale_from_norms(norm_sq_small, norm_sq_big, b_big, b_small)


def trace_not_scaled(norm_sq_small, norm_sq_big, b_small, b_big):
    g2, _ = lab02.noise_scale_from_norms(norm_sq_small, norm_sq_big, b_small, b_big)
    return g2, norm_sq_small - norm_sq_big


@pytest.mark.parametrize(
    "wrong,message",
    [
        (clamped, "case 5 of 6"),
        (unweighted, "case 1 of 6"),
        (sizes_swapped, "case 1 of 6"),
        (trace_not_scaled, "case 1 of 6"),
    ],
)
def test_noise_scale_from_norms_mistakes_are_caught(wrong, message):
    with pytest.raises(check.CheckFailed, match=message):
        check.checker("lab02.noise_scale_from_norms")(wrong)


def test_noise_scale_from_norms_recovers_the_norm_and_trace_from_exact_expectations():
    g2, trace = 0.25, 12.0
    got = lab02.noise_scale_from_norms(g2 + trace / 4, g2 + trace / 64, 4, 64)
    assert got == pytest.approx((g2, trace))
    check.checker("lab02.noise_scale_from_norms")(lab02.noise_scale_from_norms)
