"""Collectives built by hand from point-to-point messages (``isend``/``irecv`` only).

Each function works in place on the ranks' tensors, like its ``torch.distributed``
counterpart, and must be called by every rank of the group:

* :func:`ring_all_reduce`: the bandwidth-optimal ring (Patarasuk & Yuan 2009; the
  "Baidu ring all-reduce" of Gibiansky 2017): a reduce-scatter then an all-gather around
  the ring, each in p - 1 steps, each step moving 1/p of the data. Cost
  2(p-1) alpha + 2 (p-1)/p n beta: the bandwidth term hardly grows with p.
* :func:`tree_all_reduce`: recursive doubling (Thakur, Rabenseifner & Gropp 2005): in
  log2 p steps, ranks at distance 1, 2, 4, ... swap their whole vectors and add. Cost
  log2(p) (alpha + n beta): fewer steps, so better for small messages, but every step
  moves all n bytes. (Despite the name, not a tree: every rank forms the sum itself; a
  binary tree reduces to a root and broadcasts back.)
* :func:`ring_reduce_scatter` and :func:`ring_all_gather`: the two halves of the ring,
  with the signatures of ``dist.reduce_scatter`` and ``dist.all_gather``.
* :func:`naive_ring_all_reduce_blocking`: what goes wrong with blocking ``send`` then
  ``recv``: every rank waits in ``send`` for a receive that its neighbour never reaches. It
  deadlocks, and ends only because the group has a timeout (see its docstring).

Every rank ends with the same bytes: in the ring each chunk's sum is computed on one
rank and copied to the others; in recursive doubling the two partners compute
``a + b`` and ``b + a``, which floating-point addition makes bit-identical. The sums equal
``dist.all_reduce`` up to the rounding of a different order of addition.

``group`` is a process group (``None``: the whole world); ranks inside the functions are
ranks within that group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .._util import check_tensor

__all__ = [
    "naive_ring_all_reduce_blocking",
    "ring_all_gather",
    "ring_all_reduce",
    "ring_reduce_scatter",
    "tree_all_reduce",
]


# A receive matches only a message with its tag, so the all-gather's receives (tag 1) can be
# posted while the reduce-scatter's messages (tag 0) are still on their way. gloo honours
# tags; NCCL ignores them.
_GATHER_TAG = 1


def _rank_and_size(group) -> tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)


def _contiguous(name: str, tensor) -> torch.Tensor:
    check_tensor(name, tensor)
    if not tensor.is_contiguous():
        raise ValueError(f"Invalid {name}: a non-contiguous tensor (expected a contiguous one)")
    return tensor


def _exchange(send: torch.Tensor, to: int, recv: torch.Tensor, source: int, group) -> None:
    """Send ``send`` to rank ``to`` while receiving ``recv`` from rank ``source``, and wait.

    Both are posted before either is waited on (as one batch, which NCCL needs), so a ring
    of exchanges cannot deadlock. An empty chunk (a tensor smaller than the world) is
    skipped, on both sides alike, since both know the chunk's size.
    """
    ops = []
    if send.numel():
        ops.append(dist.P2POp(dist.isend, send, group=group, group_peer=to))
    if recv.numel():
        ops.append(dist.P2POp(dist.irecv, recv, group=group, group_peer=source))
    for work in dist.batch_isend_irecv(ops) if ops else []:
        work.wait()


def _ring_reduce_scatter(chunks: list[torch.Tensor], group) -> None:
    """Reduce-scatter around the ring, in place on 1-D ``chunks`` (p of them): afterwards
    ``chunks[rank]`` holds the sum over ranks of their ``chunks[rank]``.

    At step s, rank r passes its partial sum of chunk r-s-1 to rank r+1 and adds what
    rank r-1 passes it into chunk r-s-2; after p-1 steps chunk r has all p terms.
    """
    r, p = _rank_and_size(group)
    incoming = chunks[0].new_empty(max(c.numel() for c in chunks))
    for s in range(p - 1):
        send, recv = chunks[(r - s - 1) % p], chunks[(r - s - 2) % p]
        part = incoming[: recv.numel()]
        _exchange(send, (r + 1) % p, part, (r - 1) % p, group)
        recv += part


def _ring_all_gather(chunks: list[torch.Tensor], group) -> None:
    """All-gather around the ring, in place: rank r holds ``chunks[r]``; after p-1 steps,
    in which each rank passes on the chunk it received last, every rank holds all."""
    r, p = _rank_and_size(group)
    for s in range(p - 1):
        _exchange(chunks[(r - s) % p], (r + 1) % p, chunks[(r - s - 1) % p], (r - 1) % p, group)


def _post_all_gather(chunks: list[torch.Tensor], group) -> list:
    """Post every receive of the all-gather at once; return them in step order.

    At step s rank r receives chunk r-s-1 from rank r-1 (``None``: an empty chunk). Posting
    them before the reduce-scatter is safe: the summed chunk can reach rank r only after r
    has passed on its own partial sum of that chunk. On gloo it spares each send of the
    all-gather a hand-off between threads: a send that finds its receive already posted is
    written at once by the sending thread; one that does not waits for the receiver's
    notice and is then written by gloo's event-loop thread.
    """
    r, p = _rank_and_size(group)
    return [
        dist.irecv(c, group=group, group_src=(r - 1) % p, tag=_GATHER_TAG) if c.numel() else None
        for c in (chunks[(r - s - 1) % p] for s in range(p - 1))
    ]


def _ring_all_gather_posted(chunks: list[torch.Tensor], receives: list, group) -> None:
    """The all-gather of :func:`_ring_all_gather` with its receives already posted
    (:func:`_post_all_gather`): at step s rank r sends the chunk it received at step s-1."""
    r, p = _rank_and_size(group)
    sends = []
    for s in range(p - 1):
        if s and receives[s - 1] is not None:
            receives[s - 1].wait()
        chunk = chunks[(r - s) % p]
        if chunk.numel():
            sends.append(dist.isend(chunk, group=group, group_dst=(r + 1) % p, tag=_GATHER_TAG))
    for work in sends + receives[-1:]:
        if work is not None:
            work.wait()


def ring_all_reduce(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Sum ``tensor`` over the ranks, in place, by the ring algorithm; returns ``tensor``.

    The flat tensor is cut into p chunks (as equal as can be; some are empty when it holds
    fewer than p entries). A reduce-scatter leaves on rank r the sum of chunk r; an
    all-gather then copies every summed chunk to every rank (Patarasuk & Yuan 2009). Each
    rank sends 2(p-1) messages of n/p entries: 2(p-1)/p n in all, the least that the
    busiest rank of any all-reduce must send (Patarasuk & Yuan's lower bound), whatever p.
    On gloo the all-gather's
    receives are posted first (:func:`_post_all_gather`); NCCL, which has no tags and needs
    each send paired with its receive in one batch, runs the two phases one after the other.
    """
    _contiguous("tensor", tensor)
    chunks = list(torch.tensor_split(tensor.view(-1), dist.get_world_size(group)))
    if dist.get_backend(group) != dist.Backend.GLOO:
        _ring_reduce_scatter(chunks, group)
        _ring_all_gather(chunks, group)
        return tensor
    receives = _post_all_gather(chunks, group)
    _ring_reduce_scatter(chunks, group)
    _ring_all_gather_posted(chunks, receives, group)
    return tensor


def ring_reduce_scatter(output: torch.Tensor, input_list: list[torch.Tensor], group=None):
    """``output`` on rank r becomes the sum over ranks of their ``input_list[r]``, as
    ``dist.reduce_scatter(output, input_list)``; returns ``output``. ``input_list`` (p
    tensors shaped like ``output``) is left unchanged."""
    r, p = _rank_and_size(group)
    if len(input_list) != p or any(t.shape != output.shape for t in input_list):
        raise ValueError(f"Invalid input_list: expected {p} tensors shaped like output")
    chunks = list(torch.cat([t.reshape(-1) for t in input_list]).split(output.numel()))
    _ring_reduce_scatter(chunks, group)
    return output.copy_(chunks[r].view_as(output))


def ring_all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group=None):
    """``tensor_list[i]`` becomes rank i's ``tensor``, on every rank, as
    ``dist.all_gather(tensor_list, tensor)``; returns ``tensor_list``."""
    r, p = _rank_and_size(group)
    if len(tensor_list) != p or any(t.shape != tensor.shape for t in tensor_list):
        raise ValueError(f"Invalid tensor_list: expected {p} tensors shaped like tensor")
    for i, t in enumerate(tensor_list):
        _contiguous(f"tensor_list[{i}]", t)
    tensor_list[r].copy_(tensor)
    _ring_all_gather(tensor_list, group)
    return tensor_list


def tree_all_reduce(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Sum ``tensor`` over the ranks, in place, by recursive doubling; returns ``tensor``.

    With q = 2^k ranks, step j pairs each rank with the one whose rank differs in bit j;
    the two swap their whole vectors and add, so after k = log2 q steps all hold the sum.
    With p = q + e ranks (q the largest power of two <= p), the first 2e ranks fold in
    first: each even one hands its vector to the odd one above it and waits; the q ranks
    left double; the odd ones hand the sum back (Thakur, Rabenseifner & Gropp 2005, Sec.
    4). Two extra steps for a non-power-of-two world, as MPICH does.
    """
    _contiguous("tensor", tensor)
    r, p = _rank_and_size(group)
    q = 1 << (p.bit_length() - 1)
    e = p - q
    incoming, nothing = torch.empty_like(tensor), tensor[:0]
    if r < 2 * e and r % 2 == 0:  # folded in: hand over, get the sum back at the end
        _exchange(tensor, r + 1, nothing, r + 1, group)
        _exchange(nothing, r + 1, tensor, r + 1, group)
        return tensor
    if r < 2 * e:
        _exchange(nothing, r - 1, incoming, r - 1, group)
        tensor += incoming
    v = r // 2 if r < 2 * e else r - e  # rank among the q that double

    def real(u: int) -> int:
        return 2 * u + 1 if u < e else u + e

    mask = 1
    while mask < q:
        partner = real(v ^ mask)
        _exchange(tensor, partner, incoming, partner, group)
        tensor += incoming  # the partner computes incoming + tensor: the same bits
        mask <<= 1
    if r < 2 * e:
        _exchange(tensor, r - 1, nothing, r - 1, group)
    return tensor


def naive_ring_all_reduce_blocking(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """A ring all-reduce written with blocking ``send`` then ``recv``. IT DEADLOCKS.

    Every rank first sends its vector to the next rank and only then receives from the
    previous one. gloo's ``send`` returns only when the receiver has posted the matching
    ``recv`` (for any size, even one float: measured), and every rank is still in its own
    ``send``: all wait for each other in a circle. No rank ever fails; the group's
    timeout is the only way out: each ``send`` raises ``RuntimeError: ... Timed out
    waiting <timeout>ms for send operation to complete`` when the timeout passes (3.0 s
    measured with ``timeout=3``: the timeout and nothing more). Without a timeout it
    hangs for ever. :func:`ring_all_reduce` posts the send and the receive together.
    """
    _contiguous("tensor", tensor)
    r, p = _rank_and_size(group)
    passing, incoming = tensor.clone(), torch.empty_like(tensor)
    for _ in range(p - 1):
        dist.send(passing, group=group, group_dst=(r + 1) % p)
        dist.recv(incoming, group=group, group_src=(r - 1) % p)
        tensor += incoming
        passing.copy_(incoming)
    return tensor
