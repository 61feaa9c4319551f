"""Gradient accumulation, local SGD and post-local SGD in one world of 2 (float64):
accumulation with no_sync equals the large-batch gradient with one all-reduce; local-SGD
replicas are identical right after averaging, differ between averages, and follow a
one-process replay of the same schedule; torch's post-local SGD runs on gloo."""

import local_sgd_workers as w
import pytest
import torch
from torch import nn

from lsdl_lab.distributed import spawn
from lsdl_lab.distributed.local_sgd import PeriodicAverager

WORLD, PERIOD, WARMUP, STEPS = 2, 3, 2, 9


@pytest.fixture(scope="module")
def results():
    return spawn(w.all_checks, WORLD, PERIOD, WARMUP, STEPS, backend="gloo", timeout=60)


def test_accumulation_with_no_sync_equals_the_large_batch_gradient(results):
    for r in results:
        acc = r["accumulation"]
        assert torch.allclose(acc["grad"], acc["reference"], rtol=1e-12, atol=1e-14)
        assert acc["all_reduces"] == 1  # K micro-batches, one bucket, one all-reduce


def replay(period, warmup, steps):
    """The same schedule for WORLD replicas in one process: warm-up steps on the mean
    gradient, then local steps, the mean of the models every `period` local steps."""
    replicas = [w.model() for _ in range(WORLD)]
    for t in range(steps):
        grads = []
        for rank, net in enumerate(replicas):
            net.zero_grad()
            x, y = w.data(rank, t + 1, w.MICRO)
            nn.functional.mse_loss(net(x), y).backward()
            grads.append([p.grad.clone() for p in net.parameters()])
        with torch.no_grad():
            for rank, net in enumerate(replicas):
                for i, p in enumerate(net.parameters()):
                    g = sum(gs[i] for gs in grads) / WORLD if t < warmup else grads[rank][i]
                    p -= w.LR * g
            if t >= warmup and (t - warmup + 1) % period == 0:
                for params in zip(*(net.parameters() for net in replicas), strict=True):
                    mean = sum(params) / WORLD
                    for p in params:
                        p.copy_(mean)
    return [w.flat(net.parameters()) for net in replicas]


def test_local_sgd_replicas_identical_right_after_averaging(results):
    trace = results[0]["local"]["trace"]
    averaged = [t for t, (did, _) in enumerate(trace) if did]
    assert averaged == [t for t in range(STEPS) if t >= WARMUP and (t - WARMUP + 1) % PERIOD == 0]
    for t, (did, gap) in enumerate(trace):
        if did or t < WARMUP:  # after an average, or a synchronous warm-up step
            assert gap == 0.0, (t, gap)
        else:  # local steps on different data drift apart
            assert gap > 1e-6, (t, gap)
    # one all-reduce per warm-up step, one per period afterwards
    assert results[0]["local"]["rounds"] == WARMUP + len(averaged)


def test_local_sgd_matches_a_one_process_replay(results):
    expected = replay(PERIOD, WARMUP, STEPS)
    for rank, r in enumerate(results):
        assert torch.allclose(r["local"]["params"], expected[rank], rtol=1e-12, atol=1e-14)


def test_torch_post_local_sgd_runs_on_gloo(results):
    spreads = results[0]["torch"]
    # synchronous during its warm-up: identical replicas
    assert all(s == 0.0 for s in spreads[:WARMUP])
    # afterwards it drifts between averages and is identical right after each
    assert any(s > 1e-6 for s in spreads[WARMUP:])
    assert any(s == 0.0 for s in spreads[WARMUP + 1 :])


def test_overlap_times_reports_every_configuration(results):
    times = results[0]["overlap"]
    # the computation alone, then the all-reduce after the backward, then each bucket cap
    assert list(times) == ["no all-reduce", "after backward", "bucket 0.1 MB", "bucket 25 MB"]
    assert all(0 < t < 5 for t in times.values())
    assert times == results[1]["overlap"]  # the slowest rank's time, the same on both


def test_bad_arguments():
    with pytest.raises(ValueError, match="period"):
        PeriodicAverager([], 0)
    with pytest.raises(ValueError, match="warmup_steps"):
        PeriodicAverager([], 2, -1)
