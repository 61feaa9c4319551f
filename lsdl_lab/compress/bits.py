"""Bit packing: small unsigned integer codes stored ``width`` bits each in ``uint8`` bytes.

A gradient compressor is only as cheap as its wire format. GRACE (Xu et al. 2021), the
usual benchmark of compressors, sends a 1-bit sign as an 8-bit integer, so its "1-bit"
methods cost 8 bits per entry. Here ``n`` codes of ``width`` bits take exactly
``ceil(n * width / 8)`` bytes: signs 1 bit, ternary values 2 bits, QSGD's levels the fewest
bits that hold them. For ``width <= 8`` the bits of entry ``i`` start at bit ``i * width``
of the stream, least significant bit first (numpy's ``packbits(..., bitorder="little")``
order); wider codes send their low bytes first, then their remaining bits packed the same
way. Each group of 8 codes is one 64-bit integer, so packing costs a few passes over the
codes whatever the width, in torch only (it runs where the gradients are, GPU included).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .._util import check_int, check_tensor


def packed_size(n: int, width: int) -> int:
    """Bytes that ``n`` codes of ``width`` bits take: ``ceil(n * width / 8)``."""
    return -(-n * width // 8)


def pack_bits(codes: torch.Tensor, width: int) -> torch.Tensor:
    """The integer ``codes`` (each in ``[0, 2**width)``) packed ``width`` bits each into a
    ``uint8`` tensor of :func:`packed_size` bytes."""
    check_tensor("codes", codes)
    width = check_int("width", width, 1, 31)
    if width > 8:  # the low bytes whole, then the high bits: still ceil(n * width / 8) bytes
        return torch.cat([pack_bits(codes & 255, 8), pack_bits(codes >> 8, width - 8)])
    n, shifts = codes.numel(), torch.arange(8, device=codes.device)
    # 8 codes of `width` bits fill exactly `width` bytes: one 64-bit word per group of 8
    groups = F.pad(codes.reshape(-1).long(), (0, -n % 8)).view(-1, 8)
    words = (groups << width * shifts).sum(1)  # disjoint bits: the sum is a bitwise or
    out = (words[:, None] >> 8 * shifts[:width]) & 255
    return out.to(torch.uint8).reshape(-1)[: packed_size(n, width)]


def unpack_bits(packed: torch.Tensor, width: int, n: int) -> torch.Tensor:
    """The first ``n`` codes of ``width`` bits in ``packed`` (the inverse of
    :func:`pack_bits`), as ``int64``."""
    check_tensor("packed", packed, ndim=1)
    width = check_int("width", width, 1, 31)
    n = check_int("n", n, 0)
    if packed.dtype != torch.uint8 or packed.numel() != packed_size(n, width):
        raise ValueError(
            f"Invalid packed: {packed.numel()} {packed.dtype} entries (expected "
            f"{packed_size(n, width)} torch.uint8 bytes for {n} codes of {width} bits)"
        )
    if width > 8:
        return unpack_bits(packed[:n], 8, n) | unpack_bits(packed[n:], width - 8, n) << 8
    shifts = torch.arange(8, device=packed.device)
    groups = F.pad(packed.long(), (0, -(-n // 8) * width - packed.numel())).view(-1, width)
    words = (groups << 8 * shifts[:width]).sum(1)
    codes = (words[:, None] >> width * shifts) & (2**width - 1)
    return codes.reshape(-1)[:n]
