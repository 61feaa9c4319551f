"""The alpha-beta model: its formulas, its fit, and its prediction of a size it was not
fitted on, measured on a real world of 2 processes."""

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
