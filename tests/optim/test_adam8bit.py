"""Tests of lsdl_lab.optim.adam8bit: the state's bytes per parameter counted (2 + 8/2048 for
the two moments against Adam's 8); the trajectory on the book's GPT against float32 Adam within
a measured tolerance that a wrong rounding or a linear map leaves; small tensors and first
steps exactly Adam's; the quantization error of m and v in every block after steps, within
half the map's largest gap of the block's maximum; v non-negative; exact resume (the codes
stay uint8 through state_dict, where torch.optim's load would make them floats); foreach;
compile=True falling back to the eager update; bad input. The optimizer contract is
test_contract.py's once Adam8bit is in its list."""

from __future__ import annotations

import io
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_same_tree

import lsdl_lab.memory.quantize as quantize
import lsdl_lab.optim.adam8bit as adam8bit
from lsdl_lab.memory import dequantize_blockwise, dynamic_map, quantize_blockwise
from lsdl_lab.models import GPT
from lsdl_lab.optim import Adam, AdamW
from lsdl_lab.optim.adam8bit import Adam8bit, AdamW8bit
from lsdl_lab.optim.compiled import CompileWarning
from lsdl_lab.optim.pieces import adam_moments_

VOCAB, SEQ, BATCH = 256, 32, 8
SLACK = 4 * torch.finfo(torch.float32).eps  # float32's rounding, in units of a block's max


def gpt(device="cpu") -> GPT:
    """A small GPT, the same weights on every device: 4 of its tensors of 16,384 values, 2
    of 12,288 and 2 of 4,096 take 8-bit states; positions (2,048), gains and biases do not."""
    torch.manual_seed(0)
    return GPT(VOCAB, block_size=SEQ, layers=2, heads=4, dim=64).to(device)


def batches(device="cpu", seed=1) -> torch.Tensor:
    """Four batches of random tokens, which the runs cycle through (so the loss falls)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (4, BATCH, SEQ + 1), generator=gen).to(device)


def loss_of(model, tokens):
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def train(model, opt, steps, data):
    losses = []
    for t in steps:
        loss = loss_of(model, data[t % len(data)])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def run(make, device="cpu", steps=40):
    """``steps`` steps of ``make(params)`` on the GPT: the parameters' displacement from
    their start (one vector), the losses, the model and the optimizer."""
    model = gpt(device)
    start = [p.detach().clone() for p in model.parameters()]
    opt = make(model.parameters())
    losses = train(model, opt, range(steps), batches(device))
    moved = torch.cat([(p.detach() - s).flatten() for p, s in zip(model.parameters(), start)])
    return moved, losses, model, opt


def state_bytes(opt, p) -> int:
    """The bytes of ``p``'s state tensors (its step count excluded)."""
    return sum(v.numel() * v.element_size() for k, v in opt.state[p].items() if k != "step")


def is_8bit(opt, p) -> bool:
    return "exp_avg_codes" in opt.state[p]


# -- bytes -------------------------------------------------------------------------------


def test_state_bytes_per_parameter_are_two_against_adams_eight(device):
    w = torch.zeros(8, 2048, device=device, requires_grad=True)  # 8 blocks of 2048
    odd = torch.zeros(5000, device=device, requires_grad=True)  # 3 blocks, the last partial
    small = torch.zeros(4095, device=device, requires_grad=True)  # below min_8bit_size
    params = [w, odd, small]
    ours, adam = Adam8bit(params, lr=1e-3), Adam(params, lr=1e-3)
    for p in params:
        p.grad = torch.ones_like(p)
    ours.step()
    adam.step()
    # per value, one byte a moment and two float32 scales a block: 2 + 8/2048
    assert state_bytes(ours, w) / w.numel() == 2 + 8 / 2048 == 2.00390625
    assert state_bytes(ours, odd) == 2 * 5000 + 2 * 4 * 3
    assert state_bytes(adam, w) / w.numel() == state_bytes(adam, odd) / odd.numel() == 8
    assert state_bytes(ours, small) == state_bytes(adam, small) == 8 * 4095  # float32 states
    assert {k: v.dtype for k, v in ours.state[w].items() if k != "step"} == {
        "exp_avg_codes": torch.uint8, "exp_avg_absmax": torch.float32,
        "exp_avg_sq_codes": torch.uint8, "exp_avg_sq_absmax": torch.float32,
    }  # fmt: skip


def test_the_defaults_are_the_quantizations_constants():
    # one threshold and one block size, in lsdl_lab.memory.quantize, which the memory
    # calculator's count of 8-bit Adam's state reads too; re-exported where documented
    ours = Adam8bit([torch.zeros(3, requires_grad=True)])
    assert ours.defaults["min_8bit_size"] == quantize.MIN_8BIT_SIZE == 4096
    assert ours.defaults["block_size"] == quantize.BLOCK_SIZE == 2048
    assert adam8bit.MIN_8BIT_SIZE is quantize.MIN_8BIT_SIZE


def test_the_gpts_state_bytes_by_tensor():
    model = gpt()
    ours, adam = Adam8bit(model.parameters()), Adam(model.parameters())
    loss_of(model, batches()[0]).backward()
    ours.step()
    adam.step()
    params = list(model.parameters())
    big = [p for p in params if p.numel() >= 4096]
    assert [p.numel() for p in big] == [16384] + [12288, 4096, 16384, 16384] * 2
    assert [is_8bit(ours, p) for p in params] == [p.numel() >= 4096 for p in params]
    n_big = sum(p.numel() for p in big)
    ours_bytes = sum(state_bytes(ours, p) for p in params)
    adam_bytes = sum(state_bytes(adam, p) for p in params)
    expected = sum(2 * p.numel() + 8 * math.ceil(p.numel() / 2048) for p in big)
    expected += 8 * (sum(p.numel() for p in params) - n_big)
    assert ours_bytes == expected
    n = sum(p.numel() for p in params)
    assert adam_bytes == 8 * n
    # the small tensors (positions, gains, biases: 3% of the parameters) keep 8 bytes each
    assert 2.0 < ours_bytes / n < 2.3  # measured 2.20
    assert ours_bytes / adam_bytes < 0.29  # measured 0.275


# -- the trajectory against float32 Adam ---------------------------------------------------

# Measured on the CPU, 40 steps at lr 3e-3 (three seeds of the data): the displacement of the
# parameters differs from float32 Adam's by 3.0 to 3.1% of its norm and the losses by at most
# 0.004 (of 5.6 falling to 3.4-3.6); with the codes rounded down instead of to the nearest
# value (a one-sided error of up to a gap) by 23 to 24% and 0.13; with a linear map of 256
# values instead of the dynamic one the run diverges (small second moments round to 0).
DISPLACEMENT_TOLERANCE = 0.06
LOSS_TOLERANCE = 0.02


def distance(moved, reference) -> float:
    return ((moved - reference).norm() / reference.norm()).item()


def rounded_down(x, code, block_size=2048):
    """quantize_blockwise with the nearest value replaced by the largest one below x (a
    wrong rounding, for the tolerance to catch)."""
    codes, absmax = quantize_blockwise(x, code, block_size)
    decoded = dequantize_blockwise(codes, absmax, code, x.shape, block_size).reshape(-1)
    above = (decoded > x.reshape(-1).float()) & (codes > 0)
    return torch.where(above, codes - 1, codes).to(torch.uint8), absmax


def test_the_trajectory_stays_near_float32_adams(device, monkeypatch):
    reference, ref_losses, *_ = run(lambda p: Adam(p, lr=3e-3), device)
    moved, losses, *_ = run(lambda p: Adam8bit(p, lr=3e-3), device)
    assert ref_losses[-1] < ref_losses[0] - 1.5  # the model did learn
    assert distance(moved, reference) < DISPLACEMENT_TOLERANCE, distance(moved, reference)
    gap = max(abs(a - b) for a, b in zip(losses, ref_losses))
    assert gap < LOSS_TOLERANCE, gap
    assert distance(moved, reference) > 1e-3  # and the states were quantized

    # the tolerance sees a wrong rounding
    monkeypatch.setattr(adam8bit, "quantize_blockwise", rounded_down)
    wrong, wrong_losses, *_ = run(lambda p: Adam8bit(p, lr=3e-3), device)
    assert distance(wrong, reference) > DISPLACEMENT_TOLERANCE, distance(wrong, reference)
    monkeypatch.undo()
    # and a linear map (the uniform 8-bit quantization the dynamic map replaces)
    linear = lambda signed=True: torch.linspace(-1.0 if signed else 0.0, 1.0, 256)  # noqa: E731
    monkeypatch.setattr(adam8bit, "dynamic_map", linear)
    uniform, uniform_losses, *_ = run(lambda p: Adam8bit(p, lr=3e-3), device)
    assert not math.isfinite(uniform_losses[-1]) or distance(uniform, reference) > 1.0


# -- exactly Adam where nothing is rounded ---------------------------------------------------


def test_below_min_8bit_size_it_is_adam_to_the_bit(device):
    big = 10**6  # every tensor of the GPT is smaller: float32 states throughout
    for make_ours, make_adam in [
        (lambda p: Adam8bit(p, lr=3e-3, weight_decay=0.1, min_8bit_size=big),
         lambda p: Adam(p, lr=3e-3, weight_decay=0.1)),
        (lambda p: AdamW8bit(p, lr=3e-3, weight_decay=0.1, min_8bit_size=big),
         lambda p: AdamW(p, lr=3e-3, weight_decay=0.1)),
    ]:  # fmt: skip
        ours, _, model, opt = run(make_ours, device, steps=6)
        theirs, _, _, adam = run(make_adam, device, steps=6)
        assert torch.equal(ours, theirs)
        assert_same_tree(opt.state_dict()["state"], adam.state_dict()["state"])


def test_small_tensors_and_first_steps_are_adams(device):
    """With a large tensor in 8 bits beside them, the small tensors take Adam's steps to the
    bit, and so does the large one at its first step (its moments start at exact zeros);
    from the second step its moments are decoded from 8 bits."""
    gen = torch.Generator().manual_seed(3)
    shapes = [(64, 96), (32,), (4095,)]  # 6,144 values in 8 bits; two float32 states
    start = [torch.randn(s, generator=gen).to(device) for s in shapes]
    grads = [[torch.randn(s, generator=gen).to(device) for s in shapes] for _ in range(4)]
    runs = []
    for cls in (Adam8bit, Adam):
        params = [w.clone().requires_grad_() for w in start]
        opt = cls(params, lr=1e-2, weight_decay=1e-2)
        history = []
        for g in grads:
            for p, g_p in zip(params, g):
                p.grad = g_p.clone()
            opt.step()
            history.append([p.detach().clone() for p in params])
        runs.append((opt, params, history))
    (ours, params, history), (_, _, adam_history) = runs
    assert [is_8bit(ours, p) for p in params] == [True, False, False]
    for t, (a, b) in enumerate(zip(history, adam_history)):
        assert torch.equal(a[1], b[1]) and torch.equal(a[2], b[2]), t
        assert torch.equal(a[0], b[0]) == (t == 0), t  # the large one: the first step only
        torch.testing.assert_close(a[0], b[0], rtol=0, atol=1e-3 * (t + 1))  # lr 1e-2 a step


# -- the quantization error of the states after steps ---------------------------------------


@pytest.mark.parametrize("block_size", [2048, 256])
def test_the_states_error_per_block_is_within_half_the_largest_gap(block_size, device):
    """After 10 steps, one more: its exact new moments m_t, v_t (from the decoded m, v and the
    gradient, as the step computes them) against what the state keeps, block by block."""
    model = gpt(device)
    opt = Adam8bit(model.parameters(), lr=3e-3, block_size=block_size)
    data = batches(device)
    train(model, opt, range(10), data)
    (beta1, beta2) = opt.param_groups[0]["betas"]
    loss_of(model, data[10 % 4]).backward()
    params = [p for p in model.parameters() if is_8bit(opt, p)]
    m, v = opt.decoded_moments(opt.param_groups[0], params)
    adam_moments_(m, v, [p.grad for p in params], beta1, beta2)  # m_t, v_t, exactly
    opt.step()
    half_gap = {s: dynamic_map(s).diff().max().item() / 2 for s in (True, False)}
    worst = {True: 0.0, False: 0.0}
    for p, m_t, v_t in zip(params, m, v):
        state = opt.state[p]
        for exact, name, signed in ((m_t, "exp_avg", True), (v_t, "exp_avg_sq", False)):
            codes, absmax = state[name + "_codes"], state[name + "_absmax"]
            kept = dequantize_blockwise(codes, absmax, dynamic_map(signed).to(device),
                                        p.shape, block_size)  # fmt: skip
            n_blocks = absmax.numel()
            rows = F.pad(exact.flatten(), (0, n_blocks * block_size - p.numel()))
            rows = rows.view(n_blocks, block_size)
            assert torch.equal(absmax, rows.abs().amax(dim=1))  # each block's max, exactly
            err = F.pad((exact - kept).abs().flatten(), (0, n_blocks * block_size - p.numel()))
            err = err.view(n_blocks, block_size).amax(dim=1)
            assert (err <= (half_gap[signed] + SLACK) * absmax).all(), (name, p.shape)
            worst[signed] = max(worst[signed], (err / absmax).max().item())
            if not signed:
                assert (kept >= 0).all()  # the second moment stays non-negative
    # measured: 0.70% of a block's max for m and 0.35% for v, the bounds themselves
    assert worst[True] > 0.9 * half_gap[True] and worst[False] > 0.9 * half_gap[False], worst


# -- resume, foreach ------------------------------------------------------------------------


def test_resume_through_state_dict_is_exact(device):
    make = lambda params, lr=3e-3: AdamW8bit(params, lr=lr, block_size=1024)  # noqa: E731
    data = batches(device)
    model = gpt(device)
    opt = make(model.parameters())
    train(model, opt, range(8), data)
    uninterrupted = (model, opt)

    model = gpt(device)
    opt = make(model.parameters())
    train(model, opt, range(4), data)
    buffer = io.BytesIO()
    torch.save(dict(model=model.state_dict(), opt=opt.state_dict()), buffer)
    buffer.seek(0)
    saved = torch.load(buffer)  # weights_only: tensors and numbers
    model = gpt(device)
    model.load_state_dict(saved["model"])
    opt = make(model.parameters(), lr=123.0)  # restored below
    opt.load_state_dict(saved["opt"])
    codes = opt.state[model.tok.weight]["exp_avg_codes"]
    assert codes.dtype == torch.uint8 and codes.device == model.tok.weight.device
    assert opt.param_groups[0]["lr"] == 3e-3
    train(model, opt, range(4, 8), data)
    for p, q in zip(model.parameters(), uninterrupted[0].parameters(), strict=True):
        assert torch.equal(p, q)
    assert_same_tree(opt.state_dict()["state"], uninterrupted[1].state_dict()["state"])

    # why Adam8bit loads its own way: torch.optim's load casts every state tensor of a float
    # parameter to the parameter's dtype, the codes too
    plain = make(gpt(device).parameters())
    torch.optim.Optimizer.load_state_dict(plain, saved["opt"])
    assert next(iter(plain.state.values()))["exp_avg_codes"].dtype == torch.float32


def test_foreach_false_equals_foreach_true(device):
    runs = [run(lambda p, f=f: Adam8bit(p, lr=3e-3, block_size=512, foreach=f), device, steps=4)
            for f in (True, False)]  # fmt: skip
    assert torch.equal(runs[0][0], runs[1][0])
    assert_same_tree(runs[0][3].state_dict()["state"], runs[1][3].state_dict()["state"])


# -- bad input --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kw", "error", "message"),
    [
        (dict(block_size=0), ValueError, r"Invalid block_size: 0 \(expected an int >= 1\)"),
        (dict(block_size=2.0), TypeError, r"Invalid block_size: 2.0"),
        (dict(min_8bit_size=-1), ValueError, r"Invalid min_8bit_size: -1 \(expected an int >= 0"),
        (dict(min_8bit_size="4096"), TypeError, r"Invalid min_8bit_size: '4096'"),
        (dict(betas=(0.9, 1.0)), ValueError, r"Invalid beta parameter at index 1: 1.0"),
        (dict(eps=-1.0), ValueError, r"Invalid epsilon value: -1.0"),
        (dict(decoupled_weight_decay=1), TypeError, r"Invalid decoupled_weight_decay: 1"),
    ],
)
def test_bad_hyperparameters_are_refused_by_name(kw, error, message):
    p, q = torch.zeros(2, requires_grad=True), torch.zeros(3, requires_grad=True)
    with pytest.raises(error, match=message):
        Adam8bit([p], **kw)
    opt = Adam8bit([p])
    with pytest.raises(error, match=message):
        opt.add_param_group(dict(params=[q], **kw))
    assert len(opt.param_groups) == 1


def test_compile_warns_and_runs_the_eager_update():
    runs = []
    for compile in (False, True):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            runs.append(run(lambda p, c=compile: AdamW8bit(p, lr=3e-3, compile=c), steps=3))
        warned = [w for w in caught if issubclass(w.category, CompileWarning)]
        assert len(warned) == compile and (not compile or "decodes and encodes" in str(
            warned[0].message))  # fmt: skip
    assert torch.equal(runs[0][0], runs[1][0])
