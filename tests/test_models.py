import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lsdl_lab import models, scale


@pytest.mark.parametrize("hw,channels", [(8, 1), (28, 1), (32, 3)])
def test_resnet_input_sizes(hw, channels):
    m = models.ResNet(depth=8, width=4, num_classes=10, in_channels=channels)
    assert m(torch.randn(2, channels, hw, hw)).shape == (2, 10)


def test_resnet20_has_the_papers_parameter_count():
    # He et al. (2016), Table 6: ResNet-20 has 0.27M parameters. Our 1x1 projection
    # shortcuts (option B) add a few thousand over option A's parameter-free ones.
    n = models.ResNet(20, 16, 10, 3).num_parameters()
    assert 0.27e6 <= n <= 0.28e6


def test_resnet_depth_sets_block_count():
    for depth, n in [(8, 1), (14, 2), (20, 3)]:
        m = models.ResNet(depth, 4, 10, 1)
        assert len(m.blocks) == 3 * n


@pytest.mark.parametrize("depth", [7, 10, 2, "20"])
def test_resnet_bad_depth(depth):
    with pytest.raises(ValueError, match="Invalid depth"):
        models.ResNet(depth=depth)


def test_resnet_rejects_too_small_input():
    with pytest.raises(ValueError, match="H, W >= 8"):
        models.ResNet(8, 4, 10, 1)(torch.randn(1, 1, 4, 4))


def test_mlp_counts_and_shapes():
    m = models.MLP(64, 10, hidden=32, depth=2)
    assert m.num_parameters() == 64 * 32 + 32 + 32 * 32 + 32 + 32 * 10 + 10
    assert m(torch.randn(5, 1, 8, 8)).shape == (5, 10)
    assert models.MLP(4, 3, depth=0).num_parameters() == 4 * 3 + 3


@pytest.mark.parametrize("kwargs", [{"hidden": 0}, {"depth": -1}, {"in_features": 2.5}])
def test_mlp_bad_arguments(kwargs):
    args = {"in_features": 4, "num_classes": 3, **kwargs}
    with pytest.raises(ValueError, match="Invalid"):
        models.MLP(**args)


def test_gpt_is_causal():
    torch.manual_seed(0)
    m = models.GPT(vocab_size=11, block_size=16, layers=2, heads=2, dim=16).eval()
    idx = torch.randint(11, (1, 16))
    changed = idx.clone()
    changed[0, 10:] = (changed[0, 10:] + 1) % 11
    a, b = m(idx), m(changed)
    assert torch.allclose(a[0, :10], b[0, :10], atol=1e-6)  # the past cannot see the future
    assert not torch.allclose(a[0, 10:], b[0, 10:])


def test_gpt_ties_weights_and_counts_them_once():
    m = models.GPT(vocab_size=50, block_size=8, layers=1, heads=2, dim=8)
    assert m.head.weight is m.tok.weight
    assert m.num_parameters() == sum(p.numel() for p in set(m.parameters()))


@settings(max_examples=15, deadline=None)
@given(st.integers(1, 3), st.integers(1, 16), st.sampled_from([1, 2, 4]))
def test_gpt_output_shape(batch, t, heads):
    m = models.GPT(vocab_size=7, block_size=16, layers=1, heads=heads, dim=8)
    assert m(torch.randint(7, (batch, t))).shape == (batch, t, 7)


def test_gpt_rejects_long_sequences_and_bad_heads():
    m = models.GPT(vocab_size=7, block_size=4, layers=1, heads=2, dim=8)
    with pytest.raises(ValueError, match="block_size=4"):
        m(torch.zeros(1, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="Invalid heads"):
        models.GPT(vocab_size=7, heads=3, dim=8)
    with pytest.raises(ValueError, match="Invalid dropout"):
        models.GPT(vocab_size=7, dropout=1.0)


def test_generate_is_seeded():
    m = models.GPT(vocab_size=7, block_size=4, layers=1, heads=2, dim=8)
    start = torch.zeros(1, 1, dtype=torch.long)
    a = m.generate(start, 10, generator=torch.Generator().manual_seed(1))
    b = m.generate(start, 10, generator=torch.Generator().manual_seed(1))
    assert a.shape == (1, 11) and torch.equal(a, b)


def test_models_for_profiles_grow():
    sizes = [
        models.resnet_for(scale.PROFILES[n], 10, 3).num_parameters()
        for n in ("smoke", "cpu", "gpu")
    ]
    assert sizes == sorted(sizes)
    gpts = [models.gpt_for(scale.PROFILES[n], 65).num_parameters() for n in ("smoke", "cpu", "gpu")]
    assert gpts == sorted(gpts) and gpts[-1] > 10e6  # the gpu GPT is nanoGPT's char model size
