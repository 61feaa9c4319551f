"""The search: every :class:`Layout` (parallel degrees, ZeRO stage, micro-batch and
recomputation) that fits, ranked by estimated step time."""

from __future__ import annotations

from dataclasses import dataclass, field

from .._util import check_bool, check_int
from ..memory.calculator import layer_traffic
from .estimate import (
    communication_times,
    partition,
    stage_flops_per_token,
    stage_memory,
    train_flops_per_token,
)
from .inputs import Cluster, ModelShape, Techniques

__all__ = ["Layout", "evaluate", "layout_rank", "plan"]


@dataclass(frozen=True)
class Layout:
    """One planned layout of a training run: the data-, tensor-, pipeline- and
    context-parallel degrees (``dp x tp x pp x cp`` devices), the ZeRO stage, the
    micro-batch and its accumulation, the recomputation policy, the model chunks per
    device of the pipeline schedule, and the planner's estimates for them (seconds, bytes;
    ``stage`` is the busiest pipeline rank).
    Not a run's configuration (:class:`lsdl_lab.run.Config`): what the planner proposes
    for one."""

    dp: int
    tp: int
    pp: int
    zero_stage: int
    micro_batch: int
    recompute: str
    accumulation: int  # micro-batches per pipeline and step (m)
    bytes_per_device: float
    memory: dict = field(repr=False)  # bytes by category on the busiest pipeline rank
    compute_time: float
    bubble: float  # (pp - 1) / (v m), the fraction added to the compute
    communication: dict = field(repr=False)  # seconds: "tp", "pp", "dp", "cp"
    step_time: float
    tokens_per_second: float
    virtual_stages: int = 1
    stage: int = 0
    cp: int = 1

    def flops_per_device(self, model: ModelShape, recompute: str | None = None) -> float:
        """Achieved FLOP/s per device counted as :func:`train_flops_per_token` with
        ``recompute`` (default this layout's: hardware FLOPs; ``"none"``: model
        FLOPs, the MFU convention)."""
        per_token = train_flops_per_token(model, recompute or self.recompute)
        return self.tokens_per_second * per_token / (self.dp * self.tp * self.pp * self.cp)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _invalid(model: ModelShape, cluster: Cluster, dp, tp, pp, micro_batch, v, techniques, cp=1):
    """Why the degrees cannot lay out ``model`` on ``cluster`` (``(argument, reason)``), or
    ``None``."""
    shape = model.shape(1)
    if dp * tp * pp * cp != cluster.devices:
        return "dp", (
            f"{dp} x tp {tp} x pp {pp} x cp {cp} (expected {cluster.devices} devices in all)"
        )
    if tp > cluster.devices_per_node:
        return "tp", f"{tp} (expected at most devices_per_node={cluster.devices_per_node})"
    widths = (model.hidden, model.vocab, model.heads, shape.kv, shape.mlp)
    if any(w % tp for w in widths):
        return "tp", f"{tp} (expected a divisor of hidden, vocab, heads, kv_heads and ffn)"
    if pp > model.layers:
        return "pp", f"{pp} (expected at most layers={model.layers})"
    if model.global_batch % (dp * micro_batch):
        return "micro_batch", (
            f"{micro_batch} (expected dp x micro_batch = {dp * micro_batch} to divide "
            f"global_batch={model.global_batch})"
        )
    m = model.global_batch // (dp * micro_batch)
    if v > 1 and (pp == 1 or m % pp):
        return "virtual_stages", (
            f"{v} (the interleaved schedule needs pp > 1 and micro-batches {m} a multiple "
            f"of pp={pp})"
        )
    if partition(model.layers, pp, v, techniques.embedding_slots) is None:
        return "virtual_stages", f"{v} (expected at least a block per chunk of pp={pp})"
    if cp > 1:
        try:
            layer_traffic(shape, techniques.precision, tp=tp, cp=cp, context=techniques.context)
        except ValueError as error:  # the sequence, the heads
            return "cp", str(error).removeprefix(f"Invalid cp: {cp} ")
        if techniques.attention != "fused":
            return "cp", f"{cp} with attention={techniques.attention!r} (expected 'fused')"
    return None


def evaluate(
    model: ModelShape,
    cluster: Cluster,
    techniques: Techniques | None = None,
    *,
    dp: int,
    tp: int,
    pp: int,
    zero_stage: int,
    micro_batch: int,
    recompute: str,
    virtual_stages: int = 1,
    cp: int = 1,
) -> Layout:
    """The planner's estimates for one layout, whether it fits or not (compare its
    ``bytes_per_device`` with ``cluster.usable``); the text of :mod:`lsdl_lab.plan` states
    every assumption. Refuses degrees that cannot lay the model out, naming the argument."""
    techniques = _check(model, cluster, techniques)
    bad = _invalid(model, cluster, dp, tp, pp, micro_batch, virtual_stages, techniques, cp)
    if bad:
        raise ValueError(f"Invalid {bad[0]}: {bad[1]}")
    return _evaluate(model, cluster, techniques, dp, tp, pp, zero_stage, micro_batch,
                     recompute, virtual_stages, cp)  # fmt: skip


def _evaluate(model, cluster, techniques, dp, tp, pp, zero_stage, b, recompute, v, cp=1):
    layout = dict(micro_batch=b, tp=tp, pp=pp, dp=dp, zero_stage=zero_stage,
                  recompute=recompute, virtual_stages=v, cp=cp)  # fmt: skip
    m = model.global_batch // (dp * b)
    mem = stage_memory(model, techniques, **layout)
    psi, stage = mem.pop("psi_max"), mem.pop("stage")
    del mem["psi"]
    rate = cluster.peak_flops * cluster.efficiency
    per_token = stage_flops_per_token(model, pp, recompute, v, techniques.embedding_slots)
    compute = model.global_batch * model.seq_len / dp * per_token / (tp * cp * rate)
    bubble = (pp - 1) / (v * m)
    comm = communication_times(model, cluster, techniques, psi=psi, **layout)
    exposed = comm["dp"]
    if techniques.overlap:
        exposed = max(0.0, comm["dp"] - _window(compute, m, zero_stage, recompute))
    step = compute * (1 + bubble) + comm["tp"] + comm["pp"] + comm["cp"] + exposed
    return Layout(
        **layout,
        accumulation=m,
        bytes_per_device=mem["total"],
        memory=mem,
        compute_time=compute,
        bubble=bubble,
        communication=comm,
        step_time=step,
        tokens_per_second=model.global_batch * model.seq_len / step,
        stage=stage,
    )


def _window(compute: float, m: int, zero_stage: int, recompute: str) -> float:
    """Seconds of compute under which the data-parallel collectives may run, when they
    overlap: ZeRO-3 gathers weights ahead of every pass, so all of it; ZeRO-2 reduce-scatters
    each micro-batch's gradients as its backward pass makes them, so every backward pass
    (two of the three forwards' worth, three of four with full recomputation); stages 0
    and 1 reduce once a step, under the last micro-batch's backward pass."""
    backward = compute * (3 / 4 if recompute == "full" else 2 / 3)
    return {0: backward / m, 1: backward / m, 2: backward, 3: compute}[zero_stage]


def _check(model, cluster, techniques) -> Techniques:
    if not isinstance(model, ModelShape):
        raise TypeError(f"Invalid model: a {type(model).__name__} (expected a ModelShape)")
    if not isinstance(cluster, Cluster):
        raise TypeError(f"Invalid cluster: a {type(cluster).__name__} (expected a Cluster)")
    techniques = techniques or Techniques()
    if not isinstance(techniques, Techniques):
        raise TypeError(
            f"Invalid techniques: a {type(techniques).__name__} (expected a Techniques)"
        )
    return techniques


def plan(
    model: ModelShape,
    cluster: Cluster,
    techniques: Techniques | None = None,
    *,
    top: int | None = None,
    fit: bool = True,
) -> list[Layout]:
    """The layouts of ``model`` on ``cluster`` that fit in memory, fastest first
    by estimated step time (the text of :mod:`lsdl_lab.plan` states every assumption).
    ``top`` keeps the first ``top``; ``fit=False`` keeps those that do not fit too. An
    empty list means nothing allowed fits."""
    techniques = _check(model, cluster, techniques)
    if top is not None:
        check_int("top", top, 1)
    check_bool("fit", fit)
    n = cluster.devices
    layouts = []
    for tp in techniques.tp or _divisors(n):
        for pp in techniques.pp or _divisors(n // tp if n % tp == 0 else 1):
            for cp in techniques.cp:
                if n % (tp * pp * cp):
                    continue
                dp = n // (tp * pp * cp)
                if techniques.dp and dp not in techniques.dp:
                    continue
                layouts += _layouts(model, cluster, techniques, dp, tp, pp, cp, fit)
    layouts.sort(key=lambda c: c.step_time)
    return layouts[:top] if top else layouts


def _layouts(model, cluster, techniques, dp, tp, pp, cp, fit) -> list[Layout]:
    """The layouts of these degrees: every micro-batch, schedule, recomputation and ZeRO
    stage allowed (those that fit, unless ``fit`` is False)."""
    out = []
    for b in techniques.micro_batches:
        for v in techniques.virtual_stages:
            if _invalid(model, cluster, dp, tp, pp, b, v, techniques, cp):
                continue
            for recompute in techniques.recompute:
                for zero in techniques.zero_stages:
                    if zero and dp * cp == 1:
                        continue  # ZeRO partitions over dp x cp ranks: nothing to split
                    c = _evaluate(model, cluster, techniques, dp, tp, pp, zero, b,
                                  recompute, v, cp)  # fmt: skip
                    if c.bytes_per_device <= cluster.usable or not fit:
                        out.append(c)
    return out


def layout_rank(layouts: list[Layout], dp: int, tp: int, pp: int, cp: int = 1) -> int | None:
    """The 1-based rank of the degrees ``(dp, tp, pp, cp)`` among the distinct degrees of
    the ranked ``layouts`` (each ranked by its best layout), or ``None``."""
    seen = []
    for c in layouts:
        if (c.dp, c.tp, c.pp, c.cp) not in seen:
            seen.append((c.dp, c.tp, c.pp, c.cp))
    key = (dp, tp, pp, cp)
    return seen.index(key) + 1 if key in seen else None
