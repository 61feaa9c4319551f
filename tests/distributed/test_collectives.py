"""The hand-built collectives against the sum and against torch.distributed's own, in one
world per size W = 2, 3, 4 (all sizes checked inside it); the blocking ring deadlocks and
ends by the group's timeout."""

import re
import time

import dist_workers
import pytest
import torch

from lsdl_lab.distributed import WorkerError, call_each, ring_all_reduce, spawn

FLOAT64_ROUNDING = 1e-13  # a few ulps of float64, relative to the largest entry


@pytest.fixture(scope="module", params=[2, 3, 4], ids=lambda w: f"W{w}")
def world(request):
    """(W, each rank's reports): one spawn per world size for all the checks."""
    w = request.param
    checks = [
        dist_workers.all_reduce_report,
        dist_workers.gather_scatter_report,
        dist_workers.untagged_ring_report,
    ]
    if w >= 3:
        checks.append(dist_workers.subgroup_report)
    return w, spawn(call_each, w, checks, backend="gloo", timeout=60)


def test_all_reduce_equals_the_sum_on_every_size(world):
    w, reports = world
    for rank, (report, *_) in enumerate(reports):
        assert {n for _, n in report} == set(dist_workers.sizes(w))
        for (name, n), r in report.items():
            where = f"{name} all-reduce, W={w}, n={n}, rank {rank}"
            assert r["int_exact"], where
            assert r["error_vs_sum"] < FLOAT64_ROUNDING, where
            assert r["error_vs_builtin"] < FLOAT64_ROUNDING, where


def test_all_reduce_leaves_identical_bytes_on_every_rank(world):
    w, reports = world
    first = reports[0][0]
    for rank, (report, *_) in enumerate(reports[1:], 1):
        for key, r in report.items():
            assert r["digest"] == first[key]["digest"], f"{key} differs on rank {rank}, W={w}"


def test_all_gather_and_reduce_scatter_match_the_builtins(world):
    w, reports = world
    for rank, (_, report, *_) in enumerate(reports):
        assert len(report) == len(set(dist_workers.SMALL_SIZES + (w,))) + 1
        for shape, r in report.items():
            where = f"W={w}, shape {shape}, rank {rank}"
            assert r["gather_equal"], where
            assert r["scatter_error"] < FLOAT64_ROUNDING, where
            assert r["inputs_unchanged"], where


def test_the_ring_without_tags_sums_too(world):
    w, reports = world
    first = reports[0][2]
    assert set(first) == set(dist_workers.SMALL_SIZES + (w,))
    for rank, (_, _, report, *_) in enumerate(reports):
        for n, (exact, digest) in report.items():
            assert exact, f"W={w}, n={n}, rank {rank}"
            assert digest == first[n][1], f"W={w}, n={n}: rank {rank} differs from rank 0"


def test_all_reduce_on_a_subgroup(world):
    w, reports = world
    if w < 3:
        pytest.skip("a proper subgroup needs 3 ranks")
    members = [1, w - 1]
    subreports = [reports[rank][3] for rank in members]
    assert all(reports[rank][3] is None for rank in range(w) if rank not in members)
    for report in subreports:
        assert {n for _, n in report} == set(dist_workers.SMALL_SIZES)
        assert all(r["int_exact"] and r["error_vs_sum"] < FLOAT64_ROUNDING for r in report.values())
    assert all(subreports[0][k]["digest"] == subreports[1][k]["digest"] for k in subreports[0])


def test_collectives_refuse_bad_tensors():
    # checked before any message is sent, so no world is needed
    with pytest.raises(TypeError, match="Invalid tensor"):
        ring_all_reduce([1.0, 2.0])
    with pytest.raises(ValueError, match="non-contiguous"):
        ring_all_reduce(torch.zeros(4, 4).T)


def test_blocking_ring_deadlocks_and_ends_by_the_timeout():
    timeout = 2.0
    start = time.monotonic()
    with pytest.raises(WorkerError) as info:
        spawn(dist_workers.naive_ring_timed, 2, 10, backend="gloo", timeout=timeout)
    elapsed = time.monotonic() - start
    text = info.value.traceback
    # every rank is stuck in its send and times out; under load the first one reported
    # may instead fail because its peer, timed out a moment earlier, has left
    reports = [text, *info.value.others.values()]
    assert any("Timed out waiting 2000ms for send operation to complete" in r for r in reports)
    failed_after = float(re.search(r"failed after ([0-9.]+) s", text).group(1))
    assert timeout <= failed_after < timeout + 1.0  # the timeout, and little more
    assert elapsed < timeout + 15  # spawning and stopping included: never a hang
