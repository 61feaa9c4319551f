import torch

from lsdl_lab.compress import RandomK, TopK


def test_topk_keeps_the_largest_magnitudes(device):
    g = torch.tensor([0.1, -5.0, 2.0, 0.0, 3.0, -0.2, 1.0, 0.5, -4.0, 0.3], device=device)
    out = TopK(0.3).decompress(TopK(0.3).compress(g))
    assert torch.equal(out.cpu(), torch.tensor([0, -5.0, 0, 0, 3.0, 0, 0, 0, -4.0, 0]))


def test_randomk_indices_are_shared_by_seed_distinct_and_change_each_step():
    a, b, c = RandomK(0.1, seed=7), RandomK(0.1, seed=7), RandomK(0.1, seed=8)
    first = a.indices(1000, 0)
    assert first.numel() == 100 and first.unique().numel() == 100  # without replacement
    assert torch.equal(first, b.indices(1000, 0))
    assert not torch.equal(first, c.indices(1000, 0))
    assert not torch.equal(first, a.indices(1000, 1))


def test_randomk_payloads_of_two_ranks_sum(device):
    rank0, rank1 = RandomK(0.3, seed=5), RandomK(0.3, seed=5)
    g0, g1 = (torch.randn(20, dtype=torch.float64).to(device) for _ in range(2))
    p0, p1 = rank0.compress(g0), rank1.compress(g1)
    summed = p0._replace(values=p0.values + p1.values)
    both = rank0.decompress(p0) + rank1.decompress(p1)
    assert torch.allclose(rank0.decompress(summed), both, rtol=0, atol=1e-12)


def test_randomk_scaling(device):
    g = torch.ones(10, device=device)
    scaled = RandomK(0.2, seed=0).decompress(RandomK(0.2, seed=0).compress(g))
    plain = RandomK(0.2, seed=0, scaled=False)
    assert sorted(scaled.tolist()) == [0.0] * 8 + [5.0] * 2  # d / k = 5
    assert plain.decompress(plain.compress(g)).sum() == 2
