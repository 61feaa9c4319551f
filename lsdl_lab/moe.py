r"""A mixture-of-experts feed-forward layer: top-k gating with an expert capacity and the
load-balancing loss of Switch and GShard (Chapter 7).

A Transformer's MLP is replaced by E experts, each the GPT's MLP
(``Linear(dim, hidden) -> GELU -> Linear(hidden, dim)``), and a router that sends each
token to k of them (Shazeer et al. 2017; GShard, Lepikhin et al. 2021; Switch, Fedus et
al. 2022 for k = 1). For a token x, with router weights :math:`W_r` (E x dim, no bias):

.. math::

    p(x) = \operatorname{softmax}(W_r x), \qquad
    \mathcal{T}(x) = \operatorname{top-}k\,\{p_i(x)\}, \qquad
    y = \sum_{i \in \mathcal{T}(x),\ \text{kept}} g_i(x)\, E_i(x),

with gates :math:`g_i = p_i` for k = 1 (Switch) and :math:`g_i = p_i / \sum_{j \in
\mathcal{T}(x)} p_j` for k > 1 (GShard's renormalization of the top two). Each expert takes
at most

.. math:: C = \left\lceil \text{capacity\_factor} \cdot \frac{T k}{E} \right\rceil

of the k T assignments of a batch of T tokens. The assignments queue choice by choice:
every token's first choice before any token's second (GShard, Algorithm 1), tokens in
order within a choice. An assignment past its expert's C-th place is dropped: it adds
nothing, and a token all of whose assignments are dropped leaves the layer as zero, so in
a residual block it passes on the residual path alone. Gates are not renormalized after a
drop.

The load-balancing loss (Switch, Eq. 4; GShard's is the same up to a factor E^2, with f_i
from first choices alone), with
:math:`f_i` the fraction of the k T assignments routed to expert i (before the capacity
cut) and :math:`P_i` the mean router probability of expert i over the batch,

.. math:: \mathcal{L}_\text{aux} = E \sum_{i=1}^{E} f_i P_i,

is 1 when the assignments or the probabilities are spread evenly over the experts and
grows to E when one expert takes every token with certainty; only
:math:`P_i` carries a gradient. The layer stores it in :attr:`MoE.aux_loss` after each
forward, unscaled: the training loss adds :math:`\alpha\,\mathcal{L}_\text{aux}` (Switch
uses :math:`\alpha = 10^{-2}`). For k = 1 it is Switch's loss exactly; for k > 1 each
choice counts 1/k of a token, so its balanced value stays 1 (Mixtral's implementation
counts k, and its balanced value is k).

Departures from the papers, to keep the layer printable: no random routing of the second
expert (GShard), no router z-loss (ST-MoE), no jitter noise on the router's input
(Switch), no groups of tokens (the capacity is the whole batch's, as in a group of one).
The softmax is computed in float32 at least, whatever the input's precision (Switch's
selective precision).

The three steps, :func:`route`, :func:`run_experts` and :func:`combine`, are public
because :class:`~lsdl_lab.parallel.ExpertParallelMoE` runs the same route and combine
with the experts on other ranks in between.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ._util import check_int, check_positive, check_tensor

__all__ = ["MoE", "Routing", "as_tokens", "capacity", "combine", "route", "run_experts"]


def capacity(tokens: int, experts: int, top_k: int, capacity_factor: float) -> int:
    """The most assignments an expert takes: ``ceil(capacity_factor * tokens * top_k /
    experts)`` (GShard; Switch's "expert capacity")."""
    return math.ceil(capacity_factor * tokens * top_k / experts)


class Routing(NamedTuple):
    """Where the kept assignments of a batch go, grouped by expert (expert 0's first, each
    expert's in queue order): ``token`` (N,) the token of each, ``gate`` (N,) its gate;
    ``counts`` (E,) the kept assignments of each expert, ``routed`` (E,) the assignments
    routed to it before the capacity cut; ``aux_loss`` the load-balancing loss;
    ``capacity`` the C of the batch."""

    token: torch.Tensor
    gate: torch.Tensor
    counts: torch.Tensor
    routed: torch.Tensor
    aux_loss: torch.Tensor
    capacity: int

    @property
    def dropped(self) -> int:
        """The assignments over capacity."""
        return int(self.routed.sum() - self.counts.sum())


def as_tokens(x, dim: int) -> torch.Tensor:
    """``x`` of shape ``(..., dim)`` as ``(T, dim)``: every leading position a token."""
    check_tensor("x", x)
    if x.dim() < 1 or x.shape[-1] != dim:
        raise ValueError(
            f"Invalid x: shape {tuple(x.shape)} (expected a last dimension of dim = {dim})"
        )
    return x.reshape(-1, dim)


def route(logits: torch.Tensor, top_k: int, capacity_factor: float) -> Routing:
    """Top-k gating of the router's ``logits`` (T, E) with each expert's capacity (see the
    module's docstring for the equations)."""
    T, E = logits.shape
    # at least float32, whatever the input's precision (Switch's selective precision)
    probs = logits.to(torch.promote_types(logits.dtype, torch.float32)).softmax(-1)
    gate, expert = probs.topk(top_k, dim=-1)  # (T, k), best first
    if top_k > 1:
        gate = gate / gate.sum(-1, keepdim=True)  # GShard: the k gates add up to 1
    C = capacity(T, E, top_k, capacity_factor)
    # choice-major: every token's first choice queues before any token's second (GShard)
    expert, gate = expert.t().reshape(-1), gate.t().reshape(-1)
    token = torch.arange(T, device=logits.device).repeat(top_k)
    one_hot = F.one_hot(expert, E)
    place = one_hot.cumsum(0).gather(1, expert[:, None]).squeeze(1) - 1  # place in its queue
    routed = one_hot.sum(0)
    aux_loss = E * (routed / (T * top_k) * probs.mean(0)).sum()  # E sum_i f_i P_i
    kept = (place < C).nonzero().squeeze(1)
    kept = kept[expert[kept].argsort(stable=True)]  # grouped by expert, queue order within
    counts = torch.bincount(expert[kept], minlength=E)
    return Routing(token[kept], gate[kept], counts, routed, aux_loss, C)


def run_experts(experts, x: torch.Tensor, counts) -> torch.Tensor:
    """Each expert on its rows of ``x``: the first ``counts[0]`` rows go to ``experts[0]``,
    the next ``counts[1]`` to ``experts[1]``, ...; the outputs in the same order."""
    sizes = counts.tolist() if torch.is_tensor(counts) else list(counts)
    return torch.cat([expert(rows) for expert, rows in zip(experts, x.split(sizes), strict=True)])


def combine(y: torch.Tensor, routing: Routing, x: torch.Tensor) -> torch.Tensor:
    """``out[t] = sum of g * E_i(x_t)`` over token t's kept assignments (zero for a token
    with none): ``y`` holds the experts' outputs in ``routing``'s order."""
    weighted = routing.gate[:, None].to(y.dtype) * y
    return torch.zeros_like(x).index_add(0, routing.token, weighted.to(x.dtype))


def _expert(dim: int, hidden: int) -> nn.Sequential:
    """One expert: the GPT's MLP (:class:`~lsdl_lab.models.TransformerBlock`'s)."""
    return nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))


class MoE(nn.Module):
    """A mixture-of-experts feed-forward layer (see the module's docstring).

    ``forward(x)`` takes ``(..., dim)`` and returns the same shape; every leading position
    is a token. After it, :attr:`aux_loss` holds the batch's load-balancing loss (with its
    graph: add ``alpha * aux_loss`` to the loss), :attr:`tokens_per_expert` (E,) the
    assignments routed to each expert (k per token, before the capacity cut),
    :attr:`dropped` how many were over capacity, :attr:`capacity` the batch's C.
    """

    def __init__(
        self,
        dim: int,
        hidden: int,
        experts: int,
        top_k: int = 2,
        capacity_factor: float = 1.25,
    ):
        super().__init__()
        self.dim = check_int("dim", dim, 1)
        check_int("hidden", hidden, 1)
        self.num_experts = check_int("experts", experts, 1)
        self.top_k = check_int("top_k", top_k, 1, experts)
        self.capacity_factor = check_positive("capacity_factor", capacity_factor)
        self.router = nn.Linear(dim, experts, bias=False)
        self.experts = nn.ModuleList(_expert(dim, hidden) for _ in range(experts))
        self.aux_loss: torch.Tensor | None = None
        self.tokens_per_expert: torch.Tensor | None = None
        self.dropped, self.capacity = 0, 0

    def active_parameters(self) -> int:
        """Parameters a token meets: the router and ``top_k`` experts."""
        one = sum(p.numel() for p in self.experts[0].parameters())
        return self.router.weight.numel() + self.top_k * one

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = as_tokens(x, self.dim)
        routing = route(self.router(tokens), self.top_k, self.capacity_factor)
        self.aux_loss, self.capacity = routing.aux_loss, routing.capacity
        self.tokens_per_expert, self.dropped = routing.routed.detach(), routing.dropped
        y = run_experts(self.experts, tokens[routing.token], routing.counts)
        return combine(y, routing, tokens).view_as(x)

    def extra_repr(self) -> str:
        return f"top_k={self.top_k}, capacity_factor={self.capacity_factor}"
