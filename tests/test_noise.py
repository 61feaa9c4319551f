"""Tests of lsdl_lab.noise: per-example gradients, the exact noise and its closed forms, the
1/B law measured, McCandlish et al.'s two-batch estimates, modes restored, bad input.

The measurements run on every device of the ``device`` fixture (models and data made on the
CPU from their seeds, then moved there; the mini-batches are drawn on the CPU, the same on
every device); the argument checks stay on the CPU."""

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lsdl_lab import models, noise
from lsdl_lab.plot import loglog_fit


def classification_problem(n=120, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 1, 8, 8, generator=gen)
    y = torch.randint(3, (n,), generator=gen)
    torch.manual_seed(seed)
    return models.MLP(64, 3, hidden=16).to(device), x.to(device), y.to(device)


@contextlib.contextmanager
def full_float32():
    # cuDNN may run float32 convolutions in TF32 (10-bit mantissas, on by default): a
    # per-example gradient and a batch's gradient would then differ by 1e-3, not by float32
    # rounding. No effect on the CPU
    old = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32 = old


def test_per_example_gradients_match_one_backward_per_example(device):
    model, x, y = classification_problem(n=10, device=device)
    G = noise.per_example_gradients(model, F.cross_entropy, x, y, chunk_size=4)
    for i in range(10):
        assert torch.allclose(
            G[i], noise.flat_gradient(model, F.cross_entropy, x[i : i + 1], y[i : i + 1]), atol=1e-6
        )


def test_linear_regression_noise_in_closed_form(device):
    """For l_i = (w.x_i - y_i)^2 / 2 the per-example gradient is r_i x_i, r_i = w.x_i - y_i."""
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(200, 5, generator=gen), torch.randn(200, generator=gen)
    model = nn.Linear(5, 1, bias=False).to(device)
    x, y = x.to(device), y.to(device)

    def loss_fn(out, target):
        return 0.5 * (out.squeeze(-1) - target).square().mean()

    r = (model(x).squeeze(-1) - y).detach()
    per_example = r[:, None] * x
    g = per_example.mean(0)
    trace = (per_example - g).square().sum(1).mean().item()
    result = noise.gradient_noise(model, loss_fn, x, y, chunk_size=64)
    assert torch.allclose(result.mean, g, atol=1e-6)
    assert result.trace_cov == pytest.approx(trace, rel=1e-5)
    assert result.simple_noise_scale == pytest.approx(trace / g.square().sum().item(), rel=1e-5)


def test_full_gradient_equals_mean_of_per_example_gradients(device):
    model, x, y = classification_problem(device=device)
    result = noise.gradient_noise(model, F.cross_entropy, x, y, chunk_size=50)
    assert torch.allclose(result.mean, noise.flat_gradient(model, F.cross_entropy, x, y), atol=1e-6)


def test_measured_variance_follows_one_over_b(device):
    model, x, y = classification_problem(n=400, device=device)
    sizes = [1, 4, 16, 64]
    res = noise.minibatch_gradient_variance(model, F.cross_entropy, x, y, sizes, samples=200)
    for r in res:
        # the sample mean of ||g_B - g||^2 is within 4 standard errors of tr(Sigma)/B
        assert abs(r.measured - r.predicted) < 4 * r.stderr, r
    slope, _ = loglog_fit(sizes, [r.measured for r in res])
    assert slope == pytest.approx(-1.0, abs=0.1)


def test_without_replacement_the_whole_data_set_has_no_noise(device):
    model, x, y = classification_problem(n=64, device=device)
    res = noise.minibatch_gradient_variance(
        model, F.cross_entropy, x, y, [64], samples=3, replacement=False
    )
    assert res[0].predicted == 0.0 and res[0].measured < 1e-10


def test_a_dry_run_draws_every_sample_asked_for(monkeypatch):
    # The library caps a dry run in fit and the batches only (lsdl_lab.profiles): how many
    # mini-batches a measurement draws is its caller's to cap.
    model, x, y = classification_problem(n=32)
    draws = []

    def counted(out, target):
        draws.append(len(target))
        return F.cross_entropy(out, target)

    monkeypatch.setenv("LSDL_MAX_STEPS", "2")
    monkeypatch.setenv("LSDL_MAX_EXAMPLES", "4")
    gn = noise.gradient_noise(model, F.cross_entropy, x, y)
    noise.minibatch_gradient_variance(model, counted, x, y, [2, 8], samples=7, noise=gn)
    assert draws == [2] * 7 + [8] * 7


def test_measurement_uses_eval_mode_and_restores_it(device):
    torch.manual_seed(0)
    model = models.ResNet(8, 4, 3, 1).train().to(device)
    _, x, y = classification_problem(n=16, device=device)
    res = noise.minibatch_gradient_variance(model, F.cross_entropy, x, y, [2], samples=2)
    assert model.training and res[0].measured > 0
    # in eval mode the loss is a mean of per-example losses, so batch gradients are exact means
    with full_float32():
        G = noise.per_example_gradients(model, F.cross_entropy, x[:4], y[:4])
        mean = noise.flat_gradient(model, F.cross_entropy, x[:4], y[:4])
    assert torch.allclose(G.mean(0), mean, atol=1e-5)


def test_a_submodule_frozen_in_eval_mode_stays_in_eval_mode(device):
    """Every function restores each submodule's own mode, not just the top module's."""
    torch.manual_seed(0)
    model = models.ResNet(8, 4, 3, 1).train().to(device)
    model.stem.eval()  # a frozen stem: its BatchNorm must keep its running statistics
    _, x, y = classification_problem(n=16, device=device)
    modes = {name: m.training for name, m in model.named_modules()}
    noise.flat_gradient(model, F.cross_entropy, x, y)
    noise.per_example_gradients(model, F.cross_entropy, x[:4], y[:4])
    noise.gradient_noise(model, F.cross_entropy, x[:4], y[:4])
    noise.minibatch_gradient_variance(model, F.cross_entropy, x, y, [2], samples=2)
    noise.estimate_noise_scale(model, F.cross_entropy, x, y, 2, 4, samples=2)
    assert {name: m.training for name, m in model.named_modules()} == modes
    assert not model.stem[1].training and model.blocks[0].bn1.training


def test_the_mode_is_restored_when_the_loss_raises(device):
    model, x, y = classification_problem(device=device)
    model.train()

    def failing(out, target):
        raise RuntimeError("a broken loss")

    with pytest.raises(RuntimeError, match="a broken loss"):
        noise.flat_gradient(model, failing, x, y)
    assert model.training


@pytest.mark.parametrize("sizes", [[0], [121], [4, 200]])
def test_bad_batch_sizes(sizes):
    model, x, y = classification_problem()
    with pytest.raises(ValueError, match=r"Invalid batch_sizes\[\d\]: .*\[1, 120\]"):
        noise.minibatch_gradient_variance(model, F.cross_entropy, x, y, sizes)


@pytest.mark.parametrize("sizes", [[2.0], [4, "8"], [True]])
def test_batch_sizes_of_the_wrong_type(sizes):
    model, x, y = classification_problem()
    with pytest.raises(TypeError, match=r"Invalid batch_sizes\[\d\]"):
        noise.minibatch_gradient_variance(model, F.cross_entropy, x, y, sizes)


def test_bad_samples_chunk_seed_and_replacement():
    model, x, y = classification_problem()
    with pytest.raises(ValueError, match="Invalid samples"):
        noise.minibatch_gradient_variance(model, F.cross_entropy, x, y, [2], samples=1)
    with pytest.raises(TypeError, match="Invalid samples"):
        noise.minibatch_gradient_variance(model, F.cross_entropy, x, y, [2], samples=8.0)
    with pytest.raises(TypeError, match="Invalid replacement"):
        noise.minibatch_gradient_variance(model, F.cross_entropy, x, y, [2], replacement=0)
    with pytest.raises(TypeError, match="Invalid seed"):
        noise.estimate_noise_scale(model, F.cross_entropy, x, y, 2, 4, seed="1")
    with pytest.raises(ValueError, match="Invalid chunk_size"):
        noise.per_example_gradients(model, F.cross_entropy, x, y, chunk_size=0)
    with pytest.raises(TypeError, match="Invalid chunk_size"):
        noise.gradient_noise(model, F.cross_entropy, x, y, chunk_size=16.0)


def test_noise_scale_from_norms_is_exact_on_expected_norms():
    g2, trace = 2.0, 50.0
    est = noise.noise_scale_from_norms(g2 + trace / 4, g2 + trace / 64, 4, 64)
    assert est.grad_norm_sq == pytest.approx(g2) and est.trace_cov == pytest.approx(trace)
    assert est.simple_noise_scale == pytest.approx(25.0)


def test_two_batch_estimate_matches_the_closed_form_noise_scale(device):
    """Linear regression: tr Sigma and ||g||^2 are known exactly from per-example gradients."""
    gen = torch.Generator().manual_seed(3)
    x, y = torch.randn(500, 4, generator=gen), torch.randn(500, generator=gen)
    model = nn.Linear(4, 1, bias=False).to(device)
    x, y = x.to(device), y.to(device)
    with torch.no_grad():
        model.weight.fill_(0.5)

    def loss_fn(out, target):
        return 0.5 * (out.squeeze(-1) - target).square().mean()

    exact = noise.gradient_noise(model, loss_fn, x, y)
    est = noise.estimate_noise_scale(model, loss_fn, x, y, 2, 64, samples=3000, seed=1)
    assert est.trace_cov == pytest.approx(exact.trace_cov, rel=0.1)
    assert est.grad_norm_sq == pytest.approx(exact.mean.square().sum().item(), rel=0.1)
    assert est.simple_noise_scale == pytest.approx(exact.simple_noise_scale, rel=0.2)


def test_steps_and_examples_trade_off():
    s, e = noise.steps_and_examples(10.0, b_noise=10.0, s_min=100.0)
    assert (s, e) == (200.0, 2000.0)  # at B = B_noise: twice the minimal steps and examples


@pytest.mark.parametrize(
    "b_small,b_big,name", [(0, 4, "b_small"), (4, 4, "b_big"), (8, 4, "b_big"), (2, 0, "b_big")]
)
def test_bad_noise_scale_batches(b_small, b_big, name):
    with pytest.raises(ValueError, match=f"Invalid {name}:"):
        noise.noise_scale_from_norms(1.0, 0.5, b_small, b_big)


@pytest.mark.parametrize(
    "args,error,name",
    [
        ((1.0, 0.5, 2.0, 4), TypeError, "b_small"),
        ((1.0, 0.5, 2, "4"), TypeError, "b_big"),
        (("1", 0.5, 2, 4), TypeError, "norm_sq_small"),
        ((1.0, -0.5, 2, 4), ValueError, "norm_sq_big"),
    ],
)
def test_noise_scale_arguments_are_checked(args, error, name):
    with pytest.raises(error, match=f"Invalid {name}:"):
        noise.noise_scale_from_norms(*args)


def test_two_batch_estimate_checks_its_batch_sizes_against_the_data():
    model, x, y = classification_problem()
    with pytest.raises(ValueError, match=r"Invalid b_big: 121 \(expected an int in \[1, 120\]\)"):
        noise.estimate_noise_scale(model, F.cross_entropy, x, y, 2, 121)
    with pytest.raises(ValueError, match="Invalid b_big: 2 .*> b_small = 8"):
        noise.estimate_noise_scale(model, F.cross_entropy, x, y, 8, 2)


@pytest.mark.parametrize(
    "kwargs,error,name",
    [
        (dict(b_noise=0.0, s_min=1.0), ValueError, "b_noise"),
        (dict(b_noise=1.0, s_min=-1.0), ValueError, "s_min"),
        (dict(b_noise=1.0, s_min=1.0, e_min=0.0), ValueError, "e_min"),
        (dict(b_noise="10", s_min=1.0), TypeError, "b_noise"),
    ],
)
def test_steps_and_examples_arguments_are_checked(kwargs, error, name):
    with pytest.raises(error, match=f"Invalid {name}:"):
        noise.steps_and_examples(10.0, **kwargs)
