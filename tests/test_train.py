import functools
import math
import os
from pathlib import Path

import pytest
import torch
from torch import nn

from lsdl_lab import checkpoint, models, train
from lsdl_lab.data import BatchSource


class RandomBatches(BatchSource):
    """Batches drawn with replacement, each from its own generator seeded by the step."""

    def __init__(self, x, y, batch, seed):
        self.x, self.y, self.batch, self.seed = x, y, batch, seed
        self.steps_per_epoch = len(x) // batch

    def __call__(self, t):
        g = torch.Generator().manual_seed(self.seed * 1000 + t)
        idx = torch.randint(len(self.x), (self.batch,), generator=g)
        return self.x[idx], self.y[idx]


def image_batches(n=96, batch=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 1, 8, 8, generator=gen)
    y = (x.mean(dim=(1, 2, 3)) > 0).long() + 2 * (x[:, 0, 0, 0] > 0).long()
    return RandomBatches(x, y, batch, seed), [(x[:48], y[:48]), (x[48:], y[48:])]


def token_batches(vocab=13, block=8, batch=4):
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(vocab, (400,), generator=gen)

    def batches(t):
        g = torch.Generator().manual_seed(t)
        s = torch.randint(len(tokens) - block - 1, (batch,), generator=g)
        x = torch.stack([tokens[i : i + block] for i in s])
        y = torch.stack([tokens[i + 1 : i + block + 1] for i in s])
        return x, y

    return batches


def make_resnet(device="cpu"):
    torch.manual_seed(0)
    m = models.ResNet(8, 4, 4, 1).to(device)
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: min(1.0, (t + 1) / 10))
    return m, opt, sched


def make_gpt(device="cpu"):
    torch.manual_seed(0)
    m = models.GPT(13, block_size=8, layers=1, heads=2, dim=16, dropout=0.2).to(device)
    return m, torch.optim.AdamW(m.parameters(), lr=3e-3), None


class Killed(Exception):
    pass


# On CUDA two runs of the same steps may differ in their last bits: some kernels add in an
# order that varies from run to run (cuDNN's convolution backward, NLLLoss; see
# torch.use_deterministic_algorithms), and training carries the difference on. A resume
# that lost any state (RNG, data order, moments, schedule) is off by whole updates, 1e-3
# and more, so the CUDA half compares to 1e-4; the CPU half, bit for bit.
CUDA_RUN_TOLERANCE = dict(rtol=1e-4, atol=1e-5)


def assert_same_run(state: dict, expected: dict, device: torch.device) -> None:
    for k, v in state.items():
        if device.type == "cpu":
            assert torch.equal(v, expected[k]), k
        else:
            torch.testing.assert_close(v, expected[k], **CUDA_RUN_TOLERANCE, msg=k)


def same_losses(records: list[dict], device: torch.device):
    losses = [r["loss"] for r in records]
    return losses if device.type == "cpu" else pytest.approx(losses, rel=1e-4)


def kill_at(step):
    def callback(t, history):
        if t == step:
            raise Killed

    return callback


@pytest.mark.parametrize(
    "make,task,batches",
    [
        (make_resnet, "classification", image_batches()[0]),
        (make_gpt, "language_modeling", token_batches()),
    ],
)
def test_resume_is_bit_exact(tmp_path, make, task, batches, device):
    """A run killed after its step-20 checkpoint and resumed equals an uninterrupted run
    (on CUDA too, where the checkpoint's RNG states are loaded onto the GPU first)."""
    model, opt, sched = make(device)
    ref = train.fit(
        model, opt, batches, steps=40, task=task, scheduler=sched, progress=False, log_every=5
    )
    expected = {k: v.clone() for k, v in model.state_dict().items()}

    ckpt = tmp_path / "run.pt"
    model, opt, sched = make(device)
    with pytest.raises(Killed):
        train.fit(
            model,
            opt,
            batches,
            steps=40,
            task=task,
            scheduler=sched,
            progress=False,
            log_every=5,
            checkpoint=ckpt,
            checkpoint_every=10,
            callback=kill_at(27),
        )
    torch.manual_seed(123)  # a resumed process starts with other RNG state; the checkpoint fixes it
    model, opt, sched = make(device)
    resumed = train.fit(
        model,
        opt,
        batches,
        steps=40,
        task=task,
        scheduler=sched,
        progress=False,
        log_every=5,
        checkpoint=ckpt,
        resume=True,
    )
    assert_same_run(model.state_dict(), expected, device)
    assert [r["loss"] for r in resumed.train] == same_losses(ref.train, device)
    assert [r["step"] for r in resumed.train] == list(range(5, 41, 5))


def test_resume_without_checkpoint_starts_fresh(tmp_path):
    batches, _ = image_batches()
    model, opt, sched = make_resnet()
    h = train.fit(
        model, opt, batches, steps=3, progress=False, checkpoint=tmp_path / "c.pt", resume=True
    )
    assert h.train[0]["step"] == 1 and (tmp_path / "c.pt").exists()


def test_checkpoint_is_atomic(tmp_path, monkeypatch):
    """A save that dies midway leaves the previous checkpoint intact and no temp file."""
    path = tmp_path / "c.pt"
    checkpoint.save(path, "test/1", value=torch.tensor(1.0))

    def dying_save(obj, f):
        Path(f).write_bytes(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", dying_save)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save(path, "test/1", value=torch.tensor(2.0))
    monkeypatch.undo()
    assert checkpoint.load(path, "test/1")["value"].item() == 1.0
    assert os.listdir(tmp_path) == ["c.pt"]


def test_corrupt_checkpoint_says_what_to_do(tmp_path):
    path = tmp_path / "c.pt"
    path.write_bytes(b"not a checkpoint")
    with pytest.raises(checkpoint.CheckpointError, match="corrupt or truncated.*delete it"):
        checkpoint.load(path)


class _Payload:
    """An object a full unpickle would rebuild (and could run code for)."""

    def __reduce__(self):
        return (print, ("this ran while loading a checkpoint",))


def test_checkpoints_load_with_weights_only(tmp_path, device):
    """What fit saves (model, optimizer, scheduler, a stateful step, history, RNG states)
    loads with torch.load(weights_only=True); a checkpoint that needs a full unpickle is
    refused, not run."""
    batches, _ = image_batches()
    model, opt, sched = make_resnet(device)
    path = tmp_path / "c.pt"
    step = CountingClippedStep()
    train.fit(
        model, opt, batches, steps=4, step=step, scheduler=sched, progress=False, checkpoint=path
    )
    state = torch.load(path, weights_only=True)
    assert {"model", "optimizer", "scheduler", "step_fn", "history", "rng"} <= set(state)
    assert state["step"] == 4 and torch.is_tensor(state["rng"]["torch"])

    evil = tmp_path / "evil.pt"
    torch.save({"model": model.state_dict(), "x": _Payload()}, evil)
    message = f"checkpoint {evil} cannot be read: it holds objects other than tensors"
    with pytest.raises(checkpoint.CheckpointError, match=message):
        checkpoint.load(evil)
    model, opt, sched = make_resnet()
    with pytest.raises(RuntimeError, match="weights_only=True"):
        train.fit(model, opt, batches, steps=4, progress=False, checkpoint=evil, resume=True)


def test_non_finite_loss_names_the_step_and_spares_the_parameters(device):
    batches, _ = image_batches()
    model, opt, _ = make_resnet(device)

    def poisoned(t):
        x, y = batches(t)
        return (x * float("nan"), y) if t == 7 else (x, y)

    with pytest.raises(train.NonFiniteLossError, match="at step 7") as err:
        train.fit(model, opt, poisoned, steps=20, progress=False)
    assert "nan" in str(err.value)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_divergent_learning_rate_stops_with_clear_error(device):
    batches, _ = image_batches()
    torch.manual_seed(0)
    model = models.MLP(64, 4, hidden=32).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e6)
    with pytest.raises(train.NonFiniteLossError, match=r"at step \d+ \(lr=1e\+06\)"):
        train.fit(model, opt, batches, steps=50, progress=False)


def test_training_learns_and_history_is_complete(device):
    batches, evals = image_batches(n=256, batch=32)
    torch.manual_seed(0)
    model = models.MLP(64, 4, hidden=64).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    h = train.fit(model, opt, batches, epochs=10, eval_batches=evals, progress=False)
    steps = 10 * batches.steps_per_epoch
    assert h.train[-1]["step"] == steps and h.eval[-1]["step"] == steps
    assert len(h.eval) == 10  # once an epoch by default
    for key in ("loss", "accuracy", "lr", "grad_norm", "examples_per_s", "time", "epoch"):
        assert key in h.train[-1], key
    assert h.last("eval_accuracy") > 0.6
    assert h.series("loss")[1][-1] < h.series("loss")[1][0]
    times = h.series("time")[1]
    assert times == sorted(times)
    with pytest.raises(KeyError, match="recorded: .*loss"):
        h.series("perplexity")


def test_evaluate_matches_manual_average_and_restores_mode(device):
    _, evals = image_batches()  # on the CPU: evaluate moves each batch to the model's device
    model = models.ResNet(8, 4, 4, 1).to(device).train()
    m = train.evaluate(model, evals)
    assert model.training
    model.eval()
    # batch by batch, as evaluate runs them: a batch of 96 could be convolved by another
    # cuDNN algorithm than one of 48, in TF32 (torch.backends.cudnn.allow_tf32)
    with torch.no_grad():
        outputs = [(model(x.to(device)), y.to(device)) for x, y in evals]
    n = sum(len(y) for _, y in outputs)
    loss_sum = sum(nn.functional.cross_entropy(out, y, reduction="sum") for out, y in outputs)
    correct = sum((out.argmax(1) == y).sum().item() for out, y in outputs)
    assert math.isclose(m["loss"], loss_sum.item() / n, rel_tol=1e-5)
    assert m["accuracy"] == correct / n


def test_language_modeling_reports_perplexity(device):
    model, opt, _ = make_gpt(device)
    batches = token_batches()
    evals = [batches(10_000 + i) for i in range(3)]
    h = train.fit(
        model, opt, batches, steps=30, task="language_modeling", eval_batches=evals, progress=False
    )
    ppl = h.last("eval_perplexity")
    assert math.isclose(ppl, math.exp(h.last("eval_loss")), rel_tol=1e-9)
    assert ppl < 13  # below the uniform guess over 13 tokens


def test_gradient_clipping_bounds_the_update(device):
    batches, _ = image_batches()
    torch.manual_seed(0)
    model = models.MLP(64, 4, hidden=16).to(device)
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    step = functools.partial(train.train_step, clip_grad_norm=1e-3)
    train.fit(model, opt, batches, steps=1, step=step, progress=False)
    moved = torch.cat([(p.detach() - b).flatten() for p, b in zip(model.parameters(), before)])
    assert moved.norm() <= 1e-3 * (1 + 1e-4)


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        ({"steps": 0}, ValueError, "Invalid steps: 0"),
        ({"steps": True}, TypeError, "Invalid steps: True"),
        ({"steps": 2.0}, TypeError, "Invalid steps: 2.0"),
        ({"steps": None}, ValueError, "exactly one of"),
        ({"steps": 5, "epochs": 1}, ValueError, "exactly one of"),
        ({"epochs": 0}, ValueError, "Invalid epochs: 0"),
        ({"epochs": "2"}, TypeError, "Invalid epochs: '2'"),
        ({"steps": 5, "log_every": 0}, ValueError, "Invalid log_every: 0"),
        ({"steps": 5, "log_every": 0.5}, TypeError, "Invalid log_every: 0.5"),
        ({"steps": 5, "eval_every": -1}, ValueError, "Invalid eval_every: -1"),
        ({"steps": 5, "eval_every": 1.0}, TypeError, "Invalid eval_every: 1.0"),
        ({"steps": 5, "checkpoint_every": 2}, ValueError, "needs checkpoint="),
        ({"steps": 5, "task": "regression"}, ValueError, "Invalid task: 'regression'"),
        ({"steps": 5, "task": nn.MSELoss()}, TypeError, "Invalid task: a MSELoss"),
        ({"steps": 5, "step": "sgd"}, TypeError, "Invalid step"),
        ({"steps": 5, "resume": 1}, TypeError, "Invalid resume: 1"),
    ],
)
def test_bad_arguments(kwargs, error, match):
    batches, _ = image_batches()
    model, opt, _ = make_resnet()
    with pytest.raises(error, match=match):
        train.fit(model, opt, batches, progress=False, **kwargs)


def test_bad_checkpoint_every(tmp_path):
    batches, _ = image_batches()
    model, opt, _ = make_resnet()
    for value, error in ((0, ValueError), (2.5, TypeError)):
        with pytest.raises(error, match="Invalid checkpoint_every"):
            train.fit(
                model,
                opt,
                batches,
                steps=5,
                checkpoint=tmp_path / "c.pt",
                checkpoint_every=value,
                progress=False,
            )


def test_bad_clip_grad_norm_is_refused_before_any_update():
    batches, _ = image_batches()
    model, opt, _ = make_resnet()
    before = [p.detach().clone() for p in model.parameters()]
    for value, error in ((-1.0, ValueError), (0.0, ValueError), ("1", TypeError)):
        step = functools.partial(train.train_step, clip_grad_norm=value)
        with pytest.raises(error, match="Invalid clip_grad_norm"):
            train.fit(model, opt, batches, steps=3, step=step, progress=False)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


def test_epochs_need_a_batch_source_with_steps_per_epoch():
    model, opt, _ = make_resnet()
    batches, _ = image_batches()
    with pytest.raises(TypeError, match="BatchSource, which knows its steps_per_epoch"):
        train.fit(model, opt, lambda t: batches(t), epochs=1, progress=False)

    class Windows(BatchSource):  # like random text windows: no fixed epoch
        def __call__(self, t):
            return batches(t)

    with pytest.raises(ValueError, match="Windows has no fixed steps_per_epoch"):
        train.fit(model, opt, Windows(), epochs=1, progress=False)
    with pytest.raises(TypeError, match="Invalid batches: a list"):
        train.fit(model, opt, [batches(0)], steps=1, progress=False)
    # A plain function of the step runs with steps= (and evaluates ten times a run).
    _, evals = image_batches()
    h = train.fit(model, opt, lambda t: batches(t), steps=20, eval_batches=evals, progress=False)
    assert [r["step"] for r in h.eval] == list(range(2, 21, 2))
    assert "epoch" not in h.train[-1]


def test_a_custom_step_is_called_with_model_optimizer_batch_task_and_logged(device):
    batches, _ = image_batches()
    model, opt, sched = make_resnet(device)
    calls = []

    def step(model_, optimizer_, batch, task):
        calls.append((model_, optimizer_, batch, task))
        x, y = batch
        return train.StepResult(
            loss=float(len(calls)), examples=len(y), counts={"correct": 3}, stepped=False
        )

    h = train.fit(
        model, opt, batches, steps=6, step=step, scheduler=sched, log_every=3, progress=False
    )
    assert len(calls) == 6
    for t, (m, o, batch, task) in enumerate(calls):
        assert m is model and o is opt and isinstance(task, train.Classification)
        assert all(a.device.type == device.type for a in batch)  # fit moved the batch to the model
        assert all(torch.equal(a.cpu(), b) for a, b in zip(batch, batches(t)))
    # the window's mean loss over equal batches, the counts summed into the task's metric
    assert [r["loss"] for r in h.train] == [2.0, 5.0]
    assert [r["accuracy"] for r in h.train] == [9 / 48, 9 / 48]
    assert [r["grad_norm"] for r in h.train] == [None, None]
    # stepped=False: the update was skipped, so the schedule did not advance
    assert sched.last_epoch == 0


@pytest.mark.parametrize("clip", [None, 1e-3])
def test_the_logged_gradient_norm_is_the_step_s_before_clipping(clip, device):
    batches, _ = image_batches()
    torch.manual_seed(0)
    model = models.MLP(64, 4, hidden=16).to(device)
    x, y = (t.to(device) for t in batches(0))
    nn.functional.cross_entropy(model(x), y).backward()
    expected = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in model.parameters()]))
    model.zero_grad()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = functools.partial(train.train_step, clip_grad_norm=clip)
    h = train.fit(model, opt, batches, steps=1, step=step, progress=False)
    assert h.train[0]["grad_norm"] == pytest.approx(expected.item(), rel=1e-5)
    assert h.train[0]["grad_norm"] > 1e-2


def test_non_finite_loss_from_a_step_without_a_step_number():
    error = train.NonFiniteLossError(float("inf"), 0.5)
    assert "became inf (lr=0.5)" in str(error) and "at step" not in str(error)
    assert "became inf at step 3 (lr=0.5)" in str(error.at(3))


def test_evaluate_on_language_modeling_averages_over_tokens(device):
    model, _, _ = make_gpt(device)
    tokens = [t.to(device) for t in token_batches(block=8, batch=4)(0)]
    short = (tokens[0][:1, :2], tokens[1][:1, :2])  # one sequence of 2 tokens
    evals = [tokens, short]
    m = train.evaluate(model, evals, "language_modeling")
    model.eval()
    with torch.no_grad():
        losses = [
            nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="sum")
            for x, y in evals
        ]
    assert math.isclose(m["loss"], sum(losses).item() / (4 * 8 + 2), rel_tol=1e-6)


def test_evaluate_restores_every_submodule_mode_even_when_a_batch_raises(device):
    _, evals = image_batches()
    model = models.ResNet(8, 4, 4, 1).to(device).train()
    frozen = next(m for m in model.modules() if isinstance(m, nn.BatchNorm2d)).eval()
    modes = {name: m.training for name, m in model.named_modules()}

    def failing():
        yield evals[0]
        raise OSError("the disk went away")

    with pytest.raises(OSError, match="disk"):
        train.evaluate(model, failing())
    assert {name: m.training for name, m in model.named_modules()} == modes
    train.evaluate(model, evals)
    assert {name: m.training for name, m in model.named_modules()} == modes
    assert not frozen.training
    with pytest.raises(ValueError, match="Invalid batches: empty"):
        train.evaluate(model, [])


def test_accuracy_is_the_fraction_of_rows_whose_top_logit_is_the_target(device):
    output = torch.tensor(
        [[1.0, 2.0, 0.0], [3.0, 0.0, 1.0], [0.0, 0.0, 5.0], [2.0, 1.0, 0.0]], device=device
    )
    target = torch.tensor([1, 1, 2, 0], device=device)
    acc = train.accuracy(output, target)
    assert acc.dtype == torch.float64 and acc.ndim == 0 and acc.device.type == device.type
    assert acc.item() == 0.75


class CountingClippedStep(train.StatefulStep):
    """train_step with clipping whose threshold halves every 4 steps: its state matters."""

    def __init__(self):
        self.calls = 0

    def __call__(self, model, optimizer, batch, task):
        self.calls += 1
        clip = 2.0 ** -(self.calls // 4)
        return train.train_step(model, optimizer, batch, task, clip_grad_norm=clip)

    def state_dict(self):
        return {"calls": self.calls}

    def load_state_dict(self, state):
        self.calls = state["calls"]


def test_a_stateful_step_is_checkpointed_and_resumed_exactly(tmp_path, device):
    batches, _ = image_batches()
    model, opt, _ = make_resnet(device)
    step = CountingClippedStep()
    train.fit(model, opt, batches, steps=12, step=step, progress=False)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    assert step.calls == 12

    ckpt = tmp_path / "run.pt"
    model, opt, _ = make_resnet(device)
    with pytest.raises(Killed):
        train.fit(
            model,
            opt,
            batches,
            steps=12,
            step=CountingClippedStep(),
            progress=False,
            checkpoint=ckpt,
            checkpoint_every=5,
            callback=kill_at(7),
        )
    model, opt, _ = make_resnet(device)
    step = CountingClippedStep()
    train.fit(
        model, opt, batches, steps=12, step=step, progress=False, checkpoint=ckpt, resume=True
    )
    assert step.calls == 12  # 5 restored from the checkpoint, 7 run
    assert_same_run(model.state_dict(), expected, device)


def test_resuming_with_a_part_the_checkpoint_lacks_is_a_clear_error(tmp_path):
    batches, _ = image_batches()
    ckpt = tmp_path / "run.pt"
    model, opt, _ = make_resnet()
    train.fit(model, opt, batches, steps=2, progress=False, checkpoint=ckpt)
    model, opt, sched = make_resnet()
    with pytest.raises(ValueError, match="holds no scheduler state"):
        train.fit(
            model,
            opt,
            batches,
            steps=4,
            scheduler=sched,
            progress=False,
            checkpoint=ckpt,
            resume=True,
        )
