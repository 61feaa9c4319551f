"""Bit packing: small unsigned integer codes stored ``width`` bits each in ``uint8`` bytes.

A gradient compressor is only as cheap as its wire format. GRACE (Xu et al. 2021), the
usual benchmark of compressors, sends a 1-bit sign as an 8-bit integer, so its "1-bit"
methods cost 8 bits per entry. Here ``n`` codes of ``width`` bits take exactly
``ceil(n * width / 8)`` bytes: signs 1 bit, ternary values 2 bits, QSGD's levels the fewest
bits that hold them. The bits of entry ``i`` start at bit ``i * width`` of the stream,
least significant bit first (numpy's ``packbits(..., bitorder="little")`` order).
"""

from __future__ import annotations

import torch

from .._util import check_int, check_tensor


def packed_size(n: int, width: int) -> int:
    """Bytes that ``n`` codes of ``width`` bits take: ``ceil(n * width / 8)``."""
    return -(-n * width // 8)


def pack_bits(codes: torch.Tensor, width: int) -> torch.Tensor:
    """The integer ``codes`` (each in ``[0, 2**width)``) packed ``width`` bits each into a
    ``uint8`` tensor of :func:`packed_size` bytes."""
    check_tensor("codes", codes)
    width = check_int("width", width, 1, 31)
    shifts = torch.arange(width, device=codes.device, dtype=torch.int32)
    bits = (codes.reshape(-1, 1).to(torch.int32) >> shifts) & 1  # (n, width), low bit first
    stream = torch.nn.functional.pad(bits.reshape(-1), (0, -bits.numel() % 8))
    weights = 1 << torch.arange(8, device=codes.device, dtype=torch.int32)
    return (stream.view(-1, 8) * weights).sum(1).to(torch.uint8)


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
    shifts = torch.arange(8, device=packed.device, dtype=torch.int32)
    stream = (packed.reshape(-1, 1).to(torch.int32) >> shifts) & 1
    bits = stream.reshape(-1)[: n * width].view(n, width).long()
    return (bits << torch.arange(width, device=packed.device)).sum(1)
