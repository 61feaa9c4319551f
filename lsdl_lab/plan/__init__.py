"""The planner: choose data, tensor and pipeline degrees, ZeRO stage, micro-batch and
recomputation for a GPT on a cluster, from the book's own memory and cost models.

:func:`plan` takes a :class:`ModelShape` (a GPT's layers, width, heads, sequence length,
vocabulary and global batch) and a :class:`Cluster`, and enumerates every degree
``dp x tp x pp = devices`` (tensor parallelism inside a node, as Narayanan et al. 2021,
Section 3.3, advise), every allowed ZeRO stage, micro-batch size b and recomputation
policy, with ``global_batch = dp x b x m`` (m micro-batches per pipeline and step: the
gradient accumulation steps). It keeps the layouts (:class:`Layout`) whose bytes per
device fit, and ranks them by estimated step time. The model, stated once here:

**Memory** (per device, the busiest one): the first pipeline stage. It holds
``ceil(layers / pp)`` blocks plus the embeddings (counted on every stage, as Megatron-LM
keeps the tied embedding on the first and the last stage), split over ``tp`` ranks by
:func:`~lsdl_lab.memory.calculator.gpt_param_shapes`; its model states are partitioned
over ``dp`` by ZeRO (:func:`~lsdl_lab.memory.zero.zero_bytes`, Rajbhandari et al. 2020).
Under 1F1B (Narayanan et al. 2021, Section 2.2.1) the first stage has up to ``pp``
micro-batches in flight, each holding its blocks' activations by Korthikanti et al.
(2022) (:func:`~lsdl_lab.memory.calculator.activation_bytes`, per layer); the terms outside
the blocks (embedding dropout, final LayerNorm, float32 logits) are counted once. Buffers,
temporaries and fragmentation are not counted: :class:`Cluster` keeps a ``reserve``
fraction of each device's memory for them. The calculator takes no pipeline degree, so
this package builds the stage's shape (``layers = ceil(layers / pp)``) and scales the
per-layer activations itself.

**Compute**: the FLOPs of Narayanan et al. (2021, Section 5.1, eq. 3): per token a
block's forward costs ``24 h^2 + 4 s h`` and the logits ``2 V h``; training costs three
forwards (forward, and a backward twice as dear), ``72 L h^2 (1 + s/(6h)) + 6 V h`` per
token, the "6 x parameters x tokens" of Kaplan et al. (2020) with the attention scores and
the logits added. Full recomputation adds one forward of each block (the paper's 96 in
place of 72); selective recomputation adds the attention core's ``4 s h`` per block
(Korthikanti et al. 2022, Section 5). Devices run at ``efficiency x peak_flops``
whatever the micro-batch (real kernels run faster on larger ones: a known bias of this
model toward b = 1). A stage's time is set by its ``ceil(layers / pp)`` blocks; 1F1B's
bubble stretches the compute by ``1 + (pp - 1) / m``.

**Communication** by the alpha-beta model (:mod:`lsdl_lab.distributed.cost`), none of it
overlapped with compute (an upper bound: Megatron-LM 2021 runs the data-parallel
all-reduce after the backward pass and the tensor-parallel ones on the critical path):

* tensor parallelism: 4 ring all-reduces per block and micro-batch (2 forward, 2 backward;
  6 with full recomputation) of ``b s h`` activations on the intra-node link (Shoeybi et
  al. 2019);
* pipeline parallelism: ``2 (m + pp - 1)`` point-to-point messages of ``b s h / tp``
  activations on the critical path (Megatron-LM's scatter/gather splits them over the
  ``tp`` links, Narayanan et al. 2021, Section 4.1), inter-node unless the whole model
  fits in a node;
* data parallelism: the stage's gradients, ``Psi / (tp pp)`` per device, by the ring over
  ``dp`` ranks, inter-node unless ``tp dp`` devices fit in a node. ZeRO 0 and 1 accumulate
  full gradients and all-reduce them once per step (stage 1's reduce-scatter and
  all-gather move the same bytes, Rajbhandari et al. 2020, Section 7.1); ZeRO 2 keeps only
  its gradient partition, so it reduce-scatters each micro-batch and all-gathers the
  updated weights once; ZeRO 3 also all-gathers the weights in each micro-batch's forward
  and backward passes (its 1.5x volume per micro-batch).

Ranks are placed as Megatron-LM places them: tensor-parallel ranks adjacent, then
data-parallel, then pipeline stages, so a group stays on NVLink while it fits in a node.

**Not modelled**: sequence and context parallelism, the interleaved 1F1B schedule (its v
virtual stages divide the bubble by v), grouped-query attention and gated MLPs (the shape
is the book's GPT), any overlap of communication with compute, and the faster kernels of
larger micro-batches. **Validated on paper** (``tests/plan/test_search.py``, sources cited
there): Megatron-LM's Table 1 rows of 146B-1T parameters (the published layout first or
second; throughput 0.81-0.89 of the published), BLOOM-176B (first; 0.84), Llama 3 405B
(third; 0.44: outside 2x, as the interleaved schedule it runs is not modelled).

Modules: :mod:`~lsdl_lab.plan.inputs` (:class:`ModelShape`, :class:`Cluster`,
:class:`Techniques`), :mod:`~lsdl_lab.plan.estimate` (FLOPs, bytes, communication of one
layout), :mod:`~lsdl_lab.plan.search` (:func:`plan`, :class:`Layout`,
:func:`layout_rank`). The planner at lab scale (the world-2 CPU cluster from a measured
alpha-beta, set against a measured run) belongs to the book's wing,
:mod:`lsdl_lab.book.planning`.
"""

from .estimate import communication_times, stage_memory, train_flops_per_token
from .inputs import Cluster, ModelShape, Techniques
from .search import Layout, layout_rank, plan

__all__ = [
    "Cluster",
    "Layout",
    "ModelShape",
    "Techniques",
    "communication_times",
    "layout_rank",
    "plan",
    "stage_memory",
    "train_flops_per_token",
]
