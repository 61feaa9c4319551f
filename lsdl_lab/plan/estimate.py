"""The planner's estimates for one layout: FLOPs, bytes on the busiest device and
seconds of communication (the models stated in :mod:`lsdl_lab.plan`)."""

from __future__ import annotations

import math

from .._util import check_choice
from ..distributed.cost import ring_all_reduce_time
from ..memory.calculator import (
    RECOMPUTE,
    activation_bytes,
    gpt_param_shapes,
    optimizer_state_bytes,
)
from ..memory.zero import zero_bytes
from .inputs import Cluster, ModelShape, Techniques

__all__ = ["communication_times", "stage_memory", "train_flops_per_token"]


def train_flops_per_token(model: ModelShape, recompute: str = "none") -> float:
    """FLOPs per token of a training step (Narayanan et al. 2021, eq. 3, generalized):
    ``72 L h^2 (1 + s/(6h)) + 6 V h``, plus one more forward of the blocks under full
    recomputation (their 96) and of the attention core ``4 L s h`` under selective."""
    check_choice("recompute", recompute, RECOMPUTE)
    L, h, s, v = model.layers, model.hidden, model.seq_len, model.vocab
    block_forward = 24 * h * h + 4 * s * h
    extra = {"none": 0, "selective": 4 * s * h, "full": block_forward}[recompute]
    return L * (3 * block_forward + extra) + 6 * v * h


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
) -> dict[str, float]:
    """Bytes by category (and ``psi``, the stage's parameters per tensor-parallel rank) on
    the first pipeline stage: ``ceil(layers / pp)`` blocks and the embeddings, ZeRO over
    ``dp``, and under 1F1B ``min(pp, m)`` micro-batches of the blocks' activations in
    flight (Narayanan et al. 2021, Section 2.2.1), the terms outside the blocks once. The
    calculator takes no pipeline degree: the per-layer activations are its difference
    between one and two blocks."""
    b = micro_batch
    per_stage = math.ceil(model.layers / pp)
    precision = techniques.precision
    one = activation_bytes(model.shape(b, 1), precision, recompute, tp=tp)
    per_layer = activation_bytes(model.shape(b, 2), precision, recompute, tp=tp) - one
    outside = one - per_layer
    shapes = gpt_param_shapes(model.shape(b, per_stage), tp)
    psi = sum(math.prod(s) for s in shapes)
    width = 4 if precision == "fp32" else 2
    k = optimizer_state_bytes(shapes, techniques.optimizer, precision) / psi
    out = zero_bytes(psi, zero_stage, dp, k, param_bytes=width, grad_bytes=width)
    in_flight = min(pp, model.global_batch // (dp * b))
    out["activations"] = in_flight * per_stage * per_layer + outside
    out["total"] += out["activations"]
    out["psi"] = psi
    return out


def communication_times(
    model: ModelShape,
    cluster: Cluster,
    *,
    micro_batch: int,
    tp: int,
    pp: int,
    dp: int,
    zero_stage: int,
    recompute: str,
    psi: float,
    width: int,
) -> dict[str, float]:
    """Seconds of tensor-, pipeline- and data-parallel communication per step on the
    critical path (``"tp"``, ``"pp"``, ``"dp"``; nothing overlapped), ``psi`` parameters
    per device of ``width`` bytes; the model is :mod:`lsdl_lab.plan`'s."""
    h, s, b = model.hidden, model.seq_len, micro_batch
    m = model.global_batch // (dp * b)
    per_stage = math.ceil(model.layers / pp)
    out = {"tp": 0.0, "pp": 0.0, "dp": 0.0}
    if tp > 1:
        link = cluster.link(True)
        count = 6 if recompute == "full" else 4
        one = ring_all_reduce_time(width * b * s * h, tp, link.alpha, link.beta)
        out["tp"] = count * per_stage * m * one
    if pp > 1:
        link = cluster.link(tp * dp * pp <= cluster.devices_per_node)
        out["pp"] = 2 * (m + pp - 1) * (link.alpha + width * b * s * h / tp * link.beta)
    if dp > 1:
        link = cluster.link(tp * dp <= cluster.devices_per_node)
        all_reduce = ring_all_reduce_time(width * psi, dp, link.alpha, link.beta)
        half = all_reduce / 2  # a reduce-scatter or an all-gather: half a ring all-reduce
        if zero_stage <= 1:
            out["dp"] = all_reduce
        elif zero_stage == 2:
            out["dp"] = m * half + half
        else:
            out["dp"] = 3 * m * half
    return out
