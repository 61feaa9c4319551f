"""Pipeline parallelism: consecutive layers on consecutive ranks, micro-batches in flight.

Rank s of a group of p holds stage s of the model. A batch is cut into m micro-batches;
stage s receives a micro-batch's activation from stage s-1, computes, and sends its output
to s+1 (``isend``/``irecv``); backward, the gradient flows the other way. A *schedule* is
the order in which a stage runs its m forwards (F) and m backwards (B):

* **GPipe** (Huang et al., 2019): all forwards, then all backwards. Each stage keeps the
  activations of all m micro-batches until their backwards.
* **1F1B**, the non-interleaved PipeDream-Flush schedule of Narayanan et al. (2021,
  Section 2.2; "1F1B" in Megatron-LM): stage s runs ``p - s - 1`` warm-up forwards, then
  alternates one forward and one backward, then drains the remaining backwards. A
  micro-batch's backward starts as soon as possible, so stage s never holds more than
  ``p - s`` activations: at most p instead of m. Its flush at the end of the step keeps
  the weights in step (synchronous), unlike the asynchronous PipeDream.

With equal stages (forward t_f, backward t_b per micro-batch), both schedules take
``(m + p - 1)(t_f + t_b)``, of which each stage is idle ``(p - 1)(t_f + t_b)``: the
*bubble* is the fraction (p - 1)/(m + p - 1) of the step (GPipe's O((K - 1)/(M + K - 1))
with K stages and M micro-batches, Huang et al., 2019, Section 2.2), or (p - 1)/m of the
ideal time m(t_f + t_b) as Narayanan et al. (2021, Section 2.2.1) write it. Only more
micro-batches shrink it; 1F1B saves memory, not time.

:func:`pipeline_step` runs one step on the calling rank and measures what the equations
predict: busy and total time (so the bubble) and the peak number of activations in
flight. The loss is the *sum* of the micro-batches' losses, so the gradients equal those
of one process computing the same sum. Written after picotron's
``pipeline_parallel/pipeline_parallel.py`` and Megatron-LM's
``core/pipeline_parallel/schedules.py`` (a fixed activation shape between stages, as
Megatron's ``tensor_shape``); :func:`torch_pipeline_step` runs the same step with
``torch.distributed.pipelining`` as the reference.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from .._util import check_choice, check_int, device_of

__all__ = [
    "SCHEDULES",
    "PipelineReport",
    "bubble_fraction",
    "gpipe_schedule",
    "one_f_one_b_schedule",
    "pipeline_step",
    "torch_pipeline_step",
]


def bubble_fraction(num_stages: int, micro_batches: int) -> float:
    """The idle fraction of each stage of a GPipe or 1F1B step with equal stages:
    ``(p - 1) / (m + p - 1)``."""
    p, m = check_int("num_stages", num_stages, 1), check_int("micro_batches", micro_batches, 1)
    return (p - 1) / (m + p - 1)


def gpipe_schedule(num_stages: int, stage: int, micro_batches: int) -> list[tuple[str, int]]:
    """GPipe's order for one stage: ``F0 .. F(m-1)``, then ``B0 .. B(m-1)``."""
    _check_stage(num_stages, stage, micro_batches)
    return [("F", j) for j in range(micro_batches)] + [("B", j) for j in range(micro_batches)]


def one_f_one_b_schedule(num_stages: int, stage: int, micro_batches: int) -> list[tuple[str, int]]:
    """1F1B's order for one stage: ``p - s - 1`` warm-up forwards, then pairs (F, B), then
    the remaining backwards."""
    _check_stage(num_stages, stage, micro_batches)
    warmup = min(num_stages - stage - 1, micro_batches)
    actions = [("F", j) for j in range(warmup)]
    for j in range(micro_batches - warmup):
        actions += [("F", warmup + j), ("B", j)]
    return actions + [("B", j) for j in range(micro_batches - warmup, micro_batches)]


SCHEDULES = {"gpipe": gpipe_schedule, "1f1b": one_f_one_b_schedule}


def _check_stage(num_stages, stage, micro_batches):
    check_int("num_stages", num_stages, 1)
    check_int("stage", stage, 0, num_stages - 1)
    check_int("micro_batches", micro_batches, 1)


@dataclass
class PipelineReport:
    """One stage's view of a pipeline step. ``loss``: the summed loss (last stage only);
    ``busy_s``: time computing; ``total_s``: the step's time, from a barrier before the
    first action to a barrier after every stage's last; ``timeline``: (action, micro-batch,
    start, end) in seconds from the step's start. Time a process's second step: the first
    backward in a process pays torch's lazy imports (sympy, over a second)."""

    schedule: str
    stage: int
    num_stages: int
    micro_batches: int
    peak_in_flight: int
    busy_s: float
    total_s: float
    loss: float | None = None
    timeline: list[tuple[str, int, float, float]] = field(default_factory=list)

    @property
    def bubble(self) -> float:
        """Measured idle fraction ``1 - busy / total``; compare :func:`bubble_fraction`."""
        return 1.0 - self.busy_s / self.total_s


def pipeline_step(
    stage_module: nn.Module,
    micro_batches: int,
    activation_shape: Sequence[int],
    inputs: Sequence[torch.Tensor] | None = None,
    targets: Sequence | None = None,
    loss_fn: Callable | None = None,
    schedule: str = "1f1b",
    dtype: torch.dtype | None = None,
    group=None,
) -> PipelineReport:
    """Run one forward-backward step of a pipeline; call it on every rank of ``group``.

    The rank's index in ``group`` is its stage. The first stage reads ``inputs`` (m
    micro-batches), the last applies ``loss_fn(output, targets[j])`` to micro-batch j;
    the others may pass ``None`` for both. Between stages every activation has
    ``activation_shape`` and ``dtype`` (default: the stage's parameters' dtype) and is
    received on the device of the stage's parameters.
    Gradients accumulate in ``stage_module``'s ``.grad`` as for ``sum_j loss_j``.
    """
    p, s = dist.get_world_size(group), dist.get_rank(group)
    m = check_int("micro_batches", micro_batches, 1)
    activation_shape = tuple(check_int("activation_shape", d, 1) for d in activation_shape)
    actions = SCHEDULES[check_choice("schedule", schedule, tuple(SCHEDULES))](p, s, m)
    first, last = s == 0, s == p - 1
    for name, value, needed in (("inputs", inputs, first), ("targets", targets, last)):
        if needed and (value is None or len(value) != m):
            raise ValueError(f"Invalid {name} on stage {s}: expected {m} micro-batches")
    if last and loss_fn is None:
        raise ValueError("Invalid loss_fn: None (the last stage needs one)")
    like = next(stage_module.parameters(), torch.empty(0))
    dtype = like.dtype if dtype is None else dtype

    def peer(stage):  # isend and irecv name global ranks
        return stage if group is None else dist.get_global_rank(group, stage)

    def receive(src):
        x = torch.empty(activation_shape, dtype=dtype, device=like.device)
        dist.irecv(x, peer(src), group=group).wait()
        return x

    in_flight, sends, timeline, busy, loss, peak = {}, [], [], 0.0, 0.0, 0
    dist.barrier(group)
    t0 = time.perf_counter()
    for action, j in actions:
        if action == "F":
            x = inputs[j] if first else receive(s - 1).requires_grad_()
            start = time.perf_counter()
            y = stage_module(x)
            if last:
                y = loss_fn(y, targets[j])
                loss += y.item()
            in_flight[j] = (x, y)  # the graph behind y holds the micro-batch's activations
            peak = max(peak, len(in_flight))
            send = None if last else (y.detach(), s + 1)
        else:
            x, y = in_flight.pop(j)
            dy = None if last else receive(s + 1)
            start = time.perf_counter()
            torch.autograd.backward(y, dy)
            send = None if first else (x.grad, s - 1)
        stop = time.perf_counter()
        busy += stop - start
        timeline.append((action, j, start - t0, stop - t0))
        if send is not None:  # non-blocking: two stages sending to each other would deadlock
            out = send[0].contiguous()
            sends.append((dist.isend(out, peer(send[1]), group=group), out))
    for work, _ in sends:
        work.wait()
    dist.barrier(group)
    total = time.perf_counter() - t0
    return PipelineReport(schedule, s, p, m, peak, busy, total, loss if last else None, timeline)


def torch_pipeline_step(
    stage_module: nn.Module,
    micro_batches: int,
    inputs: torch.Tensor | None = None,
    targets: torch.Tensor | None = None,
    loss_fn: Callable | None = None,
    schedule: str = "1f1b",
    group=None,
) -> float | None:
    """The same step with ``torch.distributed.pipelining`` (``ScheduleGPipe`` or
    ``Schedule1F1B``), as a reference: ``inputs`` and ``targets`` are whole batches, which
    it cuts into ``micro_batches`` along dim 0. ``scale_grads=False`` keeps the summed
    loss's gradients (the default divides them by m). Returns the summed loss on the last
    stage, else ``None``. (On torch 2.9 with gloo it aborts: "Received data size doesn't
    match expected size", measured; torch 2.13 runs it.)"""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    p, s = dist.get_world_size(group), dist.get_rank(group)
    kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[
        check_choice("schedule", schedule, tuple(SCHEDULES))
    ]
    stage = PipelineStage(stage_module, s, p, device_of(stage_module), group=group)
    runner = kind(stage, micro_batches, loss_fn=loss_fn, scale_grads=False)
    if s == p - 1:
        losses = []
        runner.step(*(() if s else (inputs,)), target=targets, losses=losses)
        return float(sum(loss.item() for loss in losses))
    runner.step(inputs) if s == 0 else runner.step()
    return None
