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
* :func:`rabenseifner_all_reduce`: a reduce-scatter by recursive halving then an
  all-gather by recursive doubling (Rabenseifner 2004; Thakur, Rabenseifner & Gropp 2005,
  "Optimization of Collective Communication Operations in MPICH"): the ring's bandwidth,
  2 (p-1)/p n beta, in 2 log2 p steps.
* :func:`binary_tree_all_reduce`: reduce up a binomial tree to rank 0, broadcast back
  down: 2 ceil(log2 p) (alpha + n beta).
* :func:`hierarchical_all_reduce`: within nodes of ``local_size`` ranks, then across
  nodes, then within again, on sub-groups (:func:`node_groups`): the slow links between
  nodes carry n/``local_size`` bytes.
* :func:`all_to_all`: ``dist.all_to_all_single`` by pairwise exchange, even or uneven
  blocks: (p-1) alpha + (p-1)/p n beta.
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

import datetime

import torch
import torch.distributed as dist

from .._util import check_int, check_positive, check_tensor

__all__ = [
    "all_to_all",
    "binary_tree_all_reduce",
    "hierarchical_all_reduce",
    "naive_ring_all_reduce_blocking",
    "node_groups",
    "rabenseifner_all_reduce",
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


def _fold_in(flat: torch.Tensor, group) -> int | None:
    """MPICH's way to run a power-of-two algorithm on p = q + e ranks (q the largest power
    of two <= p): of the first 2e ranks, each even one hands its whole vector to the odd
    one above it, which adds it (Thakur, Rabenseifner & Gropp 2005, Sec. 4). Returns this
    rank's index among the q ranks that go on (None for a rank folded in: it waits for
    :func:`_fold_out`); :func:`_doubling_peer` maps an index back to a rank."""
    r, p = _rank_and_size(group)
    e = p - (1 << (p.bit_length() - 1))
    if r >= 2 * e:
        return r - e
    if r % 2 == 0:
        _exchange(flat, r + 1, flat[:0], r + 1, group)
        return None
    incoming = torch.empty_like(flat)
    _exchange(flat[:0], r - 1, incoming, r - 1, group)
    flat += incoming
    return r // 2


def _fold_out(flat: torch.Tensor, group) -> None:
    """The end of :func:`_fold_in`: each odd rank among the first 2e hands the result back
    to the even one below it."""
    r, p = _rank_and_size(group)
    e = p - (1 << (p.bit_length() - 1))
    if r < 2 * e and r % 2 == 0:
        _exchange(flat[:0], r + 1, flat, r + 1, group)
    elif r < 2 * e:
        _exchange(flat, r - 1, flat[:0], r - 1, group)


def _doubling_peer(v: int, group) -> int:
    """The rank of index v among the q ranks left by :func:`_fold_in`."""
    p = dist.get_world_size(group)
    e = p - (1 << (p.bit_length() - 1))
    return 2 * v + 1 if v < e else v + e


def tree_all_reduce(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Sum ``tensor`` over the ranks, in place, by recursive doubling; returns ``tensor``.

    With q = 2^k ranks, step j pairs each rank with the one whose rank differs in bit j;
    the two swap their whole vectors and add, so after k = log2 q steps all hold the sum.
    With p = q + e ranks (q the largest power of two <= p), the first 2e ranks fold in
    first: each even one hands its vector to the odd one above it and waits; the q ranks
    left double; the odd ones hand the sum back (:func:`_fold_in`; Thakur, Rabenseifner &
    Gropp 2005, Sec. 4). Two extra steps for a non-power-of-two world, as MPICH does.
    """
    _contiguous("tensor", tensor)
    flat = tensor.view(-1)
    v = _fold_in(flat, group)
    if v is not None:
        incoming, q = torch.empty_like(flat), 1 << (dist.get_world_size(group).bit_length() - 1)
        mask = 1
        while mask < q:
            partner = _doubling_peer(v ^ mask, group)
            _exchange(flat, partner, incoming, partner, group)
            flat += incoming  # the partner computes incoming + flat: the same bits
            mask <<= 1
    _fold_out(flat, group)
    return tensor


def _blocks(name: str, tensor, split_sizes, p: int) -> list[torch.Tensor]:
    """``tensor`` cut along its first dimension into p blocks of ``split_sizes`` rows (None:
    p equal blocks), as ``dist.all_to_all_single`` cuts it."""
    _contiguous(name, tensor)
    rows = tensor.shape[0] if tensor.dim() else -1
    if split_sizes is None:
        if rows < 0 or rows % p:
            raise ValueError(
                f"Invalid {name}: shape {tuple(tensor.shape)} (expected a first dimension "
                f"divisible by the {p} ranks, or {name}_split_sizes)"
            )
        split_sizes = [rows // p] * p
    sizes = list(split_sizes)
    if len(sizes) != p or any(s < 0 for s in sizes) or sum(sizes) != rows:
        raise ValueError(
            f"Invalid {name}_split_sizes: {sizes} (expected {p} sizes >= 0 adding up to the "
            f"first dimension of {name}, {rows})"
        )
    return list(tensor.split(sizes))


def all_to_all(
    output: torch.Tensor,
    input: torch.Tensor,
    group=None,
    *,
    output_split_sizes: list[int] | None = None,
    input_split_sizes: list[int] | None = None,
) -> torch.Tensor:
    """Block j of rank i's ``input`` becomes block i of rank j's ``output``, as
    ``dist.all_to_all_single(output, input, output_split_sizes, input_split_sizes)``;
    returns ``output``. Blocks are cut along the first dimension: p equal ones, or
    ``*_split_sizes`` rows each (uneven splits, as torch's).

    The pairwise exchange (Thakur, Rabenseifner & Gropp 2005): rank r copies its
    own block, then at step s = 1, ..., p-1 sends block r+s of ``input`` to rank r+s while
    it receives block r-s of ``output`` from rank r-s. Every step pairs every rank with
    one sender and one receiver, so no link carries two messages at once: p-1 steps,
    (p-1)/p of the input on the wire, (p-1) alpha + (p-1)/p n beta
    (:func:`~lsdl_lab.distributed.cost.pairwise_all_to_all_time`).
    """
    if isinstance(group, list | tuple):
        raise TypeError(
            "Invalid group: a list (the split sizes are keyword arguments: "
            "output_split_sizes=..., input_split_sizes=...)"
        )
    r, p = _rank_and_size(group)
    sends = _blocks("input", input, input_split_sizes, p)
    receives = _blocks("output", output, output_split_sizes, p)
    if output.shape[1:] != input.shape[1:] or output.dtype != input.dtype:
        raise ValueError(
            f"Invalid output: {output.dtype} {tuple(output.shape)} (expected input's dtype, "
            f"{input.dtype}, and its shape but for the first dimension, {tuple(input.shape)})"
        )
    if sends[r].shape != receives[r].shape:
        raise ValueError(
            f"Invalid split sizes: rank {r} sends itself {len(sends[r])} rows and expects "
            f"{len(receives[r])} (expected input_split_sizes[{r}] == output_split_sizes[{r}])"
        )
    receives[r].copy_(sends[r])
    for s in range(1, p):
        _exchange(sends[(r + s) % p], (r + s) % p, receives[(r - s) % p], (r - s) % p, group)
    return output


def rabenseifner_all_reduce(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Sum ``tensor`` over the ranks, in place, by Rabenseifner's algorithm; returns it.

    A reduce-scatter by recursive halving, then an all-gather by recursive doubling
    (Rabenseifner 2004; Thakur, Rabenseifner & Gropp 2005). The flat tensor is
    cut into q blocks (q = 2^k ranks); ``window(u, m)`` is the run of m blocks starting
    at block u with its low bits cleared. Halving, m = q/2, ..., 1: rank v sends its
    partner v^m the window the partner keeps, receives its own and adds it: after k
    steps rank v holds the sum of block v. Doubling, m = 1, ..., q/2: v sends its summed
    window to v^m and receives v^m's. 2 log2 q messages, 2 (q-1)/q n bytes: the ring's
    bandwidth in log2 q steps. A world of p = q + e ranks folds e ranks in first and
    hands them the sum at the end (:func:`_fold_in`), as MPICH does: two more steps.
    """
    _contiguous("tensor", tensor)
    flat = tensor.view(-1)
    v = _fold_in(flat, group)
    if v is not None:
        q = 1 << (dist.get_world_size(group).bit_length() - 1)
        size, extra = divmod(flat.numel(), q)  # the q blocks of torch.tensor_split
        start = [u * size + min(u, extra) for u in range(q + 1)]

        def window(u: int, m: int) -> torch.Tensor:
            u &= -m
            return flat[start[u] : start[u + m]]

        incoming, m = flat.new_empty(start[q // 2]), q // 2  # the largest window kept
        while m:  # recursive halving: keep my half of the window, add the partner's part
            peer, mine = _doubling_peer(v ^ m, group), window(v, m)
            _exchange(window(v ^ m, m), peer, incoming[: mine.numel()], peer, group)
            mine += incoming[: mine.numel()]
            m //= 2
        m = 1
        while m < q:  # recursive doubling: swap summed windows
            peer = _doubling_peer(v ^ m, group)
            _exchange(window(v, m), peer, window(v ^ m, m), peer, group)
            m *= 2
    _fold_out(flat, group)
    return tensor


def binary_tree_all_reduce(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Sum ``tensor`` over the ranks, in place, up a tree to rank 0 and back down it;
    returns ``tensor``.

    The tree is the binomial tree of MPICH's reduce and broadcast (Thakur, Rabenseifner &
    Gropp 2005): rank r's parent is r - 2^j, 2^j the lowest set bit of r;
    its children are r + 2^i for each 2^i < 2^j (every 2^i < p for rank 0). Reduce, for
    2^i = 1, 2, 4, ...: receive a child's subtree sum and add it, until r sends its own
    to its parent. Broadcast, the same tree the other way, largest subtree first. Each
    level halves the ranks that hold a partial sum, so each phase takes ceil(log2 p)
    steps of n bytes, and no rank ever handles two messages at once (a heap-ordered binary
    tree, children 2r+1 and 2r+2, has the same depth, but a parent would receive two
    messages per level): 2 ceil(log2 p) (alpha + n beta). Not pipelined: every message is
    the whole vector (NCCL's trees pipeline chunks down a binary tree; Sanders et al. 2009).
    """
    _contiguous("tensor", tensor)
    flat = tensor.view(-1)
    r, p = _rank_and_size(group)
    incoming, nothing, mask = torch.empty_like(flat), flat[:0], 1
    while mask < p and not r & mask:  # reduce: children r + 1, r + 2, r + 4, ...
        if r + mask < p:
            _exchange(nothing, r + mask, incoming, r + mask, group)
            flat += incoming
        mask <<= 1
    if r:  # mask is the lowest set bit of r: up to the parent, and the total back
        _exchange(flat, r - mask, nothing, r - mask, group)
        _exchange(nothing, r - mask, flat, r - mask, group)
    mask >>= 1
    while mask:  # broadcast to the children, largest subtree first
        if r + mask < p:
            _exchange(flat, r + mask, nothing, r + mask, group)
        mask >>= 1
    return tensor


# (parent group, local_size) -> (intra, inter): node_groups makes each pair once
_node_groups: dict = {}


def node_groups(local_size: int, group=None, timeout: float = 60.0) -> tuple:
    """``(intra, inter)``: this rank's node (the ``local_size`` consecutive ranks of
    ``group`` it is among) and the ranks of every node with its local index, as process
    groups; ``None`` for a group of one rank (nothing to send), ``group`` itself for one
    that is all of it. A collective on them raises after ``timeout`` seconds.

    Made with ``dist.new_group`` at the first call for ``(group, local_size)`` and kept.
    ``new_group`` must be called by every rank of the world, for every group in the same
    order: each rank makes the p/L nodes' groups, then the L groups across nodes, and
    keeps its two. So ``group`` must hold the whole world, unless no group is needed
    (``local_size`` 1 or p).
    """
    r, p = _rank_and_size(group)
    local_size = check_int("local_size", local_size, 1, p)
    if p % local_size:
        raise ValueError(
            f"Invalid local_size: {local_size} (expected a divisor of the {p} ranks: nodes "
            "of equal size)"
        )
    parent = dist.group.WORLD if group is None else group
    delta = datetime.timedelta(seconds=check_positive("timeout", timeout))
    if (parent, local_size) in _node_groups:
        return _node_groups[parent, local_size]
    if local_size in (1, p):
        made = (None, parent) if local_size == 1 else (parent, None)
    elif p != dist.get_world_size():
        raise ValueError(
            f"Invalid group: {p} of the world's {dist.get_world_size()} ranks (expected the "
            "whole world: dist.new_group, which makes the nodes, needs every rank of it)"
        )
    else:
        L = local_size
        nodes = [dist.new_group(list(range(k * L, k * L + L)), delta) for k in range(p // L)]
        across = [dist.new_group(list(range(i, p, L)), delta) for i in range(L)]
        made = (nodes[r // L], across[r % L])
    _node_groups[parent, local_size] = made
    return made


def hierarchical_all_reduce(
    tensor: torch.Tensor, local_size: int, group=None, timeout: float = 60.0
) -> torch.Tensor:
    """Sum ``tensor`` over the ranks, in place, in two levels; returns ``tensor``.

    The ranks form nodes of ``local_size`` consecutive ranks (the GPUs of a machine,
    linked faster to each other than to other machines). Three phases, each a ring:
    within each node a reduce-scatter leaves local rank i with its node's sum of chunk i
    (of ``local_size`` chunks); across nodes the ranks of local index i all-reduce chunk
    i (:func:`ring_all_reduce`); within each node an all-gather copies the chunks back.
    The all-reduce over the slow links between nodes is of n/``local_size`` bytes, not n
    (the hierarchical all-reduce of Horovod, Sergeev & Del Balso 2018, and of Jia et al.
    2018). The sub-groups come from :func:`node_groups` (``timeout`` seconds); ``group``'s
    size must be a multiple of ``local_size``.
    """
    _contiguous("tensor", tensor)
    intra, inter = node_groups(local_size, group, timeout)
    chunks = list(torch.tensor_split(tensor.view(-1), local_size))
    if intra is not None:
        _ring_reduce_scatter(chunks, intra)
    if inter is not None:
        ring_all_reduce(chunks[dist.get_rank(group) % local_size], inter)
    if intra is not None:
        _ring_all_gather(chunks, intra)
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
