"""The experiments of Chapter 10 (communication at scale), as workers for
:func:`~lsdl_lab.distributed.spawn` and plain functions.

Like :mod:`lsdl_lab.book.communication_experiments` for Chapter 7, every experiment that
runs on a world of processes is a top-level function ``fn(rank, world_size, ...)`` that
returns plain results (numbers, lists, dicts), the same on every rank unless it says
otherwise; the page only prints, plots and asserts::

    from lsdl_lab.distributed import spawn
    from lsdl_lab.book.scaling_experiments import collectives_report
    report = spawn(collectives_report, 4, [4_000, 400_000])[0]

* :func:`collectives_report`: the all-to-all against ``dist.all_to_all_single`` with
  uneven splits, and the ring, recursive doubling, Rabenseifner's, the binary tree and the
  hierarchical all-reduce against ``dist.all_reduce``: errors, the bytes the busiest rank
  sends (counted message by message), seconds per call;
* :func:`moe_report`: the expert-parallel MoE layer against the one-process layer,
  forward and backward, with its tokens per expert, dropped assignments and all-to-all
  bytes, at several capacity factors;
* :func:`moe_against_dense`: one process: an MoE GPT and the dense GPT of the same active
  parameters trained on the same characters (:func:`lsdl_lab.train.fit` with
  :func:`moe_step`, which adds the load-balancing loss);
* :func:`long_sequence_report`: Megatron's sequence parallelism against tensor
  parallelism alone (outputs, gradients, bytes on a ring, saved activations), and ring
  attention and Ulysses against full causal attention, with their bytes and largest
  tensors against the sequence length;
* :func:`diloco_report`: DDP, local SGD and DiLoCo on the 8x8 digits, the two infrequent
  methods on the same bytes: losses, accuracies, bytes, DiLoCo's checkpoint state.

Byte counts: :class:`~lsdl_lab.distributed.CollectiveBytes` for what a rank hands to the
built-in collectives, :class:`~lsdl_lab.distributed.traffic.SentMessages` for the
point-to-point messages of the hand-built ones (what the rank puts on its link).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .. import models
from .._util import check_int
from ..data import load_digits, text_eval_batches
from ..distributed import CollectiveBytes, all_reduce_gradients
from ..distributed.collectives import (
    all_to_all,
    binary_tree_all_reduce,
    hierarchical_all_reduce,
    rabenseifner_all_reduce,
    ring_all_reduce,
    tree_all_reduce,
)
from ..distributed.diloco import DiLoCo
from ..distributed.local_sgd import PeriodicAverager
from ..distributed.traffic import Call, SentMessages
from ..memory import LargestTensor, SavedTensorBytes
from ..moe import MoE
from ..parallel import (
    ExpertParallelMoE,
    TensorParallelBlock,
    all_reduce_sequence_parallel_grads,
    ring_attention,
    ring_attention_bytes,
    shard,
    ulysses_attention,
    ulysses_attention_bytes,
)
from ..train import LanguageModeling, StepResult, fit
from .communication_experiments import SynchronizedStep, fastest_rounds

__all__ = [
    "all_to_all_even",
    "builtin_all_to_all",
    "collectives_report",
    "context_check",
    "diloco_report",
    "long_sequence_report",
    "moe_against_dense",
    "moe_pass",
    "moe_report",
    "moe_step",
    "ring_traffic",
]


def _max_over_ranks(values: Sequence[float]) -> list[float]:
    """The largest of each value over the ranks (one all-reduce)."""
    t = torch.tensor(list(values), dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _uneven_splits(p: int, row: int) -> list[int]:
    """The rows rank ``row`` sends to each rank in the uneven all-to-all: ``1 + (row + 2 j)
    mod 3`` to rank j, so every pair differs and the blocks a rank receives are uneven too."""
    return [1 + (row + 2 * j) % 3 for j in range(p)]


def _all_to_all_check(rank: int, p: int, width: int = 5) -> dict:
    """The library's pairwise all-to-all against ``dist.all_to_all_single`` on uneven
    splits, and the bytes this rank put on its link against those it had for the others."""
    send = _uneven_splits(p, rank)
    recv = [_uneven_splits(p, s)[rank] for s in range(p)]
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(sum(send), width, generator=g, dtype=torch.float64)
    ours, torchs = x.new_empty(sum(recv), width), x.new_empty(sum(recv), width)
    with SentMessages() as sent:
        all_to_all(ours, x, output_split_sizes=recv, input_split_sizes=send)
    dist.all_to_all_single(torchs, x, output_split_sizes=recv, input_split_sizes=send)
    others = (sum(send) - send[rank]) * width * 8  # every block but this rank's own
    return {
        "equal": bool(torch.equal(ours, torchs)),
        "send_splits": send,
        "recv_splits": recv,
        "sent_bytes": sent.bytes,
        "messages": len(sent.numels),
        "bytes_for_others": others,
    }


def _hierarchical(local_size: int):
    def call(tensor, group=None):
        return hierarchical_all_reduce(tensor, local_size, group)

    return call


def all_to_all_even(tensor, group=None):
    """An even all-to-all of ``tensor`` (its first dimension divisible by the ranks), for
    :func:`~lsdl_lab.distributed.measure_collective`."""
    return all_to_all(torch.empty_like(tensor), tensor, group)


def builtin_all_to_all(tensor, group=None):
    """:func:`all_to_all_even` by ``dist.all_to_all_single``."""
    out = torch.empty_like(tensor)
    dist.all_to_all_single(out, tensor, group=group)
    return out


def collectives_report(
    rank, world_size, nbytes: Sequence[int], repeats: int = 3, local_size: int | None = None
) -> dict:
    """Every check of the chapter's all-to-all and all-reduce sections, on one world:

    * ``"all_to_all"``: :func:`_all_to_all_check` of this rank (uneven splits);
    * ``"errors"``: the largest difference, over ranks, between each all-reduce and
      ``dist.all_reduce`` on float64 vectors that differ per rank (zero up to the rounding
      of another order of additions);
    * ``"sent"``: the bytes the busiest rank sends in one call of each algorithm at each of
      ``nbytes`` (float32), counted message by message (:class:`SentMessages`);
    * ``"seconds"``: seconds per call, float32, the minimum over ``repeats`` rounds in which
      every algorithm is timed once at every size (the slowest rank's time,
      :func:`~lsdl_lab.distributed.measure_collective`), the built-in all-reduce and
      all-to-all included.

    The hierarchical all-reduce runs with nodes of ``local_size`` ranks when given (a
    divisor of the world size other than 1 and itself)."""
    algorithms = {
        "ring": ring_all_reduce,
        "recursive doubling": tree_all_reduce,
        "Rabenseifner": rabenseifner_all_reduce,
        "binary tree": binary_tree_all_reduce,
    }
    if local_size is not None:
        algorithms["hierarchical"] = _hierarchical(local_size)
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(1001, generator=g, dtype=torch.float64)  # 1001: uneven chunks at any p
    reference = x.clone()
    dist.all_reduce(reference)
    errors = {}
    for name, fn in algorithms.items():
        y = fn(x.clone())
        errors[name] = (y - reference).abs().max().item()
    errors = dict(zip(errors, _max_over_ranks(errors.values()), strict=True))

    sent = {}
    for name, fn in algorithms.items():
        counts = []
        for n in nbytes:
            with SentMessages() as messages:
                fn(torch.ones(n // 4))
            counts.append(messages.bytes)
        sent[name] = [int(b) for b in _max_over_ranks(counts)]
    with SentMessages() as messages:
        all_to_all_even(torch.ones(world_size, nbytes[-1] // (4 * world_size)))
    sent["all-to-all"] = [int(_max_over_ranks([messages.bytes])[0])]

    timed = {**algorithms, "built-in": dist.all_reduce}
    timed |= {"all-to-all": all_to_all_even, "built-in all-to-all": builtin_all_to_all}
    sizes = [n - n % (4 * world_size) for n in nbytes]  # the all-to-all cuts rows evenly
    seconds = fastest_rounds(timed, sizes, repeats)
    return {
        "world_size": world_size,
        "nbytes": list(nbytes),
        "all_to_all": _all_to_all_check(rank, world_size),
        "errors": errors,
        "sent": sent,
        "seconds": seconds,
    }


# -- mixture of experts and expert parallelism ---------------------------------------------


def _moe_tokens(rank: int, tokens: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s tokens and the gradient its output is given (float64)."""
    g = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(tokens, dim, generator=g, dtype=torch.float64)
    return x, torch.randn(x.shape, generator=g, dtype=torch.float64)


def moe_pass(layer, x, dy, alpha):
    """Forward and backward of ``(y * dy).sum() + alpha * aux_loss`` on a leaf copy of x."""
    x = x.clone().requires_grad_(True)
    y = layer(x)
    ((y * dy).sum() + alpha * layer.aux_loss).backward()
    return y.detach(), x.grad


def moe_report(
    rank,
    world_size,
    capacity_factors: Sequence[float],
    experts: int = 4,
    top_k: int = 1,
    dim: int = 8,
    hidden: int = 16,
    tokens: int = 64,
    alpha: float = 0.01,
) -> dict:
    """For each capacity factor, the expert-parallel layer
    (:class:`~lsdl_lab.parallel.ExpertParallelMoE`, ``experts / world_size`` experts a rank)
    against the one-process :class:`~lsdl_lab.moe.MoE` with the same weights, on this
    rank's ``tokens`` (float64): the largest errors of the output, the input's gradient and
    this rank's experts' gradients (the one-process layer run on every rank's tokens, as
    each expert sees them all); the tokens routed to each expert, those kept, the capacity,
    the dropped assignments; the bytes handed to the all-to-alls (forward, backward) and
    the bytes put on this rank's link (:class:`SentMessages`), each with its formula."""
    out = {}
    local = experts // world_size
    for cf in capacity_factors:
        torch.manual_seed(0)
        moe = MoE(dim, hidden, experts, top_k, cf).double()
        ep = ExpertParallelMoE.from_dense(moe)
        # the reference: every rank's tokens through the one-process layer (each expert's
        # gradient sums them all); this rank's output and input gradient from its own
        y_ref = dx_ref = None
        for s in range(world_size):
            y, dx = moe_pass(moe, *_moe_tokens(s, tokens, dim), alpha)
            if s == rank:
                y_ref, dx_ref, routed, capacity = y, dx, moe.tokens_per_expert, moe.capacity
        x, dy = _moe_tokens(rank, tokens, dim)
        with SentMessages() as wire:
            y, dx = moe_pass(ep, x, dy, alpha)
        grad_error = 0.0
        for i, expert in enumerate(ep.experts):
            dense = moe.experts[rank * local + i]
            for a, b in zip(expert.parameters(), dense.parameters(), strict=True):
                grad_error = max(grad_error, (a.grad - b.grad).abs().max().item())
        kept = [min(n, capacity) for n in routed.tolist()]
        rows = (sum(ep.sent) + sum(ep.received)) * dim * 8
        off = [j for j in range(world_size) if j != rank]
        out[cf] = {
            "output_error": (y - y_ref).abs().max().item(),
            "input_grad_error": (dx - dx_ref).abs().max().item(),
            "expert_grad_error": grad_error,
            "routed": routed.tolist(),
            "kept": kept,
            "capacity": capacity,
            "dropped": ep.dropped,
            "assignments": tokens * top_k,
            "sent_rows": ep.sent,
            "received_rows": ep.received,
            "bytes_forward": ep.bytes.forward,
            "bytes_backward": ep.bytes.backward,
            "bytes_forward_formula": 8 * experts + rows,
            "bytes_backward_formula": rows,
            "wire_bytes": wire.bytes,
            "wire_formula": 8 * (experts - local)
            + 2 * sum(ep.sent[j] + ep.received[j] for j in off) * dim * 8,
        }
    return out


def moe_step(alpha: float = 0.01):
    """A step function for :func:`~lsdl_lab.train.fit` that adds ``alpha`` times the model's
    load-balancing loss (:attr:`~lsdl_lab.models.GPT.aux_loss`, 0 for a dense GPT) to the
    task's loss; it reports the task's loss alone, so that MoE and dense runs compare."""

    def step(model, optimizer, batch, task) -> StepResult:
        x, y = batch
        output = model(x)
        loss = task.loss(output, y)
        optimizer.zero_grad(set_to_none=True)
        (loss + alpha * model.aux_loss).backward()
        optimizer.step()
        return StepResult(loss.item(), task.examples(y), task.counts(output.detach(), y))

    return step


def _ffn_parameters(gpt: models.GPT) -> tuple[int, int]:
    """(all the feed-forward layers' parameters, those one token meets), over the blocks;
    an MoE's router counted in both."""
    total = active = 0
    for block in gpt.blocks:
        params = sum(p.numel() for p in block.mlp.parameters())
        total += params
        active += block.mlp.active_parameters() if isinstance(block.mlp, MoE) else params
    return total, active


def moe_against_dense(
    text,
    block_size: int,
    layers: int,
    heads: int,
    dim: int,
    experts: int,
    steps: int,
    batch_size: int = 16,
    lr: float = 3e-3,
    alpha: float = 0.01,
    eval_batches: int = 8,
    seed: int = 0,
) -> dict:
    """A dense GPT and an MoE GPT of ``experts`` top-1 experts a block (Switch routing, each
    expert the dense MLP, so that a token meets the dense model's parameters plus a
    router) trained by AdamW for ``steps`` steps on the same batches of ``text`` (a
    :class:`~lsdl_lab.data.TextData`). For each: the training-loss history, the validation
    loss, the parameters (all, and those of the feed-forward layers, all and active), and
    for the MoE the tokens routed to each expert of the first block on a validation
    batch."""
    from ..data import TextBatches

    batches = TextBatches(text.train, block_size, batch_size, seed=seed)
    held_out = text_eval_batches(text.val, block_size, batch_size, eval_batches)
    out = {}
    for name, e in (("dense", 0), ("MoE", experts)):
        torch.manual_seed(seed)
        gpt = models.GPT(
            text.vocab_size, block_size, layers, heads, dim, moe_experts=e, moe_top_k=1
        )
        opt = torch.optim.AdamW(gpt.parameters(), lr=lr)
        history = fit(
            gpt,
            opt,
            batches,
            steps,
            step=moe_step(alpha),
            task=LanguageModeling(),
            eval_batches=held_out,
            eval_every=steps,
            progress=False,
            log_every=max(1, steps // 20),
            grad_norm=False,
        )
        ffn, active = _ffn_parameters(gpt)
        record = {
            "steps": history.series("loss")[0],
            "loss": history.series("loss")[1],
            "eval_loss": history.last("eval_loss"),
            "parameters": gpt.num_parameters(),
            "ffn_parameters": ffn,
            "ffn_active": active,
        }
        if e:
            with torch.no_grad():
                gpt(held_out[0][0])
            record["tokens_per_expert"] = gpt.blocks[0].mlp.tokens_per_expert.tolist()
            record["dropped"] = gpt.blocks[0].mlp.dropped
        out[name] = record
    return out


# -- long sequences: sequence and context parallelism ---------------------------------------


# the bytes a ring puts on each rank's link per byte handed to the collective, at p ranks
_RING = {
    "all_reduce": lambda p: 2 * (p - 1) / p,  # reduce-scatter, then all-gather
    "broadcast": lambda p: 1.0,  # a pipeline along the ring: each rank forwards it once
    "all_gather": lambda p: p - 1,  # handed its shard: the p - 1 others' pass through
    "reduce_scatter": lambda p: (p - 1) / p,  # handed all of it: p - 1 chunks of n/p
}


def ring_traffic(calls: Sequence[Call]) -> float:
    """The bytes a *ring* puts on this rank's link for the collectives of ``calls``
    (:attr:`CollectiveBytes.calls <lsdl_lab.distributed.CollectiveBytes>`: the bytes
    handed to each and its group's size p), by the collective's kind: an all-reduce handed
    n bytes sends 2 (p-1)/p n; a reduce-scatter handed n sends (p-1)/p n; an all-gather
    handed its shard of n/p sends (p-1) n/p; a broadcast, n. The flat forms count as their
    kind, under either name."""
    total = 0.0
    for call in calls:
        kind = next((k for k in _RING if call.name.startswith(k)), None)
        if kind is None:
            raise ValueError(
                f"Invalid calls: a call of {call.name} (expected only the collectives of "
                f"{sorted(_RING)}, whose ring traffic this knows)"
            )
        total += _RING[kind](call.group_size) * call.bytes
    return total


def _sequence_parallel(rank, p, dim, heads, batch, seq) -> dict:
    """Megatron's sequence parallelism against tensor parallelism alone and the
    one-process block (float64): errors, ring bytes per pass, saved activation bytes."""
    torch.manual_seed(0)
    block = models.TransformerBlock(dim, heads, 0.0).double()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch, seq, dim, generator=g, dtype=torch.float64)
    dy = torch.randn(batch, seq, dim, generator=g, dtype=torch.float64)
    dense_x = x.clone().requires_grad_(True)
    dense_y = block(dense_x)
    dense_y.backward(dy)
    ln_grad = block.ln1.weight.grad
    report = {}
    for name, sp in (("tensor", False), ("sequence", True)):
        layer = TensorParallelBlock(block, sequence_parallel=sp)
        inp, grad = (shard(x, 1), shard(dy, 1)) if sp else (x, dy)
        probe = copy.deepcopy(layer)
        with SavedTensorBytes(exclude=probe) as saved:
            probe(inp.clone().requires_grad_(True)).backward(grad)
        leaf = inp.clone().requires_grad_(True)
        with CollectiveBytes() as forward:
            y = layer(leaf)
        with CollectiveBytes() as backward:
            y.backward(grad)
        all_reduce_sequence_parallel_grads(layer)
        want_y, want_dx = (
            (shard(dense_y, 1), shard(dense_x.grad, 1)) if sp else (dense_y, dense_x.grad)
        )
        report[name] = {
            "output_error": (y - want_y).abs().max().item(),
            "input_grad_error": (leaf.grad - want_dx).abs().max().item(),
            "layernorm_grad_error": (layer.ln1.weight.grad - ln_grad).abs().max().item(),
            "ring_bytes": (ring_traffic(forward.calls), ring_traffic(backward.calls)),
            "calls": sorted({c.name for c in forward.calls + backward.calls}),
            "saved_bytes": saved.peak,
        }
    report["activation_bytes"] = batch * seq * dim * 8  # one (B, T, d) float64 tensor
    return report


def context_check(
    rank, p, method, batch, heads, shard_len, head_dim, dtype=torch.float64, seed: int = 7
) -> dict:
    """Ring attention or Ulysses on this rank's shard against full causal attention on the
    whole sequence (inputs drawn from ``seed``): errors of the output and of q, k, v's
    gradients; bytes sent forward and backward (:class:`SentMessages`). Chapter 10's and
    Lab 10's check."""
    fn = {"ring": ring_attention, "ulysses": ulysses_attention}[method]
    g = torch.Generator().manual_seed(seed)
    q, k, v, dy = (
        torch.randn(batch, heads, p * shard_len, head_dim, generator=g, dtype=dtype)
        for _ in range(4)
    )
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    y = F.scaled_dot_product_attention(*full, is_causal=True)
    y.backward(dy)
    mine = slice(rank * shard_len, (rank + 1) * shard_len)
    leaves = [t[:, :, mine].clone().requires_grad_() for t in (q, k, v)]
    with SentMessages(forbid=True) as forward:
        out = fn(*leaves)
    with SentMessages(forbid=True) as backward:
        out.backward(dy[:, :, mine])
    errors = {"output": (out - y[:, :, mine]).abs().max().item()}
    for name, a, b in zip(("dq", "dk", "dv"), leaves, full, strict=True):
        errors[name] = (a.grad - b.grad[:, :, mine]).abs().max().item()
    return {"errors": errors, "bytes": (forward.bytes, backward.bytes)}


def _largest(method, p, batch, heads, shard_len, head_dim) -> int:
    """Entries of the largest tensor made in one forward and backward (float32, causal) of
    ``method`` on shards of ``shard_len`` positions; ``"full"``: attention written out
    (``softmax(q k^T / sqrt(d)) v``) on one process over all ``p * shard_len``."""
    length = shard_len if method != "full" else p * shard_len
    q, k, v = (t.requires_grad_() for t in torch.randn(3, batch, heads, length, head_dim).unbind())
    with LargestTensor() as seen:
        if method == "full":
            mask = torch.ones(length, length, dtype=torch.bool).tril()
            scores = (q @ k.transpose(-2, -1) / math.sqrt(head_dim)).masked_fill(~mask, -math.inf)
            out = scores.softmax(-1) @ v
        else:
            out = {"ring": ring_attention, "ulysses": ulysses_attention}[method](q, k, v)
        out.sum().backward()
    return seen.numel


def long_sequence_report(
    rank,
    world_size,
    shard_lengths: Sequence[int],
    dim: int = 48,
    heads: int = 12,
    batch: int = 2,
    seq: int = 24,
    head_dim: int = 4,
) -> dict:
    """Every check of the chapter's long-sequence section, on one world:

    * ``"sequence"``: :func:`_sequence_parallel`, a block of width ``dim`` and ``heads``
      heads on ``batch`` sequences of ``seq`` positions;
    * ``"context"``: ring attention and Ulysses (when the heads divide among the ranks)
      against full causal attention, float64, at the first of ``shard_lengths``;
    * ``"bytes"``: ``{(method, s): (forward, backward)}`` sent by this rank at each shard
      length s, with the formulas' ``"formula"`` beside;
    * ``"largest"``: ``{(method, s): entries}`` of the largest tensor at each shard length,
      ``"full"`` the one-process attention over the whole sequence.

    Every measurement here is this rank's; the page reads rank 0's."""
    methods = ["ring"] + (["ulysses"] if heads % world_size == 0 else [])
    report = {
        "sequence": _sequence_parallel(rank, world_size, dim, heads, batch, seq),
        "context": {
            m: context_check(rank, world_size, m, batch, heads, shard_lengths[0], head_dim)
            for m in methods
        },
        "bytes": {},
        "formula": {},
        "largest": {},
    }
    formulas = {"ring": ring_attention_bytes, "ulysses": ulysses_attention_bytes}
    for s in shard_lengths:
        numel = batch * heads * s * head_dim
        for m in methods:
            run = context_check(rank, world_size, m, batch, heads, s, head_dim, torch.float32)
            report["bytes"][m, s] = run["bytes"]
            report["formula"][m, s] = formulas[m](numel, world_size, torch.float32)
            report["largest"][m, s] = _largest(m, world_size, batch, heads, s, head_dim)
        report["largest"]["full", s] = _largest("full", world_size, batch, heads, s, head_dim)
    return report


# -- DiLoCo ----------------------------------------------------------------------------------


def diloco_report(
    rank,
    world_size,
    steps: int,
    period: int,
    hidden: int = 32,
    batch: int = 32,
    lr: float = 3e-3,
    evals: int = 10,
) -> dict:
    """The digits MLP (``hidden`` units) trained for ``steps`` steps of AdamW (``lr``),
    ``batch`` examples per rank and step, the same examples for every method, by:

    * ``"DDP"``: the gradients all-reduced at every step;
    * ``"local SGD"``: the models averaged every ``period`` steps
      (:class:`~lsdl_lab.distributed.local_sgd.PeriodicAverager`);
    * ``"DiLoCo"``: :class:`~lsdl_lab.distributed.diloco.DiLoCo` every ``period`` steps, at
      the paper's outer step (learning rate 0.7, Nesterov momentum 0.9).

    For each: the training loss of the averaged model on the whole training set (every
    rank evaluates the mean of the ranks' models, which after a last averaging step is
    each rank's own), its test accuracy, the bytes handed to the collectives
    (:class:`~lsdl_lab.distributed.CollectiveBytes`), and ``"curve"``, pairs (bytes so far,
    training loss of the ranks' mean model) at ``evals`` points of the run. For DiLoCo also
    ``"state"``: the entries of its ``state_dict`` (the shared copy and the outer momentum)
    in bytes, and its keys.

    Each trains through :func:`~lsdl_lab.train.fit` (which caps the steps in a dry run,
    :mod:`lsdl_lab.profiles`) with a :class:`SynchronizedStep`: the method's
    communication around AdamW's update, counted."""
    steps = check_int("steps", steps, 1)
    digits = load_digits()
    x, y = digits.train_x, digits.train_y
    n = len(y)

    def batch_of(t):
        g = torch.Generator().manual_seed(t)
        idx = torch.randperm(n, generator=g)[rank * batch : (rank + 1) * batch]
        return x[idx], y[idx]

    def mean_model_loss(net):
        mean = copy.deepcopy(net)
        with torch.no_grad():
            for p in mean.parameters():
                dist.all_reduce(p)
                p /= world_size
            return F.cross_entropy(mean(x), y).item(), mean

    every = max(1, steps // evals)
    out = {}
    for name in ("DDP", "local SGD", "DiLoCo"):
        torch.manual_seed(0)
        net = models.MLP(64, 10, hidden=hidden)
        opt = torch.optim.AdamW(net.parameters(), lr=lr)
        diloco = DiLoCo(net.parameters(), period) if name == "DiLoCo" else None
        if name == "DDP":
            step = SynchronizedStep(before=partial(all_reduce_gradients, list(net.parameters())))
        elif name == "local SGD":
            step = SynchronizedStep(after=PeriodicAverager(net.parameters(), period).after_step)
        else:
            step = SynchronizedStep(after=diloco.after_step)
        curve = []

        def point(done, _history, step=step, curve=curve, net=net):
            if done % every == 0 or done == steps:
                curve.append((step.counter.bytes, mean_model_loss(net)[0]))

        history = fit(
            net, opt, batch_of, steps, step=step, callback=point, progress=False, grad_norm=False
        )
        counter, ran = step.counter, history.train[-1]["step"]
        if ran % every and ran != steps:  # the last step fit ran, in a dry run
            curve.append((counter.bytes, mean_model_loss(net)[0]))
        loss, mean = mean_model_loss(net)
        with torch.no_grad():
            acc = (mean(digits.test_x).argmax(-1) == digits.test_y).double().mean().item()
        out[name] = {
            "loss": loss,
            "accuracy": acc,
            "bytes": counter.bytes,
            "curve": curve,
            "model_bytes": sum(p.numel() * p.element_size() for p in net.parameters()),
        }
        if diloco is not None:
            state = diloco.state_dict()
            tensors = [*state["outer"]] + [
                v
                for s in state["optimizer"]["state"].values()
                for v in s.values()
                if torch.is_tensor(v)
            ]
            out[name]["state"] = {
                "keys": sorted(state),
                "bytes": sum(t.numel() * t.element_size() for t in tensors),
                "rounds": state["rounds"],
            }
    return out
