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

**Sequence parallelism** (Korthikanti et al., 2022, Section 4.2.2). Between the
parallel regions, tensor parallelism leaves every rank with the whole ``(B, T, d)``
activation: the LayerNorms and the dropouts compute the same thing p times and keep p
copies of their inputs. These are independent along the sequence, so sequence
parallelism gives rank r the r-th block of ``T/p`` positions there, and the all-reduce
``g`` splits into its two halves, ``all-reduce = all-gather o reduce-scatter``. (The
paper calls tensor parallelism's ``f`` and ``g`` "f" and "f-bar", and the new operators
"g" and "g-bar"; here ``g`` keeps Shoeybi et al.'s meaning.)

* :class:`GatherFromSequenceParallel` (the paper's ``g``): all-gather along the sequence
  forward, reduce-scatter backward. It enters a parallel region in place of ``f``: the
  column-parallel layer needs every position; its input's gradient, partial on each rank,
  is summed *and* cut back to the rank's positions in one reduce-scatter.
* :class:`ReduceScatterToSequenceParallel` (the paper's ``g-bar``): reduce-scatter
  forward, all-gather backward. It leaves a parallel region in place of ``g``: the partial
  outputs of the row-parallel layer are summed and each rank keeps its positions.

A ring all-gather and a ring reduce-scatter of an n-entry tensor each move
``(p - 1) / p * n`` entries through a rank's link, the ring all-reduce twice that: the
same bytes as tensor parallelism, with the LayerNorm and dropout activations cut to 1/p.
The parameters that then see only the rank's positions (the LayerNorms' and the row-
parallel biases) get partial gradients, summed by
:func:`all_reduce_sequence_parallel_grads` as Megatron sums them after the backward pass.

Written after Megatron-LM's ``core/tensor_parallel`` (``mappings.py``, ``layers.py``) and
picotron's ``tensor_parallel/tensor_parallel.py``; here without their vocabulary-parallel
embedding, asynchronous all-reduce, or the column layer that keeps only its input's shard
and gathers it again in the backward pass, to keep each piece printable. Dropout in tensor
parallelism alone is refused: Megatron keeps two random streams (one shared by the ranks
for the replicated regions, one per rank for the split ones), not built here. Sequence
parallelism needs only the per-rank one for the block's dropouts (each rank drops its own
positions): it draws from the rank's default generator, which the ranks must seed
differently. Attention's dropout (on the split heads) is refused in both.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .._util import all_gather_single, check_bool, check_int, reduce_scatter_single
from ..models import GPT, CausalSelfAttention, TransformerBlock

__all__ = [
    "ColumnParallelLinear",
    "CopyToParallel",
    "GatherFromSequenceParallel",
    "ReduceFromParallel",
    "ReduceScatterToSequenceParallel",
    "RowParallelLinear",
    "TensorParallelAttention",
    "TensorParallelBlock",
    "TensorParallelMLP",
    "all_reduce_sequence_parallel_grads",
    "copy_to_parallel",
    "gather_from_sequence_parallel",
    "reduce_from_parallel",
    "reduce_scatter_to_sequence_parallel",
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


# -- sequence parallelism's g and g-bar: the sequence is dim 1 of the book's (B, T, d) ------


def _all_gather_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """(B, T/p, ...) on each rank -> (B, T, ...), the ranks' blocks in rank order."""
    p = dist.get_world_size(group)
    gathered = x.new_empty((p * x.shape[0], *x.shape[1:]))  # the flat gather stacks dim 0
    all_gather_single(gathered, x.contiguous(), group=group)
    return torch.cat(gathered.chunk(p), dim=1)


def _reduce_scatter_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """(B, T, ...) partial on each rank -> rank r's (B, T/p, ...) block of the sum."""
    p = dist.get_world_size(group)
    if x.dim() < 2 or x.shape[1] % p:
        raise ValueError(
            f"Invalid x: shape {tuple(x.shape)} (expected a sequence length, dim 1, that is "
            f"a multiple of the world size {p})"
        )
    blocks = torch.cat(x.chunk(p, dim=1))  # block r of the sequence at rows r*B ... (r+1)*B
    out = x.new_empty((x.shape[0], x.shape[1] // p, *x.shape[2:]))
    reduce_scatter_single(out, blocks, group=group)
    return out


class GatherFromSequenceParallel(torch.autograd.Function):
    """Korthikanti's ``g``: ``y = [x_0, ..., x_{p-1}]`` (all-gather along the sequence)
    forward, ``dx_r = (sum over ranks of dy)_r`` (reduce-scatter) backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather_sequence(x, group)

    @staticmethod
    def backward(ctx, dy):
        return _reduce_scatter_sequence(dy, ctx.group), None


class ReduceScatterToSequenceParallel(torch.autograd.Function):
    """Korthikanti's ``g-bar``: ``y_r = (sum over ranks of x)_r`` (reduce-scatter) forward,
    ``dx = [dy_0, ..., dy_{p-1}]`` (all-gather along the sequence) backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_sequence(x, group)

    @staticmethod
    def backward(ctx, dy):
        return _all_gather_sequence(dy, ctx.group), None


def gather_from_sequence_parallel(x: torch.Tensor, group=None) -> torch.Tensor:
    """Korthikanti's ``g(x)``: this rank's ``(B, T/p, ...)`` positions in, all
    ``(B, T, ...)`` out (see :class:`GatherFromSequenceParallel`)."""
    return GatherFromSequenceParallel.apply(x, group)


def reduce_scatter_to_sequence_parallel(x: torch.Tensor, group=None) -> torch.Tensor:
    """Korthikanti's ``g-bar(x)``: partial ``(B, T, ...)`` in, this rank's
    ``(B, T/p, ...)`` block of the sum out; ``T`` must be a multiple of p (see
    :class:`ReduceScatterToSequenceParallel`)."""
    return ReduceScatterToSequenceParallel.apply(x, group)


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
    them out of a dense ``nn.Linear``), its all-reduces over ``group``; with
    ``sequence_parallel`` its input or output is the rank's block of the sequence, and
    an all-gather or a reduce-scatter along the sequence takes the place of ``f`` or ``g``."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        group=None,
        sequence_parallel: bool = False,
    ):
        super().__init__()
        self.group = group
        self.sequence_parallel = check_bool("sequence_parallel", sequence_parallel)
        self.weight = nn.Parameter(weight)
        self.bias = None if bias is None else nn.Parameter(bias)


class ColumnParallelLinear(_ShardedLinear):
    """``Y_i = f(X) A_i^T + b_i``: rank i holds rows ``A_i`` of the dense weight (a block of
    output features) and returns its block of ``Y``, without communication forward. With
    ``sequence_parallel``, ``Y_i = all-gather(X_r) A_i^T + b_i``: X arrives as the rank's positions
    and is all-gathered."""

    @classmethod
    def from_dense(
        cls, dense: nn.Linear, group=None, parts: int = 1, sequence_parallel: bool = False
    ) -> ColumnParallelLinear:
        """This rank's shard of ``dense`` (``parts``: see :func:`shard`)."""
        bias = None if dense.bias is None else shard(dense.bias.detach(), 0, group, parts)
        weight = shard(dense.weight.detach(), 0, group, parts)
        return cls(weight, bias, group, sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        enter = gather_from_sequence_parallel if self.sequence_parallel else copy_to_parallel
        return F.linear(enter(x, self.group), self.weight, self.bias)


class RowParallelLinear(_ShardedLinear):
    """``Y = g(X_i A_i^T) + b``: rank i holds columns ``A_i`` of the dense weight (a block
    of input features), reads its block ``X_i`` of the input, and the partial products
    are summed by one all-reduce. The bias is whole on every rank, added once after it.
    With ``sequence_parallel``, ``Y_r = reduce-scatter(X_i A_i^T) + b``: each rank keeps
    its positions of the sum and adds the bias to them (so the bias's gradient is partial:
    see :func:`all_reduce_sequence_parallel_grads`)."""

    @classmethod
    def from_dense(
        cls, dense: nn.Linear, group=None, sequence_parallel: bool = False
    ) -> RowParallelLinear:
        """This rank's shard of ``dense``."""
        bias = None if dense.bias is None else dense.bias.detach().clone()
        return cls(shard(dense.weight.detach(), 1, group), bias, group, sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        leave = (
            reduce_scatter_to_sequence_parallel if self.sequence_parallel else reduce_from_parallel
        )
        y = leave(F.linear(x, self.weight), self.group)
        return y if self.bias is None else y + self.bias


class TensorParallelMLP(nn.Sequential):
    """Megatron's MLP (Shoeybi et al., 2019, Figure 3a): ``g(GELU(f(X) A^T) B^T)`` with A
    split by rows (column-parallel) and B by columns (row-parallel): GELU acts on each
    rank's block alone, so one all-reduce forward (``g``) and one backward (``f``). It is
    the book's ``Linear -> GELU -> Linear`` with both linears replaced by their shards."""

    @classmethod
    def from_dense(
        cls, mlp: nn.Sequential, group=None, sequence_parallel: bool = False
    ) -> TensorParallelMLP:
        """From the book's ``TransformerBlock.mlp``."""
        if len(mlp) != 3 or not all(isinstance(mlp[i], nn.Linear) for i in (0, 2)):
            raise TypeError(f"Invalid mlp: {mlp!r} (expected Linear, activation, Linear)")
        column = ColumnParallelLinear.from_dense(mlp[0], group, sequence_parallel=sequence_parallel)
        row = RowParallelLinear.from_dense(mlp[2], group, sequence_parallel)
        return cls(column, copy.deepcopy(mlp[1]), row)


class TensorParallelAttention(nn.Module):
    """Megatron's self-attention (Shoeybi et al., 2019, Figure 3b): the heads are split
    across ranks. The q, k, v projection is column-parallel (each rank computes q, k and v
    of its ``heads / world size`` heads), attention runs per head with no communication,
    and the output projection is row-parallel: one all-reduce forward, one backward."""

    def __init__(self, qkv: ColumnParallelLinear, proj: RowParallelLinear, heads: int):
        super().__init__()
        self.qkv, self.proj, self.heads = qkv, proj, heads

    @classmethod
    def from_dense(
        cls, attn: CausalSelfAttention, group=None, sequence_parallel: bool = False
    ) -> TensorParallelAttention:
        """This rank's heads of the book's :class:`~lsdl_lab.models.CausalSelfAttention`
        (with ``sequence_parallel``, reading and returning the rank's positions)."""
        size = dist.get_world_size(group)
        if attn.heads % size:
            raise ValueError(f"Invalid heads: {attn.heads} (expected a multiple of {size} ranks)")
        if attn.dropout:
            raise ValueError(f"Invalid dropout: {attn.dropout} (expected 0, see module doc)")
        qkv = ColumnParallelLinear.from_dense(attn.qkv, group, 3, sequence_parallel)
        proj = RowParallelLinear.from_dense(attn.proj, group, sequence_parallel)
        return cls(qkv, proj, attn.heads // size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)  # all T positions, also where x holds this rank's T/p
        B, T, _ = qkv.shape
        q, k, v = qkv.chunk(3, dim=2)
        q, k, v = (t.view(B, T, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))


class TensorParallelBlock(nn.Module):
    """The book's pre-norm :class:`~lsdl_lab.models.TransformerBlock` with tensor-parallel
    attention and MLP: two all-reduces forward and two backward per block (Shoeybi et al.,
    2019, Figure 4). The LayerNorms are replicated; ``f``'s backward all-reduce makes their
    gradients whole, and equal on every rank.

    With ``sequence_parallel`` (Korthikanti et al., 2022, Section 4.2.2) the block reads and
    returns this rank's ``(B, T/p, d)`` block of the sequence; the LayerNorms, the dropouts
    and the residual additions act on it alone, and each all-reduce becomes a
    reduce-scatter and an all-gather (a reduce-scatter after attention's and the MLP's
    row-parallel layer, an all-gather before the next column-parallel one). The gradients of
    :meth:`partial_parameters` are then partial: :func:`all_reduce_sequence_parallel_grads`
    sums them."""

    def __init__(self, block: TransformerBlock, group=None, sequence_parallel: bool = False):
        super().__init__()
        self.group = group
        self.sequence_parallel = check_bool("sequence_parallel", sequence_parallel)
        if block.drop.p and not sequence_parallel:
            raise ValueError(f"Invalid dropout: {block.drop.p} (expected 0, see module doc)")
        self.ln1, self.ln2 = copy.deepcopy(block.ln1), copy.deepcopy(block.ln2)
        self.attn = TensorParallelAttention.from_dense(block.attn, group, sequence_parallel)
        self.mlp = TensorParallelMLP.from_dense(block.mlp, group, sequence_parallel)
        self.drop = copy.deepcopy(block.drop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.mlp(self.ln2(x)))

    def partial_parameters(self) -> list[nn.Parameter]:
        """The parameters that act on each position alone after the parallel regions (the
        LayerNorms', the row-parallel biases): with ``sequence_parallel`` each rank's
        gradient holds only its positions' share; without it, none."""
        if not self.sequence_parallel:
            return []
        rows = (self.attn.proj, self.mlp[2])
        return [*self.ln1.parameters(), *self.ln2.parameters()] + [
            r.bias for r in rows if r.bias is not None
        ]


def all_reduce_sequence_parallel_grads(module: nn.Module) -> None:
    """Sum over each sequence-parallel block's group the gradients of its
    :meth:`~TensorParallelBlock.partial_parameters`, in place, one all-reduce per block:
    after the backward pass and before the optimizer step (Megatron's
    ``_allreduce_layernorm_grads``). Then every rank holds the whole gradient, that of
    tensor parallelism alone."""
    for block in module.modules():
        if isinstance(block, TensorParallelBlock):
            grads = [p.grad for p in block.partial_parameters() if p.grad is not None]
            if grads:
                flat = torch.cat([g.reshape(-1) for g in grads])
                dist.all_reduce(flat, group=block.group)
                for g, total in zip(grads, flat.split([g.numel() for g in grads])):
                    g.copy_(total.view_as(g))


def tensor_parallel_gpt(gpt: GPT, group=None) -> GPT:
    """A copy of ``gpt`` whose blocks are :class:`TensorParallelBlock` shards of this rank;
    embeddings, final LayerNorm and the tied output layer stay replicated (Megatron also
    splits the vocabulary, not done here). Its logits equal ``gpt``'s on every rank."""
    tp = copy.deepcopy(gpt)  # keeps the tied head and embedding tied
    tp.blocks = nn.Sequential(*[TensorParallelBlock(b, group) for b in gpt.blocks])
    return tp
