"""lsdl_lab.steps: the pieces of a step and their composition, against train_step and
against one large batch (the data-parallel equalities run in tests/run at world 2)."""

import contextlib

import pytest
import torch
from torch import nn

from lsdl_lab import steps, train
from lsdl_lab.memory import LossScaler


def model_and_batches(device, seed=0, n=4):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)).double().to(device)
    gen = torch.Generator().manual_seed(seed + 1)
    batches = [
        (torch.randn(12, 6, generator=gen, dtype=torch.float64), torch.randint(3, (12,)))
        for _ in range(n)
    ]
    return model, [tuple(t.to(device) for t in b) for b in batches]


def run(step, device, **optimizer):
    model, batches = model_and_batches(device)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, **optimizer)
    task = train.Classification()
    results = [step(model, opt, batch, task) for batch in batches]
    return model, results


def test_one_micro_batch_on_one_process_is_train_step(device):
    plain, expected = run(train.train_step, device)
    model, results = run(steps.DataParallelStep(), device)
    assert [r.loss for r in results] == [r.loss for r in expected]
    assert [r.examples for r in results] == [12] * 4 and all(r.stepped for r in results)
    for p, q in zip(model.parameters(), plain.parameters(), strict=True):
        assert torch.equal(p, q)


def test_micro_batches_give_the_large_batchs_gradient(device):
    model, batches = model_and_batches(device, n=1)
    task = train.Classification()
    loss = task.loss(model(batches[0][0]), batches[0][1])
    whole = torch.autograd.grad(loss, list(model.parameters()))
    for k in (2, 3, 4):
        model.zero_grad()
        pairs = steps.micro_batches(batches[0], k)
        assert [len(x) for x, _ in pairs] == [12 // k] * k
        total, examples, counts = steps.accumulate(model, pairs, task)
        assert examples == 12 and counts["correct"] <= 12
        assert total.item() == pytest.approx(loss.item(), rel=1e-14)
        for p, g in zip(model.parameters(), whole, strict=True):
            torch.testing.assert_close(p.grad, g, rtol=1e-13, atol=1e-15)


class NoSync(nn.Sequential):
    """A model with DDP's ``no_sync`` that records which backward passes ran under it."""

    def __init__(self, *layers):
        super().__init__(*layers)
        self.synced = []

    @contextlib.contextmanager
    def no_sync(self):
        self.synced.append(False)
        yield

    def forward(self, x):
        self.synced.append(True)
        return super().forward(x)


def test_only_the_last_micro_batch_synchronizes():
    model = NoSync(nn.Linear(6, 3)).double()
    _, batches = model_and_batches("cpu", n=1)
    steps.accumulate(model, steps.micro_batches(batches[0], 3), train.Classification())
    # each micro-batch: its context (no_sync but the last), then its forward
    assert model.synced == [False, True, False, True, True]


def test_a_poisoned_loss_stops_the_step_before_the_update(device):
    model, batches = model_and_batches(device, n=1)
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = steps.DataParallelStep(2, faults=lambda: True)
    with pytest.raises(train.NonFiniteLossError, match="nan"):
        step(model, opt, batches[0], train.Classification())
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))


def test_fp16_scales_the_loss_and_its_state_resumes(device):
    scaler = LossScaler(init_scale=2.0**10, growth_interval=1)
    step = steps.DataParallelStep(2, precision="fp16", scaler=scaler)
    model, results = run(step, device)
    assert all(r.stepped for r in results) and scaler.get_scale() == 2.0**14
    again = steps.DataParallelStep(2, precision="fp16", scaler=LossScaler())
    again.load_state_dict(step.state_dict())
    assert again.scaler.get_scale() == 2.0**14


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="Invalid scaler: None with precision='fp16'"):
        steps.DataParallelStep(precision="fp16")
    with pytest.raises(ValueError, match="Invalid precision: 'fp8'"):
        steps.DataParallelStep(precision="fp8")
    with pytest.raises(ValueError, match="Invalid micro_batches: 0"):
        steps.DataParallelStep(0)
    batch = (torch.zeros(3, 2), torch.zeros(3))
    with pytest.raises(ValueError, match=r"Invalid k: 4 \(expected an int in \[1, 3\]\)"):
        steps.micro_batches(batch, 4)
    with pytest.raises(ValueError, match="Invalid pairs: empty"):
        steps.accumulate(nn.Linear(2, 1), [], train.Classification())


def test_the_global_loss_of_one_process_is_its_own():
    assert steps.global_loss(torch.tensor(0.25, dtype=torch.float64)) == (0.25, True)
    assert steps.global_loss(torch.tensor(float("inf")))[1] is False
