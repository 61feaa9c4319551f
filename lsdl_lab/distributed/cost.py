"""The alpha-beta cost model of collectives: predict, measure, fit.

Sending a message of n bytes between two processes takes alpha + n beta seconds
(Hockney 1994): alpha is the latency of a message, beta the inverse of the link's
bandwidth. An algorithm that runs in steps costs the sum of its steps' messages; for an
all-reduce of n bytes over p ranks (Thakur, Rabenseifner & Gropp 2005; Chan et al. 2007):

=============================  ===================================================
ring (reduce-scatter, gather)  2(p-1) alpha + 2 (p-1)/p n beta
recursive doubling ("tree")    log2 p (alpha + n beta) (p a power of two; else
                               two more steps: :func:`tree_all_reduce_time`)
Rabenseifner (halving,         2 log2 p alpha + 2 (p-1)/p n beta (p a power of
doubling)                      two; else two more steps)
binary (binomial) tree         2 ceil(log2 p) (alpha + n beta)
hierarchical, nodes of L       2(L-1) alpha + 2 (L-1)/L n beta within nodes, plus a
                               ring of n/L bytes over the N = p/L nodes' links
parameter server               2(p-1) (alpha + n beta)
=============================  ===================================================

and for an all-to-all, n the bytes of a rank's whole input: (p-1) alpha + (p-1)/p n beta
by pairwise exchange, (p-1) alpha + (p-1)/2 n beta by store-and-forward around a ring.

The ring sends the fewest bytes (its bandwidth term stays below 2 n beta for any p), the
tree the fewest messages (its latency term grows as log p, the ring's as p): the tree wins
for small messages, the ring for large ones, at the size :func:`crossover_nbytes` gives.
Rabenseifner's takes the ring's bandwidth term in the tree's number of steps: at a power
of two the ring never overtakes it. The parameter server's link carries every
push and every pull, so its time grows linearly with p in both terms.

Each model is a function ``time(nbytes, p, alpha, beta)`` (the hierarchical one with the
node size bound by ``functools.partial``), linear in alpha and beta, so
:func:`fit_alpha_beta` recovers alpha and beta from times measured on the machine at hand
(:func:`measure_collective`) by least squares, and the fit can then predict sizes it was
not fitted on.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .._util import check_choice, check_int, check_nonnegative, check_positive

__all__ = [
    "AlphaBeta",
    "binary_tree_all_reduce_time",
    "crossover_nbytes",
    "fit_alpha_beta",
    "hierarchical_all_reduce_time",
    "measure_collective",
    "pairwise_all_to_all_time",
    "parameter_server_all_reduce_time",
    "rabenseifner_all_reduce_time",
    "ring_all_reduce_time",
    "ring_all_to_all_time",
    "tree_all_reduce_time",
]


def ring_all_reduce_time(nbytes: float, p: int, alpha: float, beta: float) -> float:
    """Ring all-reduce (Patarasuk & Yuan 2009): p-1 reduce-scatter steps then p-1
    all-gather steps, each sending n/p bytes."""
    return 2 * (p - 1) * alpha + 2 * (p - 1) / p * nbytes * beta


def tree_all_reduce_time(nbytes: float, p: int, alpha: float, beta: float) -> float:
    """Recursive doubling as :func:`~lsdl_lab.distributed.tree_all_reduce` runs it: log2 q steps
    of n bytes for the largest power of two q <= p, plus one step to fold the extra ranks
    in and one to hand them the sum when p is not a power of two (Thakur et al. 2005)."""
    q = 1 << (p.bit_length() - 1)
    steps = int(math.log2(q)) + (2 if p != q else 0)
    return steps * (alpha + nbytes * beta)


def parameter_server_all_reduce_time(nbytes: float, p: int, alpha: float, beta: float) -> float:
    """All-reduce through a parameter server: one of the p ranks is the server; the other
    p-1 push their n bytes to it, then pull the n-byte sum back. Every message crosses the
    server's link, one after another, so the time is that link's: 2(p-1)(alpha + n beta)
    (the model of Li et al. 2014's server bottleneck; a sharded server divides it)."""
    return 2 * (p - 1) * (alpha + nbytes * beta)


def rabenseifner_all_reduce_time(nbytes: float, p: int, alpha: float, beta: float) -> float:
    """Rabenseifner's all-reduce as
    :func:`~lsdl_lab.distributed.collectives.rabenseifner_all_reduce` runs it: log2 q
    halving steps of n/2, n/4, ..., n/q bytes, then as many doubling steps of the same
    sizes, for the largest power of two q <= p: 2 log2 q alpha + 2 (q-1)/q n beta; two
    more steps of n bytes (fold in, hand back) when p is not a power of two (Rabenseifner
    2004; Thakur, Rabenseifner & Gropp 2005): the ring's bandwidth term in log2 q
    steps instead of 2(p-1). The additions (a gamma term, (q-1)/q n bytes summed per rank
    at a power of two, as many as the ring sums) are left out, as from every model here:
    at a power of two they do not move the crossover with the ring."""
    q = 1 << (p.bit_length() - 1)
    extra = 2 * (alpha + nbytes * beta) if p != q else 0.0
    return 2 * math.log2(q) * alpha + 2 * (q - 1) / q * nbytes * beta + extra


def binary_tree_all_reduce_time(nbytes: float, p: int, alpha: float, beta: float) -> float:
    """Reduce up a binomial tree to rank 0, then broadcast down it, as
    :func:`~lsdl_lab.distributed.collectives.binary_tree_all_reduce` runs it: each phase
    ceil(log2 p) steps of the whole n bytes: 2 ceil(log2 p) (alpha + n beta) (Thakur,
    Rabenseifner & Gropp 2005). Twice recursive doubling's time, and every
    step moves all n bytes: it never beats the ring at large n."""
    return 2 * (p - 1).bit_length() * (alpha + nbytes * beta)


def hierarchical_all_reduce_time(
    nbytes: float,
    p: int,
    alpha: float,
    beta: float,
    local_size: int,
    alpha_inter: float | None = None,
    beta_inter: float | None = None,
) -> float:
    """The two-level all-reduce of
    :func:`~lsdl_lab.distributed.collectives.hierarchical_all_reduce` on p ranks in nodes of
    L = ``local_size``, N = p/L nodes: a ring reduce-scatter and a ring all-gather within
    the node over links (alpha, beta), and a ring all-reduce of n/L bytes across nodes over
    links (``alpha_inter``, ``beta_inter``; default the same):

    2(L-1) alpha + 2 (L-1)/L n beta + 2(N-1) alpha_inter + 2 (N-1)/N (n/L) beta_inter.

    A flat ring whose ring crosses the slow links pays 2 (p-1)/p n beta_inter: the
    hierarchy sends L times fewer bytes over them (and 2(N-1) slow messages, not 2(p-1)).
    Linear in (alpha, beta) when the inter-node link is left to default, so
    ``functools.partial(hierarchical_all_reduce_time, local_size=L)`` can be fitted.
    """
    if p % check_int("local_size", local_size, 1, p):
        raise ValueError(f"Invalid local_size: {local_size} (expected a divisor of p = {p})")
    a2 = alpha if alpha_inter is None else alpha_inter
    b2 = beta if beta_inter is None else beta_inter
    nodes = p // local_size
    intra = ring_all_reduce_time(nbytes, local_size, alpha, beta)  # reduce-scatter + gather
    return intra + ring_all_reduce_time(nbytes / local_size, nodes, a2, b2)


def pairwise_all_to_all_time(nbytes: float, p: int, alpha: float, beta: float) -> float:
    """All-to-all by pairwise exchange, as :func:`~lsdl_lab.distributed.collectives.all_to_all`
    runs it, ``nbytes`` the size of a rank's whole input (its own block included): p-1
    steps, each sending one block of n/p bytes to a different rank:
    (p-1) alpha + (p-1)/p n beta, the least any all-to-all can send (every block but one's
    own must leave). MPICH's choice for long messages (Thakur, Rabenseifner & Gropp
    2005)."""
    return (p - 1) * alpha + (p - 1) / p * nbytes * beta


def ring_all_to_all_time(nbytes: float, p: int, alpha: float, beta: float) -> float:
    """All-to-all by store-and-forward around a ring, ``nbytes`` a rank's whole input: at
    step s = 1, ..., p-1 each rank passes to its successor the p-s blocks (n/p bytes each)
    still on their way: (p-1) alpha + (p-1)/2 n beta, p/2 times the pairwise exchange's
    bandwidth term, as each block crosses as many links as it travels ranks (Grama et al.
    2003, Sec. 4.5, all-to-all personalized communication on a ring). What a network that
    links each node only to its neighbours leaves; with a link between every pair
    (a switch), the pairwise exchange (:func:`pairwise_all_to_all_time`; Thakur et al.
    2005)."""
    return (p - 1) * alpha + (p - 1) / 2 * nbytes * beta


def crossover_nbytes(
    model: Callable, p: int, alpha: float, beta: float, against: Callable = ring_all_reduce_time
) -> float:
    """The message size n* (bytes) past which ``against`` (the ring by default) is faster
    than ``model`` on ``p`` ranks over the link (``alpha``, ``beta``).

    Both times are linear in n, T(n) = T(0) + n T', so with D = T_against - T_model,
    n* = -D(0) / D' where D' < 0: the ring is faster for n > n*, not faster for n < n*.
    0 when ``against`` is faster from the smallest message on; ``math.inf`` when it never
    overtakes (its bandwidth term is no smaller: Rabenseifner's at a power of two).
    Against recursive doubling, for example, 2(p-1) alpha + 2 (p-1)/p n beta =
    log2 p (alpha + n beta) at n* = (2(p-1) - log2 p) alpha / ((log2 p - 2 (p-1)/p) beta).
    """
    p = check_int("p", p, 1)
    big = 2.0**30  # the slopes over a long step: no cancellation against alpha

    def line(time: Callable) -> tuple[float, float]:
        t0 = time(0.0, p, alpha, beta)
        return t0, (time(big, p, alpha, beta) - t0) / big

    (a0, a1), (m0, m1) = line(against), line(model)
    # equal terms (computed in different orders) must compare equal: ties within rounding
    d0 = 0.0 if math.isclose(a0, m0, rel_tol=1e-12) else a0 - m0
    slope = 0.0 if math.isclose(a1, m1, rel_tol=1e-9) else a1 - m1
    if slope < 0:
        return max(0.0, -d0 / slope)
    return 0.0 if slope == 0 and d0 < 0 else math.inf


@dataclass(frozen=True)
class AlphaBeta:
    """A fitted link: ``alpha`` seconds per message, ``beta`` seconds per byte."""

    alpha: float
    beta: float

    @property
    def bandwidth(self) -> float:
        """Bytes per second (1 / beta)."""
        return math.inf if self.beta == 0 else 1 / self.beta

    def predict(self, model: Callable, nbytes: float, p: int) -> float:
        """Seconds that ``model`` predicts for ``nbytes`` on ``p`` ranks over this link."""
        return model(nbytes, p, self.alpha, self.beta)


def fit_alpha_beta(
    model: Callable, p: int, nbytes: Sequence[float], seconds: Sequence[float]
) -> AlphaBeta:
    """alpha and beta (both >= 0) such that ``model(n, p, alpha, beta)`` best matches the
    measured ``seconds`` at sizes ``nbytes``.

    The model is linear in (alpha, beta), with columns ``model(n, p, 1, 0)`` and
    ``model(n, p, 0, 1)``. The fit minimizes the *relative* squared error, each row divided
    by its time: plain least squares would fit the largest sizes alone and leave alpha, a
    few microseconds, to the noise of milliseconds. Should alpha (or beta) come out
    negative, the other is refitted alone with it at 0.
    """
    p = check_int("p", p, 1)
    if len(nbytes) != len(seconds) or len(nbytes) < 2:
        raise ValueError(
            f"Invalid nbytes, seconds: {len(nbytes)} and {len(seconds)} values "
            "(expected two lists of the same length, at least 2)"
        )
    for n, t in zip(nbytes, seconds, strict=True):
        check_nonnegative("nbytes", n)
        check_positive("seconds", t)
    t = torch.tensor(seconds, dtype=torch.float64)
    A = (
        torch.tensor(
            [[model(n, p, 1.0, 0.0), model(n, p, 0.0, 1.0)] for n in nbytes], dtype=torch.float64
        )
        / t[:, None]
    )
    b = torch.ones_like(t)
    alpha, beta = torch.linalg.lstsq(A, b[:, None]).solution[:, 0].tolist()
    if alpha < 0 or beta < 0:  # the best fit on the boundary: one parameter at zero
        keep = 1 if alpha < 0 else 0
        a = A[:, keep]
        value = max(0.0, float(a @ b / (a @ a)))
        alpha, beta = (0.0, value) if keep == 1 else (value, 0.0)
    return AlphaBeta(alpha, beta)


def measure_collective(
    collective: Callable,
    nbytes: Sequence[int],
    repeats: int = 9,
    dtype: torch.dtype = torch.float32,
    group=None,
    statistic: str = "median",
) -> list[float]:
    """Seconds that ``collective(tensor, group=group)`` takes on tensors of each of
    ``nbytes`` bytes: the median (or with ``statistic="min"`` the minimum) over ``repeats``
    calls of the slowest rank's time (a collective is done when its last rank is done).
    Every rank of the group must call it.

    The median is the time a program will see on this machine as it is. Another process
    can only slow a call down, never speed it up, so on a machine shared with other work
    the minimum is the better estimate of the cost of the collective itself, which is what
    the alpha-beta model describes (the reason ``timeit`` reports minima).

    Each call starts after a barrier, so ranks start together; one call per size before
    the timed ones warms the connections and the allocator. The repeats go round the sizes
    (all sizes, then all again), so a burst of load from another process on the machine
    lands on every size alike instead of bending the curve at one of them.

    The tensors are where the group's backend takes them: on this rank's GPU under NCCL
    (timed after a synchronization, as a CUDA collective returns before it is done), on the
    CPU under gloo.
    """
    repeats = check_int("repeats", repeats, 1)
    check_choice("statistic", statistic, ("median", "min"))
    on_gpu = dist.get_backend(group) == dist.Backend.NCCL  # NCCL moves CUDA tensors only
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    itemsize = torch.empty(0, dtype=dtype).element_size()
    counts = [check_int("nbytes", n, itemsize) // itemsize for n in nbytes]
    tensors = [torch.ones(count, dtype=dtype, device=device) for count in counts]
    times = torch.empty(repeats, len(tensors), dtype=torch.float64)
    for x in tensors:
        collective(x, group=group)
    for i in range(repeats):
        for j, x in enumerate(tensors):
            dist.barrier(group)
            start = time.perf_counter()
            collective(x, group=group)
            if on_gpu:
                torch.cuda.synchronize(device)
            times[i, j] = time.perf_counter() - start
    times = times.to(device)
    dist.all_reduce(times, op=dist.ReduceOp.MAX, group=group)
    return (times.median(dim=0) if statistic == "median" else times.min(dim=0)).values.tolist()
