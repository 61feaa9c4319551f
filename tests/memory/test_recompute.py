"""Activation checkpointing: exact gradients, and memory falling as Chen et al. (2016) say."""

import math

import pytest
import torch
from torch import nn

from lsdl_lab.memory.measure import SavedTensorBytes
from lsdl_lab.memory.recompute import (
    checkpoint_sequential,
    segments,
    sqrt_spacing,
    sweep,
    theoretical_peak,
)

L = 16


def _blocks(dtype=torch.float64, dropout=0.0, width=12, device="cpu"):
    torch.manual_seed(1)
    return [
        nn.Sequential(nn.Linear(width, width), nn.Dropout(dropout), nn.Tanh()).to(device, dtype)
        for _ in range(L)
    ]


def _grads(blocks, x, every, implementation, seed=5):
    for b in blocks:
        b.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    torch.manual_seed(seed)
    checkpoint_sequential(blocks, x, every, implementation).square().sum().backward()
    return [x.grad] + [p.grad for b in blocks for p in b.parameters()]


@pytest.mark.parametrize("implementation", ["lsdl", "torch"])
@pytest.mark.parametrize("every", [1, 3, 4, 16])
@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_gradients_equal_the_unchecked_run_bit_for_bit(implementation, every, dropout, device):
    # on CUDA the dropout masks come from the GPU's generator, whose state is replayed too
    blocks = _blocks(dropout=dropout, device=device)
    x = torch.randn(6, 12, dtype=torch.float64).to(device)
    plain = _grads(blocks, x, None, implementation)
    checked = _grads(blocks, x, every, implementation)
    assert all(torch.equal(a, b) for a, b in zip(plain, checked))


def test_random_stream_continues_as_without_checkpointing(device):
    blocks = _blocks(dropout=0.5, device=device)
    x = torch.randn(6, 12, dtype=torch.float64).to(device)
    _grads(blocks, x, None, "lsdl", seed=9)
    after_plain = torch.rand(4, device=device)  # the stream the dropout masks came from
    _grads(blocks, x, 4, "lsdl", seed=9)
    assert torch.equal(torch.rand(4, device=device), after_plain)


def test_recompute_keeps_the_autocast_setting(device):
    blocks = _blocks(dtype=torch.float32, device=device)
    x = torch.randn(6, 12).to(device)
    results = []
    for every in (None, 4):
        for b in blocks:
            b.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            y = checkpoint_sequential(blocks, x, every)
        assert y.dtype == torch.bfloat16
        y.float().sum().backward()
        results.append([p.grad for b in blocks for p in b.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_parameters_get_gradients_when_the_input_needs_none(device):
    blocks = _blocks(device=device)
    x = torch.randn(6, 12, dtype=torch.float64).to(device)  # requires_grad=False, as data is
    checkpoint_sequential(blocks, x, 4).sum().backward()
    assert all(p.grad is not None for b in blocks for p in b.parameters())


def test_activation_bytes_fall_as_the_theory_says(device):
    blocks = _blocks(width=32, device=device)
    x = torch.randn(8, 32, dtype=torch.float64).to(device)
    unit = x.numel() * 8  # one block keeps one (8, 32) float64 tensor: its Tanh output
    for every in (None, 1, 2, 4, 8, 16):
        with SavedTensorBytes(nn.ModuleList(blocks)) as c:
            checkpoint_sequential(blocks, x, every).sum().backward()
        assert c.peak == theoretical_peak(L, every) * unit, every
    k = sqrt_spacing(L)
    assert k == 4 and theoretical_peak(L, k) == 2 * math.sqrt(L) < theoretical_peak(L, None)


def test_torch_checkpoint_keeps_the_same_inputs(device):
    blocks = _blocks(width=32, device=device)
    x = torch.randn(8, 32, dtype=torch.float64).to(device)
    mine = sweep(blocks, x, [None, 2, 4, 8], "lsdl")
    torch_rows = sweep(blocks, x, [None, 2, 4, 8], "torch")
    assert [r["forward_bytes"] for r in mine] == [r["forward_bytes"] for r in torch_rows]
    assert mine[2]["forward_bytes"] == mine[0]["forward_bytes"] * 4 // (L + 1)


def test_sweep_shows_the_square_root_optimum_and_the_extra_forward(device):
    blocks = _blocks(width=32, device=device)
    rows = sweep(blocks, torch.randn(8, 32, dtype=torch.float64).to(device))
    assert [r["every"] for r in rows] == [None, 1, 2, 4, 8, 16]
    best = min(rows, key=lambda r: r["peak_bytes"])
    assert best["every"] == sqrt_spacing(L)
    assert best["peak_bytes"] <= 0.5 * rows[0]["peak_bytes"]
    assert rows[0]["block_forwards"] == L
    assert all(r["block_forwards"] == 2 * L for r in rows[1:])
    assert all(r["seconds"] > 0 for r in rows)


def test_segments_and_bad_arguments():
    assert segments(5, 2) == [(0, 2), (2, 4), (4, 5)]
    assert segments(3, None) == [(0, 1), (1, 2), (2, 3)]
    assert [sqrt_spacing(n) for n in (1, 2, 9, 16, 30)] == [1, 1, 3, 4, 5]
    assert theoretical_peak(5, 2) == 3 + 2
    blocks, x = _blocks(), torch.randn(2, 12, dtype=torch.float64)
    with pytest.raises(ValueError, match="Invalid every"):
        checkpoint_sequential(blocks, x, 0)
    with pytest.raises(TypeError, match="Invalid every"):
        checkpoint_sequential(blocks, x, 2.0)
    with pytest.raises(ValueError, match="Invalid implementation"):
        checkpoint_sequential(blocks, x, 2, "jax")
    with pytest.raises(TypeError, match="Invalid blocks"):
        checkpoint_sequential([], x, 2)
    with pytest.raises(TypeError, match="Invalid x"):
        checkpoint_sequential(blocks, [1.0], 2)


def test_the_book_gpt_blocks_with_dropout(device):
    from lsdl_lab.models import GPT

    s, b, h, layers = 16, 2, 32, 4
    gpt = GPT(50, s, layers, heads=4, dim=h, dropout=0.1).to(device, torch.float64)
    x = torch.randn(b, s, h, dtype=torch.float64).to(device)
    unit = s * b * h * 8  # one float64 activation of the residual stream
    results = {}
    for every in (None, 1, 2):
        gpt.zero_grad(set_to_none=True)
        xx = x.clone().requires_grad_()
        torch.manual_seed(3)
        with SavedTensorBytes(gpt) as c:
            y = checkpoint_sequential(gpt.blocks, xx, every)
            kept = c.live
            y.sum().backward()
        grads = [xx.grad] + [p.grad for p in gpt.blocks.parameters()]
        results[every] = (grads, kept, c.peak)
    plain, kept_plain, layer_total = results[None]
    layer = layer_total / layers  # one block's saved bytes, its own input included
    for every in (1, 2):
        grads, kept, peak = results[every]
        assert all(torch.equal(a, g) for a, g in zip(plain, grads))  # dropout replayed
        # Kept: each segment's input, p·sbh per segment (Korthikanti et al.'s full
        # recomputation at every=1); peak: those inputs, plus the last segment's blocks
        # recomputed (whose first block's input is the kept one, counted once).
        assert kept == layers // every * unit
        assert peak == kept - unit + every * layer
    assert kept_plain == layer_total > results[1][2]
