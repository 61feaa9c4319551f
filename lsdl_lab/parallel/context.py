"""Context parallelism: one sequence split across the ranks of a group, attention exact.

Each of p ranks holds a contiguous shard of s = S/p positions of q, k and v, tensors of
shape ``(batch, heads, s, head_dim)``: rank r holds positions ``[r s, (r + 1) s)``. Every
layer but attention works on its own positions; attention needs every key. Two ways to
bring the keys to the queries, each returning this rank's shard of the exact output of
``softmax(q k^T / sqrt(head_dim)) v`` over the whole sequence (causal or not):

* :func:`ring_attention` (Liu, Zaharia & Abbeel 2023, "Ring Attention with Blockwise
  Transformers"): the queries stay; the key and value blocks travel around the ring of
  ranks, one hop a step, while each rank folds the block it holds into its running
  attention by the online softmax (:func:`online_softmax_step`; Milakov & Gimelshein
  2018, the rescaling of FlashAttention, Dao et al. 2022). p steps, p - 1 of them passing
  on a block of k and v: ``2 (p-1) n`` bytes forward (n: one shard's bytes), the send of
  the next block posted before the current one is computed. Causal: blocks from
  later ranks are skipped, the diagonal block is masked. Backward passes k, v and their
  gradient accumulators around the ring again, recomputing each block's probabilities
  from the saved log-sum-exp: ``2 (p-1) n + 2 p n`` bytes. Memory per rank is O(s): the
  largest tensor is one block's scores, ``batch * heads * s * s`` entries.
* :func:`ulysses_attention` (DeepSpeed-Ulysses, Jacobs et al. 2023): an all-to-all turns
  the sequence shards into head shards (each rank gets every position of heads/p heads),
  each rank runs full attention on its heads
  (``torch.nn.functional.scaled_dot_product_attention``), and an all-to-all turns the
  output back. ``4 (p-1)/p n`` bytes forward (q, k, v out; the output back), the same
  backward (each all-to-all's gradient is the reverse all-to-all). The heads must divide
  among the ranks. Memory is that of the local attention kernel on all S positions:
  O(S heads/p head_dim) with a fused (flash) kernel, ``batch * heads/p * S * S`` scores
  with the math kernel.

Per rank and training step (forward and backward, one dtype), ring attention sends
``(6p - 4) n`` bytes: about 6 N, N = p n the bytes of one whole-sequence tensor, whatever
p; Ulysses ``8 (p-1)/p n = 8 (p-1)/p^2 N``, which falls as 1/p (Jacobs et al. 2023).
Ring attention needs no divisibility and its messages hide behind its block
computations; Ulysses is bounded by p <= heads.

With causal masking and contiguous shards the work is uneven: rank r computes r + 1
blocks, rank 0 one; the blocks that wrap around the ring reach ranks that skip them.
Striped (Brandon et al. 2023) or zigzag sharding balance it; not done here. Written after
zhuzilin's ``ring-flash-attention`` (``ring_flash_attn.py``) and DeepSpeed's
``sequence/layer.py``.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .._util import check_tensor
from ..distributed.collectives import all_to_all
from ..memory.calculator import ring_attention_bytes, ulysses_attention_bytes

# ring_attention_bytes and ulysses_attention_bytes live with the memory calculator's other
# counts of bytes (lsdl_lab.memory.calculator, which layer_traffic reads); re-exported here
__all__ = [
    "online_softmax_step",
    "ring_attention",
    "ring_attention_bytes",
    "ulysses_attention",
    "ulysses_attention_bytes",
]


def online_softmax_step(acc, m, l, q, k, v, mask=None):
    """Fold one block of keys ``k`` and values ``v`` into the running attention of the
    queries ``q``; returns the new ``(acc, m, l)``.

    ``m`` is each query's running maximum score, ``l`` its running sum of
    ``exp(score - m)``, ``acc`` its running sum of ``exp(score - m) v``. With the block's
    scores ``S = q k^T / sqrt(d)``:

    .. math::
        m' = \\max(m, \\max_j S_j), \\quad
        l' = e^{m - m'} l + \\sum_j e^{S_j - m'}, \\quad
        acc' = e^{m - m'} acc + \\sum_j e^{S_j - m'} v_j

    (Milakov & Gimelshein 2018): the old sums, taken under the old maximum, are rescaled
    to the new one. After the last block, ``acc / l`` is the attention output and
    ``m + log l`` the log-sum-exp of each query's scores. Start from ``acc = 0``,
    ``m = -inf``, ``l = 0``. ``mask`` (boolean, broadcast to the scores; True: the key is
    seen, as ``scaled_dot_product_attention``'s ``attn_mask``) hides keys; a query that
    has seen no key yet keeps ``m = -inf`` and zero sums (if it never sees one, ``acc / l``
    is 0/0, where ``scaled_dot_product_attention`` returns 0).
    """
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask is not None:
        s = s.masked_fill(~mask, -math.inf)
    m_new = torch.maximum(m, s.amax(-1))
    shift = m_new.nan_to_num(neginf=0.0)  # a query that has seen no key yet: sums stay 0
    rescale = torch.exp(m - shift)
    p = torch.exp(s - shift.unsqueeze(-1))
    return acc * rescale.unsqueeze(-1) + p @ v, m_new, l * rescale + p.sum(-1)


def _block_grads(q, k, v, do, lse, delta, mask):
    """The gradients of one block of keys and values, from the saved log-sum-exp:
    ``P = exp(S - lse)``, ``dV = P^T dO``, ``dS = P (dO V^T - delta)`` with
    ``delta = rowsum(dO * O)``, ``dQ = dS K / sqrt(d)``, ``dK = dS^T Q / sqrt(d)``
    (FlashAttention's backward pass, Dao et al. 2022, Appendix B)."""
    scale = 1 / math.sqrt(q.shape[-1])
    s = q @ k.transpose(-2, -1) * scale
    if mask is not None:
        s = s.masked_fill(~mask, -math.inf)
    p = torch.exp(s - lse.unsqueeze(-1))
    ds = p * (do @ v.transpose(-2, -1) - delta.unsqueeze(-1))
    return ds @ k * scale, ds.transpose(-2, -1) @ q * scale, p.transpose(-2, -1) @ do


# Backward sends two messages a step to the same rank: k and v (tag 0), and the gradient
# accumulators (tag 1), whose dtype may differ; tags keep gloo from pairing them wrongly.
_GRAD_TAG = 1


def _pass_on(send: torch.Tensor, recv: torch.Tensor, group, tag: int = 0) -> list:
    """Post the send of ``send`` to the next rank of the ring and the receive of ``recv``
    from the previous one, as one batch (which NCCL needs); return the works to wait on."""
    r, p = dist.get_rank(group), dist.get_world_size(group)
    return dist.batch_isend_irecv(
        [
            dist.P2POp(dist.isend, send, group=group, tag=tag, group_peer=(r + 1) % p),
            dist.P2POp(dist.irecv, recv, group=group, tag=tag, group_peer=(r - 1) % p),
        ]
    )


def _wait(works: list) -> None:
    for work in works:
        work.wait()


def _visible(r: int, source: int, s: int, causal: bool, device) -> tuple[bool, torch.Tensor | None]:
    """Whether rank r's queries see any key of rank ``source``'s block, and the mask
    (``None``: all of them). Causal with contiguous shards: all of an earlier rank's, none
    of a later rank's, the lower triangle of its own."""
    if not causal or source < r:
        return True, None
    if source > r:
        return False, None
    return True, torch.ones(s, s, dtype=torch.bool, device=device).tril()


class _RingAttention(torch.autograd.Function):
    """Ring attention forward and backward (see :func:`ring_attention`). Computed in
    float32 at least (16-bit inputs: k and v travel in their dtype, the gradient
    accumulators in float32)."""

    @staticmethod
    def forward(ctx, q, k, v, group, causal):
        r, p = dist.get_rank(group), dist.get_world_size(group)
        work = torch.promote_types(q.dtype, torch.float32)
        qw = q.to(work)
        acc = torch.zeros_like(qw)
        m = qw.new_full(q.shape[:-1], -math.inf)
        l = qw.new_zeros(q.shape[:-1])
        kv = torch.stack((k, v))
        for i in range(p):  # step i: the block of rank r - i
            if i < p - 1:  # the next block travels while this one is computed
                incoming = torch.empty_like(kv)
                works = _pass_on(kv, incoming, group)
            seen, mask = _visible(r, (r - i) % p, q.shape[-2], causal, q.device)
            if seen:
                acc, m, l = online_softmax_step(acc, m, l, qw, kv[0].to(work), kv[1].to(work), mask)
            if i < p - 1:
                _wait(works)
                kv = incoming
        out = acc / l.unsqueeze(-1)
        lse = m + torch.log(l)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.causal = group, causal
        return out.to(q.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do):
        q, k, v, out, lse = ctx.saved_tensors
        group, causal = ctx.group, ctx.causal
        r, p = dist.get_rank(group), dist.get_world_size(group)
        qw, do = q.to(out.dtype), do.to(out.dtype)
        delta = (do * out).sum(-1)
        dq = torch.zeros_like(qw)
        kv = torch.stack((k, v))
        dkv = torch.zeros_like(kv, dtype=out.dtype)  # travels with its block, gathering
        for i in range(p):
            if i < p - 1:
                incoming = torch.empty_like(kv)
                works = _pass_on(kv, incoming, group)
            seen, mask = _visible(r, (r - i) % p, q.shape[-2], causal, q.device)
            if seen:
                kw, vw = kv[0].to(out.dtype), kv[1].to(out.dtype)
                dq_block, dk, dv = _block_grads(qw, kw, vw, do, lse, delta, mask)
                dq += dq_block
                dkv[0] += dk
                dkv[1] += dv
            if p > 1:  # after the last step, block r + 1's gradients go home to rank r + 1
                passed = torch.empty_like(dkv)
                _wait(_pass_on(dkv, passed, group, _GRAD_TAG))
                dkv = passed
            if i < p - 1:
                _wait(works)
                kv = incoming
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None


def _check_shards(q, k, v) -> None:
    check_tensor("q", q, 4)
    for name, t in (("k", k), ("v", v)):
        check_tensor(name, t, 4)
        if t.shape != q.shape or t.dtype != q.dtype or t.device != q.device:
            raise ValueError(
                f"Invalid {name}: {t.dtype} {tuple(t.shape)} on {t.device} (expected q's "
                f"dtype, shape and device: {q.dtype} {tuple(q.shape)} on {q.device})"
            )


def ring_attention(q, k, v, group=None, causal: bool = True) -> torch.Tensor:
    """This rank's shard of ``softmax(q k^T / sqrt(head_dim)) v`` over the whole sequence,
    by ring attention (Liu, Zaharia & Abbeel 2023); differentiable.

    ``q``, ``k``, ``v``: this rank's contiguous shard, shape ``(batch, heads, s,
    head_dim)``, of positions ``[r s, (r + 1) s)``. At step i = 0, ..., p-1 rank r holds
    the key-value block of rank r - i, posts its send to rank r + 1 (and the receive of
    the next from r - 1), and folds the block into its queries' running attention by
    :func:`online_softmax_step`; with ``causal``, blocks of later ranks are skipped and
    its own block is masked to its lower triangle. The backward pass
    (:class:`_RingAttention`) recomputes each block's probabilities from the saved
    log-sum-exp, and sends each block's k, v and gradient accumulators dk, dv around the
    ring again, so that each block's gradient ends, complete, on its rank. Per rank the
    memory is O(s): the shards, a few key-value blocks and one block of scores
    (``batch * heads * s * s``). Bytes: :func:`ring_attention_bytes`.
    """
    _check_shards(q, k, v)
    return _RingAttention.apply(q, k, v, group, bool(causal))


def _sequence_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """``(..., heads, s, d)`` sequence shards (leading dimensions of any number) to
    ``(..., heads/p, p s, d)`` head shards: block j of the heads goes to rank j, and rank
    i's positions come back as block i of the sequence."""
    p = dist.get_world_size(group)
    *lead, h, s, d = x.shape
    blocks = x.reshape(*lead, p, h // p, s, d).movedim(-4, 0).contiguous()
    received = all_to_all(torch.empty_like(blocks), blocks, group)
    return received.movedim(0, -3).reshape(*lead, h // p, p * s, d)


def _heads_to_sequence(y: torch.Tensor, group) -> torch.Tensor:
    """The inverse of :func:`_sequence_to_heads`: ``(..., heads/p, S, d)`` head shards to
    ``(..., heads, S/p, d)`` sequence shards."""
    p = dist.get_world_size(group)
    *lead, h, S, d = y.shape
    blocks = y.reshape(*lead, h, p, S // p, d).movedim(-3, 0).contiguous()
    received = all_to_all(torch.empty_like(blocks), blocks, group)
    return received.movedim(0, -4).reshape(*lead, p * h, S // p, d)


class _SequenceToHeads(torch.autograd.Function):
    """The all-to-all from sequence shards to head shards; its gradient is the reverse
    all-to-all (and that of the reverse, this one)."""

    @staticmethod
    def forward(ctx, x, group, to_heads):
        ctx.group, ctx.to_heads = group, to_heads
        return _sequence_to_heads(x, group) if to_heads else _heads_to_sequence(x, group)

    @staticmethod
    def backward(ctx, dy):
        back = _heads_to_sequence if ctx.to_heads else _sequence_to_heads
        return back(dy.contiguous(), ctx.group), None, None


def ulysses_attention(q, k, v, group=None, causal: bool = True) -> torch.Tensor:
    """This rank's shard of ``softmax(q k^T / sqrt(head_dim)) v`` over the whole sequence,
    by DeepSpeed-Ulysses (Jacobs et al. 2023); differentiable.

    ``q``, ``k``, ``v``: this rank's contiguous sequence shard, ``(batch, heads, s,
    head_dim)``. One all-to-all (q, k and v stacked into one message per peer) gives rank
    r every position of heads ``[r h/p, (r + 1) h/p)``; ``scaled_dot_product_attention``
    runs on them; a second all-to-all returns each rank its positions of every head.
    ``heads`` must be a multiple of the p ranks. Bytes: :func:`ulysses_attention_bytes`.
    """
    _check_shards(q, k, v)
    p = dist.get_world_size(group)
    if q.shape[1] % p:
        raise ValueError(
            f"Invalid heads: {q.shape[1]} (dimension 1 of q, k and v; expected a multiple "
            f"of the {p} ranks: each rank attends over whole heads)"
        )
    qkv = _SequenceToHeads.apply(torch.stack((q, k, v)), group, True)
    y = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], is_causal=bool(causal))
    return _SequenceToHeads.apply(y, group, False)
