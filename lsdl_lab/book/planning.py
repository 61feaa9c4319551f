"""The planner at two scales, for Chapter 9 and Lab 9.

At lab scale: the book's world of 2 processes on one CPU (gloo), with the alpha-beta of its
loopback link measured by :mod:`lsdl_lab.distributed.cost` and the FLOP rate that one
process achieves on the model's training step, to set against a measured run of the
training entry point (:mod:`lsdl_lab.run`): :func:`planned_run` is the planner's layout of
such a run.

At the scale of the papers: :func:`published_runs`, the training runs whose layout and
throughput their papers state (Megatron-LM's Table 1 and its GPT-3 175B rows of Table 2,
MT-NLG 530B, BLOOM-176B, OPT-175B, Llama 3 405B), each with the techniques its framework
used, and :func:`held_to`, the planner's verdict on one: does the published layout fit
the planner's memory, where its degrees rank among the planner's layouts, and the
planner's throughput for it against the published one. ``tests/plan/test_search.py``
records each paper's numbers beside their table or section and checks these records
against them.
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .._util import check_int, check_positive
from ..distributed.cost import AlphaBeta, fit_alpha_beta, measure_collective, ring_all_reduce_time
from ..plan import (
    Cluster,
    Layout,
    ModelShape,
    Techniques,
    layout_rank,
    plan,
    train_flops_per_token,
)

__all__ = [
    "EFFICIENCY",
    "PublishedRun",
    "by_context_degree",
    "held_to",
    "lab_cluster",
    "measure_link",
    "plan_lab",
    "planned_run",
    "published_runs",
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


def by_context_degree(
    model: ModelShape, cluster: Cluster, techniques: Techniques, degrees=(1, 2, 4, 8)
) -> dict[int, Layout | None]:
    """The planner's fastest layout that fits at each context-parallel degree of
    ``degrees`` (``None``: nothing fits, or the degree splits neither the sequence nor the
    devices), for a table of how long a sequence context parallelism lets a cluster train.
    ``techniques`` (with ``attention="fused"``, which ring attention and Ulysses need)
    gives everything else the planner may choose."""
    if not isinstance(techniques, Techniques) or techniques.attention != "fused":
        raise ValueError(
            f"Invalid techniques: {techniques!r} (expected Techniques with attention='fused')"
        )
    out = {}
    for c in degrees:
        check_int("degrees", c, 1)
        best = plan(model, cluster, dataclasses.replace(techniques, cp=(c,)), top=1)
        out[c] = best[0] if best else None
    return out


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


# -- the planner against published runs --------------------------------------------------

# The fraction of the peak that every GPU's kernels reach in the planner, for every run
# below: half, a round figure fixed before the comparison (BigScience planned BLOOM with
# the same "probably the best would be 50% of [312 TFLOP/s]", chronicles-prequel.md),
# never fitted to a run. The estimates scale with it: the step is mostly computation.
EFFICIENCY = 0.5

# DGX A100 (80 GB) as Selene has it (Narayanan et al. 2021, Section 5): NVSwitch, 300 GB/s
# per GPU and direction (the A100 whitepaper's 600 GB/s both ways), eight 200 Gb/s HDR
# InfiniBand adapters a node (25 GB/s per GPU), 312 TFLOP/s 16-bit peak; latencies of
# 5 us (NVLink) and 10 us (network) are typical NCCL figures, an assumption.
A100_NODE = dict(devices_per_node=8, memory=80e9, intra_bandwidth=300e9, intra_latency=5e-6,
                 inter_bandwidth=25e9, inter_latency=10e-6, peak_flops=312e12,
                 efficiency=EFFICIENCY, reserve=0.1)  # fmt: skip
# Jean Zay's A100 nodes for BLOOM (its README): 8 GPUs with 4 NVLink links each
# (4 x 25 GB/s per direction), four 100 Gb/s Omni-Path links a node (6.25 GB/s per GPU).
JEAN_ZAY_NODE = dict(A100_NODE, intra_bandwidth=100e9, inter_bandwidth=6.25e9)
# Llama 3's H100 80 GB servers (Dubey et al. 2024, Section 3.3.1): 8 GPUs on NVLink (900
# GB/s both ways), 400 Gb/s per GPU between servers (50 GB/s), 989 TFLOP/s bf16 peak.
H100_NODE = dict(A100_NODE, intra_bandwidth=450e9, inter_bandwidth=50e9, peak_flops=989e12)


@dataclass(frozen=True)
class PublishedRun:
    """A training run as its paper states it: the model, the cluster, what its framework
    did (``techniques``: the choices the paper fixes, the others left to the planner), the
    published ``layout`` ``(dp, tp, pp)`` and throughput ``tflops`` per GPU, counted as the
    paper counts it (``count``: ``"full"``, Narayanan et al.'s eq. 3 with the recomputation
    forward; ``"none"``, model FLOPs, the MFU convention); ``source`` (a key of the book's
    references) and ``where`` in it."""

    name: str
    source: str
    where: str
    model: ModelShape
    cluster: Cluster
    techniques: Techniques
    layout: tuple[int, int, int]
    tflops: float
    count: str = "full"


def published_runs() -> list[PublishedRun]:
    """Every published run the planner is held to (the sources and readings are in the
    comments here and in ``tests/plan/test_search.py``)."""
    runs = []
    # Narayanan et al. 2021, Table 1: vocabulary 51,200, sequence 2048, mixed precision,
    # no ZeRO, the activation recomputation eq. 3 counts; the micro-batch and the
    # interleaved schedule's chunks are not in the table: left to the planner.
    megatron = Techniques(zero_stages=(0,), recompute=("full",), precision="fp16",
                          virtual_stages=(1, 2, 4))  # fmt: skip
    for params, heads, hidden, layers, tp, pp, gpus, batch, tflops in MEGATRON_TABLE1:
        runs.append(PublishedRun(
            f"Megatron-LM {params:g}B", "narayanan2021efficient", "Table 1",
            ModelShape(layers, hidden, heads, 2048, 51200, batch),
            Cluster(devices=gpus, **A100_NODE), megatron,
            (gpus // (tp * pp), tp, pp), tflops,
        ))  # fmt: skip
    # Narayanan et al. 2021, Table 2, GPT-3 175B at batch 1536: PTD-P with model-parallel
    # size 96 (t = 8 in a node, so p = 12) and micro-batch 1; ZeRO-3 (DeepSpeed) without
    # model parallelism at micro-batch 4, 2, 1, whose prefetching overlaps its collectives.
    gpt3 = ModelShape(96, 12288, 96, 2048, 51200, 1536)
    for gpus, tflops in ((384, 153), (768, 149), (1536, 141)):
        runs.append(PublishedRun(
            "GPT-3 175B, PTD-P", "narayanan2021efficient", "Table 2", gpt3,
            Cluster(devices=gpus, **A100_NODE),
            dataclasses.replace(megatron, micro_batches=(1,)), (gpus // 96, 8, 12), tflops,
        ))  # fmt: skip
    for gpus, b, tflops in ((384, 4, 144), (768, 2, 88), (1536, 1, 44)):
        runs.append(PublishedRun(
            "GPT-3 175B, ZeRO-3", "narayanan2021efficient", "Table 2", gpt3,
            Cluster(devices=gpus, **A100_NODE),
            Techniques(zero_stages=(3,), recompute=("full",), precision="fp16",
                       micro_batches=(b,), overlap=True),
            (gpus, 1, 1), tflops,
        ))  # fmt: skip
    # MT-NLG 530B (Smith et al. 2022, Sections 2.3-2.4): 105 layers, hidden 20480, 128 heads,
    # sequence 2048, batch 1920; 8-way tensor and 35-way pipeline parallelism, data
    # parallelism over 280, 350, 420 DGX A100 servers: 60.1, 50.2, 44.4 s an iteration,
    # 126, 121, 113 TFLOP/s per GPU (eq. 3's count: 126 = eq. 3 / 60.1 s / 2240).
    # DeepSpeed's pipeline engine allows ZeRO stages 0 and 1 only.
    mtnlg = ModelShape(105, 20480, 128, 2048, 51200, 1920)
    for nodes, tflops in ((280, 126), (350, 121), (420, 113)):
        runs.append(PublishedRun(
            f"MT-NLG 530B, {8 * nodes} GPUs", "smith2022using", "Section 2.4", mtnlg,
            Cluster(devices=8 * nodes, **A100_NODE),
            Techniques(zero_stages=(0, 1), recompute=("full",), precision="fp16"),
            (nodes // 35, 8, 35), tflops,
        ))  # fmt: skip
    # BLOOM-176B (Le Scao et al. 2022; the training README and chronicles): 70 layers,
    # hidden 14336, 112 heads, sequence 2048, vocabulary padded to 250,880, batch 2048;
    # TP 4, PP 12, DP 8, micro-batch 2, full recomputation, dropout 0.1, bf16 with
    # DeepSpeed's BF16_Optimizer (its own ZeRO-1; float32 gradients accumulated in an
    # unsharded buffer, "4 bytes * params", beside the bf16 ones), the embeddings
    # partitioned as layers ("type:transformer|embedding"); about 150 TFLOP/s (149.77 logged).
    runs.append(PublishedRun(
        "BLOOM-176B", "bigscience2022bloom", "training README",
        ModelShape(70, 14336, 112, 2048, 250880, 2048),
        Cluster(devices=384, **JEAN_ZAY_NODE),
        Techniques(zero_stages=(1,), micro_batches=(2,), recompute=("full",), grad_bytes=6,
                   embedding_slots=True),
        (8, 4, 12), 150,
    ))  # fmt: skip
    # OPT-175B (Zhang et al. 2022, Section 2.4 and Table 1): 96 layers, hidden 12288, 96
    # heads, sequence 2048, batch "2M" tokens, 992 A100 80 GB, FSDP (ZeRO-3, fp16 weights,
    # fp32 Adam) with Megatron-LM tensor parallelism, "up to 147 TFLOP/s per GPU". From the
    # logbook's notes and the released checkpoint (8 model parts x 124 shards): tp 8, dp 124;
    # we read "2M" as 992 sequences (8 per data-parallel rank), the vocabulary as the GPT-2
    # BPE's padded to 50,272, the 147 as counted with recomputation, and the cluster as a
    # DGX-like node: readings, not statements of the paper.
    runs.append(PublishedRun(
        "OPT-175B", "zhang2022opt", "Section 2.4",
        ModelShape(96, 12288, 96, 2048, 50272, 992),
        Cluster(devices=992, **A100_NODE),
        Techniques(zero_stages=(3,), recompute=("full",), precision="fp16", overlap=True),
        (124, 8, 1), 147,
    ))  # fmt: skip
    # Llama 3 405B (Dubey et al. 2024, Tables 3 and 4, Section 3.3.2): 126 layers, hidden
    # 16384, 128 heads, 8 key-value heads, SwiGLU FFN 53,248, vocabulary 128,000, untied;
    # sequence 8192, 16M tokens (2048 sequences) a step; TP 8, CP 1, PP 16 and DP 64 or
    # 128 at 430 or 400 TFLOP/s per GPU (BF16 MFU 43%, 41%: model FLOPs). No activation
    # checkpointing at 8K; FSDP sharding optimizer states and gradients (ZeRO-2) and
    # prefetching and reducing asynchronously; float32 gradient accumulation and
    # reduce-scatter; the interleaved schedule with one layer taken from the first and
    # the last stage, "the first model chunk on the first stage has only the embedding":
    # chunks of one layer, 8 a stage. Fused attention and sequence parallelism (the paper
    # cites Korthikanti et al. with its tensor parallelism) are our readings.
    llama = ModelShape(126, 16384, 128, 8192, 128000, 2048, tied=False, kv_heads=8,
                       ffn=53248, gated=True)  # fmt: skip
    llama_tech = Techniques(zero_stages=(2,), recompute=("none",), micro_batches=(1,),
                            virtual_stages=(8,), attention="fused", dropout=False,
                            sequence_parallel=True, embedding_slots=True, grad_bytes=4,
                            reduce_bytes=4, overlap=True)  # fmt: skip
    for gpus, dp, tflops in ((8192, 64, 430), (16384, 128, 400)):
        runs.append(PublishedRun(
            f"Llama 3 405B, {gpus // 1024}K GPUs", "dubey2024llama", "Table 4", llama,
            Cluster(devices=gpus, **H100_NODE), llama_tech, (dp, 8, 16), tflops, "none",
        ))  # fmt: skip
    return runs


# Narayanan et al. 2021, Table 1: (billions of parameters, heads, hidden, layers, tensor,
# pipeline, GPUs, batch, TFLOP/s per GPU).
MEGATRON_TABLE1 = (
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
)


def held_to(run: PublishedRun) -> dict:
    """The planner's verdict on a published ``run``: ``layout``, the published degrees
    completed with the choices the paper leaves open (the fastest that fits; if none fits,
    the one needing least memory), its ``bytes`` on the busiest device against the
    cluster's ``usable`` (``fits``), the ``rank`` of the published degrees among the
    planner's layouts that fit (1-based, ``None`` when they do not fit) and
    ``rank_by_time`` among all, memory aside; ``gap``, the completed layout's estimated
    step over the planner's best that fits (``None`` if nothing fits); and the
    ``estimate`` (TFLOP/s per GPU counted as the paper counts) with its ``ratio`` to the
    published throughput."""
    if not isinstance(run, PublishedRun):
        raise TypeError(f"Invalid run: a {type(run).__name__} (expected a PublishedRun)")
    model, cluster, t = run.model, run.cluster, run.techniques
    dp, tp, pp = run.layout
    degrees = dataclasses.replace(t, dp=(dp,), tp=(tp,), pp=(pp,))
    candidates = plan(model, cluster, degrees, fit=False)
    if not candidates:
        raise ValueError(f"Invalid run: {run.name}'s layout {run.layout} cannot lay it out")
    fitting = [c for c in candidates if c.bytes_per_device <= cluster.usable]
    if fitting:
        layout = min(fitting, key=lambda c: c.step_time)
    else:
        layout = min(candidates, key=lambda c: c.bytes_per_device)
    layouts = plan(model, cluster, t)
    estimate = layout.flops_per_device(model, run.count) / 1e12
    return {
        "layout": layout,
        "bytes": layout.bytes_per_device,
        "usable": cluster.usable,
        "fits": bool(fitting),
        "rank": layout_rank(layouts, dp, tp, pp),
        "rank_by_time": layout_rank(plan(model, cluster, t, fit=False), dp, tp, pp),
        "gap": layout.step_time / layouts[0].step_time - 1 if layouts else None,
        "estimate": estimate,
        "ratio": estimate / run.tflops,
    }
