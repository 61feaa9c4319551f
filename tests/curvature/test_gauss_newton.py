"""Tests of lsdl_lab.curvature.gauss_newton: the GGN and the Fisher (and the Hessian operator
beside them) against curvlinops 3.0.1
(float64, a 2-layer MLP and a tiny CNN, both reductions of cross-entropy and squared error),
against independent dense computations (per-example gradients, the Hessian of a linear
model), in expectation, through the probes, and on bad input. The operators run on every
device of the ``device`` fixture (models and data made on the CPU from their seeds, then
moved there), curvlinops beside them on the same device: its Monte-Carlo Fisher draws its
targets from a generator on that device, as ours does, so the same seed gives the same
matrix there too. The bad-input tests stay on the CPU."""

import pytest
import torch
import torch.nn.functional as F
from helpers import cnn, mlp
from torch import nn

from lsdl_lab import curvature as cv

pytestmark = pytest.mark.filterwarnings(
    "ignore:`torch.jit.script` is deprecated:DeprecationWarning"  # inside torch.func.jvp
)
LOSSES = {
    "cross_entropy-mean": nn.CrossEntropyLoss(),
    "cross_entropy-sum": nn.CrossEntropyLoss(reduction="sum"),
    "mse-mean": nn.MSELoss(),
    "mse-sum": nn.MSELoss(reduction="sum"),
}


def dense(op) -> torch.Tensor:
    """The operator's matrix, column by column."""
    return torch.stack([op @ e for e in torch.eye(op.dim, dtype=op.dtype, device=op.device)], 1)


def problem(make, loss_name, device="cpu"):
    """A model in evaluation mode (curvlinops does not switch modes), its loss and data."""
    model, x, y = make(device=device)
    model.eval()
    if loss_name.startswith("mse"):
        y = torch.randn(len(x), 3, generator=torch.Generator().manual_seed(9), dtype=x.dtype)
        y = y.to(device)
    return model, LOSSES[loss_name], [(x, y)]


@pytest.mark.parametrize("loss_name", LOSSES)
@pytest.mark.parametrize("make", [mlp, cnn])
def test_ggn_fisher_and_empirical_fisher_equal_curvlinops(make, loss_name, device):
    cl = pytest.importorskip("curvlinops")
    model, loss, data = problem(make, loss_name, device)
    params = list(model.parameters())
    eye = torch.eye(sum(p.numel() for p in params), dtype=torch.float64, device=device)
    # the Hessian on four random vectors (its dense matrix would cost a product per column)
    V = torch.randn(len(eye), 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    V = V.to(device)
    ours = cv.HessianOperator(model, loss, data)
    theirs = cl.HessianLinearOperator(model, loss, params, data) @ V
    torch.testing.assert_close(torch.stack([ours @ v for v in V.T], 1), theirs, rtol=1e-10,
                               atol=1e-12)  # fmt: skip
    pairs = [
        (cv.GGNOperator(model, loss, data), cl.GGNLinearOperator(model, loss, params, data)),
        (
            cv.FisherOperator(model, loss, data, empirical=True),
            cl.EFLinearOperator(model, loss, params, data),
        ),
        (  # the same seed draws the same targets: the same matrix, not only in expectation
            cv.FisherOperator(model, loss, data, samples=3, seed=5),
            cl.FisherMCLinearOperator(model, loss, params, data, seed=5, mc_samples=3),
        ),
    ]
    for ours, theirs in pairs:
        torch.testing.assert_close(dense(ours), theirs @ eye, rtol=1e-10, atol=1e-12)


def test_the_operators_restore_the_mode_and_are_fixed_matrices(device):
    model, x, y = cnn(device=device)  # BatchNorm and dropout, in training mode
    model.train()
    v = torch.randn(sum(p.numel() for p in model.parameters()), dtype=torch.float64).to(device)
    for op in (
        cv.GGNOperator(model, F.cross_entropy, [(x, y)]),
        cv.FisherOperator(model, F.cross_entropy, [(x, y)], samples=2, seed=1),
    ):
        torch.testing.assert_close(op @ v, op @ v, rtol=0, atol=0)  # same draws every time
        assert model.training and all(m.training for m in model.modules())
        G = dense(op)
        torch.testing.assert_close(G, G.T)
        assert torch.linalg.eigvalsh(G).min() > -1e-10 * G.norm()  # positive semi-definite


def test_ggn_of_a_linear_model_with_squared_error_is_its_hessian(device):
    """With f linear in w the network's curvature term vanishes: G = H exactly."""
    torch.manual_seed(0)
    model = nn.Linear(5, 3).to(device, torch.float64)
    x, y = torch.randn(20, 5, dtype=torch.float64), torch.randn(20, 3, dtype=torch.float64)
    x, y = x.to(device), y.to(device)
    G = dense(cv.GGNOperator(model, F.mse_loss, [(x, y)]))
    torch.testing.assert_close(G, cv.hessian_matrix(model, F.mse_loss, [(x, y)]))


def test_ggn_is_the_hessian_without_the_networks_curvature(device):
    """On a tanh MLP the two differ, and only the Hessian has negative eigenvalues here."""
    model, x, y = mlp(device=device)
    G = dense(cv.GGNOperator(model, F.cross_entropy, [(x, y)]))
    H = cv.hessian_matrix(model, F.cross_entropy, [(x, y)])
    assert (G - H).norm() > 1e-3 * H.norm()
    assert torch.linalg.eigvalsh(H).min() < -1e-6 and torch.linalg.eigvalsh(G).min() > -1e-12


def per_example_gradients(model, x, y, loss):
    return torch.stack(
        [
            torch.cat(
                [
                    g.flatten()
                    for g in torch.autograd.grad(
                        loss(model(xi[None]), yi[None]), model.parameters()
                    )
                ]
            )
            for xi, yi in zip(x, y)
        ]
    )


def test_empirical_fisher_is_the_mean_outer_product_of_per_example_gradients(device):
    model, x, y = mlp(device=device)
    g = per_example_gradients(model, x, y, F.cross_entropy)
    E = dense(
        cv.FisherOperator(
            model, F.cross_entropy, [(x[:25], y[:25]), (x[25:], y[25:])], empirical=True
        )
    )
    torch.testing.assert_close(E, g.T @ g / len(x))


def test_monte_carlo_fisher_tends_to_the_ggn_and_the_empirical_fisher_does_not(device):
    model, x, y = mlp(device=device)
    G = dense(cv.GGNOperator(model, F.cross_entropy, [(x, y)]))

    def error(**kwargs):
        Fm = dense(cv.FisherOperator(model, F.cross_entropy, [(x, y)], **kwargs))
        return ((Fm - G).norm() / G.norm()).item()

    few, many = error(samples=4, seed=0), error(samples=256, seed=0)
    assert many < 0.2 and many < few / 4  # Monte-Carlo error ~ 1/sqrt(samples): 8x less
    assert error(empirical=True) > 5 * many


def test_batches_are_weighted_as_the_mean_loss(device):
    model, x, y = mlp(device=device)
    for make in (
        lambda data: cv.GGNOperator(model, F.cross_entropy, data),
        lambda data: cv.FisherOperator(model, F.cross_entropy, data, empirical=True),
    ):
        whole = dense(make([(x, y)]))
        torch.testing.assert_close(dense(make([(x[:10], y[:10]), (x[10:], y[10:])])), whole)


def test_probes_and_cg_take_them(device):
    model, x, y = mlp(device=device)
    op = cv.GGNOperator(model, F.cross_entropy, [(x, y)])
    G = dense(op)
    exact = torch.linalg.eigvalsh(G)
    values, _ = cv.top_eigenvalues(op, k=2, iters=60, tol=1e-10)
    assert values == pytest.approx(exact[-2:].flip(0).tolist(), rel=1e-8)
    assert cv.trace(op, samples=60, method="hutch++")[0] == pytest.approx(
        G.trace().item(), rel=0.05
    )
    b = torch.randn(op.dim, dtype=torch.float64).to(device)
    sol, info = cv.cg(op, b, damping=1e-2, tol=1e-10)
    assert info.converged
    torch.testing.assert_close(sol, torch.linalg.solve(G + 1e-2 * torch.eye(op.dim).to(G), b))


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(loss_fn=F.nll_loss), ValueError, "Invalid loss_fn"),
        (dict(loss_fn=lambda out, y: out.sum()), ValueError, "Invalid loss_fn"),
        (dict(loss_fn=nn.CrossEntropyLoss(label_smoothing=0.1)), ValueError, "Invalid loss_fn"),
        (dict(loss_fn=nn.CrossEntropyLoss(reduction="none")), ValueError, "Invalid loss_fn"),
        (dict(samples=0), ValueError, "Invalid samples"),
        (dict(samples=2.0), TypeError, "Invalid samples"),
        (dict(seed=-1), ValueError, "Invalid seed"),
        (dict(empirical="yes"), TypeError, "Invalid empirical"),
    ],
)
def test_bad_fisher_arguments_are_named(kwargs, error, match):
    model, x, y = mlp()
    kwargs = {"loss_fn": F.cross_entropy} | kwargs
    loss_fn = kwargs.pop("loss_fn")
    with pytest.raises(error, match=match):
        cv.FisherOperator(model, loss_fn, [(x, y)], **kwargs)


def test_fisher_needs_outputs_of_one_example_per_row():
    model = nn.Conv1d(2, 3, 1).double()
    x, y = torch.randn(4, 2, 5, dtype=torch.float64), torch.zeros(4, 5, dtype=torch.long)
    with pytest.raises(ValueError, match="Invalid model: outputs of shape"):
        cv.FisherOperator(model, F.cross_entropy, [(x, y)])
