"""The planner: choose data, tensor and pipeline degrees, ZeRO stage, micro-batch and
recomputation for a GPT on a cluster, from the book's own memory and cost models.

:func:`plan` enumerates every layout ``dp x tp x pp = devices`` (tensor parallelism inside
a node, as Narayanan et al. 2021, Section 3.3, advise), every allowed ZeRO stage,
micro-batch size b and recomputation policy, with ``global_batch = dp x b x m`` (m
micro-batches per pipeline and step: the gradient accumulation steps). It keeps the
configurations whose bytes per device fit, and ranks them by estimated step time. The
model, stated once here and in each function:

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
this module builds the stage's shape (``layers = ceil(layers / pp)``) and scales the
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

**Communication** by the alpha-beta model (:mod:`lsdl_lab.dist.cost`), none of it
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
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ._util import check_choice, check_fraction, check_int, check_nonnegative, check_positive
from .dist.cost import AlphaBeta, ring_all_reduce_time
from .memory.calculator import (
    PRECISIONS,
    RECOMPUTE,
    GPTShape,
    activation_bytes,
    gpt_param_shapes,
    optimizer_state_bytes,
)
from .memory.zero import ZERO_STAGES, zero_bytes

__all__ = [
    "Cluster",
    "Config",
    "Model",
    "Techniques",
    "lab_cluster",
    "layout_rank",
    "plan",
    "plan_lab",
    "train_flops_per_token",
]


@dataclass(frozen=True)
class Model:
    """A GPT to train (the shape of :class:`~lsdl_lab.memory.calculator.GPTShape`) and its
    ``global_batch`` in sequences per step."""

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


@dataclass(frozen=True)
class Config:
    """One planned configuration and its estimates (seconds, bytes)."""

    dp: int
    tp: int
    pp: int
    zero_stage: int
    micro_batch: int
    recompute: str
    accumulation: int  # micro-batches per pipeline and step (m)
    bytes_per_device: float
    memory: dict = field(repr=False)  # bytes by category on the first stage
    compute_time: float
    bubble: float  # (pp - 1) / m, the fraction added to the compute
    communication: dict = field(repr=False)  # seconds: "tp", "pp", "dp"
    step_time: float
    tokens_per_second: float

    def flops_per_device(self, model: Model, recompute: str | None = None) -> float:
        """Achieved FLOP/s per device counted as :func:`train_flops_per_token` with
        ``recompute`` (default this configuration's: hardware FLOPs; ``"none"``: model
        FLOPs, the MFU convention)."""
        per_token = train_flops_per_token(model, recompute or self.recompute)
        return self.tokens_per_second * per_token / (self.dp * self.tp * self.pp)


def train_flops_per_token(model: Model, recompute: str = "none") -> float:
    """FLOPs per token of a training step (Narayanan et al. 2021, eq. 3, generalized):
    ``72 L h^2 (1 + s/(6h)) + 6 V h``, plus one more forward of the blocks under full
    recomputation (their 96) and of the attention core ``4 L s h`` under selective."""
    check_choice("recompute", recompute, RECOMPUTE)
    L, h, s, v = model.layers, model.hidden, model.seq_len, model.vocab
    block_forward = 24 * h * h + 4 * s * h
    extra = {"none": 0, "selective": 4 * s * h, "full": block_forward}[recompute]
    return L * (3 * block_forward + extra) + 6 * v * h


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _stage_memory(model, b, tp, pp, dp, zero, recompute, techniques) -> dict[str, float]:
    """Bytes on the first pipeline stage (the module's memory model)."""
    per_stage = math.ceil(model.layers / pp)
    one, two = model.shape(b, 1), model.shape(b, 2)
    kw = {"tp": tp}
    per_layer = activation_bytes(two, techniques.precision, recompute, **kw) - activation_bytes(
        one, techniques.precision, recompute, **kw
    )
    outside = activation_bytes(one, techniques.precision, recompute, **kw) - per_layer
    shapes = gpt_param_shapes(model.shape(b, per_stage), tp)
    psi = sum(math.prod(s) for s in shapes)
    width = 4 if techniques.precision == "fp32" else 2
    k = optimizer_state_bytes(shapes, techniques.optimizer, techniques.precision) / psi
    out = zero_bytes(psi, zero, dp, k, param_bytes=width, grad_bytes=width)
    out["psi"] = psi
    out["activations"] = min(pp, _micro_batches(model, dp, b)) * per_stage * per_layer + outside
    out["total"] += out["activations"]
    return out


def _micro_batches(model: Model, dp: int, b: int) -> int:
    return model.global_batch // (dp * b)


def _communication(model, cluster, b, tp, pp, dp, zero, recompute, m, psi, width):
    """Seconds of communication per step on the critical path (the module's model)."""
    h, s = model.hidden, model.seq_len
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
        if zero <= 1:
            out["dp"] = all_reduce
        elif zero == 2:
            out["dp"] = m * half + half
        else:
            out["dp"] = 3 * m * half
    return out


def plan(
    model: Model,
    cluster: Cluster,
    techniques: Techniques | None = None,
    *,
    top: int | None = None,
) -> list[Config]:
    """The configurations of ``model`` on ``cluster`` that fit in memory, fastest first
    (by estimated step time; the module's text states every assumption). ``top`` keeps
    the first ``top``. An empty list means nothing allowed fits."""
    if not isinstance(model, Model):
        raise TypeError(f"Invalid model: a {type(model).__name__} (expected a Model)")
    if not isinstance(cluster, Cluster):
        raise TypeError(f"Invalid cluster: a {type(cluster).__name__} (expected a Cluster)")
    techniques = techniques or Techniques()
    if not isinstance(techniques, Techniques):
        raise TypeError(
            f"Invalid techniques: a {type(techniques).__name__} (expected a Techniques)"
        )
    if top is not None:
        check_int("top", top, 1)
    n = cluster.devices
    width = 4 if techniques.precision == "fp32" else 2
    usable = cluster.memory * (1 - cluster.reserve)
    rate = cluster.peak_flops * cluster.efficiency
    tokens = model.global_batch * model.seq_len
    configs = []
    for tp in techniques.tp or _divisors(n):
        if n % tp or tp > cluster.devices_per_node or model.hidden % tp or model.vocab % tp:
            continue
        if model.heads % tp:
            continue
        for pp in techniques.pp or _divisors(n // tp):
            dp = n // (tp * pp)
            if n % (tp * pp) or pp > model.layers or (techniques.dp and dp not in techniques.dp):
                continue
            for b in techniques.micro_batches:
                if model.global_batch % (dp * b):
                    continue
                m = _micro_batches(model, dp, b)
                for recompute in techniques.recompute:
                    flops = train_flops_per_token(model, recompute) * tokens
                    # The slowest stage holds ceil(L/pp) of the L blocks.
                    imbalance = math.ceil(model.layers / pp) * pp / model.layers
                    compute = flops / (n * rate) * imbalance
                    bubble = (pp - 1) / m
                    for zero in techniques.zero_stages:
                        if zero and dp == 1:
                            continue  # ZeRO partitions over dp ranks: nothing to split
                        mem = _stage_memory(model, b, tp, pp, dp, zero, recompute, techniques)
                        if mem["total"] > usable:
                            continue
                        psi = mem.pop("psi")
                        comm = _communication(
                            model, cluster, b, tp, pp, dp, zero, recompute, m, psi, width
                        )
                        step = compute * (1 + bubble) + sum(comm.values())
                        configs.append(
                            Config(
                                dp,
                                tp,
                                pp,
                                zero,
                                b,
                                recompute,
                                m,
                                mem["total"],
                                mem,
                                compute,
                                bubble,
                                comm,
                                step,
                                tokens / step,
                            )  # fmt: skip
                        )
    configs.sort(key=lambda c: c.step_time)
    return configs[:top] if top else configs


def layout_rank(configs: list[Config], dp: int, tp: int, pp: int) -> int | None:
    """The 1-based rank of the layout ``(dp, tp, pp)`` among the distinct layouts of the
    ranked ``configs`` (each layout ranked by its best configuration), or ``None``."""
    seen = []
    for c in configs:
        if (c.dp, c.tp, c.pp) not in seen:
            seen.append((c.dp, c.tp, c.pp))
    return seen.index((dp, tp, pp)) + 1 if (dp, tp, pp) in seen else None


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
    precision). Checked here on given alpha and beta; the check against a measured run
    at world 2 is Chapter 9's."""
    techniques = techniques or Techniques(precision="fp32")
    cluster = lab_cluster(link, devices=devices, memory=memory, peak_flops=peak_flops)
    return plan(model, cluster, techniques)
