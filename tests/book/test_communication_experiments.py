"""The chapter's and lab's experiments at toy sizes, in one world of 2 (and the collectives
in worlds of 3 and 4): each returns what its docstring promises, with the effects that must
hold at any size (bytes in their stated ratios, the collectives' bytes the formulas', every
local-SGD round counted, tensor parallelism equal to the dense block, staleness within its
bound, a model many buckets long)."""

import functools

import pytest
import torch

from lsdl_lab.book import communication_experiments as E
from lsdl_lab.distributed import call_each, spawn

NAMES = ["none", "fp16 (torch)", "sign + EF", "random-1% + EF", "PowerSGD r=2"]
SMALL = functools.partial(E.digits_mlp, 16)
# width 8: narrower ResNets crash torch 2.13's oneDNN convolution on the digits (heap
# corruption at widths 2-4, measured; fine with torch.backends.mkldnn.enabled = False)
TINY_RESNET = functools.partial(E.digits_resnet, 8, 8)
# 5 hidden layers of 64 after the first: 16.6 KiB a layer, a bucket each at a 0.01 MiB cap
DEEP = functools.partial(E.deep_mlp, 64, 4)


@pytest.fixture(scope="module")
def results():
    runs = [
        functools.partial(E.collective_times, nbytes=[4_000, 400_000], repeats=1),
        functools.partial(E.compression_run, names=NAMES, steps=6, make_model=SMALL, start_iter=2),
        functools.partial(E.local_sgd_run, periods=(1, 4, 3), steps=8, make_model=SMALL),
        functools.partial(
            E.model_parallel_run, micro_batches=(1, 2), width=8, rows=2, layers=1, dim=16, heads=2
        ),
        functools.partial(E.staleness_run, staleness=(0, 1), lr=0.5, steps=10),
        functools.partial(
            E.compression_run,
            names=["none", "PowerSGD r=2", "PowerSGD r=2 (torch)"],
            steps=4,
            make_model=TINY_RESNET,
            start_iter=2,
        ),
        functools.partial(
            E.overlap_run, bucket_caps_mb=(0.01, 25.0), make_model=DEEP, rows=4, repeats=1
        ),
        functools.partial(
            E.overlap_timeline, bucket_cap_mb=0.01, make_model=DEEP, rows=4, repeats=3
        ),
    ]
    return spawn(call_each, 2, runs, timeout=120)


def test_collective_times(results):
    coll = results[0][0]
    assert coll["nbytes"] == [4_000, 400_000] and coll["world_size"] == 2
    assert set(coll["seconds"]) == {"ring", "tree", "built-in"}
    assert all(t > 0 for ts in coll["seconds"].values() for t in ts)
    assert all(a >= 0 and b >= 0 for a, b in coll["fit"].values())
    # at p = 2 the ring and recursive doubling send the same bytes: n from each rank
    assert coll["sent"] == {"ring": [4_000, 400_000], "tree": [4_000, 400_000]}


@pytest.mark.parametrize("p", [3, 4])
def test_collective_bytes_follow_the_formulas_beyond_two_ranks(p):
    nbytes = [1_200, 48_000]  # multiples of 4 p bytes: every chunk holds n / (4 p) floats
    coll = spawn(functools.partial(E.collective_times, nbytes=nbytes, repeats=1), p, timeout=120)
    sent = coll[0]["sent"]
    assert all(r["sent"] == sent for r in coll)  # the busiest rank's, on every rank
    # ring: 2(p - 1) chunks of n / p; recursive doubling: log2 q steps of n, plus the
    # hand-back of the sum to a folded rank when p is not a power of two (q = 2 at p = 3)
    assert sent["ring"] == [2 * (p - 1) * n // p for n in nbytes]
    assert sent["tree"] == [2 * n for n in nbytes]


def test_compression_bytes_follow_the_formats(results):
    comp = results[0][1]
    d = comp["none"]["parameters"]
    assert comp["none"]["bytes_per_step"] == 4 * d  # float32 all-reduce of every gradient
    assert comp["fp16 (torch)"]["bytes_per_step"] == 2 * d
    # one bucket: ceil(d / 8) bytes of signs plus one float32 scale
    assert comp["sign + EF"]["bytes_per_step"] == -(-d // 8) + 4
    assert comp["random-1% + EF"]["bytes_per_step"] < 0.02 * 4 * d
    assert all(0 <= r["accuracy"] <= 1 and r["codec_s"] >= 0 for r in comp.values())
    assert comp["none"]["codec_s"] == 0.0


def test_local_sgd_rounds(results):
    periods = results[0][2]["periods"]
    assert periods[1]["rounds"] == 8 and periods[4]["rounds"] == 2
    # 8 steps at H = 3: two periods and the last average, which is counted too
    assert periods[3]["rounds"] == 3
    assert periods[1]["bytes"] == 4 * periods[4]["bytes"]
    assert 3 * periods[1]["bytes"] == 8 * periods[3]["bytes"]


def test_overlap_on_a_model_many_buckets_long(results):
    ov = results[0][6]
    assert ov == results[1][6]  # the slowest rank's times; the same model on both
    assert list(ov["seconds"]) == [
        "no all-reduce",
        "after backward",
        "bucket 0.01 MB",
        "bucket 25 MB",
    ]
    assert all(t > 0 for t in ov["seconds"].values())
    model = DEEP()
    assert ov["gradient_bytes"] == 4 * sum(q.numel() for q in model.parameters())
    # a bucket a 64 x 64 layer (16.6 KiB > 0.01 MiB) at the small cap, one at the large
    layers = sum(1 for q in model.parameters() if q.dim() == 2)
    assert ov["buckets"][25.0] == 1 and layers - 1 <= ov["buckets"][0.01] <= layers
    assert ov["cores"] >= 1


def test_overlap_timeline_from_the_profilers_trace(results):
    timelines = [results[rank][7] for rank in (0, 1)]
    configs = ["no all-reduce", "one bucket", "bucket 0.01 MB"]
    assert timelines[0]["world"] == timelines[1]["world"]  # the slowest rank's, on both
    layers = sum(1 for q in DEEP().parameters() if q.dim() == 2)
    for tl in timelines:
        assert list(tl["timeline"]) == list(tl["hidden"]) == list(tl["world"]) == configs
        steps = tl["timeline"]
        # an all-reduce a bucket, each issued on the main thread and run on gloo's: none
        # without DDP, one for one bucket, one a layer at the small cap (as overlap_run)
        n = {name: len(t["all_reduce"]) for name, t in steps.items()}
        assert n["no all-reduce"] == 0 and n["one bucket"] == 1
        assert layers - 1 <= n["bucket 0.01 MB"] <= layers
        for name, t in steps.items():
            assert len(t["issued"]) == n[name]
            f0, f1 = t["forward"]
            assert 0 <= f0 < f1 <= t["backward"][0][0] < t["backward_end"] <= t["step"]
            # the backward's nodes, merged: disjoint and in order, the last ending it
            ends = [x for pair in t["backward"] for x in pair]
            assert ends == sorted(ends) and ends[-1] == t["backward_end"]
            for a, b in t["all_reduce"]:
                assert f1 <= a <= b  # gloo may close its event just after the step
            assert [a for a, _ in t["all_reduce"]] == sorted(a for a, _ in t["all_reduce"])
            assert t["exposed"] == pytest.approx(t["step"] - t["backward_end"])
            busy = sum(b - a for a, b in t["all_reduce"])
            assert 0 <= t["hidden"] <= min(busy, t["backward_end"]) + 1e-9
        assert steps["no all-reduce"]["hidden"] == tl["hidden"]["no all-reduce"] == 0
        # each rank issues its first small bucket while its backward still runs
        small = steps["bucket 0.01 MB"]
        assert small["issued"][0] < small["backward_end"]
        for w in tl["world"].values():
            assert w["step"] >= w["backward_end"] > 0
            assert w["exposed"] >= 0
        assert tl["cores"] >= 1


def test_intervals_merge_and_clip():
    assert E._merged([(3, 4), (0, 1), (0.5, 2), (2, 2.5)]) == [(0, 2.5), (3, 4)]
    assert E._within([(0, 1), (0.5, 2), (3, 5)], 1.5, 4) == pytest.approx(0.5 + 1)
    assert E._within([], 0, 1) == 0 and E._within([(2, 3)], 0, 1) == 0


def test_overlap_timeline_refuses_bad_arguments():
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        E.overlap_timeline(0, 1, bucket_cap_mb=0)
    with pytest.raises(ValueError, match="repeats"):
        E.overlap_timeline(0, 1, repeats=0)


def test_model_parallel(results):
    for rank in (0, 1):
        mp = results[rank][3]
        assert mp["tensor"]["output_error"] < 1e-12 and mp["tensor"]["grad_error"] < 1e-12
        assert mp["tensor"]["bytes_per_forward"] == 2 * mp["tensor"]["activation_bytes"]
        for (schedule, m), r in mp["pipeline"].items():
            assert r["formula"] == pytest.approx(1 / (m + 1))
            assert 0 <= r["bubble"] < 1
            assert r["peak_in_flight"] == (m if schedule == "gpipe" else min(m, 2 - rank))
            assert len(r["timeline"]) == 2 * m


def test_staleness_within_its_bound(results):
    stale = results[0][4]
    assert results[1][4] is None  # the worker returns nothing
    assert stale[0]["max_staleness"] == 0 and stale[1]["max_staleness"] <= 1
    assert stale["sync"]["loss"] < E.least_squares_loss(torch.zeros(20, dtype=torch.float64))


def test_powersgd_on_the_resnet_sends_the_factors_of_every_convolution(results):
    comp = results[0][5]
    # a convolution (out, in, h, w) is the matrix (out, in*h*w); vectors (BatchNorm,
    # biases) and matrices too small to gain go uncompressed: P and Q of rank r = 2
    floats = 0
    for p in TINY_RESNET().parameters():
        n, m = (p.shape[0], p[0].numel()) if p.dim() > 1 else (p.numel(), 1)
        r = min(2, n, m)
        floats += r * (n + m) if p.dim() > 1 and r * (n + m) < n * m else p.numel()
    assert comp["PowerSGD r=2"]["bytes_per_step"] == 4 * floats
    assert comp["PowerSGD r=2 (torch)"]["bytes_per_step"] == 4 * floats
    assert comp["none"]["bytes_per_step"] == 4 * comp["none"]["parameters"] > 4 * floats
    assert all(0 <= r["accuracy"] <= 1 for r in comp.values())


def test_too_few_steps_are_refused():
    with pytest.raises(ValueError, match="steps"):
        E.compression_run(0, 1, ["none"], steps=2, start_iter=5)
    with pytest.raises(ValueError, match="start_iter"):  # torch's PowerSGD needs 2
        E.compression_run(0, 1, ["none"], steps=5, start_iter=1)


def test_a_dry_run_caps_the_steps_and_examples_of_every_rank(monkeypatch):
    # The caps of lsdl_lab.profiles reach the ranks through the caller's environment, which
    # spawn hands to each rank.
    monkeypatch.setenv("LSDL_MAX_STEPS", "2")
    monkeypatch.setenv("LSDL_MAX_EXAMPLES", "4")
    runs = [
        functools.partial(E.local_sgd_run, periods=(1, 4), steps=8, make_model=SMALL),
        functools.partial(
            E.compression_run, names=["none"], steps=8, make_model=SMALL, start_iter=5
        ),
    ]
    local, comp = spawn(call_each, 2, runs, timeout=120)[0]
    # one all-reduce a step at H = 1: 2 steps ran, not 8; at H = 4 only the last average
    # (8 // 4 = 2 uncapped)
    assert local["periods"][1]["rounds"] == 2 and local["periods"][4]["rounds"] == 1
    # the compressed steps counted are those that ran: a whole gradient's bytes per step
    none = comp["none"]
    assert none["bytes_per_step"] == 4 * none["parameters"]
    # each test accuracy is on 4 test images: a multiple of 1/4
    for r in [*local["periods"].values(), none]:
        assert (4 * r["accuracy"]).is_integer(), r
