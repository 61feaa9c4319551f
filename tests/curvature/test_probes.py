"""Tests of lsdl_lab.curvature.probes: exact quadratics, any operator of the protocol (a
dense matrix, a test double), small networks against their exact Hessian, and PyHessian 0.1
as a reference.

The probes run on every device of the ``device`` fixture: the matrices and models are made
on the CPU from their seeds and moved there, and the probes draw their random vectors from
a generator on the operator's device. CUDA's generator draws other vectors than the CPU's
from the same seed, so a check that holds "within three standard errors" for the CPU's
fixed draws is made within ``z(device)`` standard errors. PyHessian runs on the CPU only
(``cuda=False``), and so do its comparisons and the bad-input tests."""

import copy
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from helpers import mlp, quadratic_operator
from helpers import symmetric as symmetric_with_basis
from hypothesis import given, settings
from hypothesis import strategies as st

from lsdl_lab import curvature as cv

pytestmark = pytest.mark.filterwarnings(
    "ignore:`torch.jit.script` is deprecated:DeprecationWarning"  # inside torch.func.jvp
)
METHODS = ["double_backward", "forward_over_reverse"]
SPECTRUM = torch.tensor([12.0, 7.0, 4.0, 2.0, 1.0, 0.5, -0.25, -0.5], dtype=torch.float64)


def symmetric(eigenvalues: torch.Tensor, seed: int = 0, device="cpu") -> torch.Tensor:
    return symmetric_with_basis(eigenvalues, seed)[0].to(device)


def z(device: torch.device) -> float:
    """Standard errors a statistical check allows: 3 for the CPU's fixed draws (a chance of
    3 in 1,000 that a new seed fails), 4 on CUDA, whose draws these seeds were not chosen
    on (6 in 100,000)."""
    return 3.0 if device.type == "cpu" else 4.0


# --- a quadratic with a known Hessian -------------------------------------------------------


@pytest.mark.parametrize("method", METHODS)
def test_top_eigenvalues_of_a_quadratic(method, device):
    A = symmetric(SPECTRUM, device=device)
    H = quadratic_operator(A, method)
    values, vectors = cv.top_eigenvalues(H, k=3, iters=500, tol=1e-10, seed=1)
    assert values == pytest.approx([12.0, 7.0, 4.0], rel=1e-6)
    for lam, u in zip(values, vectors):
        assert u.norm().item() == pytest.approx(1.0)
        torch.testing.assert_close(A @ u, lam * u, atol=1e-4, rtol=0)
    assert cv.lanczos_eigenvalues(H, k=3, seed=1) == pytest.approx([12.0, 7.0, 4.0], rel=1e-10)
    # seeded: the same seed gives the same vectors
    again, again_vectors = cv.top_eigenvalues(H, k=3, iters=500, tol=1e-10, seed=1)
    assert again == values and all(torch.equal(a, b) for a, b in zip(again_vectors, vectors))


def test_lanczos_with_m_equal_dim_recovers_the_whole_spectrum(device):
    A = symmetric(SPECTRUM, device=device)
    alpha, beta = cv.lanczos(quadratic_operator(A), m=8, seed=3)
    assert alpha.shape == (8,) and beta.shape == (7,)
    assert alpha.device.type == beta.device.type == "cpu"  # host numbers, one per product
    T = torch.diag(alpha) + torch.diag(beta, 1) + torch.diag(beta, -1)
    torch.testing.assert_close(torch.linalg.eigvalsh(T), SPECTRUM.sort().values)


def test_lanczos_goes_on_past_an_invariant_subspace(device):
    """A repeated eigenvalue closes the Krylov space early; the spectrum is still found."""
    spectrum = torch.tensor([5.0, 5.0, 5.0, 2.0, 2.0, 1.0], dtype=torch.float64)
    alpha, beta = cv.lanczos(quadratic_operator(symmetric(spectrum, device=device)), m=6)
    T = torch.diag(alpha) + torch.diag(beta, 1) + torch.diag(beta, -1)
    torch.testing.assert_close(torch.linalg.eigvalsh(T), spectrum.sort().values)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(2, 10), m=st.integers(1, 10))
def test_ritz_values_lie_within_the_spectrum(seed, n, m, device):
    gen = torch.Generator().manual_seed(seed)
    spectrum = torch.randn(n, generator=gen, dtype=torch.float64) * 3
    A = symmetric(spectrum, seed, device)
    alpha, beta = cv.lanczos(quadratic_operator(A), m=m, seed=seed)
    assert len(alpha) == min(m, n)
    ritz = torch.linalg.eigvalsh(torch.diag(alpha) + torch.diag(beta, 1) + torch.diag(beta, -1))
    assert ritz.min() >= spectrum.min() - 1e-9 and ritz.max() <= spectrum.max() + 1e-9


def test_trace_within_three_standard_errors_for_both_distributions(device):
    A = symmetric(SPECTRUM, device=device)
    H = quadratic_operator(A)
    for distribution in ("rademacher", "gaussian"):
        mean, se = cv.trace(H, samples=400, seed=5, distribution=distribution)
        assert se > 0
        assert abs(mean - A.trace().item()) < z(device) * se, (distribution, mean, se)
    assert cv.trace(H, samples=50, seed=5) == cv.trace(H, samples=50, seed=5)


def test_trace_is_exact_in_expectation(device):
    """Rademacher: v^T A v = tr A + sum_{i!=j} v_i v_j A_ij, so a diagonal A gives tr A with
    every single probe, and averaging over all 2^n sign vectors gives tr A for any A."""
    D = torch.diag(SPECTRUM).to(device)
    assert cv.trace(quadratic_operator(D), samples=3) == (pytest.approx(SPECTRUM.sum().item()), 0)
    A = symmetric(SPECTRUM, device=device)
    H = quadratic_operator(A)
    signs = torch.cartesian_prod(*[torch.tensor([-1.0, 1.0], dtype=torch.float64)] * 8)
    signs = signs.to(device)
    exact = torch.stack([v @ H.matvec(v) for v in signs]).mean()
    assert exact.item() == pytest.approx(A.trace().item(), rel=1e-12)


def test_slq_nodes_and_weights_reproduce_the_spectrum(device):
    A = symmetric(SPECTRUM, device=device)
    n, runs = len(SPECTRUM), 200
    sd = cv.spectral_density(quadratic_operator(A), runs=runs, m=n, seed=2)
    assert {t.device.type for t in sd} == {"cpu"}  # the quadrature: host numbers
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
    assert abs(sd.weights @ sd.nodes - A.trace().item() / n) < z(device) * se
    # the broadened density integrates to 1 and its support is within [lmin, lmax]
    assert torch.trapezoid(sd.density, sd.grid).item() == pytest.approx(1.0)
    # a diagonal A makes the mean exact with any probe
    sd = cv.spectral_density(quadratic_operator(torch.diag(SPECTRUM).to(device)), runs=3, m=4)
    assert (sd.weights @ sd.nodes).item() == pytest.approx(SPECTRUM.mean().item(), rel=1e-12)
    assert sd.nodes.min() >= SPECTRUM.min() - 1e-9 and sd.nodes.max() <= SPECTRUM.max() + 1e-9


def test_density_on_a_given_grid_with_given_sigma(device):
    A = symmetric(SPECTRUM, device=device)
    grid = torch.linspace(-3, 15, 2001, device=device)  # on the CPU in the result
    sd = cv.spectral_density(quadratic_operator(A), runs=2, m=8, grid=grid, sigma=0.2)
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


# --- any operator of the protocol ----------------------------------------------------------


class MatrixOperator(cv.CurvatureOperator):
    """The smallest operator of the protocol: a matrix, its product, nothing else."""

    def __init__(self, A):
        self.A, self.dim, self.dtype, self.device = A, len(A), A.dtype, A.device

    def _matvec(self, v):
        return self.A @ v


def test_every_probe_takes_any_operator_and_costs_the_products_it_says(device):
    A = symmetric(SPECTRUM, device=device)
    op = MatrixOperator(A)
    values, vectors = cv.top_eigenvalues(op, k=2, iters=500, tol=1e-10, seed=1)
    assert values == pytest.approx([12.0, 7.0], rel=1e-6)
    assert op.products <= 2 * 500
    op.products = 0
    alpha, beta = cv.lanczos(op, m=8, seed=3)
    T = torch.diag(alpha) + torch.diag(beta, 1) + torch.diag(beta, -1)
    torch.testing.assert_close(torch.linalg.eigvalsh(T), SPECTRUM.sort().values)
    assert op.products == 8
    op.products = 0
    assert cv.lanczos_eigenvalues(op, k=3, m=8, seed=1) == pytest.approx([12.0, 7.0, 4.0])
    assert op.products == 8
    op.products = 0
    mean, se = cv.trace(op, samples=50, seed=5)
    assert op.products == 50 and abs(mean - A.trace().item()) < z(device) * se
    for method, samples in [("hutch++", 7), ("xtrace", 6)]:
        op.products = 0
        cv.trace(op, samples=samples, method=method)
        assert op.products == samples
    op.products = 0
    sd = cv.spectral_density(op, runs=3, m=8, seed=2)
    assert op.products == 3 * 8
    torch.testing.assert_close(sd.nodes.view(3, 8), SPECTRUM.sort().values.expand(3, 8))


def test_the_probes_depend_only_on_the_products(device):
    """A model's Hessian operator and its exact Hessian as a dense operator: the same numbers
    (up to rounding) from the same seeds."""
    model, x, y = mlp(device=device)
    H = cv.HessianOperator(model, F.cross_entropy, [(x, y)])
    D = cv.DenseOperator(cv.hessian_matrix(model, F.cross_entropy, [(x, y)]))
    for probe in (
        lambda A: cv.top_eigenvalues(A, k=2, iters=50, tol=0.0, seed=4)[0],
        lambda A: cv.lanczos_eigenvalues(A, k=3, m=20, seed=4),
        lambda A: list(cv.trace(A, samples=20, seed=4)),
        lambda A: cv.spectral_density(A, runs=2, m=10, seed=4).nodes.tolist(),
    ):
        assert probe(H) == pytest.approx(probe(D), rel=1e-8, abs=1e-10)


# --- Lanczos against power iteration --------------------------------------------------------


@pytest.mark.parametrize("method", ["lanczos", "power"])
def test_both_methods_find_the_eigenpairs_of_largest_magnitude(method, device):
    spectrum = torch.tensor([-9.0, 6.0, 3.0, 1.0, 0.5, -0.2], dtype=torch.float64)
    A = symmetric(spectrum, device=device)
    values, vectors = cv.top_eigenvalues(
        cv.DenseOperator(A), k=2, iters=2000, tol=1e-12, method=method
    )
    assert values == pytest.approx([-9.0, 6.0], rel=1e-8)
    for lam, u in zip(values, vectors):
        assert u.norm().item() == pytest.approx(1.0)
        assert (A @ u - lam * u).norm().item() < 1e-4


def test_lanczos_needs_fewer_products_than_power_iteration_at_equal_accuracy(device):
    """Close top eigenvalues (a gap of 5%): power iteration crawls, Lanczos does not."""
    spectrum = torch.cat([torch.tensor([10.0, 9.5, 9.0]), torch.linspace(8.0, 0.0, 197)])
    A = cv.DenseOperator(symmetric(spectrum.double(), device=device))
    results = {}
    for method in ("lanczos", "power"):
        A.products = 0
        values, _ = cv.top_eigenvalues(A, k=3, iters=5000, tol=1e-10, seed=2, method=method)
        results[method] = A.products
        assert values == pytest.approx([10.0, 9.5, 9.0], rel=1e-6)
    assert 3 * results["lanczos"] < results["power"], results


def test_lanczos_stops_when_the_residuals_are_small(device):
    A = symmetric(SPECTRUM, device=device)
    op = cv.DenseOperator(A)
    (lam,), (u,) = cv.top_eigenvalues(op, tol=1e-3, seed=3)
    loose = op.products
    assert (A @ u - lam * u).norm().item() <= 1e-3 * abs(lam) * (1 + 1e-6)
    op.products = 0
    cv.top_eigenvalues(op, tol=0.0, iters=5, seed=3)
    assert op.products == 5  # tol = 0: the whole budget
    assert loose < 8  # a loose tolerance stops before the Krylov space is the whole space


# --- Hutch++ and XTrace ------------------------------------------------------------------------


def decaying(n=300, power=2.0, seed=0, device="cpu") -> torch.Tensor:
    """A PSD matrix with eigenvalues i^(-power), like a Hessian's decaying spectrum."""
    return symmetric(torch.arange(1, n + 1, dtype=torch.float64) ** -power, seed, device)


def test_hutchpp_error_falls_faster_than_hutchinsons(device):
    """Mean absolute error over 40 seeds at 30 and 120 products: Hutchinson's falls like
    1/sqrt(m) (by about 2), Hutch++'s like 1/m or faster on a decaying spectrum."""
    A = decaying(device=device)
    op, exact = cv.DenseOperator(A), A.trace().item()

    def error(method, m):
        errors = [abs(cv.trace(op, m, seed=s, method=method)[0] - exact) for s in range(40)]
        return sum(errors) / len(errors)

    hutchinson = [error("hutchinson", m) for m in (30, 120)]
    hutchpp = [error("hutch++", m) for m in (30, 120)]
    assert hutchpp[0] < hutchinson[0] and hutchpp[1] < hutchinson[1] / 4
    assert hutchpp[0] / hutchpp[1] > 2 * hutchinson[0] / hutchinson[1]


@pytest.mark.parametrize("method, samples", [("hutch++", 9), ("xtrace", 8)])
def test_a_low_rank_trace_is_exact(method, samples, device):
    """Rank 3 < the sketch's size: the sketch holds the whole range, nothing is left."""
    A = symmetric(torch.tensor([5.0, 2.0, 1.0] + [0.0] * 37, dtype=torch.float64), 0, device)
    estimate, _ = cv.trace(cv.DenseOperator(A), samples=samples, seed=1, method=method)
    assert estimate == pytest.approx(8.0, rel=1e-10)


@pytest.mark.parametrize("method, name", [("hutch++", "hutchpp_trace"), ("xtrace", "xtrace")])
def test_trace_estimators_match_curvlinops_in_distribution(method, name, device):
    """curvlinops draws from torch's global generator with other calls, so the draws differ;
    over 200 seeds both estimators are unbiased and have the same spread (curvlinops on the
    CPU, ours on the device)."""
    cl = pytest.importorskip("curvlinops")
    A = decaying(n=60)
    exact, op = A.trace().item(), cv.DenseOperator(A.to(device))
    ours, theirs = [], []
    for seed in range(200):
        ours.append(cv.trace(op, samples=12, seed=seed, method=method)[0])
        torch.manual_seed(seed)
        theirs.append(getattr(cl, name)(A, num_matvecs=12).item())
    ours, theirs = torch.tensor(ours), torch.tensor(theirs)
    for estimates in (ours, theirs):
        assert abs(estimates.mean().item() - exact) < 4 * estimates.std().item() / 200**0.5
    assert ours.std().item() == pytest.approx(theirs.std().item(), rel=0.25)


@pytest.mark.parametrize("method", ["hutch++", "xtrace"])
def test_standard_errors_cover_the_exact_trace(method, device):
    A = decaying(n=120, power=1.0, device=device)
    op, exact = cv.DenseOperator(A), A.trace().item()
    z = [(cv.trace(op, 24, seed=s, method=method), exact) for s in range(60)]
    z = torch.tensor([(mean - t) / se for (mean, se), t in z])
    assert (z.abs() < 3).double().mean().item() > 0.85  # about 99.7% if the error were normal


def test_hutchpp_and_xtrace_on_a_networks_hessian(device):
    model, x, y = mlp(device=device)
    H = cv.HessianOperator(model, F.cross_entropy, [(x, y)])
    exact = cv.hessian_matrix(model, F.cross_entropy, [(x, y)]).trace().item()
    for method in ("hutch++", "xtrace"):
        mean, se = cv.trace(H, samples=60, seed=1, method=method)
        assert abs(mean - exact) < 4 * se


# --- small networks against their exact Hessian ---------------------------------------------


def test_network_probes_against_exact_eigenvalues(device):
    model, x, y = mlp(device=device)
    exact = cv.hessian_matrix(model, F.cross_entropy, [(x, y)])
    lam = torch.linalg.eigvalsh(exact)
    H = cv.HessianOperator(model, F.cross_entropy, [(x, y)])
    top = lam[lam.abs().argmax()].item()
    assert cv.top_eigenvalues(H, iters=1000, tol=1e-12)[0][0] == pytest.approx(top, rel=1e-6)
    assert cv.lanczos_eigenvalues(H, k=2, m=30) == pytest.approx(lam[-2:].flip(0).tolist())
    mean, se = cv.trace(H, samples=200, seed=1)
    assert abs(mean - exact.trace().item()) < z(device) * se


# --- PyHessian 0.1 as a reference ----------------------------------------------------------


@pytest.fixture(scope="module")
def reference():
    """A float32 MLP, our operator on it and PyHessian's, each on its own copy of the model."""
    pyhessian = pytest.importorskip("pyhessian")
    model, x, y = mlp(seed=3, dtype=torch.float32)
    model.train()
    H = cv.HessianOperator(model, F.cross_entropy, [(x, y)])
    with warnings.catch_warnings():  # its backward(create_graph=True) warns of a cycle
        warnings.simplefilter("ignore", UserWarning)
        theirs = pyhessian.hessian(copy.deepcopy(model), F.cross_entropy, data=(x, y), cuda=False)
    assert model.training  # ours is untouched; their copy was left in eval mode
    assert not theirs.model.training
    exact = cv.hessian_matrix(copy.deepcopy(model).double(), F.cross_entropy, [(x.double(), y)])
    return H, theirs, exact


def test_top_eigenvalue_agrees_with_pyhessian(reference):
    H, theirs, exact = reference
    torch.manual_seed(0)
    (their_top,), _ = theirs.eigenvalues(maxIter=500, tol=1e-6, top_n=1)
    (ours,), _ = cv.top_eigenvalues(H, iters=500, tol=1e-6, seed=0)
    assert ours == pytest.approx(their_top, rel=1e-2)
    assert ours == pytest.approx(torch.linalg.eigvalsh(exact)[-1].item(), rel=1e-3)


def test_trace_agrees_with_pyhessian(reference):
    H, theirs, exact = reference
    torch.manual_seed(0)
    samples = torch.tensor(theirs.trace(maxIter=300, tol=1e-9), dtype=torch.float64)
    assert len(samples) == 300  # the tight tol kept it from stopping early
    their_mean, their_se = samples.mean().item(), samples.std().item() / math.sqrt(300)
    ours, se = cv.trace(H, samples=300, seed=0)
    assert abs(ours - their_mean) < 3 * math.hypot(se, their_se)
    assert abs(ours - exact.trace().item()) < 3 * se


def test_pyhessian_density_crashes_and_ours_matches_the_exact_spectrum(reference):
    H, theirs, exact = reference
    with pytest.raises(RuntimeError, match="torch.eig"):  # torch.eig is gone from torch
        theirs.density(iter=3, n_v=1)
    lam = torch.linalg.eigvalsh(exact)
    P, runs = len(lam), 20
    sd = cv.spectral_density(H, runs=runs, m=20, seed=0)
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
        (lambda H: cv.top_eigenvalues(H, k=0), "k"),
        (lambda H: cv.top_eigenvalues(H, k=9), "k"),
        (lambda H: cv.top_eigenvalues(H, iters=0), "iters"),
        (lambda H: cv.trace(H, samples=1), "samples"),
        (lambda H: cv.trace(H, distribution="uniform"), "distribution"),
        (lambda H: cv.lanczos(H, m=0), "m"),
        (lambda H: cv.lanczos_eigenvalues(H, k=0), "k"),
        (lambda H: cv.lanczos_eigenvalues(H, k=3, m=2), "k"),
        (lambda H: cv.lanczos_eigenvalues(H, m=0), "m"),
        (lambda H: cv.spectral_density(H, m=0), "m"),
        (lambda H: cv.spectral_density(H, runs=0), "runs"),
        (lambda H: cv.spectral_density(H, sigma=0.0), "sigma"),
        (lambda H: cv.top_eigenvalues(H, tol=-1e-3), "tol"),
        (lambda H: cv.trace(H, seed=-1), "seed"),
        (lambda H: cv.trace(H, method="hutch+"), "method"),
        (lambda H: cv.trace(H, samples=7, method="xtrace"), "samples"),
        (lambda H: cv.top_eigenvalues(H, method="arnoldi"), "method"),
        (lambda H: cv.top_eigenvalues(H, k=3, iters=2), "iters"),
    ],
)
def test_bad_values_are_value_errors_naming_the_argument(call, name):
    H = quadratic_operator(symmetric(SPECTRUM))
    with pytest.raises(ValueError, match=f"Invalid {name}:"):
        call(H)


@pytest.mark.parametrize(
    "call, name",
    [
        (lambda H: cv.top_eigenvalues(H, k=1.0), "k"),
        (lambda H: cv.top_eigenvalues(H, iters="10"), "iters"),
        (lambda H: cv.top_eigenvalues(H, tol=None), "tol"),
        (lambda H: cv.trace(H, samples=10.0), "samples"),
        (lambda H: cv.trace(H, seed=0.5), "seed"),
        (lambda H: cv.lanczos(H, m=True), "m"),
        (lambda H: cv.lanczos_eigenvalues(H, m=4.0), "m"),
        (lambda H: cv.spectral_density(H, runs=2.0), "runs"),
        (lambda H: cv.spectral_density(H, sigma="wide"), "sigma"),
        (lambda H: cv.trace(H.matrix, samples=10), "A"),
        (lambda H: cv.top_eigenvalues(lambda v: v), "A"),
    ],
)
def test_bad_types_are_type_errors_naming_the_argument(call, name):
    H = cv.DenseOperator(symmetric(SPECTRUM))
    with pytest.raises(TypeError, match=f"Invalid {name}:"):
        call(H)
