import math

import pytest
import torch

from lsdl_lab.compress.bits import pack_bits, packed_size, unpack_bits


@pytest.mark.parametrize("width", [1, 2, 3, 4, 5, 7, 8, 9, 12, 17, 31])
@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 100, 1001])
def test_round_trip_and_size(width, n, device):
    codes = torch.randint(0, 2**width, (n,))
    codes[:2] = torch.tensor([2**width - 1, 0])[: min(n, 2)]  # the largest code too
    codes = codes.to(device)  # packed where the gradients are
    packed = pack_bits(codes, width)
    assert packed.dtype == torch.uint8 and packed.device.type == device.type
    assert packed.numel() == math.ceil(n * width / 8) == packed_size(n, width)
    assert torch.equal(unpack_bits(packed, width, n), codes)


def test_bit_order_is_numpys_little_endian(device):
    np = pytest.importorskip("numpy")
    bits = torch.tensor([1, 0, 1, 1, 0, 0, 0, 0, 1, 1])
    expected = np.packbits(bits.numpy().astype(np.uint8), bitorder="little")
    assert pack_bits(bits.to(device), 1).tolist() == expected.tolist()
    # two-bit codes: entry i occupies bits 2i and 2i + 1
    two_bit = torch.tensor([1, 2, 3, 0], device=device)
    assert pack_bits(two_bit, 2).tolist() == [1 + (2 << 2) + (3 << 4)]


def test_wide_codes_send_their_low_bytes_first(device):
    codes = torch.tensor([0x1AB, 0x0CD, 0x1EF], device=device)  # 9 bits each: 27 bits, 4 bytes
    assert pack_bits(codes, 9).tolist() == [0xAB, 0xCD, 0xEF, 0b101]


def test_bad_arguments():
    with pytest.raises(ValueError, match="Invalid width: 0"):
        pack_bits(torch.zeros(3), 0)
    with pytest.raises(TypeError, match="Invalid codes"):
        pack_bits([1, 0], 1)
    with pytest.raises(ValueError, match="Invalid packed"):
        unpack_bits(torch.zeros(2, dtype=torch.uint8), 1, 30)
    with pytest.raises(ValueError, match="Invalid packed"):
        unpack_bits(torch.zeros(1, dtype=torch.int64), 1, 8)
