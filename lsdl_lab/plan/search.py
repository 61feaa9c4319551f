"""The search: every :class:`Layout` (parallel degrees, ZeRO stage, micro-batch and
recomputation) that fits, ranked by estimated step time."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .._util import check_int
from .estimate import communication_times, stage_memory, train_flops_per_token
from .inputs import Cluster, ModelShape, Techniques

__all__ = ["Layout", "layout_rank", "plan"]


@dataclass(frozen=True)
class Layout:
    """One planned layout of a training run: the data-, tensor- and pipeline-parallel degrees
    (``dp x tp x pp`` devices), the ZeRO stage, the micro-batch and its accumulation, the
    recomputation policy, and the planner's estimates for them (seconds, bytes). Not a
    run's configuration (:class:`lsdl_lab.run.Config`): what the planner proposes for one."""

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

    def flops_per_device(self, model: ModelShape, recompute: str | None = None) -> float:
        """Achieved FLOP/s per device counted as :func:`train_flops_per_token` with
        ``recompute`` (default this layout's: hardware FLOPs; ``"none"``: model
        FLOPs, the MFU convention)."""
        per_token = train_flops_per_token(model, recompute or self.recompute)
        return self.tokens_per_second * per_token / (self.dp * self.tp * self.pp)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def plan(
    model: ModelShape,
    cluster: Cluster,
    techniques: Techniques | None = None,
    *,
    top: int | None = None,
) -> list[Layout]:
    """The layouts of ``model`` on ``cluster`` that fit in memory, fastest first
    by estimated step time (the text of :mod:`lsdl_lab.plan` states every assumption).
    ``top`` keeps the first ``top``. An empty list means nothing allowed fits."""
    if not isinstance(model, ModelShape):
        raise TypeError(f"Invalid model: a {type(model).__name__} (expected a ModelShape)")
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
    layouts = []
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
                m = model.global_batch // (dp * b)
                for recompute in techniques.recompute:
                    flops = train_flops_per_token(model, recompute) * tokens
                    # The slowest stage holds ceil(L/pp) of the L blocks.
                    imbalance = math.ceil(model.layers / pp) * pp / model.layers
                    compute = flops / (n * rate) * imbalance
                    bubble = (pp - 1) / m
                    for zero in techniques.zero_stages:
                        if zero and dp == 1:
                            continue  # ZeRO partitions over dp ranks: nothing to split
                        layout = dict(
                            micro_batch=b, tp=tp, pp=pp, dp=dp, zero_stage=zero,
                            recompute=recompute,
                        )  # fmt: skip
                        mem = stage_memory(model, techniques, **layout)
                        if mem["total"] > usable:
                            continue
                        psi = mem.pop("psi")
                        comm = communication_times(model, cluster, psi=psi, width=width, **layout)
                        step = compute * (1 + bubble) + sum(comm.values())
                        layouts.append(
                            Layout(
                                **layout,
                                accumulation=m,
                                bytes_per_device=mem["total"],
                                memory=mem,
                                compute_time=compute,
                                bubble=bubble,
                                communication=comm,
                                step_time=step,
                                tokens_per_second=tokens / step,
                            )
                        )
    layouts.sort(key=lambda c: c.step_time)
    return layouts[:top] if top else layouts


def layout_rank(layouts: list[Layout], dp: int, tp: int, pp: int) -> int | None:
    """The 1-based rank of the degrees ``(dp, tp, pp)`` among the distinct degrees of the
    ranked ``layouts`` (each ranked by its best layout), or ``None``."""
    seen = []
    for c in layouts:
        if (c.dp, c.tp, c.pp) not in seen:
            seen.append((c.dp, c.tp, c.pp))
    return seen.index((dp, tp, pp)) + 1 if (dp, tp, pp) in seen else None
