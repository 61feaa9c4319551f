"""Tensor parallelism: one layer's weight matrix split across the ranks of a group.

Megatron-LM (Shoeybi et al., 2019, Section 3) splits a Transformer's MLP and attention so
that each needs exactly one all-reduce in the forward pass and one in the backward pass.
Two conjugate operators mark where the ranks' copies meet:

* ``f`` (:class:`CopyToParallel`): identity forward, all-reduce of the gradient backward.
  It enters a parallel region: every rank reads the same input, so the input's gradient is
  the sum of the ranks' partial gradients.
* ``g`` (:class:`ReduceFromParallel`): all-reduce forward, identity backward. It leaves a
  parallel region: the output is the sum of the ranks' partial outputs.

A linear layer ``Y = X A^T + b`` splits two ways (weights stored as ``nn.Linear`` stores
them, ``A`` of shape (out, in)): :class:`ColumnParallelLinear` keeps a block of A's rows
(output features; the output stays split), :class:`RowParallelLinear` a block of A's
columns (input features; the partial outputs are summed by ``g``). Column then row, with
the elementwise nonlinearity between them applied to each rank's block, is the MLP
``f -> column -> GELU -> row -> g``; the attention heads split the same way. Each class
is built from a dense layer (``from_dense``), so a test can compare it with its original.

Written after Megatron-LM's ``core/tensor_parallel`` (``mappings.py``, ``layers.py``) and
picotron's ``tensor_parallel/tensor_parallel.py``; here without their sequence
parallelism, vocabulary-parallel embedding or asynchronous all-reduce, to keep each piece
printable. Dropout is refused: Megatron keeps two random streams (one shared by the
ranks for the replicated regions, one per rank for the split ones), not built here.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .._util import check_int
from ..models import GPT, CausalSelfAttention, TransformerBlock

__all__ = [
    "ColumnParallelLinear",
    "CopyToParallel",
    "ReduceFromParallel",
    "RowParallelLinear",
    "TensorParallelAttention",
    "TensorParallelBlock",
    "TensorParallelMLP",
    "copy_to_parallel",
    "reduce_from_parallel",
    "shard",
    "tensor_parallel_gpt",
]


class CopyToParallel(torch.autograd.Function):
    """Megatron's ``f``: ``y = x`` forward, ``dx = sum over ranks of dy`` backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, dy):
        dy = dy.clone()  # autograd may hand the same buffer to another node
        dist.all_reduce(dy, group=ctx.group)
        return dy, None


class ReduceFromParallel(torch.autograd.Function):
    """Megatron's ``g``: ``y = sum over ranks of x`` forward, ``dx = dy`` backward."""

    @staticmethod
    def forward(ctx, x, group):
        y = x.clone()  # all_reduce is in place; x is saved by the layer that made it
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx, dy):
        return dy, None


def copy_to_parallel(x: torch.Tensor, group=None) -> torch.Tensor:
    """``f(x)``: enter a tensor-parallel region (see :class:`CopyToParallel`)."""
    return CopyToParallel.apply(x, group)


def reduce_from_parallel(x: torch.Tensor, group=None) -> torch.Tensor:
    """``g(x)``: leave a tensor-parallel region (see :class:`ReduceFromParallel`)."""
    return ReduceFromParallel.apply(x, group)


def shard(t: torch.Tensor, dim: int, group=None, parts: int = 1) -> torch.Tensor:
    """This rank's block of ``t`` along ``dim``. With ``parts > 1``, ``t`` is ``parts``
    stacked blocks (attention's q, k and v) and the rank takes its share of each, so that
    q, k and v of the same heads land on the same rank."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    check_int("parts", parts, 1)
    if t.shape[dim] % (parts * size):
        raise ValueError(
            f"Invalid t: size {t.shape[dim]} along dim {dim} (expected a multiple of "
            f"parts * world size = {parts} * {size})"
        )
    return torch.cat([p.chunk(size, dim)[rank] for p in t.chunk(parts, dim)], dim).clone()


class _ShardedLinear(nn.Module):
    """A linear layer's shard: this rank's ``weight`` and ``bias`` (``from_dense`` cuts
    them out of a dense ``nn.Linear``), its all-reduces over ``group``."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, group=None):
        super().__init__()
        self.group = group
        self.weight = nn.Parameter(weight)
        self.bias = None if bias is None else nn.Parameter(bias)


class ColumnParallelLinear(_ShardedLinear):
    """``Y_i = f(X) A_i^T + b_i``: rank i holds rows ``A_i`` of the dense weight (a block of
    output features) and returns its block of ``Y``, without communication forward."""

    @classmethod
    def from_dense(cls, dense: nn.Linear, group=None, parts: int = 1) -> ColumnParallelLinear:
        """This rank's shard of ``dense`` (``parts``: see :func:`shard`)."""
        bias = None if dense.bias is None else shard(dense.bias.detach(), 0, group, parts)
        return cls(shard(dense.weight.detach(), 0, group, parts), bias, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(copy_to_parallel(x, self.group), self.weight, self.bias)


class RowParallelLinear(_ShardedLinear):
    """``Y = g(X_i A_i^T) + b``: rank i holds columns ``A_i`` of the dense weight (a block
    of input features), reads its block ``X_i`` of the input, and the partial products
    are summed by one all-reduce. The bias is whole on every rank, added once after it."""

    @classmethod
    def from_dense(cls, dense: nn.Linear, group=None) -> RowParallelLinear:
        """This rank's shard of ``dense``."""
        bias = None if dense.bias is None else dense.bias.detach().clone()
        return cls(shard(dense.weight.detach(), 1, group), bias, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = reduce_from_parallel(F.linear(x, self.weight), self.group)
        return y if self.bias is None else y + self.bias


class TensorParallelMLP(nn.Sequential):
    """Megatron's MLP (Shoeybi et al., 2019, Figure 3a): ``g(GELU(f(X) A^T) B^T)`` with A
    split by rows (column-parallel) and B by columns (row-parallel): GELU acts on each
    rank's block alone, so one all-reduce forward (``g``) and one backward (``f``). It is
    the book's ``Linear -> GELU -> Linear`` with both linears replaced by their shards."""

    @classmethod
    def from_dense(cls, mlp: nn.Sequential, group=None) -> TensorParallelMLP:
        """From the book's ``TransformerBlock.mlp``."""
        if len(mlp) != 3 or not all(isinstance(mlp[i], nn.Linear) for i in (0, 2)):
            raise TypeError(f"Invalid mlp: {mlp!r} (expected Linear, activation, Linear)")
        column = ColumnParallelLinear.from_dense(mlp[0], group)
        return cls(column, copy.deepcopy(mlp[1]), RowParallelLinear.from_dense(mlp[2], group))


class TensorParallelAttention(nn.Module):
    """Megatron's self-attention (Shoeybi et al., 2019, Figure 3b): the heads are split
    across ranks. The q, k, v projection is column-parallel (each rank computes q, k and v
    of its ``heads / world size`` heads), attention runs per head with no communication,
    and the output projection is row-parallel: one all-reduce forward, one backward."""

    def __init__(self, qkv: ColumnParallelLinear, proj: RowParallelLinear, heads: int):
        super().__init__()
        self.qkv, self.proj, self.heads = qkv, proj, heads

    @classmethod
    def from_dense(cls, attn: CausalSelfAttention, group=None) -> TensorParallelAttention:
        """This rank's heads of the book's :class:`~lsdl_lab.models.CausalSelfAttention`."""
        size = dist.get_world_size(group)
        if attn.heads % size:
            raise ValueError(f"Invalid heads: {attn.heads} (expected a multiple of {size} ranks)")
        if attn.dropout:
            raise ValueError(f"Invalid dropout: {attn.dropout} (expected 0, see module doc)")
        qkv = ColumnParallelLinear.from_dense(attn.qkv, group, parts=3)
        return cls(qkv, RowParallelLinear.from_dense(attn.proj, group), attn.heads // size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=2)
        q, k, v = (t.view(B, T, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))


class TensorParallelBlock(nn.Module):
    """The book's pre-norm :class:`~lsdl_lab.models.TransformerBlock` with tensor-parallel
    attention and MLP: two all-reduces forward and two backward per block (Shoeybi et al.,
    2019, Figure 4). The LayerNorms are replicated; ``f``'s backward all-reduce makes their
    gradients whole, and equal on every rank."""

    def __init__(self, block: TransformerBlock, group=None):
        super().__init__()
        if block.drop.p:
            raise ValueError(f"Invalid dropout: {block.drop.p} (expected 0, see module doc)")
        self.ln1, self.ln2 = copy.deepcopy(block.ln1), copy.deepcopy(block.ln2)
        self.attn = TensorParallelAttention.from_dense(block.attn, group)
        self.mlp = TensorParallelMLP.from_dense(block.mlp, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def tensor_parallel_gpt(gpt: GPT, group=None) -> GPT:
    """A copy of ``gpt`` whose blocks are :class:`TensorParallelBlock` shards of this rank;
    embeddings, final LayerNorm and the tied output layer stay replicated (Megatron also
    splits the vocabulary, not done here). Its logits equal ``gpt``'s on every rank."""
    tp = copy.deepcopy(gpt)  # keeps the tied head and embedding tied
    tp.blocks = nn.Sequential(*[TensorParallelBlock(b, group) for b in gpt.blocks])
    return tp
