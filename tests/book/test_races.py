"""races: one fresh model per optimizer on the same batches; steps, seconds and state bytes
recorded as the optimizers' own protocols require."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lsdl_lab import optim
from lsdl_lab.book import races


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
