"""The checkers of Lab 9 accept right answers, reject the usual wrong ones with a hint that
names the mistake, and pass the exercise stub's NotImplementedError through; their
references are Young's formula, the ring's byte count and the planner's own search."""

from __future__ import annotations

import math

import pytest

from lsdl_lab import check
from lsdl_lab.check import PLACEHOLDER_MESSAGE, CheckFailed
from lsdl_lab.exercises import lab09
from lsdl_lab.plan import Cluster, ModelShape, plan

# -- the references ---------------------------------------------------------------------


def test_checkpoint_plan_is_the_minimum_of_the_waste():
    c, m, r = 60.0, 11_100.0, 600.0
    tau, waste = lab09.checkpoint_plan(c, m, r)
    assert tau == pytest.approx(math.sqrt(2 * c * m))
    # The waste at tau is below the waste at any other interval, and equals sqrt(2C/M) + R/M.
    for other in (0.5 * tau, 0.9 * tau, 1.1 * tau, 2 * tau):
        assert waste < c / other + (other / 2 + r) / m
    assert waste == pytest.approx(math.sqrt(2 * c / m) + r / m)


def test_data_parallel_bytes_counts_what_is_handed_over():
    assert lab09.data_parallel_bytes(1000, 2) == 4000  # DDP: the gradient, once
    assert lab09.data_parallel_bytes(1000, 2, "zero2") == 4000 + 2000  # + its weight shard
    assert lab09.data_parallel_bytes(1000, 4, "zero3") == 4000 + 2 * 1000
    assert lab09.data_parallel_bytes(1000, 4, "fsdp2", 2) == 2000 + 2 * 500
    with pytest.raises(ValueError, match="parallel"):
        lab09.data_parallel_bytes(1000, 2, "zero4")


def test_layouts_are_the_planners():
    got = lab09.layouts(16, 4, 2, 6)
    assert got == [(4, 2, 2), (8, 1, 2), (8, 2, 1), (16, 1, 1)]
    # on a real model and cluster, every layout the planner returns is among them
    model = ModelShape(layers=8, hidden=1024, heads=16, seq_len=256, vocab=32768, global_batch=64)
    cluster = Cluster(
        devices=16,
        devices_per_node=8,
        memory=80e9,
        intra_bandwidth=300e9,
        intra_latency=5e-6,
        inter_bandwidth=25e9,
        inter_latency=1e-5,
        peak_flops=312e12,
    )
    planned = {(c.dp, c.tp, c.pp) for c in plan(model, cluster)}
    assert planned and planned <= set(lab09.layouts(16, 8, 8, 16))


# -- right answers pass --------------------------------------------------------------------


def right_checkpoint_plan(checkpoint_seconds, mtbf_seconds, restart_seconds=0.0):
    tau = (2 * checkpoint_seconds * mtbf_seconds) ** 0.5
    return tau, checkpoint_seconds / tau + (tau / 2 + restart_seconds) / mtbf_seconds


def right_data_parallel_bytes(numel, world_size, parallel="ddp", element_bytes=4):
    gradient = numel * element_bytes
    gathers = {"ddp": 0, "zero1": 1, "zero2": 1}.get(parallel, 2)
    return gradient + gathers * gradient / world_size


def right_layouts(devices, devices_per_node, layers, heads):
    out = []
    for tp in range(1, min(devices, devices_per_node) + 1):
        if devices % tp or heads % tp:
            continue
        for pp in range(1, min(devices // tp, layers) + 1):
            if (devices // tp) % pp == 0:
                out.append([devices // (tp * pp), tp, pp])  # lists, unsorted: accepted
    return reversed(out)


def test_right_answers_pass(capsys):
    check.checker("lab09.checkpoint_plan")(right_checkpoint_plan)
    check.checker("lab09.data_parallel_bytes")(right_data_parallel_bytes)
    check.checker("lab09.layouts")(right_layouts)
    out = capsys.readouterr().out
    assert "✔ checkpoint_plan" in out and "✔ data_parallel_bytes" in out
    assert "✔ layouts" in out


def test_the_references_pass_their_own_checkers():
    check.checker("lab09.checkpoint_plan")(lab09.checkpoint_plan)
    check.checker("lab09.data_parallel_bytes")(lab09.data_parallel_bytes)
    check.checker("lab09.layouts")(lab09.layouts)


# -- wrong answers fail, with the hint that names the mistake ------------------------------


def no_factor_two(checkpoint_seconds, mtbf_seconds, restart_seconds=0.0):
    tau = (checkpoint_seconds * mtbf_seconds) ** 0.5
    return tau, checkpoint_seconds / tau + (tau / 2 + restart_seconds) / mtbf_seconds


def whole_interval_lost(checkpoint_seconds, mtbf_seconds, restart_seconds=0.0):
    tau = (2 * checkpoint_seconds * mtbf_seconds) ** 0.5
    return tau, checkpoint_seconds / tau + (tau + restart_seconds) / mtbf_seconds


def no_restart(checkpoint_seconds, mtbf_seconds, restart_seconds=0.0):
    return right_checkpoint_plan(checkpoint_seconds, mtbf_seconds)


def ring_traffic(numel, world_size, parallel="ddp", element_bytes=4):
    return 2 * (world_size - 1) / world_size * numel * element_bytes


def no_weight_gather(numel, world_size, parallel="ddp", element_bytes=4):
    return numel * element_bytes * (1 + (parallel in ("zero3", "fsdp2")) / world_size)


def whole_vector_gathered(numel, world_size, parallel="ddp", element_bytes=4):
    gathers = {"ddp": 0, "zero1": 1, "zero2": 1}.get(parallel, 2)
    return numel * element_bytes * (1 + gathers)


def tp_across_nodes(devices, devices_per_node, layers, heads):
    return right_layouts(devices, devices, layers, heads)


def any_heads(devices, devices_per_node, layers, heads):
    return right_layouts(devices, devices_per_node, layers, math.prod(range(1, devices + 1)))


def stages_without_layers(devices, devices_per_node, layers, heads):
    return right_layouts(devices, devices_per_node, devices, heads)


@pytest.mark.parametrize(
    "name, fn, hint",
    [
        ("lab09.checkpoint_plan", no_factor_two, "sqrt\\(2 C M\\)"),
        ("lab09.checkpoint_plan", whole_interval_lost, "half an interval"),
        ("lab09.checkpoint_plan", no_restart, "restart time R"),
        ("lab09.data_parallel_bytes", ring_traffic, "not the ring's traffic"),
        ("lab09.data_parallel_bytes", no_weight_gather, "all-gathers the updated weights"),
        ("lab09.data_parallel_bytes", whole_vector_gathered, "one shard"),
        ("lab09.layouts", tp_across_nodes, "inside a node"),
        ("lab09.layouts", any_heads, "whole heads"),
        ("lab09.layouts", stages_without_layers, "at least one layer"),
    ],
)
def test_wrong_answers_fail_with_the_hint(name, fn, hint):
    with pytest.raises(CheckFailed, match=hint):
        check.checker(name)(fn)


# -- the exercise stub -------------------------------------------------------------------


@pytest.mark.parametrize(
    "name", ["lab09.checkpoint_plan", "lab09.data_parallel_bytes", "lab09.layouts"]
)
def test_the_stub_asks_for_a_solution(name):
    def stub(*args, **kwargs):
        raise NotImplementedError(PLACEHOLDER_MESSAGE)

    with pytest.raises(NotImplementedError, match="not implemented yet"):
        check.checker(name)(stub)
