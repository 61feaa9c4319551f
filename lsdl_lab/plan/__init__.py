"""The planner: choose data, tensor and pipeline degrees, ZeRO stage, micro-batch,
recomputation and pipeline schedule for a GPT on a cluster, from the book's own memory and
cost models.

:func:`plan` takes a :class:`ModelShape` (a GPT's layers, width, heads, sequence length,
vocabulary and global batch; grouped-query attention and a SwiGLU MLP for Llama-style
blocks) and a :class:`Cluster`, and enumerates every degree ``dp x tp x pp = devices``
(tensor parallelism inside a node, as Narayanan et al. 2021, Section 3.3, advise), every
allowed ZeRO stage, micro-batch size b, recomputation policy and number v of model chunks
per device (the interleaved schedule), with ``global_batch = dp x b x m`` (m
micro-batches per pipeline and step: the gradient accumulation steps). It keeps the
layouts (:class:`Layout`) whose bytes on the busiest device fit ``cluster.usable``, and
ranks them by estimated step time; :func:`evaluate` estimates one layout, fitting or not.
What the training framework does is an input too (:class:`Techniques`: fused attention,
dropout, sequence parallelism, float32 gradient buffers, the reduction's precision, the
overlap of data-parallel collectives, the embedding counted as a pipeline slot). The
model, stated once here:

**Memory** (per device, the busiest pipeline rank). The blocks are spread as evenly as
possible over ``pp x v`` chunks (:func:`partition`; chunk ``k pp + r`` on rank r, as
Megatron-LM assigns them), the embeddings on the first rank and the output layer on the
last (with a copy of a tied embedding there, as Megatron-LM keeps it), each split over
``tp`` by :func:`~lsdl_lab.memory.calculator.gpt_param_parts`; model states are partitioned
over ``dp`` by ZeRO (:func:`~lsdl_lab.memory.zero.zero_bytes`, Rajbhandari et al. 2020),
with ``Techniques.gradient_bytes`` per gradient. A rank holds the activations of the
micro-batches in flight at its peak (:func:`in_flight`): under 1F1B ``pp - r`` of them
(Narayanan et al. 2021, Section 2.2.1), under the interleaved schedule Megatron-LM's
warm-up of ``2 (pp - r - 1) + (v - 1) pp`` chunks and one more (Korthikanti et al. 2022,
Section 4.2.3: ``1 + (pp - 1)/(pp v)`` times 1F1B's on the first rank), each chunk's
blocks by Korthikanti et al.'s per-layer count
(:func:`~lsdl_lab.memory.calculator.activation_parts`, with the framework's attention,
dropout and sequence parallelism), the embedding's and the output's terms on the first
and the last rank. Buffers, temporaries (a recomputed layer's rebuilt activations, the
logits' gradient), the CUDA context and fragmentation are not counted: :class:`Cluster`
keeps a ``reserve`` fraction of each device's memory for them.

**Compute**: the FLOPs of Narayanan et al. (2021, Section 5.1, eq. 3), per token a block's
forward ``24 h^2 + 4 s h`` (:func:`block_flops_per_token`: the matrices, with GQA's narrower
K and V and SwiGLU's three matrices, and the attention scores) and the logits ``2 V h``;
training costs three forwards, ``72 L h^2 (1 + s/(6h)) + 6 V h`` per token
(:func:`train_flops_per_token`), the "6 x parameters x tokens" of Kaplan et al. (2020) with
the attention scores and the logits added. Full recomputation adds one forward of each
block (the paper's 96 in place of 72); selective recomputation adds the attention core's
``4 s h`` per block (Korthikanti et al. 2022, Section 5). Devices run at ``efficiency x
peak_flops`` whatever the micro-batch (real kernels run faster on larger ones: a known
bias of this model toward b = 1). The slowest rank sets the pace: its blocks, and the
logits on the last; the bubble stretches the compute by ``1 + (pp - 1)/(v m)``.

**Communication** by the alpha-beta model (:mod:`lsdl_lab.distributed.cost`):

* tensor parallelism: 4 ring all-reduces per block and micro-batch (2 forward, 2 backward;
  6 with full recomputation) of ``b s h`` activations on the intra-node link (Shoeybi et
  al. 2019; sequence parallelism replaces each by a reduce-scatter and an all-gather of
  the same volume);
* pipeline parallelism: ``2 (v m + pp - 1)`` point-to-point messages of ``b s h / tp``
  activations on the critical path (Megatron-LM's scatter/gather splits them over the
  ``tp`` links, Narayanan et al. 2021, Section 4.1), inter-node unless the whole model
  fits in a node;
* data parallelism: the gradients of the rank with the most parameters, by the ring over
  ``dp`` ranks, inter-node unless ``tp dp`` devices fit in a node, in
  ``Techniques.reduction_bytes`` per element. ZeRO 0 all-reduces them once per step, ZeRO
  1 reduce-scatters them and all-gathers the updated weights (the same bytes,
  Rajbhandari et al. 2020, Section 7.1); ZeRO 2 keeps only its gradient partition, so it
  reduce-scatters each micro-batch; ZeRO 3 also all-gathers the weights in each
  micro-batch's forward and backward passes. Without ``overlap`` all of it is on the
  critical path (Megatron-LM 2021 and DeepSpeed's pipeline engine reduce after the last
  backward pass); with it, it runs under the compute and only what outlasts its window
  is added: ZeRO 3 prefetches under all the compute, ZeRO 2 reduces under every backward
  pass, stages 0 and 1 under the last micro-batch's (a bound: perfect overlap).

Ranks are placed as Megatron-LM places them: tensor-parallel ranks adjacent, then
data-parallel, then pipeline stages, so a group stays on NVLink while it fits in a node.

**Context parallelism** (``Techniques.cp``, default none): ``dp x tp x pp x cp = devices``,
each of the ``cp`` ranks of a sequence holding s/cp of its positions: the calculator's
activations at s/cp (ring attention or Ulysses keep no s x s scores, so it needs fused
attention), the compute split over ``tp x cp``, the tensor- and pipeline-parallel messages
s/cp long, the model states partitioned and the gradients reduced over ``dp x cp`` ranks
(Megatron-LM's), and per block and micro-batch the bytes of
:func:`~lsdl_lab.memory.calculator.layer_traffic` (ring attention's or Ulysses's, the
formulas of :mod:`lsdl_lab.parallel.context`) with a latency a ring hop or all-to-all step,
on the intra-node link while ``tp x cp`` devices fit in a node, not hidden under the
attention (a bound: ring attention overlaps them). ``Techniques.fp8`` and
``optimizer="adam8bit"`` reach the calculator as its options of the same names. Experts
(MoE) are the calculator's only: :meth:`ModelShape.from_shape` refuses them.

**Not modelled**: schedules other than 1F1B and Megatron-LM's
interleaving (Llama 3's tunable rounds, zero-bubble schedules), communication overlap
inside the tensor- and pipeline-parallel paths, and the faster kernels of larger
micro-batches. **Held to published runs** (``tests/plan/test_search.py`` records each
paper's numbers; Chapter 9 tabulates them, :func:`lsdl_lab.book.planning.held_to`): all of
Megatron-LM's Table 1 and its GPT-3 175B rows of Table 2, MT-NLG 530B, BLOOM-176B,
OPT-175B and Llama 3 405B, at one efficiency (half of peak). Every published layout fits
but Llama 3's (75 and 82 GB against 72: it ran a schedule with fewer micro-batches in
flight than Megatron-LM's warm-up); among the layouts that fit, the published degrees rank
at most 7th, within 5% of the planner's best step (ZeRO-3 on 1,536 GPUs, 18%); the
estimated throughput is within 20% of the published one for every run but ZeRO-3 on 768
and 1,536 GPUs (1.6x: the overlap the planner grants ZeRO-3 did not happen).

Modules: :mod:`~lsdl_lab.plan.inputs` (:class:`ModelShape`, :class:`Cluster`,
:class:`Techniques`), :mod:`~lsdl_lab.plan.estimate` (FLOPs, the pipeline's partition and
schedule, bytes, communication of one layout), :mod:`~lsdl_lab.plan.search` (:func:`plan`,
:func:`evaluate`, :class:`Layout`, :func:`layout_rank`). The planner at lab scale (the
world-2 CPU cluster from a measured alpha-beta, set against a measured run) and against
the published runs belongs to the book's wing, :mod:`lsdl_lab.book.planning`.
"""

from .estimate import (
    block_flops_per_token,
    communication_times,
    in_flight,
    partition,
    stage_memory,
    train_flops_per_token,
)
from .inputs import Cluster, ModelShape, Techniques
from .search import Layout, evaluate, layout_rank, plan

__all__ = [
    "Cluster",
    "Layout",
    "ModelShape",
    "Techniques",
    "block_flops_per_token",
    "communication_times",
    "evaluate",
    "in_flight",
    "layout_rank",
    "partition",
    "plan",
    "stage_memory",
    "train_flops_per_token",
]
