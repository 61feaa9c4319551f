import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lsdl_lab import models, noise
from lsdl_lab.plot import loglog_fit


def classification_problem(n=120, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 1, 8, 8, generator=gen)
    y = torch.randint(3, (n,), generator=gen)
    torch.manual_seed(seed)
    return models.MLP(64, 3, hidden=16), x, y


def test_per_example_gradients_match_one_backward_per_example():
    model, x, y = classification_problem(n=10)
    G = noise.per_example_gradients(model, F.cross_entropy, x, y, chunk_size=4)
    for i in range(10):
        assert torch.allclose(
            G[i], noise.flat_gradient(model, F.cross_entropy, x[i : i + 1], y[i : i + 1]), atol=1e-6
        )


def test_linear_regression_noise_in_closed_form():
    """For l_i = (w.x_i - y_i)^2 / 2 the per-example gradient is r_i x_i, r_i = w.x_i - y_i."""
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(200, 5, generator=gen), torch.randn(200, generator=gen)
    model = nn.Linear(5, 1, bias=False)

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


def test_full_gradient_equals_mean_of_per_example_gradients():
    model, x, y = classification_problem()
    result = noise.gradient_noise(model, F.cross_entropy, x, y, chunk_size=50)
    assert torch.allclose(result.mean, noise.flat_gradient(model, F.cross_entropy, x, y), atol=1e-6)


def test_measured_variance_follows_one_over_b():
    model, x, y = classification_problem(n=400)
    sizes = [1, 4, 16, 64]
    res = noise.minibatch_gradient_variance(model, F.cross_entropy, x, y, sizes, samples=200)
    for r in res:
        # the sample mean of ||g_B - g||^2 is within 4 standard errors of tr(Sigma)/B
        assert abs(r.measured - r.predicted) < 4 * r.stderr, r
    slope, _ = loglog_fit(sizes, [r.measured for r in res])
    assert slope == pytest.approx(-1.0, abs=0.1)


def test_without_replacement_the_whole_data_set_has_no_noise():
    model, x, y = classification_problem(n=64)
    res = noise.minibatch_gradient_variance(
        model, F.cross_entropy, x, y, [64], samples=3, replacement=False
    )
    assert res[0].predicted == 0.0 and res[0].measured < 1e-10


def test_measurement_uses_eval_mode_and_restores_it():
    torch.manual_seed(0)
    model = models.ResNet(8, 4, 3, 1).train()
    _, x, y = classification_problem(n=16)
    res = noise.minibatch_gradient_variance(model, F.cross_entropy, x, y, [2], samples=2)
    assert model.training and res[0].measured > 0
    # in eval mode the loss is a mean of per-example losses, so batch gradients are exact means
    G = noise.per_example_gradients(model, F.cross_entropy, x[:4], y[:4])
    assert torch.allclose(
        G.mean(0), noise.flat_gradient(model, F.cross_entropy, x[:4], y[:4]), atol=1e-5
    )


@pytest.mark.parametrize("sizes", [[0], [121], [2.0]])
def test_bad_batch_sizes(sizes):
    model, x, y = classification_problem()
    with pytest.raises(ValueError, match=r"Invalid batch size.*\[1, 120\]"):
        noise.minibatch_gradient_variance(model, F.cross_entropy, x, y, sizes)


def test_bad_samples_and_chunk():
    model, x, y = classification_problem()
    with pytest.raises(ValueError, match="Invalid samples"):
        noise.minibatch_gradient_variance(model, F.cross_entropy, x, y, [2], samples=1)
    with pytest.raises(ValueError, match="Invalid chunk_size"):
        noise.per_example_gradients(model, F.cross_entropy, x, y, chunk_size=0)


def test_noise_scale_from_norms_is_exact_on_expected_norms():
    g2, trace = 2.0, 50.0
    est = noise.noise_scale_from_norms(g2 + trace / 4, g2 + trace / 64, 4, 64)
    assert est.grad_norm_sq == pytest.approx(g2) and est.trace_cov == pytest.approx(trace)
    assert est.simple_noise_scale == pytest.approx(25.0)


def test_two_batch_estimate_matches_the_closed_form_noise_scale():
    """Linear regression: tr Sigma and ||g||^2 are known exactly from per-example gradients."""
    gen = torch.Generator().manual_seed(3)
    x, y = torch.randn(500, 4, generator=gen), torch.randn(500, generator=gen)
    model = nn.Linear(4, 1, bias=False)
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


@pytest.mark.parametrize("b_small,b_big", [(0, 4), (4, 4), (8, 4), (2.0, 4)])
def test_bad_noise_scale_batches(b_small, b_big):
    with pytest.raises(ValueError, match="Invalid batch sizes"):
        noise.noise_scale_from_norms(1.0, 0.5, b_small, b_big)
