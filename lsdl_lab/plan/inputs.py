"""The planner's inputs: the shape of the model to train, the cluster, and the techniques
allowed."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .._util import check_choice, check_fraction, check_int, check_nonnegative, check_positive
from ..distributed.cost import AlphaBeta
from ..memory.calculator import PRECISIONS, RECOMPUTE, GPTShape, gpt_param_shapes
from ..memory.zero import ZERO_STAGES

__all__ = ["Cluster", "ModelShape", "Techniques"]


@dataclass(frozen=True)
class ModelShape:
    """The shape of a GPT to train (that of :class:`~lsdl_lab.memory.calculator.GPTShape`,
    without its micro-batch, which the planner chooses) and its ``global_batch`` in
    sequences per step: what the planner needs to know of a model, not the model."""

    layers: int
    hidden: int
    heads: int
    seq_len: int
    vocab: int
    global_batch: int
    tied: bool = True

    def __post_init__(self):
        check_int("global_batch", self.global_batch, 1)
        self.shape(1)  # the shape's own checks

    @classmethod
    def from_shape(cls, shape: GPTShape, global_batch: int) -> ModelShape:
        """The model of a calculator's ``shape`` (its micro-batch left to the planner)."""
        if not isinstance(shape, GPTShape):
            raise TypeError(f"Invalid shape: a {type(shape).__name__} (expected a GPTShape)")
        if shape.positions not in (None, shape.seq_len):
            raise ValueError(
                f"Invalid shape: positions={shape.positions} (expected None or seq_len)"
            )
        fields = ("layers", "hidden", "heads", "seq_len", "vocab", "tied")
        return cls(**{f: getattr(shape, f) for f in fields}, global_batch=global_batch)

    def shape(self, micro_batch: int, layers: int | None = None) -> GPTShape:
        """The calculator's shape of ``layers`` blocks (default all) at ``micro_batch``."""
        return GPTShape(
            layers=self.layers if layers is None else layers,
            hidden=self.hidden,
            heads=self.heads,
            seq_len=self.seq_len,
            micro_batch=micro_batch,
            vocab=self.vocab,
            tied=self.tied,
        )

    @property
    def params(self) -> int:
        """Parameters (12 h^2 + 13 h per block, embeddings, final LayerNorm)."""
        return sum(math.prod(s) for s in gpt_param_shapes(self.shape(1)))


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
    """What the planner may use: tensor- and pipeline-parallel degrees (``None``: any
    divisor), data-parallel degrees (``None``: any), ZeRO stages, recomputation policies,
    micro-batch sizes, and the precision and optimizer of the memory calculator."""

    tp: tuple[int, ...] | None = None
    pp: tuple[int, ...] | None = None
    dp: tuple[int, ...] | None = None
    zero_stages: tuple[int, ...] = ZERO_STAGES
    recompute: tuple[str, ...] = RECOMPUTE
    micro_batches: tuple[int, ...] = (1, 2, 4, 8)
    precision: str = "bf16"
    optimizer: str = "adam"

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
        check_choice("precision", self.precision, PRECISIONS)
        for name in ("zero_stages", "recompute", "micro_batches"):
            if not getattr(self, name):
                raise ValueError(f"Invalid {name}: empty (expected at least one choice)")
