"""Tests of lsdl_lab.landscape: closed forms on linear and quadratic "models", exact restore
of the weights, Li et al.'s filter normalization as properties, Goodfellow et al.'s
interpolation end points, and Dinh et al.'s reparametrization on the library's MLP.

The measurements run on every device of the ``device`` fixture: models made on the CPU from
their seeds and moved there, while the batches stay where the test made them (the library
moves them to the model's device). Bad arguments and plots stay on the CPU."""

import copy
import math

import matplotlib
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import Quadratic, cnn, symmetric
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from lsdl_lab import curvature
from lsdl_lab import landscape as ls
from lsdl_lab.models import MLP
from lsdl_lab.train import accuracy

matplotlib.use("Agg")


class Linear(nn.Module):
    """L(x) = c^T x: its maximum over a box is at the corner x + r sign(c)."""

    def __init__(self, c: torch.Tensor, x: torch.Tensor):
        super().__init__()
        self.register_buffer("c", c)
        self.x = nn.Parameter(x.clone())

    def forward(self, inputs):
        return self.c @ self.x


def output(out, y):
    return out


SCALAR_BATCH = (torch.zeros(1), torch.zeros(1))


def mlp_data(seed=0, n=64):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=gen, dtype=torch.float64)
    return x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long()


def snapshot(model):
    return [t.detach().clone() for t in model.state_dict().values()]


def assert_unchanged(model, before):
    after = list(model.state_dict().values())
    assert all(torch.equal(a, b) for a, b in zip(before, after))


# -- loss_at --------------------------------------------------------------------------------


def test_loss_at_weights_batches_by_size_and_keeps_the_mode(device):
    model, x, y = cnn(device=device)
    model.train()
    batches = [(x[:5], y[:5]), (x[5:], y[5:])]  # unequal sizes
    model.eval()
    with torch.no_grad():
        expected = F.cross_entropy(model(x), y).item()
    model.train()
    before = snapshot(model)
    assert ls.loss_at(model, F.cross_entropy, batches) == pytest.approx(expected, rel=1e-12)
    assert ls.loss_at(model, F.cross_entropy, (x, y)) == pytest.approx(expected, rel=1e-12)
    assert model.training and model[1].training
    assert_unchanged(model, before)  # eval mode: the running statistics did not move


def test_loss_at_refuses_no_batches():
    with pytest.raises(ValueError, match="Invalid batches"):
        ls.loss_at(cnn()[0], F.cross_entropy, [])


# -- epsilon-sharpness ------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["sign_ascent", "l-bfgs-b"])
def test_epsilon_sharpness_of_a_linear_loss_is_the_box_corner(method, device):
    # max over |z_i| <= eps(|x_i| + 1) of c^T (x + z) is c^T x + eps sum |c_i| (|x_i| + 1).
    gen = torch.Generator().manual_seed(3)
    c = torch.randn(7, generator=gen, dtype=torch.float64)
    x = torch.randn(7, generator=gen, dtype=torch.float64) + 2.0
    eps = 0.01
    f = (c @ x).item()
    top = f + eps * (c.abs() * (x.abs() + 1)).sum().item()
    model = Linear(c, x).to(device)  # SCALAR_BATCH stays on the CPU
    s = ls.epsilon_sharpness(model, output, SCALAR_BATCH, epsilon=eps, steps=20, method=method)
    assert s.loss == pytest.approx(f, rel=1e-12)
    assert s.max_loss == pytest.approx(top, rel=1e-9)
    assert s.sharpness == pytest.approx(100 * (top - f) / (1 + f), rel=1e-6)
    assert (s.epsilon, s.steps) == (eps, 20)


@pytest.mark.parametrize("method", ["sign_ascent", "l-bfgs-b"])
def test_epsilon_sharpness_leaves_the_model_exactly_as_it_was(method, device):
    model, x, y = cnn(device=device)
    model.train()
    before = snapshot(model)
    s = ls.epsilon_sharpness(
        model,
        F.cross_entropy,
        [(x[:10], y[:10]), (x[10:], y[10:])],
        epsilon=1e-2,
        steps=5,
        method=method,
    )
    assert_unchanged(model, before)
    assert all(p.grad is None for p in model.parameters())
    assert model.training
    assert s.max_loss > s.loss and s.sharpness > 0
    assert s.loss == pytest.approx(ls.loss_at(model, F.cross_entropy, (x, y)), rel=1e-12)


def test_a_failing_loss_leaves_weights_and_modes_as_they_were(device):
    model, x, y = cnn(device=device)
    model.train()
    model[1].eval()  # a frozen BatchNorm stays frozen
    before = snapshot(model)
    calls = []

    def fails_on_the_second_call(out, target):
        calls.append(1)
        if len(calls) > 1:
            raise RuntimeError("a broken loss")
        return F.cross_entropy(out, target)

    with pytest.raises(RuntimeError, match="a broken loss"):
        ls.epsilon_sharpness(model, fails_on_the_second_call, (x, y), epsilon=0.1, steps=3)
    assert_unchanged(model, before)
    assert model.training and not model[1].training


@pytest.mark.parametrize("method", ls.METHODS)
def test_the_ascent_runs_the_steps_it_is_given_in_a_dry_run_too(method, monkeypatch):
    # The library caps a dry run in fit and the batches only (lsdl_lab.profiles): a probe's
    # steps are its caller's to cap. Sign ascent evaluates the loss at the start, once a step
    # and at the end; L-BFGS-B at least once an iteration.
    model, x, y = cnn()
    calls = []

    def counted(out, target):
        calls.append(1)
        return F.cross_entropy(out, target)

    def evaluations(steps):
        calls.clear()
        ls.epsilon_sharpness(model, counted, (x, y), epsilon=0.1, steps=steps, method=method)
        return len(calls)

    six, two = evaluations(6), evaluations(2)
    monkeypatch.setenv("LSDL_MAX_STEPS", "2")
    assert evaluations(6) == six
    if method == "sign_ascent":
        assert (six, two) == (1 + 6 + 1, 1 + 2 + 1)
    else:
        assert 1 + 6 <= six and 1 + 2 <= two < six


def test_epsilon_sharpness_grows_with_the_box(device):
    model, x, y = cnn(device=device)
    values = [
        ls.epsilon_sharpness(model, F.cross_entropy, (x, y), epsilon=e, steps=10).sharpness
        for e in (1e-3, 1e-2, 1e-1)
    ]
    assert 0 < values[0] < values[1] < values[2]


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(epsilon=0.0), "Invalid epsilon"),
        (dict(epsilon=-1e-3), "Invalid epsilon"),
        (dict(epsilon=math.nan), "Invalid epsilon"),
        (dict(steps=0), "Invalid steps"),
        (dict(method="adam"), "Invalid method"),
        (dict(step_size=0.0), "Invalid step_size"),
        (dict(seed=-1), "Invalid seed"),
    ],
)
def test_epsilon_sharpness_bad_values(kwargs, match):
    model, x, y = cnn()
    with pytest.raises(ValueError, match=match):
        ls.epsilon_sharpness(model, F.cross_entropy, (x, y), **kwargs)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(epsilon="0.01"), "Invalid epsilon"),
        (dict(epsilon=True), "Invalid epsilon"),
        (dict(steps=2.5), "Invalid steps"),
        (dict(step_size=None, steps=None), "Invalid steps"),
        (dict(step_size="big"), "Invalid step_size"),
        (dict(seed=0.5), "Invalid seed"),
    ],
)
def test_epsilon_sharpness_bad_types(kwargs, match):
    model, x, y = cnn()
    with pytest.raises(TypeError, match=match):
        ls.epsilon_sharpness(model, F.cross_entropy, (x, y), **kwargs)


# -- filter-normalized directions -------------------------------------------------------------


def random_net(channels, width, seed):
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(2, channels, 3),
        nn.BatchNorm2d(channels),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(channels * 4, width),
        nn.ReLU(),
        nn.Linear(width, 3),
    )


nets = st.builds(random_net, st.integers(1, 6), st.integers(1, 9), st.integers(0, 2**16))


@settings(max_examples=30, deadline=None)
@given(net=nets, seed=st.integers(0, 2**16))
def test_each_filter_has_the_norm_of_the_weights_filter(net, seed, device):
    net = net.to(device)
    direction = ls.random_direction(net, seed=seed)
    for p, d in zip(net.parameters(), direction):
        assert d.shape == p.shape and d.dtype == p.dtype and d.device == p.device
        if p.dim() <= 1:
            assert torch.count_nonzero(d) == 0  # ignore="biasbn"
        else:
            torch.testing.assert_close(
                d.flatten(1).norm(dim=1), p.detach().flatten(1).norm(dim=1), rtol=1e-5, atol=0
            )


@settings(max_examples=30, deadline=None)
@given(net=nets, c=st.floats(0.05, 20.0), ignore=st.sampled_from(["biasbn", None]))
def test_filter_normalized_directions_scale_with_the_weights(net, c, ignore, device):
    net = net.to(device)
    scaled = copy.deepcopy(net)
    with torch.no_grad():
        for p in scaled.parameters():
            p.mul_(c)
    d = ls.random_direction(net, seed=1, ignore=ignore)
    d_scaled = ls.random_direction(scaled, seed=1, ignore=ignore)
    for a, b in zip(d, d_scaled):
        torch.testing.assert_close(b, c * a, rtol=1e-5, atol=1e-6)


def test_random_direction_options(device):
    net = random_net(3, 4, 0).to(device, torch.float64)
    params = list(net.parameters())
    copied = ls.random_direction(net, seed=0, ignore=None)
    raw = ls.random_direction(net, seed=0, filter_normalize=False)
    again = ls.random_direction(net, seed=0)
    other = ls.random_direction(net, seed=1)
    for p, dc, dr, d0, d1 in zip(params, copied, raw, again, other):
        assert dc.dtype == torch.float64
        if p.dim() <= 1:
            assert torch.equal(dc, p.detach())  # ignore=None copies 1-D weights
        else:
            # filter normalization only rescales each filter of the same Gaussian draw
            cos = F.cosine_similarity(dc.flatten(1), dr.flatten(1), dim=1)
            torch.testing.assert_close(cos, torch.ones_like(cos))
            assert torch.equal(dc, d0) and not torch.equal(d0, d1)
    with pytest.raises(ValueError, match="Invalid ignore"):
        ls.random_direction(net, ignore="bn")
    with pytest.raises(TypeError, match="Invalid filter_normalize"):
        ls.random_direction(net, filter_normalize=1)
    with pytest.raises(TypeError, match="Invalid seed"):
        ls.random_direction(net, seed=1.0)


# -- slices -----------------------------------------------------------------------------------


def test_slices_of_a_quadratic_along_eigenvectors_are_exact_parabolas(device):
    lam = torch.tensor([5.0, 2.0, 0.5, -1.0], dtype=torch.float64)
    A, Q = symmetric(lam)
    model = Quadratic(A.to(device))  # the directions (Q's columns) stay on the CPU
    alphas, betas = np.linspace(-2, 2, 9), np.linspace(-1, 1, 5)
    for i in range(4):
        losses = ls.slice_1d(model, output, SCALAR_BATCH, [Q[:, i]], alphas)
        np.testing.assert_allclose(losses, 0.5 * lam[i].item() * alphas**2, rtol=1e-12, atol=1e-13)
    grid = ls.slice_2d(model, output, SCALAR_BATCH, [Q[:, 0]], [Q[:, 3]], alphas, betas)
    assert grid.shape == (len(betas), len(alphas))
    expected = 0.5 * (5.0 * alphas[None, :] ** 2 - 1.0 * betas[:, None] ** 2)
    np.testing.assert_allclose(grid, expected, rtol=1e-12, atol=1e-13)


def test_slice_2d_entries_and_exact_restore(device):
    model, x, y = cnn(device=device)
    model.train()
    before = snapshot(model)
    d1, d2 = ls.random_direction(model, seed=0), ls.random_direction(model, seed=1)
    assert all(d.device == p.device for d, p in zip(d1, model.parameters()))
    alphas, betas = [-0.5, 0.0, 0.25], [0.0, 0.5]
    grid = ls.slice_2d(model, F.cross_entropy, (x, y), d1, d2, alphas, betas)
    assert_unchanged(model, before)
    assert model.training and all(p.grad is None for p in model.parameters())
    assert grid[0, 1] == ls.loss_at(model, F.cross_entropy, (x, y))
    moved = copy.deepcopy(model)
    with torch.no_grad():
        for p, a, b in zip(moved.parameters(), d1, d2):
            p.add_(a, alpha=-0.5).add_(b, alpha=0.5)
    assert grid[1, 0] == pytest.approx(ls.loss_at(moved, F.cross_entropy, (x, y)), rel=1e-12)
    line = ls.slice_1d(model, F.cross_entropy, (x, y), d1, alphas)
    np.testing.assert_allclose(line, grid[0], rtol=1e-12)


def test_slice_bad_arguments():
    model, x, y = cnn()
    d = ls.random_direction(model)
    with pytest.raises(ValueError, match="Invalid d1"):
        ls.slice_1d(model, F.cross_entropy, (x, y), d[:-1], [0.0])
    with pytest.raises(ValueError, match="Invalid alphas"):
        ls.slice_1d(model, F.cross_entropy, (x, y), d, [])
    with pytest.raises(ValueError, match="Invalid d2"):
        ls.slice_2d(model, F.cross_entropy, (x, y), d, [t.reshape(-1) for t in d], [0.0], [0.0])
    with pytest.raises(ValueError, match="Invalid betas"):
        ls.slice_2d(model, F.cross_entropy, (x, y), d, d, [0.0], [0.0, math.nan])
    with pytest.raises(TypeError, match="Invalid d1: a Tensor"):
        ls.slice_1d(model, F.cross_entropy, (x, y), d[0], [0.0])
    with pytest.raises(TypeError, match="Invalid d1"):
        ls.slice_1d(model, F.cross_entropy, (x, y), [t.tolist() for t in d], [0.0])
    with pytest.raises(TypeError, match="Invalid alphas"):
        ls.slice_1d(model, F.cross_entropy, (x, y), d, ["left", "right"])


# -- interpolation ----------------------------------------------------------------------------


def test_interpolation_end_points_reproduce_each_model_with_batchnorm(device):
    model_a, x, y = cnn(seed=0, device=device)
    model_b, _, _ = cnn(seed=5, device=device)
    before_a, before_b = snapshot(model_a), snapshot(model_b)
    result = ls.interpolate(
        model_a, model_b, F.cross_entropy, (x, y), [0.0, 0.5, 1.0, 1.5, -0.5], metric=accuracy
    )
    assert result.losses[0] == ls.loss_at(model_a, F.cross_entropy, (x, y))
    assert result.losses[2] == ls.loss_at(model_b, F.cross_entropy, (x, y))
    for i, model in ((0, model_a), (2, model_b)):
        model.eval()
        with torch.no_grad():
            acc = (model(x).argmax(-1) == y).double().mean().item()
        assert result.metrics[i] == pytest.approx(acc, abs=1e-12)
    assert np.all(np.isfinite(result.losses))  # extrapolated running variances clipped at 0
    assert_unchanged(model_a, before_a)
    assert_unchanged(model_b, before_b)


def test_interpolation_can_recompute_the_batchnorm_statistics(device):
    model_a, x, y = cnn(seed=0, device=device)
    model_b, _, _ = cnn(seed=5, device=device)
    with torch.no_grad():
        model_b[1].running_var.mul_(10.0)  # so that extrapolating turns a variance negative
    alphas = [-0.5, 0.0, 1.5]
    clipped = ls.interpolate(model_a, model_b, F.cross_entropy, (x, y), alphas)
    result = ls.interpolate(
        model_a, model_b, F.cross_entropy, (x, y), alphas, batchnorm="recompute"
    )
    # clipped at 0, a channel is divided by sqrt(eps): loss 65.7 against 1.12 recomputed
    assert clipped.losses[0] > 20 * result.losses[0]
    assert np.all(result.losses < 2.0)
    reference = copy.deepcopy(model_a)
    torch.optim.swa_utils.update_bn([(x, y)], reference)
    assert result.losses[1] == pytest.approx(ls.loss_at(reference, F.cross_entropy, (x, y)))
    with pytest.raises(ValueError, match="Invalid batchnorm"):
        ls.interpolate(model_a, model_b, F.cross_entropy, (x, y), alphas, batchnorm="reset")


def test_interpolation_of_a_quadratic_follows_the_segment(device):
    A, _ = symmetric(torch.tensor([3.0, 1.0, 0.5], dtype=torch.float64))
    A = A.to(device)
    a, b = Quadratic(A), Quadratic(A)
    with torch.no_grad():
        a.x.copy_(torch.tensor([1.0, -2.0, 0.5]))
        b.x.copy_(torch.tensor([-1.0, 0.0, 2.0]))
    alphas = np.linspace(-0.5, 1.5, 9)
    result = ls.interpolate(a, b, output, SCALAR_BATCH, alphas)
    for alpha, loss in zip(alphas, result.losses):
        w = (1 - alpha) * a.x.detach() + alpha * b.x.detach()
        assert loss == pytest.approx((0.5 * w @ A @ w).item(), rel=1e-12)
    assert result.metrics is None
    with pytest.raises(ValueError, match="Invalid model_b"):
        ls.interpolate(a, cnn()[0], output, SCALAR_BATCH, alphas)
    with pytest.raises(TypeError, match="Invalid model_b: a dict"):
        ls.interpolate(a, {}, output, SCALAR_BATCH, alphas)


# -- Dinh et al.'s reparametrization ----------------------------------------------------------


def top_eigenvalue(model, x, y, params=None):
    H = curvature.HessianOperator(model, F.cross_entropy, [(x, y)], params=params)
    return curvature.top_eigenvalues(H, k=1, iters=300, tol=1e-9)[0][0]


@pytest.mark.parametrize("alpha", [5.0, 0.2])
def test_rescaling_relu_layers_keeps_the_function_but_not_the_sharpness(alpha, device):
    torch.manual_seed(0)
    model = MLP(8, 3, hidden=16, depth=2).to(device, torch.float64)
    x, y = (t.to(device) for t in mlp_data())
    lam = top_eigenvalue(model, x, y)
    first, second = model.net[3], model.net[5]
    blocks = [top_eigenvalue(model, x, y, [layer.weight]) for layer in (first, second)]
    with torch.no_grad():
        out = model(x)
    assert ls.rescale_relu_layers(model, first, "net.5", alpha) is model  # module or name
    with torch.no_grad():
        torch.testing.assert_close(model(x), out, rtol=1e-12, atol=1e-12)
    # The Hessian block of a layer whose weight is multiplied by s is multiplied by 1/s^2.
    new_blocks = [top_eigenvalue(model, x, y, [layer.weight]) for layer in (first, second)]
    assert new_blocks[0] == pytest.approx(blocks[0] / alpha**2, rel=1e-6)
    assert new_blocks[1] == pytest.approx(blocks[1] * alpha**2, rel=1e-6)
    # The growing block dominates: lambda_max grew 6.5x (alpha = 5) and 6.4x (1/5).
    ratio = top_eigenvalue(model, x, y) / lam
    assert ratio > 3, ratio


@pytest.mark.parametrize("alpha", [0.0, -1.0, math.inf, math.nan])
def test_rescaling_needs_a_positive_alpha(alpha):
    model = MLP(8, 3, hidden=4, depth=1)
    with pytest.raises(ValueError, match="Invalid alpha"):
        ls.rescale_relu_layers(model, "net.1", "net.3", alpha)
    with pytest.raises(ValueError, match="Invalid first: 'net.2' .*with a weight"):
        ls.rescale_relu_layers(model, "net.2", "net.3", 2.0)  # a ReLU has no weight
    with pytest.raises(ValueError, match="Invalid second: 'net.9' .*submodule"):
        ls.rescale_relu_layers(model, "net.1", "net.9", 2.0)
    with pytest.raises(TypeError, match="Invalid first: a int"):
        ls.rescale_relu_layers(model, 1, "net.3", 2.0)
    with pytest.raises(TypeError, match="Invalid alpha"):
        ls.rescale_relu_layers(model, "net.1", "net.3", "2")


# -- plots ------------------------------------------------------------------------------------


def test_plots_return_their_artists():
    import matplotlib.pyplot as plt
    from matplotlib.collections import Collection
    from matplotlib.contour import ContourSet

    alphas, betas = np.linspace(-1, 1, 7), np.linspace(-1, 1, 5)
    grid = alphas[None, :] ** 2 + 2 * betas[:, None] ** 2
    fig = plt.figure()
    ax1, ax2 = fig.add_subplot(1, 3, 1), fig.add_subplot(1, 3, 2)
    ax3 = fig.add_subplot(1, 3, 3, projection="3d")
    (line,) = ls.plot_1d(ax1, alphas, alphas**2, label="parabola")
    assert np.array_equal(line.get_ydata(), alphas**2)
    assert isinstance(ls.plot_contour(ax2, alphas, betas, grid, levels=5), ContourSet)
    assert isinstance(ls.plot_surface(ax3, alphas, betas, grid), Collection)
    plt.close(fig)
