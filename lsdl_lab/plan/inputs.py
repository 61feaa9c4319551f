"""The planner's inputs: the shape of the model to train, the cluster, and the techniques
allowed."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .._util import (
    check_bool,
    check_choice,
    check_fraction,
    check_int,
    check_nonnegative,
    check_positive,
)
from ..distributed.cost import AlphaBeta
from ..memory.calculator import (
    ATTENTIONS,
    CONTEXTS,
    OPTIMIZERS,
    PRECISIONS,
    RECOMPUTE,
    GPTShape,
    gpt_param_shapes,
)
from ..memory.zero import ZERO_STAGES

__all__ = ["Cluster", "ModelShape", "Techniques"]


@dataclass(frozen=True)
class ModelShape:
    """The shape of a GPT to train (that of :class:`~lsdl_lab.memory.calculator.GPTShape`,
    without its micro-batch, which the planner chooses) and its ``global_batch`` in
    sequences per step: what the planner needs to know of a model, not the model.
    ``kv_heads`` (grouped-query attention), ``ffn`` and ``gated`` (a SwiGLU MLP ``ffn``
    wide) describe Llama-style blocks; the defaults are GPT-2's."""

    layers: int
    hidden: int
    heads: int
    seq_len: int
    vocab: int
    global_batch: int
    tied: bool = True
    kv_heads: int | None = None
    ffn: int | None = None
    gated: bool = False

    def __post_init__(self):
        check_int("global_batch", self.global_batch, 1)
        self.shape(1)  # the shape's own checks

    @classmethod
    def from_shape(cls, shape: GPTShape, global_batch: int) -> ModelShape:
        """The model of a calculator's ``shape`` (its micro-batch left to the planner)."""
        if not isinstance(shape, GPTShape):
            raise TypeError(f"Invalid shape: a {type(shape).__name__} (expected a GPTShape)")
        if shape.experts:
            raise ValueError(
                f"Invalid shape: experts={shape.experts} (the planner does not model experts: "
                "expected a dense GPT)"
            )
        if shape.positions not in (None, shape.seq_len):
            raise ValueError(
                f"Invalid shape: positions={shape.positions} (expected None or seq_len)"
            )
        return cls(**{f: getattr(shape, f) for f in _SHAPE_FIELDS}, global_batch=global_batch)

    def shape(self, micro_batch: int, layers: int | None = None) -> GPTShape:
        """The calculator's shape of ``layers`` blocks (default all) at ``micro_batch``."""
        fields = {f: getattr(self, f) for f in _SHAPE_FIELDS}
        fields["layers"] = self.layers if layers is None else layers
        return GPTShape(micro_batch=micro_batch, **fields)

    @property
    def params(self) -> int:
        """Parameters (12 h^2 + 13 h per block at the defaults, embeddings, final
        LayerNorm)."""
        return sum(math.prod(s) for s in gpt_param_shapes(self.shape(1)))


_SHAPE_FIELDS = ("layers", "hidden", "heads", "seq_len", "vocab", "tied", "kv_heads", "ffn",
                 "gated")  # fmt: skip


@dataclass(frozen=True)
class Cluster:
    """``devices`` accelerators, ``devices_per_node`` to a node, each with ``memory``
    bytes of which ``reserve`` is kept for what the calculator does not count; links
    inside a node (``intra_bandwidth`` bytes/s per device and direction, ``intra_latency``
    s) and between nodes (``inter_*``, per device); ``peak_flops`` per device and the
    fraction ``efficiency`` of it that a large transformer's kernels achieve (an input,
    stated by whoever plans: it is the model's main unknown)."""

    devices: int
    devices_per_node: int
    memory: float
    intra_bandwidth: float
    intra_latency: float
    inter_bandwidth: float
    inter_latency: float
    peak_flops: float
    efficiency: float = 0.5
    reserve: float = 0.1

    @property
    def usable(self) -> float:
        """Bytes of a device the planner may fill: ``memory`` less the ``reserve``."""
        return self.memory * (1 - self.reserve)

    def __post_init__(self):
        check_int("devices", self.devices, 1)
        check_int("devices_per_node", self.devices_per_node, 1)
        for name in ("memory", "intra_bandwidth", "inter_bandwidth", "peak_flops"):
            check_positive(name, getattr(self, name))
        for name in ("intra_latency", "inter_latency"):
            check_nonnegative(name, getattr(self, name))
        check_fraction("efficiency", self.efficiency, closed=True)
        check_fraction("reserve", self.reserve, closed=True)
        if self.efficiency == 0:
            raise ValueError("Invalid efficiency: 0 (expected a number in (0, 1])")
        if self.devices % self.devices_per_node and self.devices > self.devices_per_node:
            raise ValueError(
                f"Invalid devices: {self.devices} (expected a multiple of "
                f"devices_per_node={self.devices_per_node})"
            )

    def link(self, inside: bool) -> AlphaBeta:
        """The alpha-beta of the intra-node (``inside``) or inter-node link."""
        if inside:
            return AlphaBeta(self.intra_latency, 1 / self.intra_bandwidth)
        return AlphaBeta(self.inter_latency, 1 / self.inter_bandwidth)


@dataclass(frozen=True)
class Techniques:
    """What the planner may use, and what the training framework does.

    Choices searched: tensor- and pipeline-parallel degrees (``None``: any divisor),
    data-parallel degrees (``None``: any), ZeRO stages, recomputation policies, micro-batch
    sizes, and ``virtual_stages``, the model chunks per device of the interleaved 1F1B
    schedule (1: plain 1F1B; Narayanan et al. 2021, Section 2.2.2); ``cp``, the
    context-parallel degrees (default ``(1,)``: none), each a divisor of the sequence, with
    ``context`` their attention (``"ring"``, Liu et al. 2023, or ``"ulysses"``, Jacobs et
    al. 2023; both need ``attention="fused"``).

    What the framework does (one value each, as the run to plan has it): the ``precision``
    and ``optimizer`` of the memory calculator; ``attention`` (``"materialized"`` s x s
    scores, or ``"fused"``: FlashAttention, none kept), ``dropout`` (its masks kept or
    not), ``sequence_parallel`` (Korthikanti et al. 2022: with ``tp > 1`` the activations
    outside the tensor-parallel regions are split too); ``embedding_slots``: the pipeline's
    partition counts the embedding and the output layer as one block each (BLOOM's
    ``type:transformer|embedding``; Llama 3 takes a block from the first and the last
    stage); ``grad_bytes``: bytes kept per parameter for its gradient (default the
    16-bit or float32 width of ``precision``; 4 where the framework accumulates float32
    gradients, as Megatron-LM does with bf16 and Llama 3 did; 6 for DeepSpeed's
    BF16_Optimizer, which keeps the bf16 gradient and an unsharded float32 buffer);
    ``reduce_bytes``: bytes per gradient element of the data-parallel reduction (default
    the width of ``precision``; 4 for a float32 reduction, as under ``torch.autocast`` over
    float32 weights or Llama 3's float32 reduce-scatter); ``overlap``: whether the
    data-parallel collectives run under the passes (DDP's buckets, FSDP's prefetch and
    reduce-scatter; Li et al. 2020) or after them (Megatron-LM 2021, DeepSpeed's pipeline
    engine); ``fp8``: the linear layers keep their inputs and weights for the backward pass
    in FP8 (Micikevicius et al. 2022; the calculator's ``fp8``).
    """

    tp: tuple[int, ...] | None = None
    pp: tuple[int, ...] | None = None
    dp: tuple[int, ...] | None = None
    zero_stages: tuple[int, ...] = ZERO_STAGES
    recompute: tuple[str, ...] = RECOMPUTE
    micro_batches: tuple[int, ...] = (1, 2, 4, 8)
    virtual_stages: tuple[int, ...] = (1,)
    cp: tuple[int, ...] = (1,)
    context: str = "ring"
    precision: str = "bf16"
    optimizer: str = "adam"
    attention: str = "materialized"
    dropout: bool = True
    sequence_parallel: bool = False
    embedding_slots: bool = False
    grad_bytes: float | None = None
    reduce_bytes: int | None = None
    overlap: bool = False
    fp8: bool = False

    def __post_init__(self):
        for name in ("tp", "pp", "dp"):
            for d in getattr(self, name) or ():
                check_int(name, d, 1)
        for z in self.zero_stages:
            check_choice("zero_stages", z, ZERO_STAGES)
        for r in self.recompute:
            check_choice("recompute", r, RECOMPUTE)
        for b in self.micro_batches:
            check_int("micro_batches", b, 1)
        for v in self.virtual_stages:
            check_int("virtual_stages", v, 1)
        for c in self.cp:
            check_int("cp", c, 1)
        check_choice("context", self.context, CONTEXTS)
        check_choice("precision", self.precision, PRECISIONS)
        check_choice("optimizer", self.optimizer, OPTIMIZERS)
        check_choice("attention", self.attention, ATTENTIONS)
        for name in ("dropout", "sequence_parallel", "embedding_slots", "overlap", "fp8"):
            check_bool(name, getattr(self, name))
        if self.grad_bytes is not None:
            check_positive("grad_bytes", self.grad_bytes)
        if self.reduce_bytes is not None:
            check_choice("reduce_bytes", self.reduce_bytes, (2, 4))
        for name in ("zero_stages", "recompute", "micro_batches", "virtual_stages", "cp"):
            if not getattr(self, name):
                raise ValueError(f"Invalid {name}: empty (expected at least one choice)")

    @property
    def width(self) -> int:
        """Bytes of a weight or an activation: 4 in float32, else 2."""
        return 4 if self.precision == "fp32" else 2

    @property
    def gradient_bytes(self) -> float:
        """Bytes kept per parameter for its gradient (``grad_bytes`` or the width)."""
        return self.grad_bytes or self.width

    @property
    def reduction_bytes(self) -> int:
        """Bytes per element of the gradients' reduction (``reduce_bytes`` or the width)."""
        return self.reduce_bytes or self.width

    def activation_options(self) -> dict:
        """The options of :func:`~lsdl_lab.memory.calculator.activation_bytes` it sets."""
        return dict(
            sequence_parallel=self.sequence_parallel,
            dropout=self.dropout,
            attention=self.attention,
            fp8=self.fp8,
        )
