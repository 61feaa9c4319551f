import math

import pytest
import torch

from lsdl_lab.compress import QSGD, SignSGD, TernGrad


def test_sign_is_the_scaled_sign(device):
    g = torch.tensor([3.0, -1.0, 0.0, -4.0], device=device)
    out = SignSGD().decompress(SignSGD().compress(g))
    expected = torch.tensor([2.0, -2.0, 2.0, -2.0], device=device)  # ||g||_1 / d = 2
    assert torch.equal(out, expected)


@pytest.mark.parametrize("seed", [0, None])  # a CPU generator, torch's global one
def test_terngrad_sends_max_norm_ternary_values(seed, device):
    g = torch.randn(500, dtype=torch.float64).to(device)
    out = TernGrad(seed=seed).decompress(TernGrad(seed=seed).compress(g))
    s = g.abs().max()
    assert set(torch.unique(out / s).tolist()) <= {-1.0, 0.0, 1.0}
    assert bool((out * g >= 0).all())  # never the opposite sign
    assert out.abs().max() == s  # the largest entry is kept with probability 1


@pytest.mark.parametrize(
    ("levels", "width"), [(1, 2), (2, 3), (3, 3), (4, 4), (7, 4), (8, 5), (127, 8), (128, 9)]
)
def test_qsgd_code_width_is_the_fewest_bits_for_2s_plus_1_levels(levels, width):
    assert QSGD(levels).width == width == math.ceil(math.log2(2 * levels + 1))


@pytest.mark.parametrize("seed", [0, None])  # a CPU generator, torch's global one
def test_qsgd_values_lie_on_the_grid_next_to_the_input(seed, device):
    g = torch.randn(300, dtype=torch.float64).to(device)
    s = 4
    out = QSGD(s, seed=seed).decompress(QSGD(s, seed=seed).compress(g))
    step = g.norm() / s
    levels = out / step
    assert torch.allclose(levels, levels.round(), atol=1e-9)
    assert bool(((out - g).abs() < step + 1e-12).all())  # rounded to a neighbouring level


@pytest.mark.parametrize("levels", [1, 2, 8])
def test_qsgd_variance_is_below_its_bound_and_matches_its_value(levels, device):
    d, n = 100, 600
    g = torch.randn(d, dtype=torch.float64).to(device)
    qsgd = QSGD(levels, seed=2)
    err = torch.stack([(qsgd.decompress(qsgd.compress(g)) - g).square().sum() for _ in range(n)])
    # exact variance: each entry is rounded between two levels l/s and (l+1)/s of ||g||
    r = levels * g.abs() / g.norm()
    p = r - r.floor()
    exact = (g.norm() / levels) ** 2 * (p * (1 - p)).sum()
    bound = min(d / levels**2, math.sqrt(d) / levels) * g.square().sum()
    assert exact <= bound
    assert abs(err.mean() - exact) < 5 * err.std() / math.sqrt(n)
    assert err.mean() + 5 * err.std() / math.sqrt(n) < bound
