"""The compressors as DDP communication hooks.

Register one with ``ddp_model.register_comm_hook(state, hook)``, ``state`` a
:class:`HookState`. DDP then calls ``hook(state, bucket)`` for each bucket of gradients
(a flat buffer, about 25 MB) instead of all-reducing it, and uses the tensor the returned
future holds as the bucket's averaged gradient.

* :func:`allgather_hook`: any compressor. Each rank's packed payload is all-gathered, every
  rank decompresses all of them and averages. Packed codes (signs, ternary values, QSGD
  levels, top-k's values at differing indices) cannot be summed, so a gather is needed;
  GRACE does the same with 8-bit codes.
* :func:`allreduce_hook`: summable compressors (random-k with a shared seed): the payloads
  are summed by an all-reduce and decompressed once.
* :func:`powersgd_hook`: PowerSGD's two all-reduces (Vogels et al. 2019), as in torch's
  ``powerSGD_hook``.

The hooks call ``torch.distributed``'s collectives from Python, so the book's one byte
counter, :class:`lsdl_lab.distributed.CollectiveBytes`, sees them: the bytes a rank hands
to the collectives during a step, as for torch's own hooks, are counted by opening one
around the training (``with CollectiveBytes() as sent: ...``), not by the hooks.

The hooks run their collectives synchronously (simple to read; no overlap with the rest
of the backward pass, unlike torch's hooks, which chain futures). Their state is kept per
bucket, keyed by the bucket's parameters: DDP rebuilds its buckets once after the first
step, and a residual kept by bucket *index* would then belong to other parameters
(torch's PowerSGD hook avoids this by all-reducing uncompressed for its first
``start_powerSGD_iter >= 2`` steps).

The hooks' annotations are real objects, not strings (no ``from __future__ import
annotations``): DDP's ``register_comm_hook`` compares them with ``dist.GradBucket`` and
``torch.futures.Future[torch.Tensor]``.
"""

from collections.abc import Callable

import torch
import torch.distributed as dist

from .._util import check_int
from .compressor import (
    Compressor,
    flatten_payload,
    unflatten_payload,
    wire_tensors,
    with_wire_tensors,
)
from .lowrank import PowerSGD, as_matrix, orthogonalize, worth_compressing


class HookState:
    """What a hook keeps between calls.

    ``make_compressor()`` builds a fresh compressor; one is kept per bucket (for PowerSGD,
    one per compressed matrix). For the first ``start_iter`` steps the bucket is all-reduced
    uncompressed, like torch's ``start_powerSGD_iter``. ``steps`` counts the completed
    steps.
    """

    def __init__(
        self,
        make_compressor: Callable[[], Compressor],
        group: dist.ProcessGroup | None = None,
        start_iter: int = 0,
    ):
        if not callable(make_compressor):
            raise TypeError(
                f"Invalid make_compressor: {make_compressor!r} (expected a function that "
                "returns a Compressor)"
            )
        self.make_compressor = make_compressor
        self.group = group
        self.start_iter = check_int("start_iter", start_iter, 0)
        self.steps = 0
        self.memory: dict[tuple, object] = {}

    def remember(self, bucket: dist.GradBucket, make: Callable[[], object]) -> object:
        """The object kept for this bucket's parameters (``make()`` the first time)."""
        key = tuple(id(p) for p in bucket.parameters())
        if key not in self.memory:
            self.memory[key] = make()
        return self.memory[key]

    def all_reduce_mean(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each tensor averaged over the ranks, by one all-reduce of their concatenation
        (one collective, not one per tensor)."""
        flat = torch.cat([t.reshape(-1) for t in tensors])
        dist.all_reduce(flat, group=self.group)
        flat /= dist.get_world_size(self.group)
        return [c.view_as(t) for c, t in zip(flat.split([t.numel() for t in tensors]), tensors)]

    def compressing(self) -> bool:
        return self.steps >= self.start_iter

    def done(
        self, bucket: dist.GradBucket, result: torch.Tensor
    ) -> torch.futures.Future[torch.Tensor]:
        """A completed future holding ``result``; the step ends with the last bucket."""
        self.steps += bucket.is_last()
        future = torch.futures.Future()
        future.set_result(result)
        return future


def allgather_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Compress, all-gather every rank's packed payload, decompress each and average."""
    grad = bucket.buffer()
    if not state.compressing():
        return state.done(bucket, grad.copy_(state.all_reduce_mean([grad])[0]))
    compressor = state.remember(bucket, state.make_compressor)
    payload = compressor.compress(grad)
    wire = flatten_payload(payload)  # one uint8 buffer: one collective
    gathered = [torch.empty_like(wire) for _ in range(dist.get_world_size(state.group))]
    dist.all_gather(gathered, wire, group=state.group)
    total = sum(compressor.decompress(unflatten_payload(w, payload)) for w in gathered)
    return state.done(bucket, grad.copy_(total).div_(len(gathered)))


def allreduce_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Compress, sum the payloads by one all-reduce, decompress the sum and average (for a
    ``summable`` compressor, whose decompression is linear in what is sent)."""
    grad = bucket.buffer()
    if not state.compressing():
        return state.done(bucket, grad.copy_(state.all_reduce_mean([grad])[0]))
    compressor = state.remember(bucket, state.make_compressor)
    if not compressor.summable:
        raise ValueError(
            f"Invalid compressor: {type(compressor).__name__} payloads cannot be summed "
            "(expected a summable compressor such as RandomK; use allgather_hook)"
        )
    payload = compressor.compress(grad)
    mean = with_wire_tensors(payload, state.all_reduce_mean(wire_tensors(payload)))
    return state.done(bucket, grad.copy_(compressor.decompress(mean)))


def powersgd_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    r"""PowerSGD with error feedback and warm start (Vogels et al. 2019, Algorithms 1-2).

    Per bucket: :math:`M \leftarrow g + e`; for each matrix worth compressing,
    :math:`P = \text{all-reduce}(M Q)`, :math:`\hat P = \operatorname{orth}(P)`,
    :math:`Q = \text{all-reduce}(M^\top \hat P) / W`, :math:`M \approx \hat P Q^\top`;
    vectors (biases) are all-reduced uncompressed, in the same collective as the ``P``;
    :math:`e \leftarrow g + e - \text{result}`. The kept ``Q`` is the averaged one. This is
    torch's ``powerSGD_hook`` with ``min_compression_rate=1`` and QR orthogonalization;
    torch also orthogonalizes the kept ``Q`` before use, which leaves the approximation
    unchanged. ``state.make_compressor()`` must return a :class:`PowerSGD` (its rank and
    seed; every rank must pass the same seed).
    """
    grad = bucket.buffer()
    if not state.compressing():
        return state.done(bucket, grad.copy_(state.all_reduce_mean([grad])[0]))
    grads = bucket.gradients()  # views into grad
    error, compressors = state.remember(
        bucket, lambda: (torch.zeros_like(grad), [state.make_compressor() for _ in grads])
    )
    if not isinstance(compressors[0], PowerSGD):
        raise TypeError(
            f"Invalid make_compressor: returns a {type(compressors[0]).__name__} "
            "(expected a PowerSGD)"
        )
    grad.add_(error)  # M = g + e, in the bucket's views
    local = grad.clone()
    worth = [worth_compressing(g.shape, c.rank) for g, c in zip(grads, compressors)]
    small = [g for g, w in zip(grads, worth) if not w]
    pairs = [(as_matrix(g), c) for g, c, w in zip(grads, compressors, worth) if w]

    # one all-reduce for the uncompressed tensors and every P = M Q (the mean P spans what
    # torch's summed P spans: orthogonalization ignores the scale)
    means = state.all_reduce_mean(small + [m @ c.warm_q(m) for m, c in pairs])
    for g, mean in zip(small, means):
        g.copy_(mean)
    ps = [orthogonalize(p) for p in means[len(small) :]]
    qs = state.all_reduce_mean([m.T @ p for (m, _), p in zip(pairs, ps)])
    for (m, c), p, q in zip(pairs, ps, qs):
        c.q = q  # warm start from the averaged Q
        m.copy_(p @ q.T)
    error.copy_(local - grad)  # e = M - what was applied
    return state.done(bucket, grad)
