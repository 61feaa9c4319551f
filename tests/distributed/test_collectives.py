"""The hand-built collectives against the sum and against torch.distributed's own, in one
world per size W = 2, 3, 4 (all sizes checked inside it): the ring and recursive doubling,
all-to-all, and the all-reduces that scale (Rabenseifner's, the binary tree, the
hierarchical one), with the bytes each rank sends against each schedule's formula; the
blocking ring deadlocks and ends by the group's timeout."""

import re
import time

import collective_workers
import dist_workers
import pytest
import torch

from lsdl_lab.distributed import WorkerError, call_each, ring_all_reduce, spawn
from lsdl_lab.distributed.cost import (
    binary_tree_all_reduce_time,
    hierarchical_all_reduce_time,
    pairwise_all_to_all_time,
    rabenseifner_all_reduce_time,
)

FLOAT64_ROUNDING = 1e-13  # a few ulps of float64, relative to the largest entry
FLOAT32_ROUNDING = 1e-6


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
    return w, spawn(call_each, w, checks + SCALING_CHECKS, backend="gloo", timeout=60)


# collective_workers' reports, last in each rank's reports, at these positions. The last
# ends with a barrier: rank 0, which holds the world's store, stays until all are done
# (a rank outside dist_workers' subgroup would otherwise leave while its members connect).
SCALING_CHECKS = [
    collective_workers.bad_arguments_report,
    collective_workers.all_to_all_report,
    collective_workers.all_reduce_report,
    collective_workers.subgroup_report,
]
BAD_ARGUMENTS, ALL_TO_ALL, SCALING, SCALING_SUBGROUP = range(-len(SCALING_CHECKS), 0)


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


def test_all_to_all_equals_the_builtin_and_sends_what_is_not_its_own(world):
    """Every dtype, even and uneven blocks: the same bytes as dist.all_to_all_single; each
    rank sends every block but its own, (p-1)/p of its input for even blocks, the
    pairwise model's bandwidth term, in one message per non-empty block."""
    w, reports = world
    for rank, report in enumerate(r[ALL_TO_ALL] for r in reports):
        assert len(report) == len(collective_workers.DTYPES) * 3
        for (dtype, case), r in report.items():
            where = f"all_to_all {dtype} {case}, W={w}, rank {rank}"
            assert r["equal"] and r["returned"] and r["input_unchanged"], where
            assert r["bytes"] == r["others_bytes"], where
            if case == "uneven":
                sends = collective_workers.uneven_splits(rank, w)
                nonempty = sum(1 for j, rows in enumerate(sends) if rows and j != rank)
                assert r["messages"] == nonempty, where
            else:
                assert r["bytes"] * w == (w - 1) * r["input_bytes"], where
                assert r["bytes"] == pairwise_all_to_all_time(r["input_bytes"], w, 0, 1), where
                assert r["messages"] == w - 1, where
    # the uneven case has empty blocks and blocks of different sizes at every world size
    splits = [collective_workers.uneven_splits(i, w) for i in range(w)]
    assert any(0 in row for row in splits) and len({n for row in splits for n in row}) > 2


def test_scaling_all_reduces_equal_the_builtin(world):
    """Rabenseifner's, the binary tree and the hierarchical all-reduce (every node size
    that divides W): exact on integers, within float64 rounding of dist.all_reduce, the
    same bytes on every rank; a 2-D float32 tensor too."""
    w, reports = world
    names = {"rabenseifner", "binary tree"} | {
        f"hierarchical {k}" for k in range(1, w + 1) if w % k == 0
    }
    first = reports[0][SCALING]
    assert {name for name, _ in first} == names
    assert {n for _, n in first} == set(collective_workers.SIZES) | {"5x7"}
    for rank, report in enumerate(r[SCALING] for r in reports):
        for (name, n), r in report.items():
            where = f"{name} all-reduce, W={w}, n={n}, rank {rank}"
            if n == "5x7":
                assert r["error"] < FLOAT32_ROUNDING, where
                continue
            assert r["int_exact"] and r["returned"], where
            assert r["error"] < FLOAT64_ROUNDING, where
            assert r["digest"] == first[name, n]["digest"], where


def _sent(reports, name, n):
    return [r[SCALING][name, n]["bytes"] for r in reports]


def test_bytes_sent_follow_each_schedule(world):
    """The bytes each rank sends (float64, n entries, B = 8n bytes) against the schedule:
    Rabenseifner's 2 (q-1)/q B on the q ranks that double, B on a rank folded in and B more
    on the rank it folds into; the tree's 2 (p-1) B in all (B up and B down each edge), the
    most on rank 0, ceil(log2 p) B; the hierarchical one's 2 (L-1)/L B within the node and
    2 (N-1)/N B/L across nodes on every rank. Where a rank's bytes are the critical path's,
    they are the beta term of the cost model."""
    w, reports = world
    n = collective_workers.EVEN
    B = 8 * n
    q = 1 << (w.bit_length() - 1)
    e = w - q
    rabenseifner = _sent(reports, "rabenseifner", n)
    for rank, sent in enumerate(rabenseifner):
        folded, into = rank < 2 * e and rank % 2 == 0, rank < 2 * e and rank % 2 == 1
        assert sent == (B if folded else 2 * (q - 1) * B // q + (B if into else 0)), rank
    if q == w:
        assert set(rabenseifner) == {rabenseifner_all_reduce_time(B, w, 0, 1)}
    for m in collective_workers.SIZES:
        tree = _sent(reports, "binary tree", m)
        assert sum(tree) == 2 * (w - 1) * 8 * m, m
        assert tree[0] == max(tree) == (w - 1).bit_length() * 8 * m, m
    assert 2 * _sent(reports, "binary tree", n)[0] == binary_tree_all_reduce_time(B, w, 0, 1)
    for local in (k for k in range(1, w + 1) if w % k == 0):
        nodes = w // local
        expected = 2 * (local - 1) * B / local + 2 * (nodes - 1) * B / (nodes * local)
        assert hierarchical_all_reduce_time(B, w, 0, 1, local) == pytest.approx(expected)
        assert _sent(reports, f"hierarchical {local}", n) == [pytest.approx(expected)] * w


def test_scaling_all_reduces_on_a_subgroup(world):
    w, reports = world
    members = range(1, w)
    assert reports[0][SCALING_SUBGROUP] is None
    names = 2 + sum(1 for k in range(1, w) if (w - 1) % k == 0)  # hierarchical: divisors
    for rank in members:
        report = reports[rank][SCALING_SUBGROUP]
        assert len(report) == 3 * names and all(report.values()), (w, rank, report)


def test_scaling_collectives_refuse_bad_arguments(world):
    w, reports = world
    expected = {
        "rows not divisible": ("ValueError", "Invalid input: shape"),
        "splits of the wrong length": ("ValueError", "Invalid input_split_sizes"),
        "splits not adding up": ("ValueError", "Invalid input_split_sizes"),
        "other columns": ("ValueError", "Invalid output"),
        "other dtype": ("ValueError", "Invalid output"),
        "own block mismatch": ("ValueError", "Invalid split sizes"),
        "splits passed as group": ("TypeError", "Invalid group: a list"),
        "local_size not dividing": ("ValueError", "Invalid local_size"),
        "local_size 0": ("ValueError", "Invalid local_size: 0"),
        "non-contiguous": ("ValueError", "non-contiguous"),
        "tree non-contiguous": ("ValueError", "non-contiguous"),
    }
    for rank, report in enumerate(r[BAD_ARGUMENTS] for r in reports):
        assert set(report) == set(expected)
        for case, (kind, start) in expected.items():
            assert report[case] is not None, f"{case}: nothing raised, W={w}, rank {rank}"
            assert report[case][0] == kind and start in report[case][1], (case, report[case])
    if w > 2:
        assert "divisor" in reports[0][BAD_ARGUMENTS]["local_size not dividing"][1]


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
