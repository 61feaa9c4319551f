"""Checkers of Lab 9, the combined recipe: Young's checkpoint interval, the bytes a rank
sends per step under data parallelism and ZeRO, and the parallel layouts the planner
searches.

The references are the formulas the lab states and the library they stand for:
:func:`layouts` asks :func:`lsdl_lab.plan.plan` itself which ``(dp, tp, pp)`` it
enumerates; :func:`data_parallel_bytes` is the ring's count of Chapter 7 and the ZeRO
paper's (Rajbhandari et al. 2020, Section 7), the one the training entry point's byte
counter is checked against in the lab. When a function fails, the checker looks for the
usual slips and names the one it finds.
"""

from __future__ import annotations

import functools
import math

from .._util import check_choice
from ..check import CheckFailed, answer_or_none, check_function, exercise, with_hints
from ..plan import Cluster, ModelShape, Techniques, plan

PARALLELS = ("ddp", "zero1", "zero2", "zero3", "fsdp2")


def checkpoint_plan(
    checkpoint_seconds: float, mtbf_seconds: float, restart_seconds: float = 0.0
) -> tuple[float, float]:
    r"""Young's (1974) first-order optimal checkpoint interval
    :math:`\tau^* = \sqrt{2CM}` for a checkpoint of ``checkpoint_seconds`` :math:`C` and a
    mean time between failures ``mtbf_seconds`` :math:`M`, and the fraction of time
    wasted there, :math:`C/\tau^* + (\tau^*/2 + R)/M` with the restart time :math:`R`."""
    tau = math.sqrt(2 * checkpoint_seconds * mtbf_seconds)
    waste = checkpoint_seconds / tau + (tau / 2 + restart_seconds) / mtbf_seconds
    return tau, waste


def data_parallel_bytes(
    numel: int, world_size: int, parallel: str = "ddp", element_bytes: int = 4
) -> float:
    """Bytes one rank *hands* to the collectives of a step with one micro-batch, for
    ``numel`` parameters of ``element_bytes`` each on ``world_size`` ranks, by the entry
    point's count (:class:`lsdl_lab.distributed.CollectiveBytes`: the tensor each rank
    contributes). DDP all-reduces the gradients (the whole vector); ZeRO stages 1 and 2
    reduce-scatter them (the whole vector) and all-gather the updated weights (its own
    shard, ``1/N`` of it); ZeRO-3 and FSDP2 gather the weights before the forward and again
    before the backward pass (Rajbhandari et al. 2020, Section 7), two shards."""
    check_choice("parallel", parallel, PARALLELS)
    shards = {"ddp": 0, "zero1": 1, "zero2": 1, "zero3": 2, "fsdp2": 2}[parallel]
    return numel * element_bytes * (1 + shards / world_size)


def layouts(
    devices: int, devices_per_node: int, layers: int, heads: int
) -> list[tuple[int, int, int]]:
    """The ``(dp, tp, pp)`` layouts, sorted, that :func:`lsdl_lab.plan.plan` considers for
    a GPT of ``layers`` blocks and ``heads`` attention heads on ``devices`` devices,
    ``devices_per_node`` to a node: ``tp`` divides ``devices``, fits in a node and divides
    the heads; ``pp`` divides ``devices / tp`` and is at most ``layers``;
    ``dp = devices / (tp pp)``. Asked of the planner itself, with memory to spare and a
    batch every layout can split."""
    vocab = 64 * math.lcm(*range(1, devices_per_node + 1))  # any tp <= a node divides it
    model = ModelShape(layers, 64 * heads, heads, 8, vocab, global_batch=devices)
    cluster = Cluster(
        devices=devices,
        devices_per_node=devices_per_node,
        memory=1e18,
        intra_bandwidth=1e9,
        intra_latency=0.0,
        inter_bandwidth=1e9,
        inter_latency=0.0,
        peak_flops=1e12,
        reserve=0.0,
    )
    techniques = Techniques(zero_stages=(0,), recompute=("none",), micro_batches=(1,))
    return sorted({(c.dp, c.tp, c.pp) for c in plan(model, cluster, techniques)})


def _close(got, expected) -> bool:
    try:
        return all(math.isclose(g, e, rel_tol=1e-9) for g, e in zip(got, expected, strict=True))
    except TypeError:
        return False


@exercise("lab09.checkpoint_plan")
def check_checkpoint_plan(student_fn) -> None:
    cases = [
        (60.0, 11_100.0, 600.0),  # Llama 3's M, a minute to save, ten to restart
        (10.0, 11_100.0, 600.0),
        (300.0, 3600.0, 0.0),
        (1.0, 86_400.0, 60.0),
        {"checkpoint_seconds": 5.0, "mtbf_seconds": 1000.0},  # restart defaults to 0
    ]
    try:
        check_function(student_fn, checkpoint_plan, cases, name="checkpoint_plan", rtol=1e-9)
    except CheckFailed as failure:
        hints = []
        got = answer_or_none(student_fn, 60.0, 11_100.0, 0.0)
        if isinstance(got, tuple) and len(got) == 2:
            if math.isclose(got[0], math.sqrt(60.0 * 11_100.0), rel_tol=1e-6):
                hints.append("the optimum is sqrt(2 C M): the factor 2 comes from tau/2")
            tau = math.sqrt(2 * 60.0 * 11_100.0)
            if math.isclose(got[1], 60.0 / tau + tau / 11_100.0, rel_tol=1e-6):
                hints.append("a failure loses on average half an interval, tau / 2, not tau")
        with_r = answer_or_none(student_fn, 60.0, 11_100.0, 600.0)
        if isinstance(got, tuple) and isinstance(with_r, tuple) and got == with_r:
            hints.append("each failure also costs the restart time R: add R / M to the waste")
        raise with_hints(failure, hints) from None
    print("✔ checkpoint_plan: every case equals Young's interval and its waste")


@exercise("lab09.data_parallel_bytes")
def check_data_parallel_bytes(student_fn) -> None:
    cases = [
        (1000, 2, "ddp"),
        (1000, 2, "zero1"),
        (1000, 2, "zero2"),
        (1000, 2, "zero3"),
        (1000, 4, "fsdp2"),
        (10**6, 8, "zero2", 2),
        (12345, 1, "zero3"),
        {"numel": 5000, "world_size": 4},
    ]
    try:
        check_function(student_fn, data_parallel_bytes, cases, name="data_parallel_bytes")
    except CheckFailed as failure:
        hints = []
        ddp = answer_or_none(student_fn, 1000, 4, "ddp") or 0
        if _close([ddp], [2 * 3 / 4 * 4000]) or _close([ddp], [8000]):
            hints.append("count what is handed over (the gradient once), not the ring's traffic")
        if _close([answer_or_none(student_fn, 1000, 2, "zero2") or 0], [4000]):
            hints.append("ZeRO also all-gathers the updated weights: each rank hands its shard")
        if _close([answer_or_none(student_fn, 1000, 2, "zero3") or 0], [6000]):
            hints.append("ZeRO-3 gathers the weights twice (forward and backward)")
        if _close([answer_or_none(student_fn, 1000, 2, "zero2") or 0], [8000]):
            hints.append("an all-gather's input is one shard, numel / world_size elements")
        if _close([answer_or_none(student_fn, 1000, 2, "ddp", 2) or 0], [4000]):
            hints.append("multiply by element_bytes: 16-bit gradients hand over half the bytes")
        raise with_hints(failure, hints) from None
    print("✔ data_parallel_bytes: every case equals the entry point's count")


@exercise("lab09.layouts")
def check_layouts(student_fn) -> None:
    cases = [
        (8, 8, 4, 8),
        (16, 8, 24, 16),
        (16, 4, 2, 6),  # tp limited by the node and by the heads; pp by the layers
        (16, 4, 2, 16),  # tp limited by the node only
        (12, 6, 3, 4),
        (1, 1, 1, 1),
        (64, 8, 96, 96),
    ]
    try:
        check_function(_sorted_tuples(student_fn), layouts, cases, name="layouts")
    except CheckFailed as failure:
        hints = []
        wide = answer_or_none(_sorted_tuples(student_fn), 16, 4, 2, 16)
        if isinstance(wide, list) and any(tp > 4 for _, tp, _ in wide):
            hints.append("tensor parallelism stays inside a node: tp <= devices_per_node")
        got = answer_or_none(_sorted_tuples(student_fn), 16, 4, 2, 6)
        if isinstance(got, list):
            if any(6 % tp for _, tp, _ in got):
                hints.append("each tensor-parallel rank holds whole heads: heads % tp == 0")
            if any(pp > 2 for _, _, pp in got):
                hints.append("a pipeline stage holds at least one layer: pp <= layers")
            if any(dp * tp * pp != 16 for dp, tp, pp in got):
                hints.append("every device is used: dp * tp * pp == devices")
        raise with_hints(failure, hints) from None
    print("✔ layouts: every case gives the layouts lsdl_lab.plan.plan searches")


def _sorted_tuples(student_fn):
    """The student's layouts as a sorted list of tuples (any iterable of triples will do)."""

    @functools.wraps(student_fn)  # so that the exercise's stub is named as the student's
    def normalized(*args, **kwargs):
        return sorted(tuple(int(x) for x in layout) for layout in student_fn(*args, **kwargs))

    return normalized
