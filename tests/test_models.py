"""Tests of lsdl_lab.models: the MLP, the CIFAR ResNet (He et al., 2016), the GPT, ghost
batch normalization (Hoffer et al., 2017) and the clear errors of each."""

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from lsdl_lab import models, profiles
from lsdl_lab.models import MLP, GhostBatchNorm2d, ResNet, ghost_batch_norm

EXACT = dict(rtol=0.0, atol=0.0)


@pytest.mark.parametrize("hw,channels", [(8, 1), (28, 1), (32, 3)])
def test_resnet_input_sizes(hw, channels, device):
    m = models.ResNet(depth=8, width=4, num_classes=10, in_channels=channels).to(device)
    assert m(torch.randn(2, channels, hw, hw, device=device)).shape == (2, 10)


def test_resnet20_has_the_papers_parameter_count():
    # He et al. (2016), Table 6: ResNet-20 has 0.27M parameters. Our 1x1 projection
    # shortcuts (option B) add a few thousand over option A's parameter-free ones.
    n = models.ResNet(20, 16, 10, 3).num_parameters()
    assert 0.27e6 <= n <= 0.28e6


def test_resnet_depth_sets_block_count():
    for depth, n in [(8, 1), (14, 2), (20, 3)]:
        m = models.ResNet(depth, 4, 10, 1)
        assert len(m.blocks) == 3 * n


@pytest.mark.parametrize("depth", [7, 10, 2, -4])
def test_resnet_bad_depth(depth):
    with pytest.raises(ValueError, match=r"Invalid depth: .* \(expected 6n \+ 2"):
        models.ResNet(depth=depth)


@pytest.mark.parametrize(
    "kwargs,error,name",
    [
        (dict(depth="20"), TypeError, "depth"),
        (dict(depth=20.0), TypeError, "depth"),
        (dict(width=0), ValueError, "width"),
        (dict(width=True), TypeError, "width"),
        (dict(num_classes=1), ValueError, "num_classes"),
        (dict(in_channels=None), TypeError, "in_channels"),
    ],
)
def test_resnet_bad_arguments(kwargs, error, name):
    with pytest.raises(error, match=f"Invalid {name}:"):
        models.ResNet(**kwargs)


def test_resnet_rejects_too_small_input():
    with pytest.raises(ValueError, match="H, W >= 8"):
        models.ResNet(8, 4, 10, 1)(torch.randn(1, 1, 4, 4))


def test_mlp_counts_and_shapes():
    m = models.MLP(64, 10, hidden=32, depth=2)
    assert m.num_parameters() == 64 * 32 + 32 + 32 * 32 + 32 + 32 * 10 + 10
    m.net[1].weight.requires_grad_(False)
    assert models.count_parameters(m) == m.num_parameters() == 32 + 32 * 32 + 32 + 32 * 10 + 10
    assert models.count_parameters(m, trainable_only=False) == 64 * 32 + m.num_parameters()
    with pytest.raises(TypeError, match="Invalid trainable_only"):
        models.count_parameters(m, trainable_only="no")
    assert m(torch.randn(5, 1, 8, 8)).shape == (5, 10)
    assert models.MLP(4, 3, depth=0).num_parameters() == 4 * 3 + 3


@pytest.mark.parametrize(
    "kwargs,error,name",
    [
        ({"hidden": 0}, ValueError, "hidden"),
        ({"depth": -1}, ValueError, "depth"),
        ({"num_classes": 0}, ValueError, "num_classes"),
        ({"in_features": 2.5}, TypeError, "in_features"),
        ({"depth": "2"}, TypeError, "depth"),
    ],
)
def test_mlp_bad_arguments(kwargs, error, name):
    args = {"in_features": 4, "num_classes": 3, **kwargs}
    with pytest.raises(error, match=f"Invalid {name}:"):
        models.MLP(**args)


def test_gpt_is_causal(device):
    torch.manual_seed(0)
    m = models.GPT(vocab_size=11, block_size=16, layers=2, heads=2, dim=16).to(device).eval()
    idx = torch.randint(11, (1, 16)).to(device)
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
@given(batch=st.integers(1, 3), t=st.integers(1, 16), heads=st.sampled_from([1, 2, 4]))
def test_gpt_output_shape(batch, t, heads, device):
    m = models.GPT(vocab_size=7, block_size=16, layers=1, heads=heads, dim=8).to(device)
    assert m(torch.randint(7, (batch, t), device=device)).shape == (batch, t, 7)


def test_gpt_rejects_long_sequences_and_bad_heads():
    m = models.GPT(vocab_size=7, block_size=4, layers=1, heads=2, dim=8)
    with pytest.raises(ValueError, match="block_size=4"):
        m(torch.zeros(1, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="Invalid heads: 3 .*divisor of dim = 8"):
        models.GPT(vocab_size=7, heads=3, dim=8)
    with pytest.raises(ValueError, match="Invalid dropout"):
        models.GPT(vocab_size=7, dropout=1.0)
    with pytest.raises(TypeError, match="Invalid dropout"):
        models.GPT(vocab_size=7, dropout="0.1")
    with pytest.raises(TypeError, match="Invalid layers"):
        models.GPT(vocab_size=7, layers=2.0)
    with pytest.raises(ValueError, match="Invalid vocab_size"):
        models.GPT(vocab_size=0)


def test_generate_is_seeded(device):
    m = models.GPT(vocab_size=7, block_size=4, layers=1, heads=2, dim=8).to(device)
    start = torch.zeros(1, 1, dtype=torch.long, device=device)
    # a CPU generator (as lsdl_lab's seeded ones) also for a model on the GPU
    a = m.generate(start, 10, generator=torch.Generator().manual_seed(1))
    b = m.generate(start, 10, generator=torch.Generator().manual_seed(1))
    assert a.shape == (1, 11) and a.device.type == device.type and torch.equal(a, b)
    unseeded = m.generate(start, 3)  # torch's global generator, on the device
    assert unseeded.device.type == device.type
    with pytest.raises(ValueError, match="Invalid temperature"):
        m.generate(start, 3, temperature=0.0)
    with pytest.raises(TypeError, match="Invalid new_tokens"):
        m.generate(start, 3.0)


def test_models_for_profiles_grow():
    sizes = [
        models.resnet_for(profiles.PROFILES[n], 10, 3).num_parameters()
        for n in ("smoke", "cpu", "gpu")
    ]
    assert sizes == sorted(sizes)
    gpts = [models.gpt_for(profiles.PROFILES[n], 65).num_parameters() for n in profiles.PROFILES]
    assert gpts == sorted(gpts) and gpts[-1] > 10e6  # the gpu GPT is nanoGPT's char model size


# -- ghost batch normalization (Hoffer et al., 2017) ------------------------------------------


def bn_pair(ghost_batch_size, seed=0, device="cpu", **kwargs):
    torch.manual_seed(seed)
    bn = nn.BatchNorm2d(3, **kwargs).double()
    with torch.no_grad():
        if bn.affine:
            bn.weight.uniform_(0.5, 2.0)
            bn.bias.uniform_(-1.0, 1.0)
    ghost = GhostBatchNorm2d(3, ghost_batch_size, **kwargs).double()
    ghost.load_state_dict(bn.state_dict())
    return bn.to(device), ghost.to(device)


def images(n, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    return (2 * torch.randn(n, 3, 4, 4, generator=gen, dtype=torch.float64) + 1).to(device)


def assert_same_state(a, b):
    for (k, u), v in zip(a.state_dict().items(), b.state_dict().values()):
        torch.testing.assert_close(u, v, rtol=1e-12, atol=1e-12, msg=k)


@pytest.mark.parametrize("ghost_batch_size", [16, 100])
def test_ghost_batch_holding_the_whole_batch_is_batchnorm(ghost_batch_size, device):
    bn, ghost = bn_pair(ghost_batch_size, device=device)
    x = images(16, device=device)
    torch.testing.assert_close(ghost(x), bn(x), **EXACT)
    assert_same_state(ghost, bn)


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(2, 40),
    ghost_batch_size=st.integers(2, 12),
    momentum=st.sampled_from([0.1, 0.5, None]),
)
def test_each_ghost_batch_is_normalized_with_its_own_statistics(
    n, ghost_batch_size, momentum, device
):
    # x.split(ghost_batch_size): when n is not a multiple, the last ghost batch is smaller.
    bn, ghost = bn_pair(ghost_batch_size, device=device, momentum=momentum)
    x = images(n, device=device)
    chunks = x.split(ghost_batch_size)
    expected = torch.cat([bn(c) for c in chunks])  # running statistics: one update a chunk
    torch.testing.assert_close(ghost(x), expected, rtol=1e-12, atol=1e-12)
    assert_same_state(ghost, bn)
    assert ghost.num_batches_tracked.item() == len(chunks)


def test_ghost_batch_norm_differs_from_batchnorm_and_matches_it_in_eval(device):
    bn, ghost = bn_pair(4, device=device)
    x = images(16, device=device)
    assert not torch.allclose(ghost(x), bn(x))  # four ghost batches, not one batch
    ghost.load_state_dict(bn.state_dict())  # their running statistics moved differently
    bn.eval(), ghost.eval()
    torch.testing.assert_close(ghost(x), bn(x), **EXACT)


def test_ghost_batch_norm_replaces_every_batchnorm_in_place(device):
    torch.manual_seed(0)
    model = ResNet(depth=8, width=4, num_classes=10, in_channels=1).to(device)
    x = torch.randn(8, 1, 8, 8).to(device)
    model(x)  # training mode: running statistics move away from their initial values
    model.eval()
    reference = copy.deepcopy(model)
    assert ghost_batch_norm(model, 2) is model
    kinds = [type(m) for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    assert len(kinds) == 9 and set(kinds) == {GhostBatchNorm2d}  # stem, 3 x 2, 2 shortcuts
    assert not model.training and "ghost_batch_size=2" in repr(model.stem[1])
    torch.testing.assert_close(model(x), reference(x), **EXACT)  # same parameters and buffers
    model.train()
    assert model(x).shape == (8, 10)
    assert ghost_batch_norm(model, 4).stem[1].ghost_batch_size == 4
    single = ghost_batch_norm(nn.BatchNorm2d(3, device=device), 2)
    assert isinstance(single, GhostBatchNorm2d) and single.running_mean.device.type == device.type


@pytest.mark.parametrize("bad", [0, -2])
def test_ghost_batch_size_must_be_positive(bad):
    with pytest.raises(ValueError, match="Invalid ghost_batch_size"):
        GhostBatchNorm2d(3, bad)
    with pytest.raises(ValueError, match="Invalid ghost_batch_size"):
        ghost_batch_norm(MLP(4, 2), bad)


@pytest.mark.parametrize("bad", [2.0, True, None, "4"])
def test_ghost_batch_size_must_be_an_int(bad):
    with pytest.raises(TypeError, match="Invalid ghost_batch_size"):
        GhostBatchNorm2d(3, bad)
    with pytest.raises(TypeError, match="Invalid ghost_batch_size"):
        ghost_batch_norm(MLP(4, 2), bad)
