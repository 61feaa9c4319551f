r"""Gradient noise: how far a mini-batch gradient strays from the full gradient.

With a loss that is an average of per-example losses, :math:`L(w) = \frac1N\sum_i \ell_i(w)`,
the full gradient is :math:`g = \frac1N\sum_i \nabla\ell_i` and the per-example gradients
have covariance :math:`\Sigma = \frac1N\sum_i (\nabla\ell_i - g)(\nabla\ell_i - g)^\top`.
A mini-batch of :math:`B` examples drawn independently (with replacement) gives the
unbiased estimate :math:`g_B = \frac1B\sum_{i\in\mathcal B}\nabla\ell_i` with

.. math:: \mathbb E\,\|g_B - g\|^2 = \frac{\operatorname{tr}\Sigma}{B},

and drawn without replacement, the same times the finite-population correction
:math:`(N-B)/(N-1)`. The 1/B law is what makes large batches attractive (less noise per
step) and what limits their benefit (McCandlish et al., 2018): once the noise is small
compared with :math:`\|g\|^2`, doubling the batch buys little. Their *simple noise scale*
is :math:`B_\text{simple} = \operatorname{tr}\Sigma / \|g\|^2`.

The model is put in evaluation mode while measuring: with BatchNorm in training mode an
example's loss depends on the rest of its batch, the loss is no longer a sum of
per-example terms, and the law above does not apply as stated.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from ._util import LossFn, check_bool, check_int, check_positive, check_real, eval_mode, flatten

__all__ = [
    "GradientNoise",
    "VarianceMeasurement",
    "flat_gradient",
    "gradient_noise",
    "minibatch_gradient_variance",
    "noise_scale_from_norms",
    "estimate_noise_scale",
    "NoiseScaleEstimate",
    "per_example_gradients",
    "steps_and_examples",
]


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: p.detach() for k, p in model.named_parameters() if p.requires_grad}


def flat_gradient(model: nn.Module, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor):
    """The gradient of ``loss_fn(model(x), y)`` as one flat vector (model in eval mode)."""
    params = [p for p in model.parameters() if p.requires_grad]
    with eval_mode(model):
        grads = torch.autograd.grad(loss_fn(model(x), y), params)
    return flatten(grads)


def per_example_gradients(
    model: nn.Module, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor, chunk_size: int = 256
) -> torch.Tensor:
    """The (N, P) matrix whose row i is the flat gradient of example i's loss.

    ``torch.func.vmap`` over ``grad`` of a one-example loss computes all rows in one
    vectorized pass per chunk, instead of N backward passes.
    """
    check_int("chunk_size", chunk_size, 1)
    params, buffers = _params(model), dict(model.named_buffers())

    def one_loss(p, xi, yi):
        out = functional_call(model, (p, buffers), (xi.unsqueeze(0),))
        return loss_fn(out, yi.unsqueeze(0))

    per_example = vmap(grad(one_loss), in_dims=(None, 0, 0))
    rows = []
    with eval_mode(model):
        for i in range(0, x.shape[0], chunk_size):
            g = per_example(params, x[i : i + chunk_size], y[i : i + chunk_size])
            rows.append(torch.cat([t.reshape(t.shape[0], -1) for t in g.values()], dim=1))
    return torch.cat(rows)


@dataclass(frozen=True)
class GradientNoise:
    """The full gradient and the spread of per-example gradients around it."""

    mean: torch.Tensor  # g, shape (P,)
    trace_cov: float  # tr Σ = E_i ||∇ℓ_i - g||²
    n: int

    @property
    def simple_noise_scale(self) -> float:
        """McCandlish et al.'s B_simple = tr Σ / ||g||²."""
        return self.trace_cov / self.mean.square().sum().item()

    def predicted_variance(self, batch_size: int, replacement: bool = True) -> float:
        """E||g_B - g||² for batches of ``batch_size`` drawn with or without replacement."""
        fpc = 1.0 if replacement else (self.n - batch_size) / (self.n - 1)
        return self.trace_cov / batch_size * fpc


def gradient_noise(
    model: nn.Module, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor, chunk_size: int = 256
) -> GradientNoise:
    """Exact g and tr Σ over the N examples (x, y), one chunk of per-example gradients at a time."""
    check_int("chunk_size", chunk_size, 1)
    total, total_sq, n = None, 0.0, x.shape[0]
    for i in range(0, n, chunk_size):
        G = per_example_gradients(
            model, loss_fn, x[i : i + chunk_size], y[i : i + chunk_size], chunk_size
        )
        s = G.sum(0, dtype=torch.float64)
        total = s if total is None else total + s
        total_sq += G.double().square().sum().item()
    mean = total / n
    # tr Σ = E||∇ℓ_i||² - ||g||², accumulated in float64 against cancellation.
    trace_cov = total_sq / n - mean.square().sum().item()
    return GradientNoise(mean=mean.float(), trace_cov=max(trace_cov, 0.0), n=n)


@dataclass(frozen=True)
class VarianceMeasurement:
    batch_size: int
    measured: float  # mean over draws of ||g_B - g||²
    stderr: float  # standard error of that mean
    predicted: float  # tr Σ / B (times the finite-population correction without replacement)


def _sampled_gradients(model, loss_fn, x, y, b: int, samples: int, gen, replacement=True):
    """Flat gradients of ``samples`` mini-batches of ``b`` random examples drawn with ``gen``:
    independently (with replacement) or ``b`` distinct ones (without), as in training."""
    n = x.shape[0]
    for _ in range(samples):
        if replacement:
            idx = torch.randint(n, (b,), generator=gen)
        else:
            idx = torch.randperm(n, generator=gen)[:b]
        idx = idx.to(x.device)
        yield flat_gradient(model, loss_fn, x[idx], y[idx])


def minibatch_gradient_variance(
    model: nn.Module,
    loss_fn: LossFn,
    x: torch.Tensor,
    y: torch.Tensor,
    batch_sizes: Sequence[int],
    samples: int = 32,
    seed: int = 0,
    replacement: bool = True,
    noise: GradientNoise | None = None,
) -> list[VarianceMeasurement]:
    """Measure E||g_B - g||² by drawing ``samples`` real mini-batches of each size.

    Each mini-batch gradient is an ordinary backward pass, as in training; g is the
    full-batch gradient over (x, y). The prediction tr Σ / B comes from the exact
    per-example gradients, so measurement and theory are computed independently.
    """
    n = x.shape[0]
    batch_sizes = [check_int(f"batch_sizes[{i}]", b, 1, n) for i, b in enumerate(batch_sizes)]
    samples = check_int("samples", samples, 2)  # two at least, for the mean's standard error
    check_int("seed", seed, 0)
    check_bool("replacement", replacement)
    noise = noise or gradient_noise(model, loss_fn, x, y)
    g = noise.mean.to(x.device)
    gen = torch.Generator().manual_seed(seed)
    results = []
    for b in batch_sizes:
        gradients = _sampled_gradients(model, loss_fn, x, y, b, samples, gen, replacement)
        d = torch.tensor([(gb - g).square().sum().item() for gb in gradients], dtype=torch.float64)
        results.append(
            VarianceMeasurement(
                batch_size=b,
                measured=d.mean().item(),
                stderr=(d.std() / samples**0.5).item(),
                predicted=noise.predicted_variance(b, replacement),
            )
        )
    return results


def _check_batch_sizes(b_small, b_big, n: int | None = None) -> None:
    check_int("b_small", b_small, 1, n)
    check_int("b_big", b_big, 1, n)
    if b_big <= b_small:
        raise ValueError(f"Invalid b_big: {b_big!r} (expected an int > b_small = {b_small})")


@dataclass(frozen=True)
class NoiseScaleEstimate:
    """McCandlish et al.'s unbiased estimates from gradient norms at two batch sizes."""

    grad_norm_sq: float  # estimate of ||g||^2
    trace_cov: float  # estimate of tr Sigma
    b_small: int
    b_big: int

    @property
    def simple_noise_scale(self) -> float:
        """B_simple = tr Sigma / ||g||^2, the critical batch size's estimate."""
        return self.trace_cov / self.grad_norm_sq


def noise_scale_from_norms(
    norm_sq_small: float, norm_sq_big: float, b_small: int, b_big: int
) -> NoiseScaleEstimate:
    r"""The estimators of McCandlish et al. (2018), Appendix A.1.

    Since :math:`\mathbb E\|g_B\|^2 = \|g\|^2 + \operatorname{tr}\Sigma / B`, the squared
    norms measured at two batch sizes :math:`B_s < B_b` give unbiased estimates

    .. math::
        \|\mathcal G\|^2 = \frac{B_b \|g_{B_b}\|^2 - B_s \|g_{B_s}\|^2}{B_b - B_s}, \qquad
        \mathcal S = \frac{\|g_{B_s}\|^2 - \|g_{B_b}\|^2}{1/B_s - 1/B_b}.

    In data-parallel training they come for free: :math:`B_s` is one worker's batch and
    :math:`B_b` the global batch after the all-reduce. Average each estimate over many
    steps before dividing; the ratio of averages is the paper's recommendation.
    """
    _check_batch_sizes(b_small, b_big)
    check_real("norm_sq_small", norm_sq_small, 0.0)
    check_real("norm_sq_big", norm_sq_big, 0.0)
    g2 = (b_big * norm_sq_big - b_small * norm_sq_small) / (b_big - b_small)
    trace = (norm_sq_small - norm_sq_big) / (1 / b_small - 1 / b_big)
    return NoiseScaleEstimate(g2, trace, b_small, b_big)


def estimate_noise_scale(
    model: nn.Module,
    loss_fn: LossFn,
    x: torch.Tensor,
    y: torch.Tensor,
    b_small: int,
    b_big: int,
    samples: int = 32,
    seed: int = 0,
) -> NoiseScaleEstimate:
    """Measure ||g_B||^2 on ``samples`` random batches of each size (with replacement) and
    apply :func:`noise_scale_from_norms` to the averages."""
    _check_batch_sizes(b_small, b_big, x.shape[0])
    check_int("samples", samples, 1)
    check_int("seed", seed, 0)
    gen = torch.Generator().manual_seed(seed)
    means = []
    for b in (b_small, b_big):
        gradients = _sampled_gradients(model, loss_fn, x, y, b, samples, gen)
        means.append(sum(gb.square().sum().item() for gb in gradients) / samples)
    return noise_scale_from_norms(means[0], means[1], b_small, b_big)


def steps_and_examples(batch_size, b_noise: float, s_min: float, e_min: float | None = None):
    r"""McCandlish et al.'s trade-off: steps :math:`S = S_{min}(1 + B_{noise}/B)` and examples
    :math:`E = E_{min}(1 + B/B_{noise})` to reach a given loss, with
    :math:`E_{min} = S_{min} B_{noise}` unless given. Works on floats or arrays."""
    check_positive("b_noise", b_noise)
    check_positive("s_min", s_min)
    e_min = s_min * b_noise if e_min is None else check_positive("e_min", e_min)
    return s_min * (1 + b_noise / batch_size), e_min * (1 + batch_size / b_noise)
