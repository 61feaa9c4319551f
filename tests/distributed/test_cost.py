"""The alpha-beta model: its formulas (the ring, the trees, Rabenseifner's, the hierarchical
all-reduce, all-to-all), its fit, the crossover sizes against brute force, and its
prediction of a size it was not fitted on, measured on a real world of 2 processes."""

import functools
import math

import dist_workers
import pytest

from lsdl_lab.distributed import (
    AlphaBeta,
    fit_alpha_beta,
    parameter_server_all_reduce_time,
    ring_all_reduce_time,
    spawn,
    tree_all_reduce_time,
)
from lsdl_lab.distributed.cost import (
    binary_tree_all_reduce_time,
    crossover_nbytes,
    hierarchical_all_reduce_time,
    pairwise_all_to_all_time,
    rabenseifner_all_reduce_time,
    ring_all_to_all_time,
)

MODELS = [ring_all_reduce_time, tree_all_reduce_time, parameter_server_all_reduce_time]


def test_the_formulas():
    a, b, n = 3.0, 0.5, 8.0
    assert ring_all_reduce_time(n, 1, a, b) == 0  # alone, nothing to send
    assert ring_all_reduce_time(n, 2, a, b) == 2 * a + n * b
    assert ring_all_reduce_time(n, 4, a, b) == 6 * a + 1.5 * n * b
    assert tree_all_reduce_time(n, 4, a, b) == 2 * (a + n * b)
    assert tree_all_reduce_time(n, 8, a, b) == 3 * (a + n * b)
    assert tree_all_reduce_time(n, 3, a, b) == 3 * (a + n * b)  # 1 doubling + fold + unfold
    assert tree_all_reduce_time(n, 6, a, b) == 4 * (a + n * b)
    assert parameter_server_all_reduce_time(n, 4, a, b) == 6 * (a + n * b)
    # the ring's bandwidth term stays below 2 n beta; the server's grows with p
    assert ring_all_reduce_time(n, 1000, 0, b) < 2 * n * b
    assert parameter_server_all_reduce_time(n, 1000, 0, b) == 2 * 999 * n * b


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.__name__)
@pytest.mark.parametrize("p", [2, 3, 8])
def test_fit_recovers_alpha_and_beta(model, p):
    alpha, beta = 40e-6, 1 / 2e9
    nbytes = [4 * 10**k for k in range(2, 8)]
    seconds = [model(n, p, alpha, beta) for n in nbytes]
    fit = fit_alpha_beta(model, p, nbytes, seconds)
    assert fit.alpha == pytest.approx(alpha, rel=1e-9)
    assert fit.beta == pytest.approx(beta, rel=1e-9)
    assert fit.bandwidth == pytest.approx(2e9, rel=1e-9)
    assert fit.predict(model, 12345, p) == pytest.approx(model(12345, p, alpha, beta))


def test_fit_keeps_alpha_and_beta_nonnegative():
    # a time that falls with size would need beta < 0: the fit puts beta at 0 instead
    fit = fit_alpha_beta(ring_all_reduce_time, 2, [1e3, 1e6], [2e-3, 1e-3])
    assert fit.beta == 0 and fit.alpha > 0
    fit = fit_alpha_beta(ring_all_reduce_time, 2, [1e3, 1e6], [1e-9, 1e-3])
    assert fit.alpha == 0 and fit.beta > 0
    assert AlphaBeta(1.0, 0.0).bandwidth == float("inf")


def test_fit_checks_its_arguments():
    with pytest.raises(ValueError, match="Invalid nbytes, seconds"):
        fit_alpha_beta(ring_all_reduce_time, 2, [1e3], [1e-3])
    with pytest.raises(ValueError, match="Invalid seconds"):
        fit_alpha_beta(ring_all_reduce_time, 2, [1e3, 1e4], [1e-3, 0.0])
    with pytest.raises(ValueError, match="Invalid p: 0"):
        fit_alpha_beta(ring_all_reduce_time, 0, [1e3, 1e4], [1e-3, 1e-2])


def test_the_fit_predicts_a_size_it_was_not_fitted_on():
    """Ring all-reduce at world 2, float32, 16 KB to 16 MB, the fastest of 15 calls of each
    size (another process on the machine only ever adds time); the 4 MB point is left out
    of the fit and predicted. On a loaded machine a measurement can still be swamped by
    other work, so the worker measures again, at most 4 times, while the prediction is off
    by more than 25%; four bad ones fail the test."""
    nbytes = [4 * 2**k for k in (12, 14, 16, 18, 20, 22)]
    held_out = 4 * 2**20
    tries = spawn(dist_workers.fitted_ring, 2, nbytes, held_out, 4, backend="gloo", timeout=60)[0]
    last = tries[-1]
    print(
        f"fitted alpha {last['fit'].alpha * 1e6:.1f} us, beta {last['fit'].beta * 1e9:.3f} ns/B "
        f"({last['fit'].bandwidth / 1e9:.2f} GB/s); 4 MB predicted {last['predicted'] * 1e3:.2f} "
        f"ms, measured {last['measured'] * 1e3:.2f} ms; {len(tries)} measurement(s)"
    )
    assert last["fit"].beta > 0
    assert abs(last["predicted"] - last["measured"]) <= 0.25 * last["measured"], tries


# -- the collectives that scale, all-to-all, and the crossover -------------------------------


def test_the_formulas_of_the_collectives_that_scale():
    a, b, n = 3.0, 0.5, 8.0
    # Rabenseifner: 2 log2 p alpha + 2 (p-1)/p n beta; two more steps of n off a power of 2
    assert rabenseifner_all_reduce_time(n, 1, a, b) == 0
    assert rabenseifner_all_reduce_time(n, 2, a, b) == 2 * a + n * b
    assert rabenseifner_all_reduce_time(n, 4, a, b) == 4 * a + 1.5 * n * b
    assert rabenseifner_all_reduce_time(n, 8, a, b) == 6 * a + 1.75 * n * b
    assert rabenseifner_all_reduce_time(n, 3, a, b) == 2 * a + n * b + 2 * (a + n * b)
    # at a power of two, the ring's bandwidth term in log2 p steps instead of 2(p-1)
    for p in (2, 4, 16, 1024):
        assert rabenseifner_all_reduce_time(n, p, 0, b) == ring_all_reduce_time(n, p, 0, b)
    assert rabenseifner_all_reduce_time(n, 1024, a, 0) == 20 * a
    # the binomial tree: 2 ceil(log2 p) (alpha + n beta)
    assert binary_tree_all_reduce_time(n, 1, a, b) == 0
    assert binary_tree_all_reduce_time(n, 2, a, b) == 2 * (a + n * b)
    assert binary_tree_all_reduce_time(n, 3, a, b) == 4 * (a + n * b)
    assert binary_tree_all_reduce_time(n, 4, a, b) == 4 * (a + n * b)
    assert binary_tree_all_reduce_time(n, 5, a, b) == 6 * (a + n * b)
    assert binary_tree_all_reduce_time(n, 8, a, b) == 2 * tree_all_reduce_time(n, 8, a, b)
    # all-to-all: pairwise (p-1) alpha + (p-1)/p n beta, ring (p-1) alpha + (p-1)/2 n beta
    assert pairwise_all_to_all_time(n, 1, a, b) == ring_all_to_all_time(n, 1, a, b) == 0
    assert pairwise_all_to_all_time(n, 4, a, b) == 3 * a + 0.75 * n * b
    assert ring_all_to_all_time(n, 4, a, b) == 3 * a + 1.5 * n * b
    assert pairwise_all_to_all_time(n, 2, a, b) == ring_all_to_all_time(n, 2, a, b)
    for p in (3, 8, 64):  # the ring pays p/2 times the pairwise bandwidth term
        ratio = ring_all_to_all_time(n, p, 0, b) / pairwise_all_to_all_time(n, p, 0, b)
        assert ratio == pytest.approx(p / 2)


def test_the_hierarchical_formula():
    a, b, a2, b2, n = 1.0, 0.25, 50.0, 4.0, 64.0

    def model(p, local):
        return hierarchical_all_reduce_time(n, p, a, b, local, a2, b2)

    # 4 ranks in 2 nodes: a ring of 2 within (twice: scatter, gather), a ring of 2 across
    assert model(4, 2) == 2 * a + n * b + 2 * a2 + (n / 2) * b2
    # one node: the ring on the fast links; one rank a node: the ring on the slow ones
    assert model(4, 4) == ring_all_reduce_time(n, 4, a, b)
    assert model(4, 1) == ring_all_reduce_time(n, 4, a2, b2)
    assert hierarchical_all_reduce_time(n, 8, a, b, 2) == pytest.approx(
        ring_all_reduce_time(n, 2, a, b) + ring_all_reduce_time(n / 2, 4, a, b)
    )
    # the slow links carry n/L, not n: at large n the hierarchy beats the flat ring, which
    # is as slow as its slowest link
    big = 1e9
    for p, local in ((8, 2), (16, 4), (64, 8)):
        flat = ring_all_reduce_time(big, p, a2, b2)
        two_level = hierarchical_all_reduce_time(big, p, a, b, local, a2, b2)
        assert two_level < flat / (local / 2)
    with pytest.raises(ValueError, match="Invalid local_size: 3"):
        hierarchical_all_reduce_time(n, 4, a, b, 3)


@pytest.mark.parametrize(
    "model",
    [
        rabenseifner_all_reduce_time,
        binary_tree_all_reduce_time,
        pairwise_all_to_all_time,
        ring_all_to_all_time,
        functools.partial(hierarchical_all_reduce_time, local_size=2),
    ],
    ids=["rabenseifner", "binary_tree", "pairwise_all_to_all", "ring_all_to_all", "hier"],
)
@pytest.mark.parametrize("p", [2, 6, 8])
def test_fit_recovers_alpha_and_beta_of_the_new_models(model, p):
    alpha, beta = 40e-6, 1 / 2e9
    nbytes = [4 * 10**k for k in range(2, 8)]
    fit = fit_alpha_beta(model, p, nbytes, [model(n, p, alpha, beta) for n in nbytes])
    assert fit.alpha == pytest.approx(alpha, rel=1e-9)
    assert fit.beta == pytest.approx(beta, rel=1e-9)


def _brute_force_crossover(model, against, p, alpha, beta, sizes):
    """The first of ``sizes`` from which ``against`` is faster at every larger size (None:
    at none of them), by evaluating both models at every size."""
    faster = [against(n, p, alpha, beta) < model(n, p, alpha, beta) for n in sizes]
    if not faster[-1]:
        return None
    k = len(faster) - 1
    while k and faster[k - 1]:
        k -= 1
    return sizes[k]


@pytest.mark.parametrize("p", [2, 3, 4, 5, 6, 8, 12, 16, 64])
@pytest.mark.parametrize("alpha, beta", [(20e-6, 1 / 10e9), (2e-6, 1 / 100e9), (1e-3, 1e-9)])
def test_the_crossover_agrees_with_brute_force(p, alpha, beta):
    """n* against the models evaluated on a grid 1.001 apart from 1 byte to 1 TB: the grid's
    first size from which the ring is faster is the first grid size above n*."""
    sizes = [1.001**k for k in range(27_700)]  # 1 B to 1e12 B
    for model in (tree_all_reduce_time, rabenseifner_all_reduce_time, binary_tree_all_reduce_time):
        n_star = crossover_nbytes(model, p, alpha, beta)
        found = _brute_force_crossover(model, ring_all_reduce_time, p, alpha, beta, sizes)
        where = f"{model.__name__}, p={p}, alpha={alpha}, beta={beta}: n*={n_star}"
        if n_star == math.inf:
            assert found is None, where
        elif n_star < sizes[0]:
            assert found == sizes[0], where
        else:
            assert found is not None and found / 1.001 <= n_star < found * (1 + 1e-12), where
        if n_star not in (0, math.inf):  # the two times meet there
            ring = ring_all_reduce_time(n_star, p, alpha, beta)
            assert ring == pytest.approx(model(n_star, p, alpha, beta), rel=1e-9), where


def test_where_the_ring_overtakes():
    alpha, beta = 20e-6, 1 / 10e9
    # recursive doubling: the closed form of the docstring
    for p in (4, 8, 64):
        lg = math.log2(p)
        closed = (2 * (p - 1) - lg) * alpha / ((lg - 2 * (p - 1) / p) * beta)
        assert crossover_nbytes(tree_all_reduce_time, p, alpha, beta) == pytest.approx(closed)
    # at p = 2 the two send the same bytes and the ring one more message: never
    assert crossover_nbytes(tree_all_reduce_time, 2, alpha, beta) == math.inf
    # Rabenseifner's at a power of two: the same bandwidth in fewer steps, never overtaken
    for p in (2, 4, 8, 1024):
        assert crossover_nbytes(rabenseifner_all_reduce_time, p, alpha, beta) == math.inf
    # off a power of two its two extra steps of n bytes let the ring overtake it
    assert 0 < crossover_nbytes(rabenseifner_all_reduce_time, 6, alpha, beta) < math.inf
    # the tree: overtaken at a size that grows with p, as the ring's 2(p-1) alpha does
    sizes = [crossover_nbytes(binary_tree_all_reduce_time, p, alpha, beta) for p in (4, 16, 64)]
    assert sizes == sorted(sizes) and sizes[0] > 0
    # all-to-all: the pairwise exchange is never slower than the ring's store-and-forward
    assert crossover_nbytes(ring_all_to_all_time, 8, alpha, beta, pairwise_all_to_all_time) == 0
    assert (
        crossover_nbytes(pairwise_all_to_all_time, 8, alpha, beta, ring_all_to_all_time) == math.inf
    )
    with pytest.raises(ValueError, match="Invalid p: 0"):
        crossover_nbytes(tree_all_reduce_time, 0, alpha, beta)
