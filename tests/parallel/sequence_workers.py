"""Workers for the sequence-parallelism tests (``test_sequence.py``). Each rank builds the
one-process block from the same seed, runs it, tensor parallelism alone and sequence
parallelism on the same input and output gradient, and reports the largest errors, the
collectives called (by name, with the bytes handed to each) and the saved-tensor bytes;
only these small reports travel back."""

import copy
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn.functional as F
from parallel_workers import refusal

from lsdl_lab.distributed import CollectiveBytes
from lsdl_lab.distributed.traffic import COUNTED
from lsdl_lab.memory import SavedTensorBytes
from lsdl_lab.models import TransformerBlock
from lsdl_lab.parallel import (
    TensorParallelBlock,
    all_reduce_sequence_parallel_grads,
    reduce_scatter_to_sequence_parallel,
    shard,
)

DIM, HEADS, B, T = 16, 4, 2, 8
DROPOUT = 0.25


@contextmanager
def named_collectives():
    """Record ``(name, bytes handed)`` for each call of a counted collective (the names
    :class:`CollectiveBytes` sees), to convert each kind to its ring traffic."""
    calls, originals = [], {name: getattr(dist, name) for name in COUNTED}

    def recording(name, fn):
        def call(*args, **kwargs):
            tensor = args[1] if name != "all_reduce" and name != "broadcast" else args[0]
            calls.append((name, tensor.numel() * tensor.element_size()))
            return fn(*args, **kwargs)

        return call

    for name, fn in originals.items():
        setattr(dist, name, recording(name, fn))
    try:
        yield calls
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def _error(a, b):
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


def _gather_sequence(y):
    """The ranks' (B, T/p, d) blocks as the whole (B, T, d), outside any counter."""
    blocks = [torch.empty_like(y) for _ in range(dist.get_world_size())]
    dist.all_gather(blocks, y.contiguous())
    return torch.cat(blocks, dim=1)


def _step(module, x, dy):
    """Forward and backward of ``module`` on a leaf copy of ``x``: output, input gradient,
    and per pass the collectives called and the bytes :class:`CollectiveBytes` counted."""
    x = x.clone().requires_grad_(True)
    with CollectiveBytes() as forward, named_collectives() as forward_calls:
        y = module(x)
    with CollectiveBytes() as backward, named_collectives() as backward_calls:
        y.backward(dy)
    return {
        "y": y.detach(),
        "dx": x.grad,
        "calls": {"forward": forward_calls, "backward": backward_calls},
        "bytes": {"forward": forward.bytes, "backward": backward.bytes},
    }


def _saved_peak(module, x, dy):
    """The most bytes autograd holds for backward in one forward and backward pass."""
    module = copy.deepcopy(module)
    x = x.clone().requires_grad_(True)
    with SavedTensorBytes(exclude=module) as saved:
        module(x).backward(dy)
    return saved.peak


def _masked_block(block, x, masks):
    """The one-process block with its two dropouts replaced by the given (B, T, d) masks:
    ``x + attn(LN1(x)) * M1``, then ``+ mlp(LN2(.)) * M2``."""
    x = x + block.attn(block.ln1(x)) * masks[0]
    return x + block.mlp(block.ln2(x)) * masks[1]


def _rank_masks(seed, rank, world_size):
    """The two masks rank ``r`` draws after ``manual_seed(seed + r)``, for every r, joined
    along the sequence (what the sequence-parallel dropouts drew on their positions)."""
    masks = [[], []]
    for r in range(world_size):
        torch.manual_seed(seed + r)
        for m in masks:
            ones = torch.ones(B, T // world_size, DIM, dtype=torch.float64)
            m.append(F.dropout(ones, DROPOUT, training=True))
    return [torch.cat(m, dim=1) for m in masks]


def sequence_parallel_report(rank, world_size):
    """Sequence parallelism against tensor parallelism alone and the one-process block,
    float64, forward and backward; its collectives, bytes and saved activations."""
    torch.manual_seed(0)
    block = TransformerBlock(DIM, HEADS, 0.0).double()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(B, T, DIM, generator=gen, dtype=torch.float64)
    dy = torch.randn(B, T, DIM, generator=gen, dtype=torch.float64)
    ours = lambda t: shard(t, 1)  # noqa: E731  this rank's positions
    report = {}

    dense_x = x.clone().requires_grad_(True)
    dense_y = block(dense_x)
    dense_y.backward(dy)
    dense_grads = {n: p.grad for n, p in block.named_parameters()}

    tp = TensorParallelBlock(block)
    sp = TensorParallelBlock(block, sequence_parallel=True)
    report["memory"] = {"tp": _saved_peak(tp, x, dy), "sp": _saved_peak(sp, ours(x), ours(dy))}
    tp_run, sp_run = _step(tp, x, dy), _step(sp, ours(x), ours(dy))
    report["calls"] = {"tp": tp_run["calls"], "sp": sp_run["calls"]}
    report["bytes"] = {"tp": tp_run["bytes"], "sp": sp_run["bytes"]}
    tp_grads = {n: p.grad.clone() for n, p in tp.named_parameters()}

    # the sharded weights' gradients are whole already; the LayerNorms' and the row biases'
    # hold this rank's positions only until all_reduce_sequence_parallel_grads sums them
    partial = {n for n, p in sp.named_parameters() if any(p is q for q in sp.partial_parameters())}
    before = {n: _error(p.grad, tp_grads[n]) for n, p in sp.named_parameters() if n in partial}
    with CollectiveBytes() as summed, named_collectives() as summed_calls:
        all_reduce_sequence_parallel_grads(sp)
    report["partial"] = {
        "names": sorted(partial),
        "error before the sum": before,
        "bytes": summed.bytes,
        "calls": summed_calls,
        "entries": sum(p.numel() for p in sp.partial_parameters()),
    }

    slices = {
        "attn.qkv.weight": lambda g: shard(g, 0, parts=3),
        "attn.qkv.bias": lambda g: shard(g, 0, parts=3),
        "attn.proj.weight": lambda g: shard(g, -1),
        "mlp.0.weight": lambda g: shard(g, 0),
        "mlp.0.bias": lambda g: shard(g, 0),
        "mlp.2.weight": lambda g: shard(g, -1),
    }
    cut = {n: slices.get(n, lambda g: g)(g) for n, g in dense_grads.items()}
    sp_y = _gather_sequence(sp_run["y"])
    report["errors"] = {
        "tp": {
            "output": _error(tp_run["y"], dense_y),
            "input_grad": _error(tp_run["dx"], dense_x.grad),
            **{f"grad {n}": _error(g, cut[n]) for n, g in tp_grads.items()},
        },
        "sp": {
            "output (own positions)": _error(sp_run["y"], ours(dense_y)),
            "output (gathered)": _error(sp_y, dense_y),
            "output (gathered) against tp": _error(sp_y, tp_run["y"]),
            "input_grad": _error(sp_run["dx"], ours(dense_x.grad)),
            "input_grad against tp": _error(sp_run["dx"], ours(tp_run["dx"])),
            **{f"grad {n}": _error(p.grad, cut[n]) for n, p in sp.named_parameters()},
            **{
                f"grad {n} against tp": _error(p.grad, tp_grads[n])
                for n, p in sp.named_parameters()
            },
        },
    }
    report["shapes"] = {n: tuple(p.shape) for n, p in sp.named_parameters()}

    # dropout on this rank's positions, drawn from a generator seeded per rank
    torch.manual_seed(0)
    dropped = TransformerBlock(DIM, HEADS, DROPOUT).double()
    dropped.attn.dropout = 0.0  # attention's dropout is refused (module doc)
    sp_dropped = TensorParallelBlock(dropped, sequence_parallel=True)
    torch.manual_seed(100 + rank)
    run = _step(sp_dropped, ours(x), ours(dy))
    all_reduce_sequence_parallel_grads(sp_dropped)
    masks = _rank_masks(100, rank, world_size)
    ref_x = x.clone().requires_grad_(True)
    ref_y = _masked_block(dropped, ref_x, masks)
    ref_y.backward(dy)
    grads = {n: slices.get(n, lambda g: g)(p.grad) for n, p in dropped.named_parameters()}
    report["dropout"] = {
        "errors": {
            "output": _error(run["y"], ours(ref_y)),
            "input_grad": _error(run["dx"], ours(ref_x.grad)),
            **{f"grad {n}": _error(p.grad, grads[n]) for n, p in sp_dropped.named_parameters()},
        },
        "dropped fraction": (masks[0] == 0).double().mean().item(),
        "effect": _error(run["y"], _step(sp, ours(x), ours(dy))["y"]),
    }
    sp_eval = copy.deepcopy(sp_dropped).eval()
    dense_eval = copy.deepcopy(dropped).eval()
    report["dropout"]["masks held"] = {
        "sp": _saved_peak(sp_dropped, ours(x), ours(dy)) - _saved_peak(sp_eval, ours(x), ours(dy)),
        "dense": _saved_peak(dropped, x, dy) - _saved_peak(dense_eval, x, dy),
    }

    report["refusals"] = {
        "sequence": refusal(reduce_scatter_to_sequence_parallel, torch.ones(B, T + 1, DIM)),
        "flag": refusal(TensorParallelBlock, block, sequence_parallel=1),
        "tp dropout": refusal(TensorParallelBlock, dropped),
        "attention dropout": refusal(
            TensorParallelBlock, TransformerBlock(DIM, HEADS, DROPOUT), sequence_parallel=True
        ),
    }
    return report
