"""Quantization: every entry sent in a few bits, with one scale per tensor.

* :class:`SignSGD`: 1 bit per entry, the scaled sign of Karimireddy et al. (2019).
* :class:`TernGrad`: 2 bits per entry, stochastic ternary values (Wen et al. 2017).
* :class:`QSGD`: ``ceil(log2(2s + 1))`` bits per entry, stochastic rounding to ``s`` levels
  (Alistarh et al. 2017).

All three send a :class:`Packed` payload: the codes bit-packed into bytes
(:mod:`lsdl_lab.compress.bits`) and one scale in the tensor's dtype. Bytes on the wire:
``ceil(d * bits / 8) + itemsize`` for a tensor of ``d`` entries. GRACE (Xu et al. 2021)
sends the same codes one per ``int8``, 8 bits per entry whatever the method.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .._util import check_int, generator
from .bits import pack_bits, unpack_bits
from .compressor import Compressor


class Packed(NamedTuple):
    """Bit-packed codes and one scale (sent); the shape (known to every rank, not sent)."""

    bits: torch.Tensor
    scale: torch.Tensor
    shape: torch.Size


def _random_source(name: str, seed: int | None) -> torch.Generator | None:
    # None: torch's global generator, so torch.manual_seed governs it (give each rank its own
    # seed: independent rounding noise averages out across ranks, shared noise does not).
    return None if seed is None else generator(name, check_int("seed", seed))


def _uniform(like: torch.Tensor, gen: torch.Generator | None) -> torch.Tensor:
    """Uniform [0, 1) numbers shaped like ``like`` (drawn on the CPU when ``gen`` is set)."""
    if gen is None:
        return torch.rand_like(like)
    return torch.rand(like.shape, generator=gen, dtype=like.dtype).to(like.device)


def _safe(scale: torch.Tensor) -> torch.Tensor:
    # A zero scale means an all-zero tensor: dividing by the smallest normal number instead
    # of 0 gives 0/tiny = 0 everywhere, not NaN, with no branch.
    return scale.clamp_min(torch.finfo(scale.dtype).tiny)


class SignSGD(Compressor):
    r"""1-bit sign compression with the mean magnitude as its scale.

    .. math:: C(g) = \frac{\|g\|_1}{d}\,\operatorname{sign}(g)

    The scaled sign of Karimireddy et al. (2019, EF-SGD): the scale makes ``C`` a
    :math:`\delta`-contraction, :math:`\|C(g) - g\|^2 \le (1 - \delta)\|g\|^2`, which
    error feedback needs. 1-bit SGD (Seide et al. 2014) and signSGD (Bernstein et al. 2018)
    send the same bit, but Seide et al. decode each column to the mean of its positive or
    of its negative entries, and signSGD's majority vote sends no scale; here one scale per
    tensor, and the hook averages the ranks' scaled signs. A zero entry is sent as ``+``
    (one bit has no room for 0) and comes back as ``+scale``; an all-zero tensor has scale
    0 and comes back as zeros. Biased: wrap it in
    :class:`ErrorFeedback`, which carries every such difference to the next step.
    Wire: ``ceil(d / 8)`` bytes of signs plus one scale.
    """

    def compress(self, tensor: torch.Tensor) -> Packed:
        scale = tensor.abs().mean()
        negative = tensor < 0
        return Packed(pack_bits(negative, 1), scale, tensor.shape)

    def decompress(self, payload: Packed) -> torch.Tensor:
        negative = unpack_bits(payload.bits, 1, payload.shape.numel())
        sign = 1 - 2 * negative.to(payload.scale.dtype)
        return (payload.scale * sign).reshape(payload.shape)


class TernGrad(Compressor):
    r"""Stochastic ternarization (Wen et al. 2017), unbiased.

    .. math:: s = \max_i |g_i|, \qquad \tilde g_i = s \operatorname{sign}(g_i)\, b_i,
       \qquad b_i \sim \text{Bernoulli}(|g_i| / s),

    so :math:`\mathbb{E}\tilde g = g`. Each entry is one of :math:`\{-s, 0, s\}`: 2 bits.
    Per tensor (per DDP bucket) scale; the paper's layer-wise scale, its gradient clipping
    and its *scaler sharing* (an extra all-reduce of the max across ranks) are left out, so
    each rank sends its own scale. ``seed`` fixes this compressor's random stream (``None``:
    torch's global generator).
    """

    def __init__(self, seed: int | None = None):
        self.generator = _random_source("terngrad", seed)

    def compress(self, tensor: torch.Tensor) -> Packed:
        s = tensor.abs().max()
        b = _uniform(tensor, self.generator) < tensor.abs() / _safe(s)
        ternary = torch.sign(tensor) * b  # in {-1, 0, 1}
        return Packed(pack_bits(ternary + 1, 2), s, tensor.shape)

    def decompress(self, payload: Packed) -> torch.Tensor:
        ternary = unpack_bits(payload.bits, 2, payload.shape.numel()) - 1
        return (payload.scale * ternary).reshape(payload.shape)


class QSGD(Compressor):
    r"""Stochastic quantization to ``levels`` = :math:`s` levels (Alistarh et al. 2017).

    .. math:: Q_s(g_i) = \|g\|_2 \operatorname{sign}(g_i)\, \xi_i / s, \qquad
       \xi_i = \ell + \text{Bernoulli}(r_i - \ell),\quad r_i = s|g_i| / \|g\|_2,\
       \ell = \lfloor r_i \rfloor,

    unbiased, with variance :math:`\mathbb{E}\|Q_s(g) - g\|^2 \le \min(d/s^2,
    \sqrt d / s)\,\|g\|^2` (the paper's Lemma 3.1). The signed level
    :math:`\operatorname{sign}(g_i)\xi_i \in \{-s, \dots, s\}` is sent as the code
    :math:`\operatorname{sign}(g_i)\xi_i + s` in the fewest bits that hold :math:`2s + 1`
    values, ``ceil(log2(2s + 1))`` (:attr:`width`), plus the norm. The paper's Elias coding
    of the levels (fewer bits when most are 0) and its buckets of a few hundred entries
    with a norm each are not used: one norm per tensor (per DDP bucket), fixed-width codes.
    """

    def __init__(self, levels: int, seed: int | None = None):
        self.levels = check_int("levels", levels, 1)
        self.width = (2 * self.levels).bit_length()  # bits for the codes 0 .. 2s
        self.generator = _random_source("qsgd", seed)

    def compress(self, tensor: torch.Tensor) -> Packed:
        s, norm = self.levels, tensor.norm()
        r = s * tensor.abs() / _safe(norm)
        lower = r.floor()
        xi = (lower + (_uniform(r, self.generator) < r - lower)).clamp_(max=s)
        code = torch.sign(tensor) * xi + s
        return Packed(pack_bits(code, self.width), norm, tensor.shape)

    def decompress(self, payload: Packed) -> torch.Tensor:
        level = unpack_bits(payload.bits, self.width, payload.shape.numel()) - self.levels
        return (payload.scale / self.levels * level).reshape(payload.shape)
