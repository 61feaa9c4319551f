"""The worlds of Lab 10 (communication at scale), as workers for
:func:`~lsdl_lab.distributed.spawn`: each a top-level ``fn(rank, world_size, ...)`` that
calls the library directly and returns plain numbers, so that a notebook can spawn it.

* :func:`collective_scaling`: the all-to-all (:func:`~lsdl_lab.distributed.all_to_all`)
  against ``dist.all_to_all_single``, and the ring and Rabenseifner all-reduces against
  ``dist.all_reduce``: equal results, the messages and bytes each rank sends, and the time
  per call over message sizes;
* :func:`expert_parallel_check`: :class:`~lsdl_lab.parallel.ExpertParallelMoE` against the
  one-process :class:`~lsdl_lab.moe.MoE` it was cut from, forward and backward, and the
  bytes of its all-to-alls against their formula;
* :func:`context_parallel_check`: ring attention and Ulysses against full causal attention,
  forward and backward, and the bytes each rank sends against
  :func:`~lsdl_lab.parallel.context.ring_attention_bytes` and
  :func:`~lsdl_lab.parallel.context.ulysses_attention_bytes`, at several sequence lengths.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..distributed.collectives import all_to_all, rabenseifner_all_reduce, ring_all_reduce
from ..distributed.traffic import SentMessages
from ..moe import MoE
from ..parallel.context import (
    ring_attention_bytes,
    ulysses_attention_bytes,
)
from ..parallel.expert import ExpertParallelMoE
from .communication_experiments import timed_rounds
from .scaling_experiments import all_to_all_even, builtin_all_to_all, context_check, moe_pass

__all__ = [
    "ALL_REDUCES",
    "ALL_TO_ALLS",
    "collective_scaling",
    "context_parallel_check",
    "expert_parallel_check",
]


ALL_TO_ALLS = {"all-to-all (ours)": all_to_all_even, "all-to-all (built-in)": builtin_all_to_all}
ALL_REDUCES = {
    "ring": ring_all_reduce,
    "Rabenseifner": rabenseifner_all_reduce,
    "all-reduce (built-in)": dist.all_reduce,
}


def _agreement(rank: int, p: int) -> dict:
    """The largest difference from the built-in of our all-to-all (uneven blocks) and our
    two all-reduces (1001 float64 entries, not a multiple of p)."""
    g = torch.Generator().manual_seed(rank)
    rows = [[(i + 2 * j) % 4 for j in range(p)] for i in range(p)]  # rows[i][j]: i to j
    x = torch.randn(sum(rows[rank]), 3, generator=g, dtype=torch.float64)
    splits = ([rows[j][rank] for j in range(p)], rows[rank])
    ours = all_to_all(
        x.new_empty(sum(splits[0]), 3),
        x,
        None,
        output_split_sizes=splits[0],
        input_split_sizes=splits[1],
    )
    theirs = x.new_empty(ours.shape)
    dist.all_to_all_single(theirs, x, *splits)
    out = {"all-to-all": (ours - theirs).abs().max().item()}
    v = torch.randn(1001, generator=g, dtype=torch.float64)
    built_in = v.clone()
    dist.all_reduce(built_in)
    for name in ("ring", "Rabenseifner"):
        out[name] = (ALL_REDUCES[name](v.clone()) - built_in).abs().max().item()
    return out


def _min_times(collectives: dict, nbytes: Sequence[int], rounds: int) -> dict:
    """Seconds per call of each collective on float32 tensors of each size: the minimum
    over ``rounds`` of the slowest rank's time (:func:`timed_rounds`, which caps them in a
    dry run), each call after a barrier. The tensors are made and each collective warmed
    on them once, before the rounds (what :func:`~lsdl_lab.distributed.measure_collective`
    does per call, which would pay the warm-up once per round here). Another process can
    only slow a call down, so the minimum is the cost of the collective itself."""
    tensors = [torch.ones(n // 4) for n in nbytes]
    for fn in collectives.values():
        for x in tensors:
            fn(x)

    def one_round(_) -> torch.Tensor:
        # every collective at every size in each round: a burst of load hits them all alike
        times = torch.empty(len(collectives), len(tensors), dtype=torch.float64)
        for a, fn in enumerate(collectives.values()):
            for j, x in enumerate(tensors):
                dist.barrier()
                start = time.perf_counter()
                fn(x)
                times[a, j] = time.perf_counter() - start
                x.fill_(1.0)  # an all-reduce multiplied it by p
        return times

    times = torch.stack(timed_rounds(one_round, rounds))
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    best = times.min(0).values
    return {name: best[a].tolist() for a, name in enumerate(collectives)}


def collective_scaling(rank, world_size, nbytes: Sequence[int], repeats: int = 5) -> dict:
    """For float32 tensors of each of ``nbytes`` bytes (multiples of 4 p): ``seconds``,
    each collective's time per call, the minimum over ``repeats`` rounds of the slowest
    rank's time (:func:`_min_times`); ``messages`` and
    ``sent``, the point-to-point messages and bytes this rank sends in one call of each of
    ours (:class:`~lsdl_lab.distributed.traffic.SentMessages`; the built-ins send from C++,
    where nothing counts them); and ``error``, the largest difference of ours from the
    built-ins on float64 tensors. Results differ by rank only in ``messages`` and ``sent``.
    """
    timed = {**ALL_TO_ALLS, **ALL_REDUCES}
    seconds = _min_times(timed, nbytes, repeats)
    messages, sent = {}, {}
    for name in ("all-to-all (ours)", "ring", "Rabenseifner"):
        messages[name], sent[name] = [], []
        for n in nbytes:
            with SentMessages() as counted:
                timed[name](torch.ones(n // 4))
            messages[name].append(len(counted.numels))
            sent[name].append(counted.bytes)
    return {
        "nbytes": list(nbytes),
        "seconds": seconds,
        "messages": messages,
        "sent": sent,
        "error": _agreement(rank, world_size),
    }


def _tokens(rank: int, n: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s tokens (float64, ``n + 2 rank`` of them: a different batch on each
    rank) and the gradient its output is given."""
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(n + 2 * rank, dim, generator=g, dtype=torch.float64)
    return x, torch.randn(x.shape, generator=g, dtype=torch.float64)


def expert_parallel_check(
    rank,
    world_size,
    dim: int = 16,
    hidden: int = 32,
    experts: int = 4,
    top_k: int = 2,
    capacity_factor: float = 1.0,
    tokens: int = 24,
    alpha: float = 0.01,
) -> dict:
    """:class:`ExpertParallelMoE` (E/p experts on each rank) against the one-process
    :class:`MoE` it was cut from, float64, on this rank's tokens: the largest differences
    of the output, of the input's gradient and of the local experts' weight gradients
    (summed, in the reference, over every rank's tokens, which the expert saw); the rows
    sent to and received from each rank at dispatch; the bytes handed to the all-to-alls
    forward and backward, with their formula, ``8 E + (S + R) d b`` forward (the int64
    counts, the dispatch and the combine) and ``(S + R) d b`` backward."""
    torch.manual_seed(0)
    moe = MoE(dim, hidden, experts, top_k, capacity_factor).double()
    ep = ExpertParallelMoE.from_dense(moe, None)
    x, dy = _tokens(rank, tokens, dim)
    y, dx = moe_pass(ep, x, dy, alpha)
    moe.zero_grad()
    for s in range(world_size):  # the reference: every rank's tokens through one layer
        y_ref, dx_ref = moe_pass(moe, *_tokens(s, tokens, dim), alpha)
        if s == rank:
            mine = (y_ref, dx_ref, moe.tokens_per_expert.tolist(), moe.dropped)
    local = experts // world_size
    reference = moe.experts[rank * local : (rank + 1) * local]
    grad_error = max(
        (a.grad - b.grad).abs().max().item()
        for a, b in zip(ep.experts.parameters(), reference.parameters(), strict=True)
    )
    S, R, b = sum(ep.sent), sum(ep.received), x.element_size()
    return {
        "output_error": (y - mine[0]).abs().max().item(),
        "input_grad_error": (dx - mine[1]).abs().max().item(),
        "expert_grad_error": grad_error,
        "routed": mine[2],
        "dropped": mine[3],
        "sent": ep.sent,
        "received": ep.received,
        "bytes": (ep.bytes.forward, ep.bytes.backward),
        "formula": (8 * experts + (S + R) * dim * b, (S + R) * dim * b),
    }


def context_parallel_check(
    rank,
    world_size,
    shards: Sequence[int] = (4, 8, 16),
    batch: int = 1,
    heads: int = 4,
    head_dim: int = 8,
) -> dict:
    """Ring attention and Ulysses against full causal attention, float64, for each shard
    length s in ``shards`` (sequences of p s positions): ``error[method][s]``, the largest
    difference of this rank's output and of its q, k, v gradients from those of
    ``scaled_dot_product_attention`` on the whole sequence; ``bytes[method][s]``, the
    bytes this rank sends (forward, backward) counted message by message, and
    ``formula[method][s]`` what :func:`ring_attention_bytes` and
    :func:`ulysses_attention_bytes` predict."""
    formulas = {"ring": ring_attention_bytes, "Ulysses": ulysses_attention_bytes}
    out = {key: {m: {} for m in formulas} for key in ("error", "bytes", "formula")}
    for s in shards:
        for name, formula in formulas.items():
            run = context_check(rank, world_size, name.lower(), batch, heads, s, head_dim, seed=s)
            out["error"][name][s] = max(run["errors"].values())
            out["bytes"][name][s] = run["bytes"]
            out["formula"][name][s] = formula(
                batch * heads * s * head_dim, world_size, torch.float64
            )
    return out
