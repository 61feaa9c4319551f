"""Sparsification: send ``k`` of the ``d`` entries.

* :class:`TopK`: the ``k`` largest in magnitude, as values and ``int32`` indices
  (Aji & Heafield 2017; Stich et al. 2018; Alistarh et al. 2018).
* :class:`RandomK`: ``k`` entries drawn without replacement from a generator every rank
  seeds alike, so the indices are never sent (Stich et al. 2018; Wangni et al. 2018).

``k = max(1, round(ratio * d))``. Both are biased unless random-k is scaled by ``d / k``;
wrap the biased ones in :class:`ErrorFeedback` (Stich et al. 2018: "sparsified SGD with
memory").
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .._util import check_bool, check_int, check_real, generator
from .compressor import Compressor


def _k_of(ratio: float, d: int) -> int:
    return max(1, round(ratio * d))


def _check_ratio(ratio: float) -> float:
    return check_real("ratio", ratio, 0.0, 1.0, low_open=True)


class Sparse(NamedTuple):
    """Values and their ``int32`` indices (sent); the shape (not sent)."""

    values: torch.Tensor
    indices: torch.Tensor
    shape: torch.Size


class Sampled(NamedTuple):
    """Values at indices every rank draws alike (sent); the step that seeds the draw and the
    shape (known to every rank, not sent)."""

    values: torch.Tensor
    step: int
    shape: torch.Size


class TopK(Compressor):
    r"""The ``k = round(ratio * d)`` entries of largest magnitude.

    .. math:: C(g) = g \odot 1[\,|g_i| \text{ among the } k \text{ largest}\,]

    A contraction with :math:`\delta = k/d` (Stich et al. 2018), biased: use it with
    :class:`ErrorFeedback`. Wire: ``k`` values plus ``k`` ``int32`` indices (8 bytes per
    entry in float32). The payloads of two ranks are not summable (their indices differ),
    so the hook all-gathers them, as GRACE does; torch has no top-k hook.
    """

    def __init__(self, ratio: float):
        self.ratio = _check_ratio(ratio)

    def compress(self, tensor: torch.Tensor) -> Sparse:
        flat = tensor.reshape(-1)
        indices = flat.abs().topk(_k_of(self.ratio, flat.numel()), sorted=False).indices
        return Sparse(flat[indices], indices.to(torch.int32), tensor.shape)

    def decompress(self, payload: Sparse) -> torch.Tensor:
        out = payload.values.new_zeros(payload.shape.numel())
        out[payload.indices.long()] = payload.values
        return out.reshape(payload.shape)


class RandomK(Compressor):
    r"""``k = round(ratio * d)`` entries chosen uniformly without replacement.

    .. math:: C(g) = \gamma\, g \odot 1[i \in S], \qquad |S| = k, \qquad
       \gamma = d/k \text{ (scaled) or } 1

    Scaled (the default), :math:`\mathbb{E}\,C(g) = g`: unbiased, with variance
    :math:`(d/k - 1)\|g\|^2`. Unscaled, it is a contraction with :math:`\delta = k/d`, the
    form to wrap in :class:`ErrorFeedback` (the scaled one expands, and error feedback
    assumes a contraction). The set :math:`S` of step ``t`` comes from a generator seeded
    by ``(seed, t)``, so every rank with the same ``seed`` picks the same entries: only the
    ``k`` values go on the wire, and payloads of different ranks can be summed
    (all-reduce).
    """

    summable = True

    def __init__(self, ratio: float, seed: int = 0, scaled: bool = True):
        self.ratio = _check_ratio(ratio)
        self.seed = check_int("seed", seed)
        self.scaled = check_bool("scaled", scaled)
        self.step = 0

    def indices(self, d: int, step: int) -> torch.Tensor:
        """The ``k`` indices of step ``step`` in a tensor of ``d`` entries (same on every
        rank that shares the seed)."""
        draw = generator("randomk", self.seed, step)
        return torch.randperm(d, generator=draw)[: _k_of(self.ratio, d)]

    def compress(self, tensor: torch.Tensor) -> Sampled:
        flat = tensor.reshape(-1)
        step, self.step = self.step, self.step + 1
        indices = self.indices(flat.numel(), step).to(flat.device)
        return Sampled(flat[indices], step, tensor.shape)

    def decompress(self, payload: Sampled) -> torch.Tensor:
        d = payload.shape.numel()
        indices = self.indices(d, payload.step).to(payload.values.device)
        gamma = d / indices.numel() if self.scaled else 1.0
        out = payload.values.new_zeros(d)
        out[indices] = gamma * payload.values
        return out.reshape(payload.shape)
