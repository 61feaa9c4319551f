"""Tests of lsdl_lab.memory.quantize: the dynamic maps' numbers (256 sorted values; the signed
map with 0, 1 and a negative half mirroring the positive one, within half a gap of -1; the
unsigned map in [0, 1]; seven decades; each decade's count of values), the round trip's error
in every block within half the map's largest gap times the block's maximum (and near it: the
bound is tight), nearest rounding, the last partial block, zeros, the bytes (one a value and
four a block), and bad input."""

from __future__ import annotations

import math

import pytest
import torch

from lsdl_lab.memory import (
    dequantize_blockwise,
    dynamic_map,
    quantize_blockwise,
    quantized_bytes,
)

# the largest gap of each map: the top decade [0.1, 1] cut into 64 (signed) or 128 steps
GAP = {True: 0.9 / 64, False: 0.9 / 128}
# float32 rounding of x / N_b, of Q_q * N_b and of the difference: a few ulps of N_b
SLACK = 4 * torch.finfo(torch.float32).eps


def bound(signed: bool, absmax: torch.Tensor) -> torch.Tensor:
    """The largest error a round trip may leave in each block: half the largest gap of the
    map (measured on the map itself) times the block's maximum, and float32's rounding."""
    half_gap = dynamic_map(signed).diff().max().item() / 2
    return (half_gap + SLACK) * absmax


def blocks(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """``x`` flattened into rows of ``block_size`` (the last padded with zeros)."""
    flat = x.reshape(-1)
    n_blocks = -(-flat.numel() // block_size)
    padded = torch.nn.functional.pad(flat, (0, n_blocks * block_size - flat.numel()))
    return padded.view(n_blocks, block_size)


def round_trip(x, signed, block_size=2048):
    code = dynamic_map(signed).to(x.device)
    codes, absmax = quantize_blockwise(x, code, block_size)
    return codes, absmax, dequantize_blockwise(codes, absmax, code, x.shape, block_size)


def states(n: int, signed: bool, device, seed: int = 0) -> torch.Tensor:
    """Values like an optimizer's moments: Gaussian, with magnitudes spread over four
    decades along the tensor (squared for the unsigned map: a second moment)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen) * torch.logspace(-4, 0, n)[torch.randperm(n, generator=gen)]
    return (x if signed else x.square()).to(device)


# -- the maps ----------------------------------------------------------------------------


@pytest.mark.parametrize("signed", [True, False])
def test_the_map_has_256_sorted_values_from_seven_decades(signed):
    code = dynamic_map(signed)
    assert code.dtype == torch.float32 and code.shape == (256,)
    assert (code.diff() > 0).all()  # sorted, no value twice
    assert code.min() >= (-1.0 if signed else 0.0) and code.max() == 1.0
    assert (code == 0).sum() == 1
    magnitudes = code[code != 0].abs()
    # the smallest nonzero value: 10^-6 times the midpoint of [0.1, 1] (signed) or of its first
    # half (unsigned): seven decades down from 1
    smallest = 1e-6 * (0.55 if signed else 0.325)
    assert math.isclose(magnitudes.min().item(), smallest, rel_tol=1e-6)
    # decade j (values in [10^-(j+1), 10^-j)) holds 2^(6-j) values a sign, 2^(7-j) unsigned
    for j in range(7):
        in_decade = ((magnitudes >= 10.0 ** -(j + 1)) & (magnitudes < 10.0**-j)).sum().item()
        assert in_decade == 2 ** (6 - j + (not signed)) * (2 if signed else 1), j


def test_the_signed_map_is_symmetric_but_for_one():
    code = dynamic_map(True)
    negative, positive = code[code < 0], code[code > 0]
    assert len(negative) == 127 and len(positive) == 128  # 255 nonzero values: one sign more
    # the positive half is the negative one mirrored, and 1
    assert torch.equal(positive[:-1], -negative.flip(0)) and positive[-1] == 1.0
    # so -1 itself is missing: its nearest value is half the largest gap away
    assert math.isclose(1 + code[0].item(), GAP[True] / 2, rel_tol=1e-5)


@pytest.mark.parametrize("signed", [True, False])
def test_the_largest_gap_is_in_the_top_decade(signed):
    code = dynamic_map(signed)
    assert math.isclose(code.diff().max().item(), GAP[signed], rel_tol=1e-4)


# -- the round trip ----------------------------------------------------------------------


@pytest.mark.parametrize("signed", [True, False])
def test_the_error_in_each_block_is_within_half_the_largest_gap(signed, device):
    n, block_size = 5 * 2048 + 300, 2048  # five full blocks and a partial one
    x = states(n, signed, device)
    codes, absmax, x_hat = round_trip(x, signed, block_size)
    err = blocks((x - x_hat).abs(), block_size).amax(dim=1)
    assert err.shape == absmax.shape == (6,)
    assert (err <= bound(signed, absmax)).all(), (err / absmax, GAP[signed] / 2)
    # and the bound is what happens, not a loose ceiling: in every block (2048 or 300 values,
    # a tenth or more of them in the top decade) some value falls near the middle of the
    # largest gap (measured: 0.95 to 1.0 of it)
    assert (err >= 0.9 * GAP[signed] / 2 * absmax).all(), err / absmax
    if not signed:
        assert (x_hat >= 0).all()  # a second moment stays non-negative


@pytest.mark.parametrize("signed", [True, False])
def test_rounding_is_to_the_nearest_value_of_the_map(signed, device):
    code = dynamic_map(signed).to(device)
    gen = torch.Generator().manual_seed(1)
    x = torch.rand(4096, generator=gen).to(device) * (2 if signed else 1) - (1 if signed else 0)
    x[0] = 1.0  # the maximum, so that every value is its own normalized value
    codes, absmax = quantize_blockwise(x, code, 4096)
    assert absmax.item() == 1.0
    nearest = (x[:, None] - code[None, :]).abs().argmin(dim=1)
    # where two map values are equally near (none here, drawn at random) either would do
    assert torch.equal(code[codes.long()], code[nearest])


def test_the_maximum_of_each_block_is_kept_exactly_when_positive(device):
    # 1 is in both maps: a block's largest positive value decodes to itself
    x = states(3 * 100, True, device).abs()
    codes, absmax, x_hat = round_trip(x, True, 100)
    rows, rows_hat = blocks(x, 100), blocks(x_hat, 100)
    top = rows.argmax(dim=1)
    assert torch.equal(rows_hat.gather(1, top[:, None]), rows.gather(1, top[:, None]))


@pytest.mark.parametrize("n", [1, 5, 2047, 2048, 2049, 3 * 2048 - 1])
def test_a_partial_last_block_has_its_own_scale(n, device):
    x = states(n, True, device, seed=n)
    if n > 2048:
        x[-1] = 1e3  # the last block's outlier, which must not coarsen the full blocks
    codes, absmax, x_hat = round_trip(x, True)
    assert codes.shape == (n,) and codes.dtype == torch.uint8
    assert absmax.shape == (-(-n // 2048),) and absmax.dtype == torch.float32
    expected = torch.stack([row.abs().max() for row in x.split(2048)])
    assert torch.equal(absmax, expected)
    assert x_hat.shape == x.shape and x_hat.dtype == torch.float32
    err = torch.stack([e.abs().max() for e in (x - x_hat).split(2048)])
    assert (err <= bound(True, absmax)).all()


def test_shapes_and_dtypes_come_back(device):
    x = states(6 * 7 * 5, True, device).view(6, 7, 5).to(torch.bfloat16)
    codes, absmax, x_hat = round_trip(x, True, block_size=32)
    assert codes.shape == (210,) and absmax.shape == (7,)
    assert x_hat.shape == (6, 7, 5) and x_hat.dtype == torch.float32
    err = blocks((x.float() - x_hat).abs(), 32).amax(dim=1)
    assert (err <= bound(True, absmax)).all()


def test_zeros_stay_exact_zeros(device):
    x = torch.zeros(3000, device=device)
    x[2500] = -2.0  # a nonzero value in the second block only
    codes, absmax, x_hat = round_trip(x, True)
    assert absmax.tolist() == [0.0, 2.0]
    assert torch.equal(x_hat[:2048], torch.zeros(2048, device=device))  # 0 is in the map
    x_hat[2500] = 0.0
    assert torch.equal(x_hat[2048:], torch.zeros(952, device=device))  # and in the block
    empty = round_trip(torch.zeros(0, device=device), False)
    assert empty[0].shape == (0,) and empty[1].shape == (0,) and empty[2].shape == (0,)


def test_an_outlier_coarsens_its_block_only(device):
    # the paper's case for blocks: one large value spoils the precision of its block, not of
    # the tensor (the other blocks keep about 1.2% of relative error); with one scale for the
    # whole tensor the others, 10^-8 of it and less, are below the map's seven decades and
    # round to zero
    gen = torch.Generator().manual_seed(2)
    x = (torch.randn(4 * 2048, generator=gen) * 1e-3).to(device)
    x[0] = 1e5
    _, _, blockwise = round_trip(x, True, 2048)
    _, _, whole = round_trip(x, True, 4 * 2048)
    rest = slice(2048, None)
    error = lambda y: ((x[rest] - y[rest]).norm() / x[rest].norm()).item()  # noqa: E731
    assert error(blockwise) < 0.02 and error(whole) == 1.0, (error(blockwise), error(whole))


# -- bytes -------------------------------------------------------------------------------


@pytest.mark.parametrize(("n", "block_size"), [(2048 * 10, 2048), (5000, 2048), (7, 4), (0, 2)])
def test_bytes_are_one_a_value_and_four_a_block(n, block_size, device):
    codes, absmax, _ = round_trip(states(n, True, device), True, block_size)
    measured = codes.numel() * codes.element_size() + absmax.numel() * absmax.element_size()
    assert measured == quantized_bytes(n, block_size) == n + 4 * math.ceil(n / block_size)
    if n == 2048 * 10:
        assert measured / n == 1 + 4 / 2048  # 1.002 bytes a value, against float32's 4


# -- bad input ---------------------------------------------------------------------------


def test_bad_input_is_refused_by_name():
    code, x = dynamic_map(), torch.ones(10)
    codes, absmax = quantize_blockwise(x, code, 4)
    with pytest.raises(TypeError, match=r"Invalid x: torch.int64 \(expected a floating tensor"):
        quantize_blockwise(torch.ones(3, dtype=torch.long), code)
    with pytest.raises(TypeError, match=r"Invalid x: list"):
        quantize_blockwise([1.0], code)
    with pytest.raises(TypeError, match=r"Invalid code: torch.int64"):
        quantize_blockwise(x, torch.arange(256))
    with pytest.raises(ValueError, match=r"Invalid code: a tensor of shape \(300,\)"):
        quantize_blockwise(x, torch.linspace(-1, 1, 300))
    with pytest.raises(ValueError, match=r"Invalid code: a tensor of shape \(16, 16\)"):
        dequantize_blockwise(codes, absmax, code.view(16, 16), (10,), 4)
    for bad, error in [(0, ValueError), (2.0, TypeError), (True, TypeError)]:
        with pytest.raises(error, match=r"Invalid block_size: .* \(expected an int >= 1\)"):
            quantize_blockwise(x, code, bad)
        with pytest.raises(error, match=r"Invalid block_size"):
            dequantize_blockwise(codes, absmax, code, (10,), bad)
    with pytest.raises(TypeError, match=r"Invalid codes: torch.int64 \(expected a uint8"):
        dequantize_blockwise(codes.long(), absmax, code, (10,), 4)
    with pytest.raises(ValueError, match=r"Invalid shape: \(3, 4\), 12 values \(expected 10"):
        dequantize_blockwise(codes, absmax, code, (3, 4), 4)
    with pytest.raises(
        ValueError, match=r"Invalid absmax: \(3,\) \(expected a 1-D tensor of 5 block scales"
    ):
        # blocks of 4 were quantized; blocks of 2 would need 5 scales
        dequantize_blockwise(codes, absmax, code, (10,), 2)
    with pytest.raises(TypeError, match=r"Invalid signed: 1 \(expected True or False\)"):
        dynamic_map(1)
    with pytest.raises(ValueError, match=r"Invalid n: -1"):
        quantized_bytes(-1)
