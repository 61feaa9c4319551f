"""Tests of lsdl_lab.data.batches: batch sources, pure functions of the step.

* BatchSource: the interface every batch source subclasses, with ``steps_per_epoch``.
* Each epoch reads each example once, in the order of epoch_permutation (one stream per
  seed and epoch, the same for ImageBatches and GrowingBatches).
* GrowingBatches: batch sizes as scheduled, a pure function of the step, usable by fit.
* Bad input: a ValueError (TypeError for a wrong type) naming the argument.
"""

from __future__ import annotations

import hashlib
import math
import random
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lsdl_lab import data as D
from lsdl_lab import optim
from lsdl_lab.data import BatchSource, GrowingBatches, ImageBatches
from lsdl_lab.schedules import batch_size_schedule, constant
from lsdl_lab.train import fit

# -- the interface -----------------------------------------------------------------------


def test_batch_sources_share_one_interface():
    x, y = _indexed(10)
    image = ImageBatches(x, y, 3, drop_last=False)
    text = D.TextBatches(torch.arange(50), 4, 2)
    growing = GrowingBatches(x, y, lambda epoch: 2)
    for source in (image, text, growing):
        assert isinstance(source, BatchSource)
    assert image.steps_per_epoch == 4 and text.steps_per_epoch is None
    assert growing.steps_per_epoch is None  # its epochs change length
    with pytest.raises(TypeError, match="abstract"):
        BatchSource()


def test_a_new_batch_source_needs_only_call(device):
    class Constant(BatchSource):
        steps_per_epoch = 1

        def __call__(self, step):
            return torch.ones(2, 3), torch.zeros(2, dtype=torch.long)

    model = torch.nn.Linear(3, 2, device=device)  # fit moves the CPU batches to it
    opt = optim.SGD(model.parameters(), lr=0.1)
    history = fit(model, opt, Constant(), epochs=2, progress=False, log_every=1)
    assert len(history.train) == 2


# -- epoch permutations ------------------------------------------------------------------


def _seed(*parts) -> int:
    """The stream of a use, written out: blake2b of the parts' repr, 63 bits."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@pytest.mark.parametrize("n, seed, epoch", [(10, 0, 0), (37, 5, 3), (1, 2, 0)])
def test_epoch_permutation_is_its_own_seeded_stream(n, seed, epoch, device):
    expected = torch.randperm(
        n, generator=torch.Generator().manual_seed(_seed("epoch", seed, epoch))
    )
    assert torch.equal(D.epoch_permutation(n, seed, epoch), expected)
    x, y = _indexed(n)
    order = ImageBatches(x, y, n, seed=seed, device=device)(epoch)[1]
    # the same order on every device
    assert order.device.type == device.type and torch.equal(order.cpu(), expected)
    growing = GrowingBatches(x, y, lambda e: n, seed=seed, device=device)
    assert torch.equal(growing(epoch)[1].cpu(), expected)


def _indexed(n: int, hw: int = 4):
    """Examples whose pixels and labels are their own index, so batches reveal the order."""
    x = torch.arange(n, dtype=torch.float32).view(n, 1, 1, 1).expand(n, 2, hw, hw).clone()
    return x, torch.arange(n)


def test_image_batches_are_a_function_of_the_step(device):
    x, y = _indexed(50)
    a = D.ImageBatches(x, y, 8, seed=1, augment=True, device=device)
    first = a(7)
    assert first[0].device.type == first[1].device.type == device.type
    for step in (30, 0, 13, 7):
        a(step)
    b = D.ImageBatches(x, y, 8, seed=1, augment=True, device=device)
    for got in (a(7), b(7)):
        assert torch.equal(got[0], first[0]) and torch.equal(got[1], first[1])


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 60), data=st.data(), seed=st.integers(0, 2**40), drop_last=st.booleans())
def test_each_epoch_reads_each_example_once(n, data, seed, drop_last, device):
    bs = data.draw(st.integers(1, n))
    x, y = _indexed(n)
    batches = D.ImageBatches(x, y, bs, seed=seed, drop_last=drop_last, device=device)
    assert len(batches) == (n // bs if drop_last else -(-n // bs))
    for epoch in (0, 3):
        seen = torch.cat([batches(epoch * len(batches) + i)[1] for i in range(len(batches))])
        assert len(set(seen.tolist())) == len(seen)
        assert len(seen) == (len(batches) * bs if drop_last else n)
        xb, yb = batches(epoch * len(batches))
        assert torch.equal(xb[:, 0, 0, 0].long(), yb)  # images travel with their labels


def test_epochs_and_seeds_differ_and_shuffle_off_is_in_order():
    x, y = _indexed(64)
    a = D.ImageBatches(x, y, 64, seed=0)
    assert not torch.equal(a(0)[1], a(1)[1])  # epoch 0 against epoch 1
    assert sorted(a(0)[1].tolist()) == list(range(64))
    assert not torch.equal(a(0)[1], D.ImageBatches(x, y, 64, seed=1)(0)[1])
    ordered = D.ImageBatches(x, y, 16, shuffle=False)
    assert torch.equal(torch.cat([ordered(i)[1] for i in range(4)]), y)


def test_augmentation_is_crop_and_flip_per_step(device):
    x = torch.randn(32, 3, 8, 8)
    y = torch.zeros(32, dtype=torch.long)
    batches = D.ImageBatches(x, y, 32, shuffle=False, augment=True, seed=5, device=device)
    xb, _ = batches(0)
    assert xb.shape == x.shape and torch.equal(xb, batches(0)[0])
    assert not torch.equal(xb, batches(1)[0])  # same examples, other step, other crops
    # Against a per-example reference on the CPU that draws the same random numbers (the
    # generator is a CPU one whatever the device of the pixels).
    g = torch.Generator().manual_seed(123)
    got = D.random_crop_flip(x.to(device), torch.Generator().manual_seed(123))
    assert got.device.type == device.type
    got = got.cpu()
    offsets = torch.randint(0, 9, (2, 32), generator=g)
    flip = torch.rand(32, generator=g) < 0.5
    padded = torch.nn.functional.pad(x, (4, 4, 4, 4))
    for i in range(32):
        dy, dx = offsets[:, i].tolist()
        crop = padded[i, :, dy : dy + 8, dx : dx + 8]
        assert torch.equal(got[i], crop.flip(-1) if flip[i] else crop)
    assert 0 < flip.sum() < 32


@pytest.mark.parametrize("bad, error", [(0, ValueError), (11, ValueError), (2.0, TypeError)])
def test_image_batches_bad_batch_size(bad, error):
    x, y = _indexed(10)
    with pytest.raises(error, match=r"batch_size: .*\[1, 10\]"):
        D.ImageBatches(x, y, bad)
    with pytest.raises(ValueError, match="step"):
        D.ImageBatches(x, y, 2)(-1)
    with pytest.raises(ValueError, match="x, y"):
        D.ImageBatches(x, y[:5], 2)


def test_eval_batches_in_order_keep_last(device):
    x, y = _indexed(10)
    batches = D.eval_batches(x, y, 4, device=device)
    assert [len(b[1]) for b in batches] == [4, 4, 2]
    assert all(t.device.type == device.type for b in batches for t in b)
    assert torch.equal(torch.cat([b[1] for b in batches]).cpu(), y)
    assert len(D.eval_batches(x, y, 4, max_batches=2)) == 2
    with pytest.raises(ValueError, match="max_batches"):
        D.eval_batches(x, y, 4, max_batches=0)


# -- text batches ----------------------------------------------------------------------


def test_text_batches_targets_are_next_tokens(device):
    tokens = torch.arange(1000) * 7 % 101
    batches = D.TextBatches(tokens, block_size=16, batch_size=5, seed=2, device=device)
    x, y = batches(3)
    assert x.shape == y.shape == (5, 16) and x.dtype == y.dtype == torch.int64
    assert x.device.type == y.device.type == device.type
    assert torch.equal(y[:, :-1], x[:, 1:])
    ramp = D.TextBatches(torch.arange(1000), 16, 5, seed=2, device=device)
    rx, ry = ramp(3)
    assert torch.equal(ry, rx + 1)
    assert torch.equal(rx, ramp(3)[0]) and not torch.equal(rx, ramp(4)[0])
    assert torch.equal(rx.cpu(), D.TextBatches(torch.arange(1000), 16, 5, seed=2)(3)[0])
    other_seed = D.TextBatches(torch.arange(1000), 16, 5, seed=3, device=device)
    assert not torch.equal(rx, other_seed(3)[0])


def test_text_batches_bad_block_size():
    tokens = torch.arange(20)
    for bad in (0, 20):
        with pytest.raises(ValueError, match=r"block_size: .*\[1, 19\]"):
            D.TextBatches(tokens, bad, 2)
    x, y = D.TextBatches(tokens, 19, 2)(0)  # the longest block: one possible window
    assert torch.equal(x[0], tokens[:19]) and torch.equal(y[0], tokens[1:])


def test_text_eval_batches_are_contiguous(device):
    tokens = torch.arange(103)
    batches = D.text_eval_batches(tokens, block_size=10, batch_size=4, device=device)
    assert [len(x) for x, _ in batches] == [4, 4, 2]
    assert all(x.device.type == y.device.type == device.type for x, y in batches)
    xs = torch.cat([x for x, _ in batches]).flatten()
    assert torch.equal(xs.cpu(), tokens[:100])
    on_device = D.text_eval_batches(tokens.to(device), block_size=10, batch_size=4)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(on_device, batches))
    assert all(torch.equal(y, x + 1) for x, y in batches)
    assert len(D.text_eval_batches(tokens, 10, 4, max_batches=1)) == 1


def test_flags_are_bools_and_sizes_are_ints():
    x, y = _indexed(10)
    for flag in ("shuffle", "drop_last", "augment"):
        with pytest.raises(TypeError, match=f"Invalid {flag}: 1 "):
            ImageBatches(x, y, 2, **{flag: 1})
    with pytest.raises(TypeError, match="Invalid batch_size: True"):
        ImageBatches(x, y, True)
    with pytest.raises(TypeError, match="Invalid seed: True"):
        ImageBatches(x, y, 2, seed=True)
    with pytest.raises(TypeError, match="Invalid step: True"):
        ImageBatches(x, y, 2)(True)
    with pytest.raises(TypeError, match="Invalid block_size: True"):
        D.TextBatches(torch.arange(20), True, 2)
    with pytest.raises(TypeError, match="Invalid max_batches: 1.0"):
        D.eval_batches(x, y, 4, max_batches=1.0)


def test_examples_must_be_tensors_of_matching_lengths():
    x, y = _indexed(10)
    with pytest.raises(TypeError, match="Invalid x: a list"):
        ImageBatches(x.tolist(), y, 2)
    with pytest.raises(ValueError, match=r"Invalid y: a tensor of shape \(10, 1\)"):
        D.eval_batches(x, y[:, None], 2)
    with pytest.raises(ValueError, match="Invalid x, y: lengths 0, 0"):
        ImageBatches(x[:0], y[:0], 1)
    assert D.eval_batches(x[:0], y[:0], 4) == []  # evaluating nothing is allowed
    with pytest.raises(ValueError, match=r"Invalid x: .*\(N, C, H, W\)"):
        ImageBatches(x.flatten(1), y, 2, augment=True)
    with pytest.raises(TypeError, match="Invalid tokens: a list"):
        D.text_eval_batches([1, 2, 3], 1, 1)
    with pytest.raises(ValueError, match="Invalid tokens: 1 tokens"):
        D.TextBatches(torch.arange(1), 1, 1)
    with pytest.raises(ValueError, match="Invalid padding: -1"):
        D.random_crop_flip(x, torch.Generator(), padding=-1)


# -- GrowingBatches ----------------------------------------------------------------------

N = 37


def growing(drop_last=False, seed=0, device=None):
    x = torch.arange(N, dtype=torch.float32).unsqueeze(1).repeat(1, 3)
    y = torch.arange(N)
    schedule = batch_size_schedule(4, [1, 2], 2)
    return GrowingBatches(x, y, schedule, seed, device, drop_last=drop_last)


def test_growing_batches_cover_each_example_once_per_epoch(device):
    b = growing(device=device)
    assert [b.epoch_start(e) for e in range(5)] == [0, 10, 15, 18, 21]  # ceil(37 / 4, 8, 16...)
    for e in range(4):
        size = [4, 8, 16, 16][e]
        seen = []
        for t in range(b.epoch_start(e), b.epoch_start(e + 1)):
            xb, yb = b(t)
            assert b.epoch(t) == e and len(yb) == b.batch_size(t)
            assert torch.equal(xb[:, 0].long(), yb)
            seen.append(yb)
        sizes = [len(s) for s in seen]
        assert sizes[:-1] == [size] * (len(sizes) - 1) and sizes[-1] == N - size * (len(sizes) - 1)
        assert sorted(torch.cat(seen).tolist()) == list(range(N))
        assert not torch.equal(torch.cat(seen).cpu(), torch.arange(N))  # shuffled


def test_growing_batches_drop_last():
    b = growing(drop_last=True)
    assert [b.epoch_start(e) for e in range(4)] == [0, 9, 13, 15]
    for e in range(3):
        ys = torch.cat([b(t)[1] for t in range(b.epoch_start(e), b.epoch_start(e + 1))])
        size = [4, 8, 16][e]
        assert len(ys) == (N // size) * size and len(set(ys.tolist())) == len(ys)
        assert all(b.batch_size(t) == size for t in range(b.epoch_start(e), b.epoch_start(e + 1)))


def test_growing_batches_are_a_pure_function_of_the_step():
    order = list(range(30))
    random.Random(0).shuffle(order)
    a, b = growing(seed=3), growing(seed=3)
    reference = {t: a(t) for t in range(30)}
    for t in order:  # a fresh object, visited out of order: same batches
        xb, yb = b(t)
        assert torch.equal(xb, reference[t][0]) and torch.equal(yb, reference[t][1])
    assert b.epoch(29) == a.epoch(29) and not torch.equal(growing(seed=4)(0)[1], a(0)[1])


def test_growing_batches_match_image_batches_under_a_constant_schedule(device):
    x, y = torch.randn(50, 2), torch.arange(50)
    ours = GrowingBatches(x, y, lambda epoch: 8, seed=5, device=device, drop_last=True)
    theirs = ImageBatches(x, y, batch_size=8, seed=5, device=device)
    assert ours.epoch_start(3) == 3 * theirs.steps_per_epoch
    for t in range(3 * theirs.steps_per_epoch):
        assert torch.equal(ours(t)[1], theirs(t)[1]) and torch.equal(ours(t)[0], theirs(t)[0])


def test_growing_batches_train_with_fit(device):
    torch.manual_seed(0)
    x, y = torch.randn(64, 5), torch.randint(0, 3, (64,))
    batches = GrowingBatches(x, y, batch_size_schedule(8, [1], 4), seed=0, device=device)
    model = torch.nn.Linear(5, 3).to(device)
    opt = optim.SGD(model.parameters(), lr=0.1)
    history = fit(model, opt, batches, steps=batches.epoch_start(3), progress=False, log_every=1)
    assert len(history.train) == 8 + 2 + 2
    assert all(math.isfinite(r["loss"]) for r in history.train)


BAD = [
    (lambda: growing()(-1), "Invalid step: -1 (expected an int >= 0)"),
    (lambda: growing().epoch_start(-2), "Invalid epoch: -2 (expected an int >= 0)"),
    (lambda: GrowingBatches(torch.zeros(5, 2), torch.zeros(4), constant()),
     "Invalid x, y: lengths 5, 4 (expected equal non-zero lengths)"),
    (lambda: GrowingBatches(torch.zeros(5, 2), torch.zeros(5), lambda e: 6)(0),
     "Invalid schedule(0): 6 (expected an int in [1, 5], the data set has 5 examples)"),
    (lambda: GrowingBatches(torch.zeros(5, 2), torch.zeros(5), lambda e: 2 - e).epoch_start(3),
     "Invalid schedule(2): 0 (expected an int >= 1)"),
]  # fmt: skip


@pytest.mark.parametrize("call, message", BAD)
def test_growing_batches_bad_input_names_argument_and_range(call, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        call()


@pytest.mark.parametrize(
    "call, name",
    [
        (lambda: GrowingBatches([1, 2], torch.zeros(2), constant()), "x"),
        (lambda: GrowingBatches(torch.zeros(2), torch.zeros(2), 4), "schedule"),
        (lambda: GrowingBatches(torch.zeros(2), torch.zeros(2), constant(), drop_last=1),
         "drop_last"),
        (lambda: GrowingBatches(torch.zeros(4), torch.zeros(4), lambda e: 2.0)(0), "schedule(0)"),
        (lambda: growing().epoch_start(True), "epoch"),
    ],
)  # fmt: skip
def test_growing_batches_wrong_types_raise_type_error(call, name):
    with pytest.raises(TypeError, match=f"Invalid {re.escape(name)}: "):
        call()
