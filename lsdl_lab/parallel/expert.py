"""Expert parallelism: a mixture-of-experts layer's experts split across the ranks of a
group, the tokens sent to them by all-to-all (GShard, Lepikhin et al. 2021; Switch, Fedus
et al. 2022).

Each rank holds the whole router and E/p of the E experts (rank r: experts r E/p, ...,
(r+1) E/p - 1), and its own batch of tokens (expert parallelism runs along data
parallelism: the ranks' tokens differ). One forward of :class:`ExpertParallelMoE`:

1. **Route** this rank's tokens exactly as :class:`~lsdl_lab.moe.MoE` does
   (:func:`~lsdl_lab.moe.route`: top-k, the capacity of this rank's batch, the aux loss).
   The kept assignments come grouped by expert, so grouped by the rank that owns it.
2. **Exchange the counts**: an all-to-all of the E kept counts (E/p to each rank), so each
   rank learns how many rows every rank will send to each of its experts: the splits of
   the next all-to-all are uneven, and the receiver must size its buffer.
3. **Dispatch**: an all-to-all of the rows, ``n_s`` rows to rank s, ``n_s`` the kept
   assignments of rank s's experts.
4. **The local experts** on what arrived, regrouped by expert
   (:func:`~lsdl_lab.moe.run_experts`).
5. **Combine**: the reverse all-to-all brings each output back to the rank of its token,
   where :func:`~lsdl_lab.moe.combine` weighs it by its gate.

Steps 3 and 5 are :class:`AllToAll`, an autograd function whose backward is the reverse
all-to-all (the gradient of a permutation of rows across ranks is the inverse
permutation), so the layer is differentiable end to end: the backward runs the two
all-to-alls again, combine's reverse first. The all-to-all is the library's own
:func:`~lsdl_lab.distributed.all_to_all`, pairwise point-to-point exchanges with uneven
splits, which has ``dist.all_to_all_single``'s argument order: the book's collective is
the one proven here, and :class:`~lsdl_lab.distributed.traffic.SentMessages` sees its
messages. (``dist.all_to_all_single`` is one line away; it has no autograd of its own
either, ``torch.distributed.nn.functional.all_to_all_single`` does.)

Bytes: each forward counts, in :attr:`ExpertParallelMoE.bytes`, the bytes of the tensors
this rank hands to its all-to-alls, forward and then backward (the ``CollectiveBytes``
convention: the whole input, its own block included). With ``d`` the width, ``b`` the
bytes of an element, ``S`` the rows sent and ``R`` the rows received at dispatch:
forward ``8 E + (S + R) d b`` (int64 counts, dispatch, combine), backward ``(S + R) d b``.

The router's gradient is this rank's (from its tokens): summed over ranks by data
parallelism's all-reduce, as every replicated parameter's. Each expert's gradient is
whole on its owning rank: it saw every rank's tokens routed to it.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..distributed.collectives import all_to_all
from ..models import GPT
from ..moe import MoE, as_tokens, combine, route, run_experts

__all__ = ["AllToAll", "AllToAllBytes", "ExpertParallelMoE", "expert_parallel_gpt"]


@dataclass
class AllToAllBytes:
    """Bytes this rank handed to a layer's all-to-alls: ``forward`` in its forward (the
    counts, the dispatch, the combine), ``backward`` in its backward (the two reverses)."""

    forward: int = 0
    backward: int = 0

    @property
    def total(self) -> int:
        return self.forward + self.backward


def _handed(x: torch.Tensor) -> int:
    return x.numel() * x.element_size()


class AllToAll(torch.autograd.Function):
    """Rows of ``x`` to the ranks, ``input_splits[s]`` rows to rank s, ``output_splits[s]``
    rows from it (:func:`~lsdl_lab.distributed.all_to_all`); backward, the reverse
    all-to-all of the gradient (the splits swapped). ``bytes`` (an :class:`AllToAllBytes`
    or None) counts the tensor handed over each way."""

    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group, bytes):
        ctx.splits, ctx.group, ctx.bytes = (output_splits, input_splits), group, bytes
        if bytes is not None:
            bytes.forward += _handed(x)
        out = x.new_empty((sum(output_splits), *x.shape[1:]))
        return all_to_all(
            out, x, group, output_split_sizes=output_splits, input_split_sizes=input_splits
        )

    @staticmethod
    def backward(ctx, dy):
        output_splits, input_splits = ctx.splits
        dy = dy.contiguous()
        if ctx.bytes is not None:
            ctx.bytes.backward += _handed(dy)
        dx = dy.new_empty((sum(input_splits), *dy.shape[1:]))
        all_to_all(
            dx, dy, ctx.group, output_split_sizes=input_splits, input_split_sizes=output_splits
        )
        return dx, None, None, None, None


class ExpertParallelMoE(nn.Module):
    """:class:`~lsdl_lab.moe.MoE` with its experts split over ``group`` (see the module's
    docstring). Built from a one-process layer with :meth:`from_dense`: this rank keeps a
    copy of the router and its E/p experts. ``forward(x)`` takes this rank's tokens
    ``(..., dim)`` and equals ``moe(x)``; it sets the same statistics as MoE
    (:attr:`aux_loss`, :attr:`tokens_per_expert`, :attr:`dropped`, :attr:`capacity`,
    for this rank's tokens), and :attr:`sent` / :attr:`received`, the rows sent to and
    received from each rank at dispatch, and :attr:`bytes`, the :class:`AllToAllBytes` of
    the step (its ``backward`` filled in by the backward pass).
    """

    def __init__(self, router: nn.Linear, experts: nn.ModuleList, moe: MoE, group=None):
        super().__init__()
        self.group, self.dim, self.num_experts = group, moe.dim, moe.num_experts
        self.top_k, self.capacity_factor = moe.top_k, moe.capacity_factor
        self.router, self.experts = router, experts
        self.aux_loss: torch.Tensor | None = None
        self.tokens_per_expert: torch.Tensor | None = None
        self.dropped, self.capacity = 0, 0
        self.sent: list[int] = []
        self.received: list[int] = []
        self.bytes = AllToAllBytes()

    @classmethod
    def from_dense(cls, moe: MoE, group=None) -> ExpertParallelMoE:
        """This rank's share of ``moe``: a copy of its router and of experts r E/p to
        (r+1) E/p - 1."""
        if not isinstance(moe, MoE):
            raise TypeError(f"Invalid moe: a {type(moe).__name__} (expected an MoE)")
        r, p = dist.get_rank(group), dist.get_world_size(group)
        if moe.num_experts % p:
            raise ValueError(
                f"Invalid experts: {moe.num_experts} (expected a multiple of the group's {p} "
                "ranks: each holds experts / ranks of them)"
            )
        local = moe.num_experts // p
        experts = nn.ModuleList(copy.deepcopy(moe.experts[r * local : (r + 1) * local]))
        return cls(copy.deepcopy(moe.router), experts, moe, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = as_tokens(x, self.dim)
        routing = route(self.router(tokens), self.top_k, self.capacity_factor)
        self.aux_loss, self.capacity = routing.aux_loss, routing.capacity
        self.tokens_per_expert, self.dropped = routing.routed.detach(), routing.dropped
        y = self.dispatch_and_combine(tokens[routing.token], routing.counts)
        return combine(y, routing, tokens).view_as(x)

    def dispatch_and_combine(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The experts' outputs for ``rows`` (grouped by expert, ``counts[e]`` rows for
        expert e of all E), computed on the ranks that own them."""
        p, local = dist.get_world_size(self.group), len(self.experts)
        self.bytes = AllToAllBytes(forward=_handed(counts))
        # from each rank s: how many rows it sends to each of my experts, (p, E/p)
        incoming = all_to_all(torch.empty_like(counts), counts, self.group).view(p, local)
        self.sent = counts.view(p, local).sum(1).tolist()
        self.received = incoming.sum(1).tolist()
        arrived = AllToAll.apply(rows, self.received, self.sent, self.group, self.bytes)
        # arrived rows: by source rank, then my expert; regroup by expert, then source
        block = torch.arange(p * local, device=rows.device).repeat_interleave(incoming.view(-1))
        by_expert = (block % local * p + block // local).argsort(stable=True)
        y = run_experts(self.experts, arrived[by_expert], incoming.sum(0))
        y = y[by_expert.argsort()]
        return AllToAll.apply(y, self.sent, self.received, self.group, self.bytes)

    def extra_repr(self) -> str:
        return (
            f"experts={len(self.experts)} of {self.num_experts}, top_k={self.top_k}, "
            f"capacity_factor={self.capacity_factor}"
        )


def expert_parallel_gpt(gpt: GPT, group=None) -> GPT:
    """A copy of an MoE ``gpt`` whose MoE layers are :class:`ExpertParallelMoE` shards of
    this rank; everything else stays replicated. On each rank's tokens its logits and
    :attr:`~lsdl_lab.models.GPT.aux_loss` equal ``gpt``'s."""
    layers = [block.mlp for block in gpt.blocks]
    if not all(isinstance(mlp, MoE) for mlp in layers):
        raise ValueError("Invalid gpt: a dense GPT (expected one built with moe_experts > 0)")
    ep = copy.deepcopy(gpt)  # keeps the tied head and embedding tied
    for block, moe in zip(ep.blocks, layers, strict=True):
        block.mlp = ExpertParallelMoE.from_dense(moe, group)
    return ep
