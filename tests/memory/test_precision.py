"""The loss scaler against torch.amp.GradScaler, and the fp16/bf16 demonstrations."""

import contextlib
import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lsdl_lab.memory.precision import (
    LossScaler,
    amp_step,
    bf16_range_vs_precision,
    fp16_underflow,
)

INJECT = {9, 16}  # steps whose gradients get an inf on top of the natural overflows


def _model(device="cpu"):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4)).to(device)


def _run(scaler, model, optimizer, steps=24, scheduler=None):
    """fp16 autocast training on the model's device; per step: the scale used, whether the
    step was skipped (GradScaler says so by lowering its scale), the weights after it."""
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(1)
    history = []
    for t in range(steps):
        x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)
        x, y = x.to(device), y.to(device)
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.float16):
            loss = nn.functional.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        if t in INJECT:
            model[0].weight.grad[0, 0] = math.inf
        before = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        skipped = scaler.get_scale() < before
        if scheduler is not None and not skipped:
            scheduler.step()
        weights = [p.detach().clone() for p in model.parameters()]
        history.append((before, skipped, weights))
    return history


def test_equal_to_grad_scaler_step_for_step(device):
    settings = dict(init_scale=2.0**24, growth_factor=2.0, backoff_factor=0.5, growth_interval=3)
    runs = []
    for scaler in (torch.amp.GradScaler(device.type, **settings), LossScaler(**settings)):
        model = _model(device)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        runs.append(_run(scaler, model, opt))
    theirs, mine = runs
    for t, ((s1, k1, w1), (s2, k2, w2)) in enumerate(zip(theirs, mine)):
        assert s1 == s2 and k1 == k2, t
        assert all(torch.equal(a, b) for a, b in zip(w1, w2)), t
    skipped = [t for t, (_, k, _) in enumerate(mine) if k]
    assert len(skipped) >= 5  # fp16 overflows at 2^24, halving down to a scale that fits
    assert INJECT <= set(skipped)
    scales = [s for s, _, _ in mine]
    assert any(b > a for a, b in zip(scales, scales[1:]))  # and it grew again


def test_amp_step_is_the_same_loop(device):
    settings = dict(init_scale=2.0**24, growth_interval=3)
    model = _model(device)
    theirs = _run(
        torch.amp.GradScaler(device.type, **settings),
        model,
        torch.optim.SGD(model.parameters(), lr=0.05),
    )
    model = _model(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0)
    scaler = LossScaler(**settings)
    gen = torch.Generator().manual_seed(1)
    for t, (scale, skipped, weights) in enumerate(theirs[:9]):
        batch = torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)
        batch = tuple(t.to(device) for t in batch)
        assert scaler.get_scale() == scale
        loss = amp_step(model, opt, nn.functional.mse_loss, batch, torch.float16, scaler, sched)
        assert math.isfinite(loss) and scaler.skipped == skipped
        assert all(torch.equal(a, p) for a, p in zip(weights, model.parameters())), t
    assert sched.last_epoch == 9 - scaler.skipped_steps == 2


def test_amp_step_bf16_trains_float32_master_weights(device):
    model = _model(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, y = torch.randn(64, 16).to(device), torch.randn(64, 4).to(device)
    losses = [amp_step(model, opt, nn.functional.mse_loss, (x, y)) for _ in range(30)]
    assert losses[-1] < 0.7 * losses[0]
    assert all(p.dtype == torch.float32 for p in model.parameters())
    with pytest.raises(ValueError, match="Invalid dtype"):
        amp_step(model, opt, nn.functional.mse_loss, (x, y), torch.float64)
    with pytest.raises(TypeError, match="Invalid scaler"):
        amp_step(model, opt, nn.functional.mse_loss, (x, y), scaler=torch.amp.GradScaler("cpu"))


def test_skipped_step_flags_and_schedule(device):
    model = _model(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    scaler = LossScaler(init_scale=2.0**24, growth_interval=3)
    history = _run(scaler, model, opt, steps=12, scheduler=sched)
    skips = sum(k for _, k, _ in history)
    assert scaler.skipped_steps == skips > 0
    assert sched.last_epoch == 12 - skips  # the schedule advanced on taken steps only
    # A skipped step returns None and leaves the weights untouched.
    model[0].weight.grad = torch.full_like(model[0].weight, math.nan)
    before = [p.detach().clone() for p in model.parameters()]
    assert scaler.step(opt) is None and scaler.skipped
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_floor_growth_and_state_dict(device):
    p = nn.Parameter(torch.zeros(3, device=device))
    opt = torch.optim.SGD([p], lr=1.0)
    scaler = LossScaler(init_scale=8.0, growth_interval=2, min_scale=2.0)
    scales = []
    for grad in [math.inf, math.inf, math.inf, 1.0, 1.0, 1.0, 1.0]:
        p.grad = torch.full((3,), grad * scaler.get_scale(), device=device)
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    assert scales == [4.0, 2.0, 2.0, 2.0, 4.0, 4.0, 8.0]  # floor 2; doubling every 2 clean
    assert torch.equal(p.detach().cpu(), torch.full((3,), -4.0))  # four taken steps, unscaled
    state = scaler.state_dict()
    other = LossScaler()
    other.load_state_dict(state)
    assert other.state_dict() == state
    # GradScaler's state (no min_scale) loads too, and back.
    ref = torch.amp.GradScaler("cpu", init_scale=16.0, growth_interval=7)
    other.load_state_dict(ref.state_dict())
    assert other.get_scale() == 16.0 and other.growth_interval == 7 and other.min_scale == 2.0
    ref.load_state_dict(other.state_dict())
    assert ref.get_scale() == 16.0


def test_grows_only_to_a_finite_scale(device):
    p = nn.Parameter(torch.zeros(1, device=device))
    opt = torch.optim.SGD([p], lr=0.0)
    scaler = LossScaler(init_scale=2.0**127, growth_interval=1)
    p.grad = torch.ones(1, device=device)
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 2.0**127


def test_usage_errors_as_grad_scaler():
    p = nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = LossScaler()
    with pytest.raises(RuntimeError, match="No inf checks"):
        scaler.update()
    p.grad = torch.ones(2)
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="already been called"):
        scaler.unscale_(opt)
    scaler.step(opt)
    with pytest.raises(RuntimeError, match="after step"):
        scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="closure"):
        scaler.step(opt, lambda: 0.0)
    half = nn.Parameter(torch.zeros(2, dtype=torch.float16))
    half.grad = torch.ones(2, dtype=torch.float16)
    with pytest.raises(ValueError, match="FP16 gradients"):
        LossScaler().unscale_(torch.optim.SGD([half], lr=0.1))


@pytest.mark.parametrize(
    "kwargs, name, error",
    [
        ({"init_scale": 0.0}, "init_scale", ValueError),
        ({"growth_factor": 1.0}, "growth_factor", ValueError),
        ({"backoff_factor": 1.0}, "backoff_factor", ValueError),
        ({"backoff_factor": 0.0}, "backoff_factor", ValueError),
        ({"growth_interval": 0}, "growth_interval", ValueError),
        ({"growth_interval": 2.5}, "growth_interval", TypeError),
        ({"min_scale": -1.0}, "min_scale", ValueError),
        ({"init_scale": 0.5}, "init_scale", ValueError),  # below the default floor 1
    ],
)
def test_bad_arguments(kwargs, name, error):
    with pytest.raises(error, match=f"Invalid {name}"):
        LossScaler(**kwargs)


def test_found_inf_is_all_reduced_over_a_process_group():
    # A real gloo group of one rank runs the all-reduce code path in this process; the
    # agreement of ranks at world 2 is tested with the sharded optimizer.
    if dist.is_initialized():
        pytest.skip("this process already belongs to a process group")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        p = nn.Parameter(torch.zeros(2))
        opt = torch.optim.SGD([p], lr=0.1)
        scaler = LossScaler(init_scale=4.0, process_group=dist.group.WORLD)
        p.grad = torch.tensor([1.0, math.inf])
        assert scaler.step(opt) is None
        scaler.update()
        assert scaler.get_scale() == 2.0
        p.grad = torch.tensor([2.0, 2.0])
        scaler.step(opt)
        assert not scaler.skipped and torch.equal(p.detach(), torch.tensor([-0.1, -0.1]))
    finally:
        dist.destroy_process_group()


def test_fp16_underflow_without_scaling_and_not_with_it():
    small = fp16_underflow(grad_size=2.0**-28)
    assert small["zero_fraction_float32"] == 0.0
    assert small["zero_fraction_unscaled"] > 0.5
    assert small["zero_fraction_scaled"] < 0.01
    assert small["max_relative_error_scaled"] < 1e-2
    # The effect is underflow: with gradients inside fp16's range nothing is lost.
    assert fp16_underflow(grad_size=2.0**-12)["zero_fraction_unscaled"] < 0.01


def test_bf16_has_fp32_range_and_little_precision():
    rows = bf16_range_vs_precision()
    fp16, bf16, fp32 = rows["float16"], rows["bfloat16"], rows["float32"]
    assert fp16["70000"] == math.inf and fp16["1e-8"] == 0.0
    assert math.isfinite(bf16["70000"]) and bf16["1e-8"] > 0.0
    assert bf16["max"] > 1e38 and fp16["max"] == 65504.0
    assert bf16["eps"] == 2.0**-7 and fp16["eps"] == 2.0**-10
    assert bf16["1+2^-9"] == 1.0 and fp16["1+2^-9"] > 1.0
    assert bf16["sum of 1000 x 1e-3 onto 1"] == 1.0  # stalled: fp32 master weights are needed
    assert fp32["sum of 1000 x 1e-3 onto 1"] == pytest.approx(2.0, abs=1e-3)


def test_the_mixed_precision_of_a_device_is_what_it_computes_fast(monkeypatch):
    from lsdl_lab.memory import mixed_precision_for

    assert mixed_precision_for("cpu") == ("none", "float32: cpu has no fast 16-bit arithmetic")
    # a GPU, pretended: its name, and whether it computes in bfloat16 (asked of it as the
    # current device; emulated bfloat16 does not count)
    asked = []
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "Tesla T4")
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext(asked.append(d)))
    emulated = lambda including_emulation=True: including_emulation  # noqa: E731
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", emulated)
    assert mixed_precision_for(torch.device("cuda", 1)) == (
        "fp16",
        "float16 with the loss scaler: Tesla T4 has no bfloat16 arithmetic",
    )
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA A100")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    assert mixed_precision_for("cuda:1") == ("bf16", "bfloat16: NVIDIA A100 computes in it")
    assert asked == [torch.device("cuda", 1)] * 2
