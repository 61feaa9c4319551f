"""The planner at lab scale: the book's world of 2 processes on one CPU (gloo), with the
alpha-beta of its loopback link measured by :mod:`lsdl_lab.dist.cost`."""

from __future__ import annotations

from .._util import check_int
from ..dist.cost import AlphaBeta
from .inputs import Cluster, Model, Techniques
from .search import Config, plan

__all__ = ["lab_cluster", "plan_lab"]


def lab_cluster(
    link: AlphaBeta,
    *,
    devices: int = 2,
    memory: float,
    peak_flops: float,
    efficiency: float = 1.0,
    reserve: float = 0.0,
) -> Cluster:
    """A one-node cluster of ``devices`` processes (the book's world 2 on gloo and a CPU)
    whose links are all the measured ``link`` (:func:`~lsdl_lab.dist.fit_alpha_beta` on
    :func:`~lsdl_lab.dist.measure_collective`'s times): on one machine, "intra" and
    "inter" node are the same loopback. ``peak_flops`` is the measured FLOP/s of one
    process (then ``efficiency`` 1)."""
    if not isinstance(link, AlphaBeta):
        raise TypeError(f"Invalid link: a {type(link).__name__} (expected an AlphaBeta)")
    alpha = link.alpha
    # A zero beta (a fit on the boundary) stands as a tiny positive one: finite bandwidth.
    bandwidth = 1 / max(link.beta, 1e-18)
    return Cluster(
        devices=check_int("devices", devices, 1),
        devices_per_node=devices,
        memory=memory,
        intra_bandwidth=bandwidth,
        intra_latency=alpha,
        inter_bandwidth=bandwidth,
        inter_latency=alpha,
        peak_flops=peak_flops,
        efficiency=efficiency,
        reserve=reserve,
    )


def plan_lab(
    model: Model,
    link: AlphaBeta,
    *,
    memory: float,
    peak_flops: float,
    devices: int = 2,
    techniques: Techniques | None = None,
) -> list[Config]:
    """:func:`plan` for the lab's world (``devices`` processes on one CPU, gloo) from a
    measured alpha-beta ``link`` and FLOP rate, in float32 by default (the lab's
    precision). Tested on given alpha and beta (``tests/plan/test_lab.py``); its estimate
    is not yet checked against a measured run at world 2 (Chapter 9's table will)."""
    techniques = techniques or Techniques(precision="fp32")
    cluster = lab_cluster(link, devices=devices, memory=memory, peak_flops=peak_flops)
    return plan(model, cluster, techniques)
