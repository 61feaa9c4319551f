"""The planner at lab scale: the book's world of 2 processes on one CPU (gloo), with the
alpha-beta of its loopback link measured by :mod:`lsdl_lab.distributed.cost` and the FLOP rate
that one process achieves on the model's training step, to set against a measured run of the
training entry point (:mod:`lsdl_lab.run`): :func:`planned_run` is the planner's
layout of such a run."""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist

from .._util import check_int, check_positive
from ..distributed.cost import AlphaBeta, fit_alpha_beta, measure_collective, ring_all_reduce_time
from ..plan import Cluster, Layout, ModelShape, Techniques, plan, train_flops_per_token

__all__ = [
    "lab_cluster",
    "measure_link",
    "plan_lab",
    "planned_run",
    "run_model",
    "step_flop_rate",
]

# The ZeRO stage the planner counts for each data-parallel mode of lsdl_lab.run: FSDP2
# partitions parameters, gradients and optimizer state, as ZeRO-3.
ZERO_STAGE = {"ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3, "fsdp2": 3}


def measure_link(
    rank: int, world_size: int, nbytes=(4096, 65536, 1 << 20, 4 << 20), repeats: int = 5
) -> AlphaBeta:
    """A worker for :func:`lsdl_lab.distributed.spawn`: the alpha-beta of this world's link,
    fitted with the ring's model (Chapter 7) to the fastest of ``repeats`` calls of
    ``dist.all_reduce`` on float32 tensors of each of ``nbytes`` bytes (the minimum: load
    from other processes only slows a call down)."""
    del rank
    seconds = measure_collective(dist.all_reduce, list(nbytes), repeats, statistic="min")
    return fit_alpha_beta(ring_all_reduce_time, world_size, list(nbytes), seconds)


def step_flop_rate(model: ModelShape, records: list[dict], recompute: str = "none") -> float:
    """The FLOP/s a run of ``model`` achieved, from its metrics ``records``
    (:mod:`lsdl_lab.run.metrics`, ``log_every=1``): the FLOPs of a step
    (:func:`~lsdl_lab.plan.train_flops_per_token` with ``recompute``, times the global
    batch's tokens) over the median step time, the first step (warm-up) left out. Of a
    one-process run, it is the rate, all overheads included, at which the planner's
    compute time is to be read (efficiency 1)."""
    times = [r["step_time_s"] for r in records[1:]]
    if not times:
        raise ValueError(f"Invalid records: {len(records)} (expected at least 2 steps)")
    tokens = model.global_batch * model.seq_len
    return train_flops_per_token(model, recompute) * tokens / statistics.median(times)


def run_model(config) -> ModelShape:
    """The planner's :class:`ModelShape` of the GPT that an :mod:`lsdl_lab.run` ``config``
    trains (its profile's sizes and its corpus's vocabulary)."""
    from ..run.build import build  # the entry point's builder, only where it is asked for

    if getattr(config, "model", None) != "gpt":
        raise ValueError(f"Invalid config: model {getattr(config, 'model', None)!r} "
                         "(expected a run config of model 'gpt')")  # fmt: skip
    gpt = build(config, torch.device("cpu")).model
    return ModelShape(
        layers=len(gpt.blocks),
        hidden=gpt.tok.embedding_dim,
        heads=gpt.blocks[0].attn.heads,
        seq_len=gpt.block_size,
        vocab=gpt.tok.num_embeddings,
        global_batch=config.global_batch,
    )


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
    whose links are all the measured ``link`` (:func:`~lsdl_lab.distributed.fit_alpha_beta` on
    :func:`~lsdl_lab.distributed.measure_collective`'s times): on one machine, "intra" and
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
    model: ModelShape,
    link: AlphaBeta,
    *,
    memory: float,
    peak_flops: float,
    devices: int = 2,
    techniques: Techniques | None = None,
) -> list[Layout]:
    """:func:`~lsdl_lab.plan.plan` for the lab's world (``devices`` processes on one CPU,
    gloo) from a measured alpha-beta ``link`` and FLOP rate, in float32 by default (the
    lab's precision). ``tests/book/test_planning.py`` checks it on given alpha and beta,
    and against a measured world-2 run of the entry point (Chapter 9's table does too)."""
    techniques = techniques or Techniques(precision="fp32")
    cluster = lab_cluster(link, devices=devices, memory=memory, peak_flops=peak_flops)
    return plan(model, cluster, techniques)


def planned_run(
    model: ModelShape,
    link: AlphaBeta,
    peak_flops: float,
    *,
    parallel: str = "ddp",
    micro_batch: int | None = None,
    recompute: str = "none",
    devices: int = 2,
) -> Layout:
    """The planner's :class:`~lsdl_lab.plan.Layout` of a data-parallel run of
    :mod:`lsdl_lab.run` on the lab's world: ``dp = devices``, no tensor or pipeline
    parallelism, the ZeRO stage of ``parallel`` (FSDP2 as ZeRO-3), ``micro_batch``
    sequences per micro-batch (default the whole per-rank batch), float32 and Adam(W), as
    the run is. Its
    ``memory["total"] - memory["activations"]`` are the model states the run's
    ``memory`` records count; its ``step_time`` sets compute at ``peak_flops`` against
    the run's measured step time."""
    if parallel not in ZERO_STAGE:
        raise ValueError(f"Invalid parallel: {parallel!r} (expected one of {list(ZERO_STAGE)})")
    check_positive("peak_flops", peak_flops)
    devices = check_int("devices", devices, 2)
    b = model.global_batch // devices if micro_batch is None else micro_batch
    techniques = Techniques(
        tp=(1,),
        pp=(1,),
        dp=(devices,),
        zero_stages=(ZERO_STAGE[parallel],),
        recompute=(recompute,),
        micro_batches=(check_int("micro_batch", b, 1),),
        precision="fp32",
        optimizer="adam",
    )
    found = plan_lab(model, link, memory=1e18, peak_flops=peak_flops, devices=devices,
                     techniques=techniques)  # fmt: skip
    if not found:
        raise ValueError(
            f"Invalid micro_batch: {b} (expected a divisor of global_batch / devices = "
            f"{model.global_batch / devices:g})"
        )
    return found[0]
