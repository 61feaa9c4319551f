"""The planner's estimates for one layout: FLOPs, the pipeline's partition and schedule,
bytes on the busiest device and seconds of communication (the models stated in
:mod:`lsdl_lab.plan`)."""

from __future__ import annotations

import functools
import math

from .._util import check_choice
from ..distributed.cost import ring_all_reduce_time
from ..memory.calculator import (
    RECOMPUTE,
    activation_parts,
    gpt_param_parts,
    layer_traffic,
    optimizer_state_bytes,
)
from ..memory.zero import zero_bytes
from .inputs import Cluster, ModelShape, Techniques

__all__ = [
    "block_flops_per_token",
    "communication_times",
    "in_flight",
    "partition",
    "stage_flops_per_token",
    "stage_memory",
    "train_flops_per_token",
]


def block_flops_per_token(model: ModelShape, recompute: str = "none") -> float:
    """FLOPs per token of one block's training step: three forwards (the backward costs
    two), each ``2 (h (h + 2 kv h/a) + h^2 + 2 h ffn) + 4 s h`` (the matrices, a gated MLP's
    three, and the attention scores and values), ``24 h^2 + 4 s h`` at the defaults
    (Narayanan et al. 2021, eq. 3); one more forward under full recomputation, the
    attention core's ``4 s h`` under selective (Korthikanti et al. 2022, Section 5)."""
    check_choice("recompute", recompute, RECOMPUTE)
    shape = model.shape(1)
    h, s = model.hidden, model.seq_len
    qkv = h + 2 * shape.kv * (h // model.heads)
    matrices = h * qkv + h * h + (3 if model.gated else 2) * h * shape.mlp
    forward = 2 * matrices + 4 * s * h
    extra = {"none": 0, "selective": 4 * s * h, "full": forward}[recompute]
    return 3 * forward + extra


def train_flops_per_token(model: ModelShape, recompute: str = "none") -> float:
    """FLOPs per token of a training step (Narayanan et al. 2021, eq. 3, generalized):
    ``layers`` blocks (:func:`block_flops_per_token`) and the logits, ``6 V h``:
    ``72 L h^2 (1 + s/(6h)) + 6 V h`` at the defaults, 96 in place of 72 under full
    recomputation."""
    return model.layers * block_flops_per_token(model, recompute) + 6 * model.vocab * model.hidden


@functools.lru_cache(maxsize=4096)
def partition(layers: int, pp: int, virtual_stages: int = 1, embedding_slots: bool = False):
    """The blocks of each model chunk on each pipeline rank: ``out[r][k]`` for rank ``r``
    and chunk ``k`` (global chunk ``k pp + r``, Megatron-LM's interleaved assignment). The
    ``layers`` blocks (and, with ``embedding_slots``, the embedding before them and the
    output layer after them, one slot each) are spread as evenly as the ``pp x
    virtual_stages`` chunks allow; ``None`` if a chunk would hold nothing."""
    ends = 1 if embedding_slots else 0
    slots, chunks = layers + 2 * ends, pp * virtual_stages
    sizes = [(c + 1) * slots // chunks - c * slots // chunks for c in range(chunks)]
    sizes[0] -= ends  # the embedding's slot
    sizes[-1] -= ends  # the output layer's
    inner = sizes[1:-1] if embedding_slots else sizes
    if min(sizes) < 0 or (inner and min(inner) < 1):
        return None
    return tuple(tuple(sizes[k * pp + r] for k in range(virtual_stages)) for r in range(pp))


@functools.lru_cache(maxsize=65536)
def in_flight(pp: int, virtual_stages: int, micro_batches: int, rank: int) -> tuple[int, ...]:
    """Micro-batches whose activations rank ``rank`` holds at its peak, per model chunk,
    under 1F1B (Narayanan et al. 2021, Section 2.2.1: ``pp - rank`` at most) or its
    interleaved form (Megatron-LM's warm-up of ``2 (pp - rank - 1) + (v - 1) pp`` forward
    chunks, plus the one in steady state; Korthikanti et al. 2022, Section 4.2.3, count
    the same ``1 + (pp - 1)/(pp v)`` times 1F1B's on the first rank). The forward chunks
    run in groups of ``pp`` micro-batches, each group through chunk 0, then chunk 1, ..."""
    v, m = virtual_stages, micro_batches
    warm = pp - rank - 1 if v == 1 else 2 * (pp - rank - 1) + (v - 1) * pp
    left = min(warm + 1, v * m)
    counts = [0] * v
    for group in range(math.ceil(m / pp)):
        size = min(pp, m - group * pp)
        for k in range(v):
            take = min(size, left)
            counts[k] += take
            left -= take
            if not left:
                return tuple(counts)
    return tuple(counts)


def _ranks(pp: int, blocks) -> list[int]:
    """One rank of each kind (its chunks' blocks, first, last), the earliest: it holds the
    most micro-batches in flight, so it is the busiest of its kind."""
    seen, out = set(), []
    for r in range(pp):
        kind = (blocks[r], r == 0, r == pp - 1)
        if kind not in seen:
            seen.add(kind)
            out.append(r)
    return out


def _rank_shapes(model: ModelShape, parts: dict, blocks_here: int, rank: int, pp: int) -> list:
    """The parameter shapes rank ``rank`` holds: its blocks, the embeddings on the first
    rank, the final LayerNorm and the output layer on the last (Megatron-LM keeps a copy of
    a tied embedding there)."""
    shapes = parts["block"] * blocks_here
    if rank == 0:
        shapes = parts["embedding"] + shapes
    if rank == pp - 1:
        shapes = shapes + parts["head"]
        if pp > 1 and model.tied:
            shapes = shapes + parts["embedding"][:1]
    return shapes


def stage_memory(
    model: ModelShape,
    techniques: Techniques,
    *,
    micro_batch: int,
    tp: int,
    pp: int,
    dp: int,
    zero_stage: int,
    recompute: str,
    virtual_stages: int = 1,
    cp: int = 1,
) -> dict[str, float]:
    """Bytes by category on the busiest pipeline rank, with ``psi`` (its parameters),
    ``psi_max`` (the most any rank holds: its gradients set the data-parallel time) and
    ``stage`` (which rank). Each rank holds the blocks of its chunks (:func:`partition`),
    the first also the embeddings and the last the output layer, split over ``tp`` by the
    calculator and partitioned over ``dp`` by ZeRO; and the activations of the
    micro-batches in flight (:func:`in_flight`), each chunk's blocks by the calculator's
    per-layer count, the embedding's on the first rank and the output's on the last. With
    ``cp`` context-parallel ranks a rank keeps s/cp positions of each activation, and ZeRO
    partitions the model states over the ``dp x cp`` ranks that hold the same ones
    (Megatron-LM's distributed optimizer shards over data and context parallelism)."""
    v = virtual_stages
    m = model.global_batch // (dp * micro_batch)
    blocks = partition(model.layers, pp, v, techniques.embedding_slots)
    if blocks is None:
        raise ValueError(f"Invalid pp: {pp} x {v} chunks (expected at least one block per chunk)")
    shape = model.shape(micro_batch)
    parts = gpt_param_parts(shape, tp)
    act = activation_parts(
        shape, techniques.precision, recompute, tp=tp, cp=cp, **techniques.activation_options()
    )
    best, psi_max = None, 0
    for r in _ranks(pp, blocks):
        shapes = _rank_shapes(model, parts, sum(blocks[r]), r, pp)
        psi = sum(math.prod(s) for s in shapes)
        psi_max = max(psi_max, psi)
        k = optimizer_state_bytes(shapes, techniques.optimizer, techniques.precision) / psi
        out = zero_bytes(psi, zero_stage, dp * cp, k, param_bytes=techniques.width,
                         grad_bytes=techniques.gradient_bytes)  # fmt: skip
        flight = in_flight(pp, v, m, r)
        out["activations"] = sum(n * b * act["layer"] for n, b in zip(flight, blocks[r]))
        out["activations"] += flight[0] * act["embedding"] if r == 0 else 0
        out["activations"] += flight[-1] * act["output"] if r == pp - 1 else 0
        out["total"] += out["activations"]
        out["psi"], out["stage"] = psi, r
        if best is None or out["total"] > best["total"]:
            best = out
    best["psi_max"] = psi_max
    return best


def stage_flops_per_token(
    model: ModelShape, pp: int, recompute: str, virtual_stages: int = 1,
    embedding_slots: bool = False,
) -> float:  # fmt: skip
    """FLOPs per token of the slowest pipeline rank: its blocks, and the logits on the
    last (the embedding's lookup costs nothing)."""
    blocks = partition(model.layers, pp, virtual_stages, embedding_slots)
    block = block_flops_per_token(model, recompute)
    logits = 6 * model.vocab * model.hidden
    return max(sum(blocks[r]) * block + (logits if r == pp - 1 else 0) for r in range(pp))


def communication_times(
    model: ModelShape,
    cluster: Cluster,
    techniques: Techniques,
    *,
    micro_batch: int,
    tp: int,
    pp: int,
    dp: int,
    zero_stage: int,
    recompute: str,
    virtual_stages: int = 1,
    cp: int = 1,
    psi: float,
) -> dict[str, float]:
    """Seconds of tensor-, pipeline-, data- and context-parallel communication per step
    (``"tp"``, ``"pp"``, ``"dp"``, ``"cp"``), ``psi`` parameters on the device with the
    most; the model is :mod:`lsdl_lab.plan`'s. With ``cp`` ranks to a sequence each
    activation message is s/cp positions; the gradients are reduced over ``dp x cp``
    ranks; each block sends :func:`~lsdl_lab.memory.calculator.layer_traffic`'s context
    bytes per micro-batch, with one latency per ring hop (``2 cp - 1``, forward and
    backward) or per all-to-all step (``4 (cp - 1)``), on the intra-node link while ``tp
    cp`` devices fit in a node, not overlapped with the attention it feeds (a bound)."""
    h, s, b, v = model.hidden, model.seq_len // cp, micro_batch, virtual_stages
    width, grads = techniques.width, techniques.reduction_bytes
    m = model.global_batch // (dp * b)
    blocks = partition(model.layers, pp, v, techniques.embedding_slots)
    per_stage = max(sum(chunks) for chunks in blocks)
    out = {"tp": 0.0, "pp": 0.0, "dp": 0.0, "cp": 0.0}
    if tp > 1:
        link = cluster.link(True)
        count = 6 if recompute == "full" else 4
        one = ring_all_reduce_time(width * b * s * h, tp, link.alpha, link.beta)
        out["tp"] = count * per_stage * m * one
    if pp > 1:
        link = cluster.link(tp * cp * dp * pp <= cluster.devices_per_node)
        messages = 2 * (v * m + pp - 1)
        out["pp"] = messages * (link.alpha + width * b * s * h / tp * link.beta)
    if cp > 1:
        link = cluster.link(tp * cp <= cluster.devices_per_node)
        shape = model.shape(micro_batch)
        sent = layer_traffic(shape, techniques.precision, recompute, tp=tp, cp=cp,
                             context=techniques.context)["cp"]  # fmt: skip
        hops = 2 * cp - 1 if techniques.context == "ring" else 4 * (cp - 1)
        out["cp"] = per_stage * m * (hops * link.alpha + sent * link.beta)
    if dp * cp > 1:
        n = dp * cp
        link = cluster.link(tp * n <= cluster.devices_per_node)

        def half(nbytes):  # a reduce-scatter or an all-gather: half a ring all-reduce
            return ring_all_reduce_time(nbytes, n, link.alpha, link.beta) / 2

        if zero_stage == 0:
            out["dp"] = 2 * half(grads * psi)
        elif zero_stage == 1:
            out["dp"] = half(grads * psi) + half(width * psi)
        elif zero_stage == 2:
            out["dp"] = m * half(grads * psi) + half(width * psi)
        else:
            out["dp"] = m * (half(grads * psi) + 2 * half(width * psi))
    return out
