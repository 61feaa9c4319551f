r"""Block-wise 8-bit quantization with a dynamic map (Dettmers et al., 2022, "8-bit Optimizers
via Block-wise Quantization", ICLR): how an optimizer keeps its states in one byte a value.

**Three steps** (the paper's Section 2). A tensor :math:`x` is cut into blocks of :math:`B`
consecutive values of its flattened form (the last block may be shorter); each block
:math:`b` is normalized by its absolute maximum, each normalized value is replaced by the
index of the nearest of the 256 values :math:`Q_0 < Q_1 < \dots < Q_{255}` of a map in
:math:`[-1, 1]`, and decoding looks the index up and multiplies back:

.. math::
    N_b = \max_{i \in b} |x_i|, \qquad
    q_i = \arg\min_{j} \left| Q_j - \frac{x_i}{N_b} \right|, \qquad
    \hat x_i = Q_{q_i}\, N_b .

Storage: one byte per value (:math:`q_i`, ``uint8``) and four per block (:math:`N_b`,
float32): :math:`1 + 4/B` bytes a value, 1.002 at the paper's :math:`B = 2048`. Adam's two
moments then take about 2 bytes a parameter instead of 8 (the paper's 8 GB against 2 GB for
a billion parameters). **The error** of a value is at most half the gap between the two map
values around :math:`x_i / N_b`, so in every block

.. math::
    \max_{i \in b} |x_i - \hat x_i| \;\le\; \frac{\Delta}{2}\, N_b, \qquad
    \Delta = \max_j\, (Q_{j+1} - Q_j),

provided the map reaches the ends of the range it serves to within :math:`\Delta/2` (both
maps below do). A block's scale is its own: one outlier coarsens its block of :math:`B`
values, not the whole tensor (the paper's case for blocks), and the blocks are independent,
so they are quantized in parallel.

**The dynamic map** (:func:`dynamic_map`) is Dettmers's (2016, "8-Bit Approximations for
Parallelism in Deep Learning", ICLR) dynamic tree quantization: after the sign bit, a run of
:math:`j` zero bits sets the decade :math:`10^{-j}` (:math:`j = 0, \dots, 6`), a one bit ends
the run, and the :math:`6 - j` bits left are a linear fraction in :math:`[0.1, 1]`:

.. math::
    Q \in \{0, 1\} \cup \left\{ \pm 10^{-j} \left(0.1 + 0.9\,
    \frac{k + \tfrac12}{2^{6-j}}\right) : 0 \le j \le 6,\ 0 \le k < 2^{6-j} \right\} .

Large values get fine steps (64 a sign in :math:`[0.1, 1]`), small ones a coarse step but a
range of seven decades: :math:`5.5 \cdot 10^{-7}` is the smallest nonzero value. That
suits an optimizer's states, whose magnitudes span orders of magnitude within a tensor, where
a linear map of 256 steps would round everything below :math:`1/255` of the block's maximum
to zero. The unsigned variant (``signed=False``, the paper's *dynamic quantization*, for
Adam's second moment, which is never negative) spends the sign bit on one more bit of
fraction: :math:`2^{7-j}` values in decade :math:`j`, no negative values, so a decoded
second moment cannot be negative. The paper's motivation: Adam's second moment spans about
three to five orders of magnitude, fewer than the map's seven.

**The numbers of each map** (the tests measure them): 256 values, sorted; signed: 0 and 1,
127 negative values mirroring the 127 positive ones below 1 (the largest negative value is
:math:`-0.99297`, half a gap from :math:`-1`), the largest gap :math:`\Delta = 0.9/64 =
0.0140625` (a round trip is then within 0.70% of the block's maximum); unsigned: 0 and 1
and 254 values between, :math:`\Delta = 0.9/128`, within 0.35%.

**As bitsandbytes computes it** (github.com/bitsandbytes-foundation/bitsandbytes, read at
commit 95f9af3: ``create_dynamic_map`` in ``bitsandbytes/functional.py`` builds these maps;
the PyTorch kernel of ``quantize_blockwise`` in ``bitsandbytes/backends/default/ops.py``
rounds to the nearest value by bucketing between the midpoints of the sorted map): the same
maps, value for value (the map is built here from the formula above in float32 as there), and
the same rounding, a binary search (:func:`torch.searchsorted`) among the midpoints
:math:`(Q_j + Q_{j+1})/2`, a tie going to the lower value. Block size: the paper's 2048 is
the default here; bitsandbytes's optimizers now use 256.

A NaN or an infinity spoils its whole block (:math:`N_b` is then NaN or infinite), as it
would spoil a float32 state; nothing is checked for it, which would cost a synchronization
with the GPU on every call. For the same reason ``code`` is not checked for order: it must
be sorted ascending, as :func:`dynamic_map` returns it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from .._util import check_bool, check_int

__all__ = [
    "BLOCK_SIZE",
    "MIN_8BIT_SIZE",
    "dequantize_blockwise",
    "dynamic_map",
    "quantize_blockwise",
    "quantized_bytes",
]

#: the paper's block size (Dettmers et al., 2022)
BLOCK_SIZE = 2048
#: the fewest values a tensor needs for its optimizer states to be kept in 8 bits
#: (bitsandbytes's ``min_8bit_size``): a smaller one (a bias, a LayerNorm gain) keeps its
#: states in full precision, where a block's scale would cost more than the byte saves
MIN_8BIT_SIZE = 4096
#: decades of the dynamic map: 10^0 down to 10^-6
DECADES = 7


def dynamic_map(signed: bool = True) -> Tensor:
    r"""The 256 values of the dynamic map, float32, sorted ascending: signed (dynamic tree
    quantization, for Adam's first moment) or unsigned (for its second moment), as the
    module's docstring writes them:

    .. math::
        \{0, 1\} \cup \{\pm 10^{-j} (0.1 + 0.9 (k + \tfrac12) / n_j)\}, \qquad
        n_j = 2^{6-j} \text{ (signed)}, \ 2^{7-j} \text{ (unsigned, no } -\text{)}.
    """
    check_bool("signed", signed)
    values = [0.0, 1.0]
    for j in range(DECADES):
        n = 2 ** (DECADES - 1 - j + (not signed))  # levels of the linear fraction
        edges = torch.linspace(0.1, 1.0, n + 1)
        # in float32 throughout, as bitsandbytes computes them: the same values, bit for bit
        centers = ((edges[:-1] + edges[1:]) / 2 * 10.0**-j).tolist()
        values += centers + ([-c for c in centers] if signed else [])
    return torch.tensor(sorted(values), dtype=torch.float32)


def check_code(code) -> Tensor:
    """A 1-D floating tensor of 2 to 256 values (one byte indexes at most 256)."""
    if not isinstance(code, Tensor) or not code.is_floating_point():
        raise TypeError(
            f"Invalid code: {type(code).__name__ if not isinstance(code, Tensor) else code.dtype}"
            " (expected a floating tensor of map values, as dynamic_map returns)"
        )
    if code.ndim != 1 or not 2 <= code.numel() <= 256:
        raise ValueError(
            f"Invalid code: a tensor of shape {tuple(code.shape)} (expected 1-D, 2 to 256 "
            "values sorted ascending, as dynamic_map returns)"
        )
    return code


def blocks_of(n: int, block_size: int) -> int:
    """How many blocks ``n`` values take: :math:`\\lceil n / B \\rceil`."""
    return -(-n // block_size)


def quantize_blockwise(
    x: Tensor, code: Tensor, block_size: int = BLOCK_SIZE
) -> tuple[Tensor, Tensor]:
    r"""``x`` in 8 bits: ``(codes, absmax)``, the index :math:`q_i` of each value of ``x``
    flattened (``uint8``, 1-D, ``x.numel()`` of them) and each block's scale :math:`N_b`
    (float32, :math:`\lceil n / B \rceil` of them; the last block may be shorter):

    .. math::
        N_b = \max_{i \in b} |x_i|, \qquad
        q_i = \arg\min_j \left| Q_j - x_i / N_b \right|

    by a binary search among the midpoints of ``code`` (:math:`Q`, sorted ascending, on
    ``x``'s device). A block of zeros has :math:`N_b = 0` and decodes to zeros.
    """
    if not isinstance(x, Tensor) or not x.is_floating_point():
        raise TypeError(
            f"Invalid x: {x.dtype if isinstance(x, Tensor) else type(x).__name__} "
            "(expected a floating tensor)"
        )
    code = check_code(code).to(torch.float32)
    check_int("block_size", block_size, 1)
    n = x.numel()
    blocks = blocks_of(n, block_size)
    # the last block padded with zeros, which change no block's maximum
    padded = F.pad(x.detach().reshape(-1).float(), (0, blocks * block_size - n))
    padded = padded.view(blocks, block_size)
    absmax = padded.abs().amax(dim=1)
    scale = torch.where(absmax > 0, absmax, torch.ones_like(absmax))  # 0 / 0 nowhere
    normalized = (padded / scale[:, None]).view(-1)[:n]
    midpoints = (code[:-1] + code[1:]) / 2
    codes = torch.searchsorted(midpoints, normalized).to(torch.uint8)
    return codes, absmax


def dequantize_blockwise(
    codes: Tensor,
    absmax: Tensor,
    code: Tensor,
    shape: Sequence[int],
    block_size: int = BLOCK_SIZE,
) -> Tensor:
    r"""The float32 tensor of ``shape`` that ``(codes, absmax)`` stand for:
    :math:`\hat x_i = Q_{q_i} N_b` (``block_size`` and ``code`` those of
    :func:`quantize_blockwise`)."""
    if not isinstance(codes, Tensor) or codes.dtype != torch.uint8:
        raise TypeError(
            f"Invalid codes: {codes.dtype if isinstance(codes, Tensor) else type(codes).__name__}"
            " (expected a uint8 tensor, as quantize_blockwise returns)"
        )
    code = check_code(code).to(torch.float32)
    check_int("block_size", block_size, 1)
    shape = torch.Size(shape)
    n = codes.numel()
    if shape.numel() != n:
        raise ValueError(
            f"Invalid shape: {tuple(shape)}, {shape.numel()} values (expected {n}, one per code)"
        )
    blocks = blocks_of(n, block_size)
    if not isinstance(absmax, Tensor) or absmax.ndim != 1 or absmax.numel() != blocks:
        got = tuple(absmax.shape) if isinstance(absmax, Tensor) else type(absmax).__name__
        raise ValueError(
            f"Invalid absmax: {got} (expected a 1-D tensor of {blocks} block scales: "
            f"{n} codes in blocks of {block_size})"
        )
    values = F.pad(code[codes.reshape(-1).long()], (0, blocks * block_size - n))
    values = values.view(blocks, block_size) * absmax.float()[:, None]
    return values.view(-1)[:n].view(shape)


def quantized_bytes(n: int, block_size: int = BLOCK_SIZE) -> int:
    r"""The bytes of ``n`` values in 8 bits: :math:`n + 4 \lceil n / B \rceil` (one byte a
    code, a float32 scale a block)."""
    check_int("n", n, 0)
    check_int("block_size", block_size, 1)
    return n + 4 * blocks_of(n, block_size)
