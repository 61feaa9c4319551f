"""Tests of lsdl_lab.hessian: exact quadratics, small networks against the exact Hessian,
and PyHessian 0.1 as a reference."""

import copy
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from helpers import Quadratic, cnn
from helpers import symmetric as symmetric_with_basis
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from lsdl_lab import hessian as hs

pytestmark = pytest.mark.filterwarnings(
    "ignore:`torch.jit.script` is deprecated:DeprecationWarning"  # inside torch.func.jvp
)
METHODS = ["double_backward", "forward_over_reverse"]
SPECTRUM = torch.tensor([12.0, 7.0, 4.0, 2.0, 1.0, 0.5, -0.25, -0.5], dtype=torch.float64)


def symmetric(eigenvalues: torch.Tensor, seed: int = 0) -> torch.Tensor:
    return symmetric_with_basis(eigenvalues, seed)[0]


def scaled_loss(out, y):
    return y.mean() * out


def quadratic_operator(A, method="double_backward"):
    batch = (torch.zeros(1), torch.ones(1, dtype=A.dtype))
    return hs.HessianOperator(
        Quadratic(A, torch.randn(len(A), dtype=A.dtype)), scaled_loss, [batch], method=method
    )


def mlp(seed=0, dtype=torch.float64):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).to(dtype)
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(40, 6, generator=gen, dtype=dtype)
    y = torch.randint(3, (40,), generator=gen)
    return model, x, y


# --- a quadratic with a known Hessian -------------------------------------------------------


@pytest.mark.parametrize("method", METHODS)
def test_quadratic_matvec_is_A_v_for_flat_and_list_vectors(method):
    A = symmetric(SPECTRUM)
    H = quadratic_operator(A, method)
    assert (H.num_parameters, H.dtype, H.device) == (8, torch.float64, torch.device("cpu"))
    v = torch.randn(8, dtype=torch.float64)
    torch.testing.assert_close(H.matvec(v), A @ v)
    torch.testing.assert_close(H @ v, A @ v)
    (hv,) = H.matvec([v])
    torch.testing.assert_close(hv, A @ v)


@pytest.mark.parametrize("method", METHODS)
def test_batches_are_weighted_by_size(method):
    """Batches of 1 and 3 examples scaling the loss by 1 and 2: H = (1/4 + 3/4 * 2) A."""
    A = symmetric(SPECTRUM)
    batches = [(torch.zeros(1), torch.full((1,), 1.0)), (torch.zeros(3), torch.full((3,), 2.0))]
    H = hs.HessianOperator(
        Quadratic(A, torch.randn(len(A), dtype=A.dtype)), scaled_loss, batches, method=method
    )
    v = torch.randn(8, dtype=torch.float64)
    torch.testing.assert_close(H @ v, 1.75 * (A @ v))


@pytest.mark.parametrize("method", METHODS)
def test_one_pair_is_one_batch_and_no_grad_around_the_operator_is_harmless(method):
    """A bare (x, y) pair means [(x, y)]; an operator built and used inside torch.no_grad()
    (as in an evaluation loop) still differentiates."""
    model, x, y = mlp()
    v = torch.randn(sum(p.numel() for p in model.parameters()), dtype=torch.float64)
    expected = hs.HessianOperator(model, F.cross_entropy, [(x, y)], method=method) @ v
    with torch.no_grad():
        H = hs.HessianOperator(model, F.cross_entropy, (x, y), method=method)
        hv = H @ v
    assert len(H.batches) == 1
    torch.testing.assert_close(hv, expected)
    torch.testing.assert_close(hv, hs.hessian_matrix(model, F.cross_entropy, (x, y)) @ v)


@pytest.mark.parametrize("method", METHODS)
def test_top_eigenvalues_of_a_quadratic(method):
    A = symmetric(SPECTRUM)
    H = quadratic_operator(A, method)
    values, vectors = hs.top_eigenvalues(H, k=3, iters=500, tol=1e-10, seed=1)
    assert values == pytest.approx([12.0, 7.0, 4.0], rel=1e-6)
    for lam, u in zip(values, vectors):
        assert u.norm().item() == pytest.approx(1.0)
        torch.testing.assert_close(A @ u, lam * u, atol=1e-4, rtol=0)
    assert hs.lanczos_eigenvalues(H, k=3, seed=1) == pytest.approx([12.0, 7.0, 4.0], rel=1e-10)
    # seeded: the same seed gives the same vectors
    again, again_vectors = hs.top_eigenvalues(H, k=3, iters=500, tol=1e-10, seed=1)
    assert again == values and all(torch.equal(a, b) for a, b in zip(again_vectors, vectors))


def test_lanczos_with_m_equal_dim_recovers_the_whole_spectrum():
    A = symmetric(SPECTRUM)
    alpha, beta = hs.lanczos(quadratic_operator(A), m=8, seed=3)
    assert alpha.shape == (8,) and beta.shape == (7,)
    T = torch.diag(alpha) + torch.diag(beta, 1) + torch.diag(beta, -1)
    torch.testing.assert_close(torch.linalg.eigvalsh(T), SPECTRUM.sort().values)


def test_lanczos_goes_on_past_an_invariant_subspace():
    """A repeated eigenvalue closes the Krylov space early; the spectrum is still found."""
    spectrum = torch.tensor([5.0, 5.0, 5.0, 2.0, 2.0, 1.0], dtype=torch.float64)
    alpha, beta = hs.lanczos(quadratic_operator(symmetric(spectrum)), m=6)
    T = torch.diag(alpha) + torch.diag(beta, 1) + torch.diag(beta, -1)
    torch.testing.assert_close(torch.linalg.eigvalsh(T), spectrum.sort().values)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(2, 10), m=st.integers(1, 10))
def test_ritz_values_lie_within_the_spectrum(seed, n, m):
    gen = torch.Generator().manual_seed(seed)
    spectrum = torch.randn(n, generator=gen, dtype=torch.float64) * 3
    alpha, beta = hs.lanczos(quadratic_operator(symmetric(spectrum, seed)), m=m, seed=seed)
    assert len(alpha) == min(m, n)
    ritz = torch.linalg.eigvalsh(torch.diag(alpha) + torch.diag(beta, 1) + torch.diag(beta, -1))
    assert ritz.min() >= spectrum.min() - 1e-9 and ritz.max() <= spectrum.max() + 1e-9


def test_trace_within_three_standard_errors_for_both_distributions():
    A = symmetric(SPECTRUM)
    H = quadratic_operator(A)
    for distribution in ("rademacher", "gaussian"):
        mean, se = hs.trace(H, samples=400, seed=5, distribution=distribution)
        assert se > 0
        assert abs(mean - A.trace().item()) < 3 * se, (distribution, mean, se)
    assert hs.trace(H, samples=50, seed=5) == hs.trace(H, samples=50, seed=5)


def test_trace_is_exact_in_expectation():
    """Rademacher: v^T A v = tr A + sum_{i!=j} v_i v_j A_ij, so a diagonal A gives tr A with
    every single probe, and averaging over all 2^n sign vectors gives tr A for any A."""
    D = torch.diag(SPECTRUM)
    assert hs.trace(quadratic_operator(D), samples=3) == (pytest.approx(SPECTRUM.sum().item()), 0)
    A = symmetric(SPECTRUM)
    H = quadratic_operator(A)
    signs = torch.cartesian_prod(*[torch.tensor([-1.0, 1.0], dtype=torch.float64)] * 8)
    exact = torch.stack([v @ H.matvec(v) for v in signs]).mean()
    assert exact.item() == pytest.approx(A.trace().item(), rel=1e-12)


def test_slq_nodes_and_weights_reproduce_the_spectrum():
    A = symmetric(SPECTRUM)
    n, runs = len(SPECTRUM), 200
    sd = hs.spectral_density(quadratic_operator(A), runs=runs, m=n, seed=2)
    # m = n: every run's nodes are the eigenvalues themselves
    torch.testing.assert_close(sd.nodes.view(runs, n), SPECTRUM.sort().values.expand(runs, n))
    assert sd.weights.sum().item() == pytest.approx(1.0, abs=1e-12)
    # each eigenvalue's weight is E[(u_i^T q)^2] = 1/n; its standard error < 0.1/n here
    per_eigenvalue = sd.weights.view(runs, n).sum(0)
    torch.testing.assert_close(
        per_eigenvalue, torch.full((n,), 1 / n, dtype=torch.float64), atol=0.04, rtol=0
    )
    # mean of the measure = (1/runs) sum q^T A q, E = tr A / n with a known standard error
    offdiag = A - torch.diag(torch.diag(A))
    se = math.sqrt(2 * offdiag.square().sum().item() / n**2 / runs)
    assert abs(sd.weights @ sd.nodes - A.trace().item() / n) < 3 * se
    # the broadened density integrates to 1 and its support is within [lmin, lmax]
    assert torch.trapezoid(sd.density, sd.grid).item() == pytest.approx(1.0)
    # a diagonal A makes the mean exact with any probe
    sd = hs.spectral_density(quadratic_operator(torch.diag(SPECTRUM)), runs=3, m=4)
    assert (sd.weights @ sd.nodes).item() == pytest.approx(SPECTRUM.mean().item(), rel=1e-12)
    assert sd.nodes.min() >= SPECTRUM.min() - 1e-9 and sd.nodes.max() <= SPECTRUM.max() + 1e-9


def test_density_on_a_given_grid_with_given_sigma():
    A = symmetric(SPECTRUM)
    grid = torch.linspace(-3, 15, 2001)
    sd = hs.spectral_density(quadratic_operator(A), runs=2, m=8, grid=grid, sigma=0.2)
    assert sd.grid.shape == (2001,) and sd.density.shape == (2001,)
    assert torch.trapezoid(sd.density, sd.grid).item() == pytest.approx(1.0)
    # Gaussian broadening keeps the mean and adds sigma^2 to the variance
    mean = (sd.weights @ sd.nodes).item()
    assert torch.trapezoid(sd.grid * sd.density, sd.grid).item() == pytest.approx(mean)
    var = (sd.weights @ (sd.nodes - mean) ** 2).item() + 0.2**2
    assert torch.trapezoid((sd.grid - mean) ** 2 * sd.density, sd.grid).item() == pytest.approx(var)
    # no mass beyond 6 sigma outside [lmin, lmax]
    outside = (sd.grid < SPECTRUM.min() - 6 * 0.2) | (sd.grid > SPECTRUM.max() + 6 * 0.2)
    assert sd.density[outside].max() < 1e-7


# --- small networks against their exact Hessian ---------------------------------------------


@pytest.mark.parametrize("make", [mlp, cnn], ids=["mlp", "cnn"])
def test_network_matvec_matches_exact_hessian_and_methods_agree(make):
    model, x, y = make()
    model.train()
    state = copy.deepcopy(model.state_dict())
    batches = [(x[:10], y[:10]), (x[10:], y[10:])]  # uneven sizes
    exact = hs.hessian_matrix(model, F.cross_entropy, batches)
    assert model.training
    one_batch = hs.hessian_matrix(model, F.cross_entropy, [(x, y)])
    torch.testing.assert_close(exact, one_batch)
    torch.testing.assert_close(exact, exact.T)
    gen = torch.Generator().manual_seed(0)
    V = torch.randn(3, len(exact), generator=gen, dtype=torch.float64)
    for method in METHODS:
        H = hs.HessianOperator(model, F.cross_entropy, batches, method=method)
        for v in V:
            torch.testing.assert_close(H @ v, exact @ v)
        assert model.training and all(m.training for m in model.modules())
    # eval mode did not touch BatchNorm's running statistics
    for k, t in model.state_dict().items():
        torch.testing.assert_close(t, state[k], msg=k)


def test_mixed_modes_are_restored_and_params_select_a_block():
    model, x, y = cnn()
    model.train()
    model[1].eval()
    last = list(model[6].parameters())
    H = hs.HessianOperator(model, F.cross_entropy, [(x, y)], params=last)
    assert H.num_parameters == 39
    exact = hs.hessian_matrix(model, F.cross_entropy, [(x, y)])
    v = torch.randn(39, dtype=torch.float64)
    torch.testing.assert_close(H @ v, exact[-39:, -39:] @ v)
    H2 = hs.HessianOperator(
        model, F.cross_entropy, [(x, y)], params=last, method="forward_over_reverse"
    )
    torch.testing.assert_close(H2 @ v, H @ v)
    assert model.training and model[0].training and not model[1].training


def test_a_training_step_makes_a_kept_graph_stale_but_not_a_recomputed_one():
    model, x, y = mlp()
    H = hs.HessianOperator(model, F.cross_entropy, [(x, y)])
    H_func = hs.HessianOperator(model, F.cross_entropy, [(x, y)], method="forward_over_reverse")
    F.cross_entropy(model(x), y).backward()
    torch.optim.SGD(model.parameters(), lr=0.5).step()
    v = torch.randn(H.num_parameters, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="build a new operator"):
        H @ v
    exact = hs.hessian_matrix(model, F.cross_entropy, [(x, y)])
    torch.testing.assert_close(H_func @ v, exact @ v)


def test_network_probes_against_exact_eigenvalues():
    model, x, y = mlp()
    exact = hs.hessian_matrix(model, F.cross_entropy, [(x, y)])
    lam = torch.linalg.eigvalsh(exact)
    H = hs.HessianOperator(model, F.cross_entropy, [(x, y)])
    top = lam[lam.abs().argmax()].item()
    assert hs.top_eigenvalues(H, iters=1000, tol=1e-12)[0][0] == pytest.approx(top, rel=1e-6)
    assert hs.lanczos_eigenvalues(H, k=2, m=30) == pytest.approx(lam[-2:].flip(0).tolist())
    mean, se = hs.trace(H, samples=200, seed=1)
    assert abs(mean - exact.trace().item()) < 3 * se


# --- PyHessian 0.1 as a reference ----------------------------------------------------------


@pytest.fixture(scope="module")
def reference():
    """A float32 MLP, our operator on it and PyHessian's, each on its own copy of the model."""
    pyhessian = pytest.importorskip("pyhessian")
    model, x, y = mlp(seed=3, dtype=torch.float32)
    model.train()
    H = hs.HessianOperator(model, F.cross_entropy, [(x, y)])
    with warnings.catch_warnings():  # its backward(create_graph=True) warns of a cycle
        warnings.simplefilter("ignore", UserWarning)
        theirs = pyhessian.hessian(copy.deepcopy(model), F.cross_entropy, data=(x, y), cuda=False)
    assert model.training  # ours is untouched; their copy was left in eval mode
    assert not theirs.model.training
    exact = hs.hessian_matrix(copy.deepcopy(model).double(), F.cross_entropy, [(x.double(), y)])
    return H, theirs, exact


def test_top_eigenvalue_agrees_with_pyhessian(reference):
    H, theirs, exact = reference
    torch.manual_seed(0)
    (their_top,), _ = theirs.eigenvalues(maxIter=500, tol=1e-6, top_n=1)
    (ours,), _ = hs.top_eigenvalues(H, iters=500, tol=1e-6, seed=0)
    assert ours == pytest.approx(their_top, rel=1e-2)
    assert ours == pytest.approx(torch.linalg.eigvalsh(exact)[-1].item(), rel=1e-3)


def test_trace_agrees_with_pyhessian(reference):
    H, theirs, exact = reference
    torch.manual_seed(0)
    samples = torch.tensor(theirs.trace(maxIter=300, tol=1e-9), dtype=torch.float64)
    assert len(samples) == 300  # the tight tol kept it from stopping early
    their_mean, their_se = samples.mean().item(), samples.std().item() / math.sqrt(300)
    ours, se = hs.trace(H, samples=300, seed=0)
    assert abs(ours - their_mean) < 3 * math.hypot(se, their_se)
    assert abs(ours - exact.trace().item()) < 3 * se


def test_pyhessian_density_crashes_and_ours_matches_the_exact_spectrum(reference):
    H, theirs, exact = reference
    with pytest.raises(RuntimeError, match="torch.eig"):  # torch.eig is gone from torch
        theirs.density(iter=3, n_v=1)
    lam = torch.linalg.eigvalsh(exact)
    P, runs = len(lam), 20
    sd = hs.spectral_density(H, runs=runs, m=20, seed=0)
    spread = (lam[-1] - lam[0]).item()
    assert sd.weights.sum().item() == pytest.approx(1.0, abs=1e-9)
    assert torch.trapezoid(sd.density, sd.grid).item() == pytest.approx(1.0, abs=1e-6)
    # Ritz values lie in [lmin, lmax] (up to float32 round-off) and reach the extremes
    assert sd.nodes.min() >= lam[0] - 1e-4 * spread and sd.nodes.max() <= lam[-1] + 1e-4 * spread
    assert sd.nodes.max().item() == pytest.approx(lam[-1].item(), rel=1e-3)
    # the quadrature's mean is tr H / P up to the Rademacher probes' known standard error
    offdiag = exact - torch.diag(torch.diag(exact))
    se = math.sqrt(2 * offdiag.square().sum().item() / P**2 / runs)
    assert abs((sd.weights @ sd.nodes).item() - exact.trace().item() / P) < 3 * se
    # the estimated measure is close to the exact one: 1-Wasserstein distance between CDFs
    t = torch.linspace(lam[0].item(), lam[-1].item(), 4001, dtype=torch.float64)
    cdf_exact = (lam[None, :] <= t[:, None]).double().mean(1)
    cdf_slq = ((sd.nodes[None, :] <= t[:, None]).double() * sd.weights).sum(1)
    w1 = torch.trapezoid((cdf_exact - cdf_slq).abs(), t).item()
    assert w1 < 0.02 * spread, w1


# --- bad input -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "call, name",
    [
        (lambda H: hs.top_eigenvalues(H, k=0), "k"),
        (lambda H: hs.top_eigenvalues(H, k=9), "k"),
        (lambda H: hs.top_eigenvalues(H, iters=0), "iters"),
        (lambda H: hs.trace(H, samples=1), "samples"),
        (lambda H: hs.trace(H, distribution="uniform"), "distribution"),
        (lambda H: hs.lanczos(H, m=0), "m"),
        (lambda H: hs.lanczos_eigenvalues(H, k=0), "k"),
        (lambda H: hs.lanczos_eigenvalues(H, k=3, m=2), "k"),
        (lambda H: hs.lanczos_eigenvalues(H, m=0), "m"),
        (lambda H: hs.spectral_density(H, m=0), "m"),
        (lambda H: hs.spectral_density(H, runs=0), "runs"),
        (lambda H: hs.spectral_density(H, sigma=0.0), "sigma"),
        (lambda H: H.matvec(torch.zeros(7, dtype=torch.float64)), "v"),
    ],
)
def test_bad_arguments_are_named(call, name):
    H = quadratic_operator(symmetric(SPECTRUM))
    with pytest.raises(ValueError, match=f"Invalid {name}:"):
        call(H)


def test_bad_operator_arguments_are_named():
    model, x, y = mlp()
    with pytest.raises(ValueError, match="Invalid method:"):
        hs.HessianOperator(model, F.cross_entropy, [(x, y)], method="finite_differences")
    with pytest.raises(ValueError, match="Invalid batches:"):
        hs.HessianOperator(model, F.cross_entropy, [])
    with pytest.raises(ValueError, match="Invalid batches:"):
        hs.hessian_matrix(model, F.cross_entropy, iter([]))
    with pytest.raises(ValueError, match="Invalid params:"):
        hs.HessianOperator(
            model,
            F.cross_entropy,
            [(x, y)],
            params=[torch.zeros(2, requires_grad=True)],
            method="forward_over_reverse",
        )
    with pytest.raises(ValueError, match="Invalid params:"):
        hs.HessianOperator(model, F.cross_entropy, [(x, y)], params=[])
