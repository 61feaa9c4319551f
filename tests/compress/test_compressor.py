"""The contract every compressor keeps: shapes, bytes measured equal to the stated formula,
no NaN on a zero tensor, the flat wire format, and (for the unbiased ones) unbiasedness by
Monte Carlo."""

import math

import pytest
import torch

from lsdl_lab.compress import QSGD, ErrorFeedback, PowerSGD, RandomK, SignSGD, TernGrad, TopK
from lsdl_lab.compress.compressor import flatten_payload, payload_nbytes, unflatten_payload


def _k(ratio, d):
    return max(1, round(ratio * d))


# (compressor, bytes of a float32 tensor of shape (n, m) according to the stated formula)
COMPRESSORS = {
    "sign": (lambda: SignSGD(), lambda n, m: math.ceil(n * m / 8) + 4),
    "sign+ef": (lambda: ErrorFeedback(SignSGD()), lambda n, m: math.ceil(n * m / 8) + 4),
    "terngrad": (lambda: TernGrad(seed=0), lambda n, m: math.ceil(2 * n * m / 8) + 4),
    "qsgd1": (lambda: QSGD(1, seed=0), lambda n, m: math.ceil(2 * n * m / 8) + 4),
    "qsgd2": (lambda: QSGD(2, seed=0), lambda n, m: math.ceil(3 * n * m / 8) + 4),
    "qsgd8": (lambda: QSGD(8, seed=0), lambda n, m: math.ceil(5 * n * m / 8) + 4),
    "qsgd127": (lambda: QSGD(127, seed=0), lambda n, m: n * m + 4),
    "topk": (lambda: TopK(0.1), lambda n, m: 8 * _k(0.1, n * m)),
    "randomk": (lambda: RandomK(0.25, seed=3), lambda n, m: 4 * _k(0.25, n * m)),
    "powersgd": (lambda: PowerSGD(2), lambda n, m: 4 * (n + m) * min(2, n, m)),
}
SHAPES = [(1, 1), (7, 1), (1, 8), (3, 3), (100, 1), (13, 77)]


@pytest.mark.parametrize("name", COMPRESSORS)
@pytest.mark.parametrize("shape", SHAPES)
def test_bytes_measured_equal_formula(name, shape, device):
    make, formula = COMPRESSORS[name]
    compressor = make()
    payload = compressor.compress(torch.randn(shape).to(device))
    assert compressor.nbytes(payload) == payload_nbytes(payload) == formula(*shape)
    out = compressor.decompress(payload)
    assert out.shape == shape and out.device.type == device.type


def test_packed_payloads_are_really_packed(device):
    d = 1000
    sign = SignSGD().compress(torch.randn(d).to(device))
    assert sign.bits.dtype == torch.uint8 and sign.bits.numel() == d // 8
    tern = TernGrad(seed=0).compress(torch.randn(d).to(device))
    assert tern.bits.dtype == torch.uint8 and tern.bits.numel() == d // 4
    sparse = TopK(0.01).compress(torch.randn(d).to(device))
    assert sparse.indices.dtype == torch.int32 and sparse.values.numel() == 10
    randomk = RandomK(0.01).compress(torch.randn(d).to(device))
    assert [type(t) for t in randomk[1:]] == [int, torch.Size]


@pytest.mark.parametrize("name", COMPRESSORS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_zero_tensor_gives_zeros_not_nan(name, dtype, device):
    compressor = COMPRESSORS[name][0]()
    zeros = torch.zeros(6, 5, dtype=dtype, device=device)
    for _ in range(2):  # the second call warm-starts PowerSGD from a zero Q
        out = compressor.decompress(compressor.compress(zeros))
        assert out.dtype == dtype and torch.equal(out, zeros)


@pytest.mark.parametrize("name", COMPRESSORS)
def test_flat_wire_format_round_trips(name, device):
    compressor = COMPRESSORS[name][0]()
    payload = compressor.compress(torch.randn(9, 5).to(device))
    wire = flatten_payload(payload)
    assert wire.dtype == torch.uint8 and wire.numel() == compressor.nbytes(payload)
    assert wire.device.type == device.type
    back = unflatten_payload(wire.clone(), payload)
    assert torch.equal(compressor.decompress(back), compressor.decompress(payload))


def test_bad_arguments():
    for ratio in (0, -0.1, 1.5, math.nan):
        with pytest.raises(ValueError, match="Invalid ratio"):
            TopK(ratio)
        with pytest.raises(ValueError, match="Invalid ratio"):
            RandomK(ratio, seed=0)
    with pytest.raises(TypeError, match="Invalid ratio"):
        TopK("0.1")
    with pytest.raises(ValueError, match="Invalid levels: 0"):
        QSGD(0)
    with pytest.raises(TypeError, match="Invalid levels"):
        QSGD(2.0)
    with pytest.raises(ValueError, match="Invalid rank: 0"):
        PowerSGD(0)
    with pytest.raises(TypeError, match="Invalid scaled"):
        RandomK(0.1, seed=0, scaled=1)
    with pytest.raises(TypeError, match="Invalid seed"):
        TernGrad(seed=0.5)
    assert TopK(1).compress(torch.randn(5)).values.numel() == 5  # ratio 1 is allowed


def _monte_carlo(compressor, g, n):
    """Mean and standard error of decompress(compress(g)) over n draws, per entry."""
    draws = torch.stack([compressor.decompress(compressor.compress(g)) for _ in range(n)])
    return draws.mean(0), draws.std(0) / math.sqrt(n)


UNBIASED = {
    "terngrad": lambda: TernGrad(seed=1),
    "qsgd1": lambda: QSGD(1, seed=1),
    "qsgd3": lambda: QSGD(3, seed=1),
    "qsgd16": lambda: QSGD(16, seed=1),
    "randomk-scaled": lambda: RandomK(0.2, seed=1),
}


def _within_standard_errors(mean, se, g):
    # For an unbiased compressor E||mean - g||^2 = sum_i Var_i / n, estimated by sum_i se_i^2.
    # Pooled over the entries, not entry by entry: an entry rounded up with probability 0.999
    # often shows no spread at all in 1000 draws, though its mean is not exactly g.
    return bool((mean - g).square().sum() <= 4 * se.square().sum())


@pytest.mark.parametrize("name", UNBIASED)
def test_unbiased_by_monte_carlo(name, device):
    g = torch.randn(40, dtype=torch.float64).to(device)
    g[3] = 0.0
    mean, se = _monte_carlo(UNBIASED[name](), g, 1000)
    assert (se > 0).sum() >= 30, "the draws must actually vary"
    assert _within_standard_errors(mean, se, g)


@pytest.mark.parametrize("make", [lambda: RandomK(0.2, seed=1, scaled=False), lambda: SignSGD()])
def test_the_same_check_detects_a_biased_compressor(make, device):
    g = torch.randn(40, dtype=torch.float64).to(device)
    mean, se = _monte_carlo(make(), g, 1000)
    assert not _within_standard_errors(mean, se, g)
