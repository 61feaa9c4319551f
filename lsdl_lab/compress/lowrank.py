"""Low-rank compression: PowerSGD (Vogels et al. 2019)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from .._util import check_int, generator
from .compressor import Compressor


class LowRank(NamedTuple):
    """The factors ``P`` (n x r, orthonormal columns) and ``Q`` (m x r) of ``M ~ P Q^T``
    (sent); the shape (not sent)."""

    p: torch.Tensor
    q: torch.Tensor
    shape: torch.Size


def as_matrix(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor as an ``(n, m)`` matrix, ``n`` its first dimension (a view): a convolution's
    weight ``(out, in, h, w)`` becomes ``(out, in * h * w)``, as in Vogels et al. and torch."""
    return tensor.reshape(tensor.shape[0] if tensor.ndim else 1, -1)


def orthogonalize(p: torch.Tensor) -> torch.Tensor:
    """An orthonormal basis of ``p``'s column space (reduced QR). Householder QR gives
    orthonormal columns even for a zero or rank-deficient ``p``, where Gram-Schmidt divides
    by zero (torch's hook then needs its ``orthogonalization_epsilon``)."""
    return torch.linalg.qr(p).Q


def worth_compressing(shape: torch.Size, rank: int) -> bool:
    """Whether rank-``rank`` factors of a tensor of this shape are smaller than the tensor:
    ``(n + m) r < n m``, with the tensor as an ``n x m`` matrix. Vectors never are. Torch's
    hook uses the same test with ``min_compression_rate = 1``."""
    if len(shape) < 2:
        return False
    n = shape[0]
    m = shape.numel() // n
    return (n + m) * min(rank, n, m) < n * m


class PowerSGD(Compressor):
    r"""Rank-``rank`` approximation by one step of subspace iteration (Vogels et al. 2019).

    .. math:: P = M Q, \qquad \hat P = \operatorname{orth}(P), \qquad Q \leftarrow M^\top
       \hat P, \qquad M \approx \hat P Q^\top

    ``Q`` is kept for the next call (warm start), so successive calls continue the power
    iteration towards the top singular subspace. Exact on matrices of rank at most ``rank``
    (then :math:`\hat P \hat P^\top M = M`). A tensor is viewed as a matrix by
    :func:`as_matrix`; the rank used is ``min(rank, n, m)``. Wire: ``(n + m) r`` numbers.
    The first ``Q`` is Gaussian from a generator seeded by ``seed``: ranks that share the
    seed share ``Q``, which the distributed algorithm needs (:func:`powersgd_hook`, where
    ``P`` and ``Q`` are all-reduced in between, so the payloads of ranks sum). Used alone,
    the payloads of two ranks have different ``P`` and do not sum. Not unbiased: use it
    with error feedback, as Vogels et al. do.
    """

    def __init__(self, rank: int, seed: int = 0):
        self.rank = check_int("rank", rank, 1)
        self.seed = check_int("seed", seed)
        self.q: torch.Tensor | None = None

    def warm_q(self, matrix: torch.Tensor) -> torch.Tensor:
        """The ``Q`` to multiply ``matrix`` by: the last one, or a fresh Gaussian one."""
        m, r = matrix.shape[1], min(self.rank, *matrix.shape)
        if self.q is None or self.q.shape != (m, r):
            self.q = torch.randn(m, r, generator=generator("powersgd", self.seed))
        return self.q.to(matrix)

    def compress(self, tensor: torch.Tensor) -> LowRank:
        m = as_matrix(tensor)
        p = orthogonalize(m @ self.warm_q(m))
        self.q = m.T @ p
        return LowRank(p, self.q, tensor.shape)

    def decompress(self, payload: LowRank) -> torch.Tensor:
        return (payload.p @ payload.q.T).reshape(payload.shape)
