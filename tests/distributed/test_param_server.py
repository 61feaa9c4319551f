"""The parameter server in one world of 4 (a server, 3 workers): synchronous SGD equals
all-reduce SGD in float64; asynchronous SGD keeps its staleness within the bound, and
with bound 0 is sequential SGD on fresh weights, replayed here in one process."""

import dist_workers
import pytest
import torch

from lsdl_lab.distributed import asynchronous_sgd, spawn, synchronous_sgd

LR, STEPS = 0.05, 30


@pytest.fixture(scope="module")
def reports():
    return spawn(dist_workers.param_server_report, 4, LR, STEPS, backend="gloo", timeout=60)


def loss(w):
    X, y = dist_workers.least_squares()
    return 0.5 * ((X @ w - y) ** 2).mean().item()


def test_synchronous_sgd_equals_all_reduce_sgd(reports):
    server = reports[0]["sync"]
    assert reports[0]["all_reduce"] is None
    for rank in (1, 2, 3):
        assert reports[rank]["sync"] == STEPS  # each worker computed one gradient a step
        assert torch.allclose(reports[rank]["all_reduce"], server, rtol=1e-13, atol=1e-15)
    assert loss(server) < 0.5 * loss(torch.zeros(dist_workers.DIM, dtype=torch.float64))


def test_asynchronous_staleness_stays_within_its_bound(reports):
    for s in (0, 1, 2):
        w, stale = reports[0][s]
        assert len(stale) == STEPS
        assert 0 <= min(stale) and max(stale) <= s, (s, stale)
        assert sum(reports[rank][s] for rank in (1, 2, 3)) == STEPS  # no gradient lost
    # with room for 2 or 3 workers at once, gradients do arrive late
    assert max(reports[0][1][1]) == 1 and max(reports[0][2][1]) == 2


def test_staleness_zero_is_sequential_sgd_on_fresh_weights(reports):
    # one worker at a time, taking turns 1, 2, 3, 1, ...: replayed in this process
    w = torch.zeros(dist_workers.DIM, dtype=torch.float64)
    for t in range(STEPS):
        w = w - LR * dist_workers.shard_gradient(w, t % 3, t // 3)
    assert torch.equal(reports[0][0][0], w)


def test_bad_arguments():
    w0 = torch.zeros(3)
    with pytest.raises(ValueError, match="Invalid world_size: 1"):
        synchronous_sgd(0, 1, w0, dist_workers.shard_gradient, 0.1, 5)
    with pytest.raises(ValueError, match="Invalid lr"):
        synchronous_sgd(0, 2, w0, dist_workers.shard_gradient, 0.0, 5)
    with pytest.raises(ValueError, match="Invalid staleness: -1"):
        asynchronous_sgd(0, 2, w0, dist_workers.shard_gradient, 0.1, 5, -1)
