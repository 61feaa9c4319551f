"""Activation checkpointing of a sequence of blocks: keep some inputs, recompute the rest.

Chen, Xu, Zhang & Guestrin (2016), "Training Deep Nets with Sublinear Memory Cost": cut
a chain of L blocks into segments of k blocks, keep only each segment's input during the
forward pass (computed without a graph), and in the backward pass recompute one segment's
forward with its graph, then backpropagate through it. With blocks of equal activation
size a (in bytes), the activation memory is

.. math:: M(k) = \\left\\lceil L/k \\right\\rceil a + k\\,a,

the kept inputs plus one recomputed segment, minimized at :math:`k = \\sqrt{L}` where
:math:`M = 2\\sqrt{L}\\,a` instead of :math:`L a` (Chen et al. 2016, Section 4.1); the price
is one extra forward pass of every block. :func:`sweep` measures both against k.

:class:`Recompute` is the library's own recomputation (an ``autograd.Function``, like
``torch.utils.checkpoint(use_reentrant=True)``, but with the segment's parameters passed
as inputs, so their gradients flow through the graph even when the segment's input needs
none); :func:`checkpoint_sequential` runs a list of blocks with it or with
``torch.utils.checkpoint.checkpoint(use_reentrant=False)``, the reference. The forward
pass is recomputed under the same random state and autocast setting, so dropout masks
and precisions match and the gradients equal those of the unchecked run bit for bit.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from .._util import check_choice, check_int, check_tensor
from .measure import SavedTensorBytes

__all__ = [
    "IMPLEMENTATIONS",
    "Recompute",
    "checkpoint_sequential",
    "segments",
    "sqrt_spacing",
    "sweep",
    "theoretical_peak",
]

IMPLEMENTATIONS = ("lsdl", "torch")


class Recompute(torch.autograd.Function):
    """``Recompute.apply(segment, x, *params)``: ``segment(x)`` keeping only ``x``.

    ``params`` are the segment's parameters: as inputs of the Function they receive their
    gradients from its ``backward``, which recomputes ``segment(x)`` with a graph and
    differentiates it.
    """

    @staticmethod
    def forward(ctx, segment: Callable, x: torch.Tensor, *params: torch.Tensor):
        ctx.segment, ctx.params = segment, params
        ctx.cpu_rng = torch.get_rng_state()
        ctx.cuda_rng = torch.cuda.get_rng_state(x.device) if x.is_cuda else None
        device_type = x.device.type
        ctx.autocast = (
            device_type,
            torch.is_autocast_enabled(device_type),
            torch.get_autocast_dtype(device_type),
        )
        ctx.save_for_backward(x)
        return segment(x)  # a Function's forward builds no graph: nothing else is kept

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (x,) = ctx.saved_tensors
        x = x.detach().requires_grad_(ctx.needs_input_grad[1])
        device_type, autocast_on, autocast_dtype = ctx.autocast
        devices = [x.device] if x.is_cuda else []
        # The same random numbers as the forward pass (dropout), left as they were after.
        with torch.random.fork_rng(devices=devices), torch.enable_grad():
            torch.set_rng_state(ctx.cpu_rng)
            if ctx.cuda_rng is not None:
                torch.cuda.set_rng_state(ctx.cuda_rng, x.device)
            with torch.autocast(device_type, dtype=autocast_dtype, enabled=autocast_on):
                y = ctx.segment(x)
        needs = ctx.needs_input_grad[1:]
        wanted = [t for t, need in zip((x, *ctx.params), needs) if need]
        grads = iter(torch.autograd.grad(y, wanted, grad_out, allow_unused=True))
        return (None, *(next(grads) if need else None for need in needs))


def _segment_fn(blocks: Sequence[nn.Module]) -> Callable[[torch.Tensor], torch.Tensor]:
    def run(x: torch.Tensor) -> torch.Tensor:
        for block in blocks:
            x = block(x)
        return x

    return run


def segments(num_blocks: int, every: int | None) -> list[tuple[int, int]]:
    """The ``(start, stop)`` block ranges of segments of ``every`` blocks (the last may be
    shorter); ``every=None`` is one range per block, meaning no checkpointing."""
    num_blocks = check_int("num_blocks", num_blocks, 1)
    if every is None:
        return [(i, i + 1) for i in range(num_blocks)]
    every = check_int("every", every, 1)
    return [(i, min(i + every, num_blocks)) for i in range(0, num_blocks, every)]


def sqrt_spacing(num_blocks: int) -> int:
    """Chen et al.'s segment length for L blocks: ``round(sqrt(L))``, at least 1."""
    return max(1, round(math.sqrt(check_int("num_blocks", num_blocks, 1))))


def theoretical_peak(num_blocks: int, every: int | None) -> int:
    """Activation memory in units of one block's activations: L + 1 without checkpointing
    (every block's saved tensors and the input), ceil(L/k) + k with segments of k."""
    num_blocks = check_int("num_blocks", num_blocks, 1)
    if every is None:
        return num_blocks + 1
    every = check_int("every", every, 1)
    return math.ceil(num_blocks / every) + min(every, num_blocks)


def checkpoint_sequential(
    blocks: Sequence[nn.Module],
    x: torch.Tensor,
    every: int | None,
    implementation: str = "lsdl",
) -> torch.Tensor:
    """Run ``blocks`` in order on ``x``, checkpointing segments of ``every`` blocks.

    ``every=None`` runs them plainly (every activation kept); ``every=sqrt_spacing(L)`` is
    Chen et al.'s choice. ``implementation`` is ``"lsdl"`` (:class:`Recompute`) or
    ``"torch"`` (``torch.utils.checkpoint.checkpoint(use_reentrant=False)``). Outside
    gradient mode (evaluation) nothing is checkpointed: there is nothing to keep.
    """
    blocks = list(blocks)
    if not blocks or not all(isinstance(b, nn.Module) for b in blocks):
        raise TypeError("Invalid blocks: expected a non-empty sequence of nn.Module")
    check_tensor("x", x)
    check_choice("implementation", implementation, IMPLEMENTATIONS)
    spans = segments(len(blocks), every)
    if every is None or not torch.is_grad_enabled():
        return _segment_fn(blocks)(x)
    for start, stop in spans:
        run = _segment_fn(blocks[start:stop])
        if implementation == "torch":
            x = torch_checkpoint(run, x, use_reentrant=False)
        else:
            params = [p for b in blocks[start:stop] for p in b.parameters()]
            x = Recompute.apply(run, x, *params)
    return x


def sweep(
    blocks: Sequence[nn.Module],
    x: torch.Tensor,
    spacings: Sequence[int | None] | None = None,
    implementation: str = "lsdl",
    repeats: int = 1,
) -> list[dict]:
    """Measure one forward and backward pass of ``blocks`` on ``x`` at each spacing.

    ``spacings`` defaults to no checkpointing (``None``), then k = 1, 2, 4, ... up to L
    and ``sqrt_spacing(L)``. One row per spacing: ``every``; ``peak_bytes`` (activation
    memory, :class:`SavedTensorBytes`' peak, the model's parameters excluded);
    ``forward_bytes`` (bytes still saved when the forward pass ends); ``block_forwards``
    (block calls, L without checkpointing, 2L with: the extra forward pass);
    ``seconds`` (the fastest of ``repeats`` passes); ``theory_units``
    (:func:`theoretical_peak`). The loss is ``output.sum()``. Gradients accumulate in the
    blocks' ``.grad``; they are cleared before each pass.

    With ``implementation="torch"`` the recomputation runs under torch's own hooks and is
    invisible to the counter: ``peak_bytes`` then shows only the kept inputs.
    """
    blocks = list(blocks)
    repeats = check_int("repeats", repeats, 1)
    if spacings is None:
        powers = [2**i for i in range(len(blocks).bit_length()) if 2**i <= len(blocks)]
        spacings = [None, *sorted({*powers, sqrt_spacing(len(blocks))})]
    model = nn.ModuleList(blocks)
    calls = [0]

    def count(*_):
        calls[0] += 1

    handles = [b.register_forward_hook(count) for b in blocks]
    rows = []
    try:
        for every in spacings:
            best = math.inf
            for _ in range(repeats):
                model.zero_grad(set_to_none=True)
                calls[0] = 0
                start = time.perf_counter()
                with SavedTensorBytes(model, device=x.device) as counter:
                    y = checkpoint_sequential(blocks, x, every, implementation)
                    forward_bytes = counter.live
                    y.sum().backward()
                best = min(best, time.perf_counter() - start)
            rows.append(
                {
                    "every": every,
                    "peak_bytes": counter.peak,
                    "forward_bytes": forward_bytes,
                    "block_forwards": calls[0],
                    "seconds": best,
                    "theory_units": theoretical_peak(len(blocks), every),
                }
            )
    finally:
        for h in handles:
            h.remove()
    return rows
