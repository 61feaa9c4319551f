import math
import os

import pytest
import torch
from torch import nn

from lsdl_lab import models, train


def image_batches(n=96, batch=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 1, 8, 8, generator=gen)
    y = (x.mean(dim=(1, 2, 3)) > 0).long() + 2 * (x[:, 0, 0, 0] > 0).long()

    def batches(t):
        g = torch.Generator().manual_seed(seed * 1000 + t)
        idx = torch.randint(n, (batch,), generator=g)
        return x[idx], y[idx]

    batches.steps_per_epoch = n // batch
    return batches, [(x[:48], y[:48]), (x[48:], y[48:])]


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


def make_resnet():
    torch.manual_seed(0)
    m = models.ResNet(8, 4, 4, 1)
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: min(1.0, (t + 1) / 10))
    return m, opt, sched


def make_gpt():
    torch.manual_seed(0)
    m = models.GPT(13, block_size=8, layers=1, heads=2, dim=16, dropout=0.2)
    return m, torch.optim.AdamW(m.parameters(), lr=3e-3), None


class Killed(Exception):
    pass


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
def test_resume_is_bit_exact(tmp_path, make, task, batches):
    """A run killed after its step-20 checkpoint and resumed equals an uninterrupted run."""
    model, opt, sched = make()
    ref = train.fit(
        model, opt, batches, steps=40, task=task, scheduler=sched, progress=False, log_every=5
    )
    expected = {k: v.clone() for k, v in model.state_dict().items()}

    ckpt = tmp_path / "run.pt"
    model, opt, sched = make()
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
    model, opt, sched = make()
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
    for k, v in model.state_dict().items():
        assert torch.equal(v, expected[k]), k
    assert [r["loss"] for r in resumed.train] == [r["loss"] for r in ref.train]
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
    train.save_checkpoint(path, value=torch.tensor(1.0))

    def dying_save(obj, f):
        f.write(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", dying_save)
    with pytest.raises(KeyboardInterrupt):
        train.save_checkpoint(path, value=torch.tensor(2.0))
    monkeypatch.undo()
    assert train.load_checkpoint(path)["value"].item() == 1.0
    assert os.listdir(tmp_path) == ["c.pt"]


def test_corrupt_checkpoint_says_what_to_do(tmp_path):
    path = tmp_path / "c.pt"
    path.write_bytes(b"not a checkpoint")
    with pytest.raises(RuntimeError, match="delete it"):
        train.load_checkpoint(path)


def test_non_finite_loss_names_the_step_and_spares_the_parameters():
    batches, _ = image_batches()
    model, opt, _ = make_resnet()

    def poisoned(t):
        x, y = batches(t)
        return (x * float("nan"), y) if t == 7 else (x, y)

    with pytest.raises(train.NonFiniteLossError, match="at step 7") as err:
        train.fit(model, opt, poisoned, steps=20, progress=False)
    assert "nan" in str(err.value)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_divergent_learning_rate_stops_with_clear_error():
    batches, _ = image_batches()
    torch.manual_seed(0)
    model = models.MLP(64, 4, hidden=32)
    opt = torch.optim.SGD(model.parameters(), lr=1e6)
    with pytest.raises(train.NonFiniteLossError, match=r"at step \d+ \(lr=1e\+06\)"):
        train.fit(model, opt, batches, steps=50, progress=False)


def test_training_learns_and_history_is_complete():
    batches, evals = image_batches(n=256, batch=32)
    torch.manual_seed(0)
    model = models.MLP(64, 4, hidden=64)
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


def test_evaluate_matches_manual_average_and_restores_mode():
    _, evals = image_batches()
    model = models.ResNet(8, 4, 4, 1).train()
    m = train.evaluate(model, evals)
    assert model.training
    model.eval()
    with torch.no_grad():
        x = torch.cat([b[0] for b in evals])
        y = torch.cat([b[1] for b in evals])
        out = model(x)
    assert math.isclose(m["loss"], nn.functional.cross_entropy(out, y).item(), rel_tol=1e-5)
    assert m["accuracy"] == (out.argmax(1) == y).sum().item() / len(y)


def test_language_modeling_reports_perplexity():
    model, opt, _ = make_gpt()
    batches = token_batches()
    evals = [batches(10_000 + i) for i in range(3)]
    h = train.fit(
        model, opt, batches, steps=30, task="language_modeling", eval_batches=evals, progress=False
    )
    ppl = h.last("eval_perplexity")
    assert math.isclose(ppl, math.exp(h.last("eval_loss")), rel_tol=1e-9)
    assert ppl < 13  # below the uniform guess over 13 tokens


def test_gradient_clipping_bounds_the_update():
    batches, _ = image_batches()
    torch.manual_seed(0)
    model = models.MLP(64, 4, hidden=16)
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    train.fit(model, opt, batches, steps=1, clip_grad_norm=1e-3, progress=False)
    moved = torch.cat([(p.detach() - b).flatten() for p, b in zip(model.parameters(), before)])
    assert moved.norm() <= 1e-3 * (1 + 1e-4)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"steps": 0}, "Invalid steps"),
        ({"steps": None}, "exactly one of"),
        ({"steps": 5, "epochs": 1}, "exactly one of"),
        ({"epochs": 0}, "Invalid epochs"),
        ({"steps": 5, "clip_grad_norm": -1.0}, "Invalid clip_grad_norm"),
        ({"steps": 5, "log_every": 0.5}, "Invalid log_every"),
        ({"steps": 5, "checkpoint_every": 2}, "needs checkpoint="),
        ({"steps": 5, "task": "regression"}, "Invalid task: 'regression'"),
    ],
)
def test_bad_arguments(kwargs, match):
    batches, _ = image_batches()
    model, opt, _ = make_resnet()
    with pytest.raises(ValueError, match=match):
        train.fit(model, opt, batches, progress=False, **kwargs)


def test_epochs_need_steps_per_epoch():
    model, opt, _ = make_resnet()
    with pytest.raises(ValueError, match="steps_per_epoch"):
        train.fit(model, opt, lambda t: None, epochs=1, progress=False)


def test_accuracy_is_the_fraction_of_rows_whose_top_logit_is_the_target():
    output = torch.tensor([[1.0, 2.0, 0.0], [3.0, 0.0, 1.0], [0.0, 0.0, 5.0], [2.0, 1.0, 0.0]])
    target = torch.tensor([1, 1, 2, 0])
    acc = train.accuracy(output, target)
    assert acc.dtype == torch.float64 and acc.ndim == 0
    assert acc.item() == 0.75
