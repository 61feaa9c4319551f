"""races: one fresh model per optimizer on the same batches; steps, seconds and state bytes
recorded as the optimizers' own protocols require; schedules, schedule-free's evaluation at
its average, the learning-rate sweep, and the race of 2026, on a GPT and on a ResNet (Muon
on its kernels), with its state counted exactly."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lsdl_lab import optim
from lsdl_lab.book import races
from lsdl_lab.models import GPT, ResNet


def data(device="cpu"):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 5, generator=g)
    y = (x @ torch.randn(5, 3, generator=g)).argmax(1)
    return x.to(device), y.to(device)


def make_model(device="cpu"):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)).to(device)


def full_loss(model):
    x, y = data(next(model.parameters()).device)
    return F.cross_entropy(model(x), y).item()


def test_every_protocol_steps_and_the_same_start(device):
    opts = {
        "SGD": lambda m: optim.SGD(m.parameters(), lr=0.1),
        "K-FAC": lambda m: optim.KFAC(m, lr=0.1, seed=0),
        "Shampoo": lambda m: optim.Shampoo(m.parameters(), lr=0.1),
        "Newton": lambda m: optim.Newton(m.parameters(), damping=1e-2, line_search=True),
        "HF": lambda m: optim.HessianFree(m.parameters(), cg_iters=10),
    }
    batches = data(device)
    runs = races.race(
        lambda: make_model(device), opts, lambda t: batches, 5, F.cross_entropy, full_loss
    )
    start = full_loss(make_model(device))
    for name, run in runs.items():
        assert run.steps == 5 and len(run.losses) == 5 and not run.diverged, name
        assert run.losses[-1] < start, (name, run.losses, start)
        assert all(b >= a for a, b in zip(run.seconds, run.seconds[1:])), name
        assert all(0 < u <= s for u, s in zip(run.update_seconds, run.seconds)), name
        assert run.num_parameters == 5 * 8 + 8 + 8 * 3 + 3
    assert runs["SGD"].state_bytes == 0  # no momentum: no state
    # Newton keeps nothing between steps; HF its last CG solution (one vector, float32)
    assert runs["Newton"].state_bytes == 0
    assert runs["HF"].state_bytes == 4 * runs["HF"].num_parameters


def test_state_bytes_counts_nested_state(device):
    model = make_model(device)
    adam = optim.Adam(model.parameters())
    shampoo = optim.Shampoo(model.parameters(), grafting="none")
    for opt in (adam, shampoo):
        model.zero_grad()
        x, y = data(device)
        F.cross_entropy(model(x), y).backward()
        opt.step()
    assert races.state_bytes(adam) == 2 * 4 * 75  # two moments (the step counts are numbers)
    # Shampoo: per weight (8 x 5, 3 x 8) a statistic and a root on each side, per bias one
    sides = [8, 5, 8, 3, 8, 3]
    assert races.state_bytes(shampoo) == 2 * 4 * sum(n * n for n in sides)
    with pytest.raises(TypeError, match="optimizer"):
        races.state_bytes(model)


def test_steps_and_seconds_to_a_target():
    run = races.Run("r", 10, losses=[3.0, math.nan, 1.0, 0.5], seconds=[1.0, 2.0, 3.0, 4.0])
    assert run.steps_to(1.0) == 3 and run.seconds_to(1.0) == 3.0
    assert run.steps_to(0.1) is None and run.seconds_to(0.1) is None
    assert run.final_loss() == 0.5
    run.state_bytes = 80
    assert run.bytes_per_parameter == 8.0
    other = races.Run("b", 10, losses=[3.0, 2.0, 1.5, 1.0], seconds=[0.5, 1.0, 1.5, 2.0])
    cost = races.relative_cost({"r": run, "b": other}, "b", 1.0)
    assert cost["r"] == dict(steps=0.75, seconds=1.5, per_step=2.0)
    # per step: the median step, so one slow step (another process's burst) does not count
    burst = races.Run("b", 10, losses=[3.0, 2.0, 1.5, 1.0], seconds=[0.5, 1.0, 4.0, 4.5])
    assert races.relative_cost({"r": run, "b": burst}, "b", 1.0)["r"]["per_step"] == 2.0
    assert races.relative_cost({"r": run, "b": other}, "b", 0.5)["r"]["steps"] is None
    with pytest.raises(ValueError, match="baseline"):
        races.relative_cost({"r": run}, "b", 1.0)


def test_divergence_stops_the_run(device):
    calls = []

    def blows_up(out, y):  # finite for two steps, then NaN
        calls.append(1)
        return F.cross_entropy(out, y) * (1.0 if len(calls) <= 2 else math.nan)

    opts = {"SGD": lambda m: optim.SGD(m.parameters(), lr=0.1)}
    batches = data(device)
    run = races.race(lambda: make_model(device), opts, lambda t: batches, 50, blows_up)["SGD"]
    assert run.diverged and run.steps == 3 and run.final_loss() == math.inf


def test_a_dry_run_stops_where_fit_stops_and_evaluates_the_last_step(monkeypatch):
    # a race trains through lsdl_lab.train.fit, whose step counter caps a dry run
    monkeypatch.setenv("LSDL_MAX_STEPS", "2")
    model, batches = make_model(), data()
    opt = optim.SGD(model.parameters(), lr=0.1)
    run = races.train_run(
        "SGD", model, opt, lambda t: batches, 7, F.cross_entropy, full_loss, 3, progress=False
    )
    assert run.steps == 2 and len(run.losses) == 2 and not run.diverged
    assert math.isnan(run.losses[0])  # step 1 is not a multiple of eval_every
    assert run.losses[1] == full_loss(model)  # the last step that ran is evaluated


def test_bad_arguments():
    with pytest.raises(ValueError, match="optimizers"):
        races.race(make_model, {}, lambda t: data(), 5, F.cross_entropy)
    with pytest.raises(ValueError, match="steps"):
        races.race(make_model, {"SGD": lambda m: optim.SGD(m.parameters(), lr=0.1)},
                   lambda t: data(), 0, F.cross_entropy)  # fmt: skip


# -- schedules, the sweep, the race of 2026 ------------------------------------------------


def test_loss_at_seconds_reads_the_last_evaluation_within_the_budget():
    run = races.Run("r", 10, losses=[3.0, math.nan, 1.0, 0.5], seconds=[1.0, 2.0, 3.0, 4.0])
    assert run.loss_at_seconds(2.5) == 3.0  # step 2 was not evaluated
    assert run.loss_at_seconds(3.0) == 1.0 and run.loss_at_seconds(100.0) == 0.5
    assert math.isnan(run.loss_at_seconds(0.5))
    blown = races.Run("b", 10, losses=[3.0, 2.0], seconds=[1.0, 2.0], diverged=True)
    assert blown.loss_at_seconds(1.5) == 3.0 and blown.loss_at_seconds(2.0) == math.inf
    with pytest.raises(ValueError, match="budget"):
        run.loss_at_seconds(-1.0)


def test_warmup_cosine():
    f = races.warmup_cosine(10, 2)
    assert [f(t) for t in (0, 1, 2)] == [0.5, 1.0, 1.0]  # linear_warmup: (t + 1) / warmup
    assert f(6) == pytest.approx(0.5) and f(10) == pytest.approx(0.0)
    with pytest.raises(ValueError, match="warmup"):
        races.warmup_cosine(10, 10)


def test_a_schedule_scales_every_step():
    # a schedule of zero: the weights never move, every evaluation is the start's
    model, batches = make_model(), data()
    opt = optim.SGD(model.parameters(), lr=0.1)
    run = races.train_run("SGD", model, opt, lambda t: batches, 4, F.cross_entropy, full_loss,
                          progress=False, schedule=lambda t: 0.0)  # fmt: skip
    assert run.losses == [full_loss(make_model())] * 4
    with pytest.raises(TypeError, match="schedule"):
        races.train_run("SGD", model, opt, lambda t: batches, 4, F.cross_entropy,
                        schedule=0.5)  # fmt: skip


def test_schedule_free_is_evaluated_at_its_average(device):
    model, batches = make_model(device), data(device)
    opt = optim.ScheduleFreeAdamW(model.parameters(), lr=0.05)
    modes = []

    def evaluate(m):
        modes.append(opt.param_groups[0]["train_mode"])
        return full_loss(m)

    run = races.train_run("SF", model, opt, lambda t: batches, 4, F.cross_entropy, evaluate,
                          progress=False)  # fmt: skip
    assert modes == [False] * 4  # eval(): the parameters hold the average x
    assert opt.param_groups[0]["train_mode"]  # and back at y to train
    assert run.state_bytes == 8 * run.num_parameters  # z and v; y is not kept after eval


def test_sweep_picks_the_lowest_final_loss():
    def make_sgd(model, lr):
        return optim.SGD(model.parameters(), lr=lr)

    batches = data()
    best, runs = races.sweep(make_model, make_sgd, [1e-4, 0.5, 1e4], lambda t: batches, 8,
                             F.cross_entropy, full_loss)  # fmt: skip
    assert list(runs) == [1e-4, 0.5, 1e4] and best == 0.5
    assert runs[0.5].final_loss() < runs[1e-4].final_loss() < runs[1e4].final_loss()
    with pytest.raises(ValueError, match="lrs"):
        races.sweep(make_model, make_sgd, [], lambda t: batches, 8, F.cross_entropy)
    with pytest.raises(ValueError, match="schedules"):
        races.race(make_model, {"a": lambda m: make_sgd(m, 0.1)}, lambda t: batches, 2,
                   F.cross_entropy, schedules={"b": lambda t: 1.0})  # fmt: skip


def test_the_race_of_2026_on_a_small_gpt():
    vocab, block = 11, 8
    tokens = torch.randint(vocab, (4, block + 1), generator=torch.Generator().manual_seed(0))
    x, y = tokens[:, :-1], tokens[:, 1:]

    def new_gpt():
        torch.manual_seed(0)
        return GPT(vocab, block, 1, 2, 16)

    def lm_loss(logits, targets):
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def evaluate(model):
        return lm_loss(model(x), y).item()

    result = races.modern_race(new_gpt, lambda t: (x, y), 6, lm_loss, evaluate, 3, lrs=(1e-3, 3e-2))
    runs = result.runs
    assert list(runs) == ["AdamW", "Muon", "SOAP", "Shampoo", races.SCHEDULE_FREE]
    for name in races.SWEPT:  # the sweep's best run is the race's, renamed
        assert set(result.sweeps[name]) == {1e-3, 3e-2}
        assert result.lr[name] == min(
            result.sweeps[name], key=lambda lr: result.sweeps[name][lr].final_loss()
        )
        assert runs[name] is result.sweeps[name][result.lr[name]] and runs[name].name == name
    start = evaluate(new_gpt())
    for name, run in runs.items():
        assert run.steps == 6 and math.isnan(run.losses[0]) and run.final_loss() < start, name
    # the state, exactly: Muon one buffer for its hidden matrices, AdamW's two for the rest
    model = new_gpt()
    N = model.num_parameters()
    hidden = sum(p.numel() for g in optim.muon_param_groups(model) if g["use_muon"]
                 for _, p in g["params"])  # fmt: skip
    soap_extra = sum(2 * n * n for p in model.parameters() if p.dim() >= 2 for n in p.shape)
    assert 0 < hidden < N
    assert runs["AdamW"].state_bytes == runs[races.SCHEDULE_FREE].state_bytes == 8 * N
    assert runs["Muon"].state_bytes == 4 * hidden + 8 * (N - hidden)
    assert runs["SOAP"].state_bytes == 8 * N + 4 * soap_extra
    assert runs["Shampoo"].state_bytes > 8 * N
    with pytest.raises(ValueError, match="adamw_lr"):
        races.modern_optimizers(0.0, 1e-3, 2)


def test_the_race_of_2026_on_a_small_resnet_gives_muon_its_kernels():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 1, 8, 8, generator=g), torch.randint(3, (32,), generator=g)

    def new_resnet():
        torch.manual_seed(0)
        return ResNet(depth=8, width=4, num_classes=3, in_channels=1)

    def evaluate(model):
        return F.cross_entropy(model(x), y).item()

    result = races.modern_race(new_resnet, lambda t: (x, y), 8, F.cross_entropy, evaluate, 4,
                               lrs=(1e-3, 1e-2))  # fmt: skip
    runs = result.runs
    start = evaluate(new_resnet())
    for name, run in runs.items():
        assert run.steps == 8 and not run.diverged and run.final_loss() < start, name
    # Muon keeps one buffer for every kernel (conv=True), AdamW's two for the rest (BatchNorm,
    # the head); SOAP a statistic and a basis for each of a kernel's four dimensions
    model = new_resnet()
    N = model.num_parameters()
    kernels = sum(p.numel() for p in model.parameters() if p.dim() == 4)
    soap_extra = sum(2 * n * n for p in model.parameters() if p.dim() >= 2 for n in p.shape)
    assert 0.8 * N < kernels < N
    assert runs["AdamW"].state_bytes == runs[races.SCHEDULE_FREE].state_bytes == 8 * N
    assert runs["Muon"].state_bytes == 4 * kernels + 8 * (N - kernels)
    assert runs["SOAP"].state_bytes == 8 * N + 4 * soap_extra
    # on a GPT, which has no kernels, the race's Muon splits as muon_param_groups' default
    gpt = GPT(11, 8, 1, 2, 16)
    muon = races.modern_optimizers(1e-3, 1e-3, 2)["Muon"](gpt)
    assert [len(group["params"]) for group in muon.param_groups] == [
        len(group["params"]) for group in optim.muon_param_groups(gpt)
    ]
