"""Tests of lsdl_lab.optim.schedule_free: the paper's recursion written out in float64 (the
three sequences y, z, x and the averaging weights, x also as the weighted average of the
z's in closed form) equals the optimizer's parameters, in train mode (y) and in eval mode
(x); the train/eval switch is an exact round trip; a step in eval mode raises and changes
nothing; exact resume through ``state_dict``, in either mode; groups join in the
optimizer's mode; the compiled path's fallback; bad input; and, where the authors' package
is installed, its numbers. The contract (foreach, groups, edges, sparse and complex) is
test_contract.py's."""

from __future__ import annotations

import io
import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from lsdl_lab import optim
from lsdl_lab.models import MLP
from lsdl_lab.optim.compiled import CompileWarning

CLOSE = dict(rtol=1e-12, atol=1e-12)  # float64: the same arithmetic in another order


def paper_recursion(w0, grads_at, steps, lr, betas, eps, weight_decay, warmup, r, power):
    """Defazio et al.'s Schedule-Free AdamW, as the paper writes it, with x kept explicitly:
    yields (y_{t+1}, x_{t+1}) after each step t, the gradient at y_t from ``grads_at(t, y)``.
    Also checks x against the closed form, the weighted average of z_2 .. z_{t+1}."""
    beta1, beta2 = betas
    z, x, v = w0.clone(), w0.clone(), torch.zeros_like(w0)
    weights, zs, gamma_max = [], [], 0.0
    for t in range(1, steps + 1):
        y = (1 - beta1) * z + beta1 * x
        g = grads_at(t, y)
        v = beta2 * v + (1 - beta2) * g * g
        gamma = lr * min(1.0, t / warmup) if warmup else lr
        z = z - gamma * (g / ((v / (1 - beta2**t)).sqrt() + eps) + weight_decay * y)
        gamma_max = max(gamma_max, gamma)
        weights.append(t**r * gamma_max**power)
        c = weights[-1] / sum(weights) if sum(weights) > 0 else 0.0
        x = (1 - c) * x + c * z
        zs.append(z)
        if sum(weights) > 0:  # x_{t+1} = sum_i w_i z_{i+1} / sum_i w_i
            average = sum(w * z_i for w, z_i in zip(weights, zs)) / sum(weights)
            torch.testing.assert_close(x, average, **CLOSE)
        yield (1 - beta1) * z + beta1 * x, x


def gradient_field(seed, shape, device):
    """A gradient that depends on where it is taken: A y - b (a quadratic's), so the
    recursion's y matters, plus noise drawn per step."""
    gen = torch.Generator().manual_seed(seed)
    A = torch.randn(shape[-1], shape[-1], generator=gen, dtype=torch.float64)
    A, b = (A @ A.T / shape[-1]).to(device), torch.randn(shape, generator=gen, dtype=torch.float64)
    noise = [torch.randn(shape, generator=gen, dtype=torch.float64) for _ in range(20)]
    return lambda t, y: y @ A - b.to(device) + noise[t - 1].to(device)


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    steps=st.integers(1, 12),
    lr=st.floats(1e-3, 0.2),
    betas=st.tuples(st.floats(0.05, 0.99), st.floats(0.0, 0.999)),
    eps=st.sampled_from([1e-8, 1e-3]),
    weight_decay=st.sampled_from([0.0, 0.1]),
    warmup=st.integers(0, 5),
    r=st.sampled_from([0.0, 1.0, 2.0]),
    power=st.sampled_from([0.0, 1.0, 2.0]),
)
def test_the_papers_recursion_in_train_and_eval_modes(
    seed, steps, lr, betas, eps, weight_decay, warmup, r, power, device
):
    shape = (3, 4)
    grads_at = gradient_field(seed, shape, device)
    w0 = torch.randn(shape, generator=torch.Generator().manual_seed(seed + 1),
                     dtype=torch.float64).to(device)  # fmt: skip
    w = w0.clone().requires_grad_()
    opt = optim.ScheduleFreeAdamW([w], lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                  warmup_steps=warmup, r=r, weight_lr_power=power)  # fmt: skip
    paper = paper_recursion(w0, grads_at, steps, lr, betas, eps, weight_decay, warmup, r, power)
    for t, (y, x) in enumerate(paper, start=1):
        w.grad = grads_at(t, w.detach())  # at the optimizer's own y_t
        opt.step()
        torch.testing.assert_close(w.detach(), y, **CLOSE)  # train mode: y_{t+1}
        opt.eval()
        torch.testing.assert_close(w.detach(), x, **CLOSE)  # eval mode: x_{t+1}
        opt.train()


def test_the_first_average_is_z_and_warmup_weights_grow_as_the_squared_rate():
    # c_2 = 1: x_2 = z_2; during warmup gamma_t = lr t / T, so c_{t+1} = t^2 / sum_i i^2
    w = torch.zeros(2, dtype=torch.float64, requires_grad=True)
    opt = optim.ScheduleFreeAdamW([w], lr=0.1, warmup_steps=4)
    for t in range(1, 5):
        w.grad = torch.tensor([1.0, -2.0], dtype=torch.float64)
        opt.step()
        state = opt.state[w]
        assert state["lr_max"] == pytest.approx(0.1 * t / 4, rel=1e-15)
        assert state["weight_sum"] == pytest.approx(
            sum((0.1 * i / 4) ** 2 for i in range(1, t + 1))
        )
        if t == 1:
            opt.eval()
            assert torch.equal(w.detach(), state["z"])
            opt.train()


# -- the modes -------------------------------------------------------------------------------


def trained(steps=5, seed=0, **options):
    torch.manual_seed(seed)
    model = MLP(6, 3, hidden=12, depth=2).double()
    opt = optim.ScheduleFreeAdamW(model.parameters(), **{"lr": 1e-2, **options})
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(16, 6, generator=gen, dtype=torch.float64)
        y = torch.randint(0, 3, (16,), generator=gen)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return model, opt


def weights(model):
    return [p.detach().clone() for p in model.parameters()]


def test_train_and_eval_switch_is_an_exact_round_trip():
    model, opt = trained(weight_decay=0.1)
    y = weights(model)
    opt.eval()
    x = weights(model)
    assert all(not torch.equal(a, b) for a, b in zip(x, y))  # x and y differ
    assert all(g["train_mode"] is False for g in opt.param_groups)
    opt.eval()  # a no-op in eval mode
    assert all(torch.equal(a, b) for a, b in zip(weights(model), x))
    opt.train()
    assert all(torch.equal(a, b) for a, b in zip(weights(model), y))  # bit for bit
    assert all("y" not in opt.state[p] for p in model.parameters())  # freed
    opt.train()  # a no-op in train mode
    assert all(torch.equal(a, b) for a, b in zip(weights(model), y))
    opt.eval()
    assert all(torch.equal(a, b) for a, b in zip(weights(model), x))


def test_before_any_step_both_modes_are_the_starting_point():
    # x_1 = y_1 = z_1 = w_0: it starts in train mode, and the switch moves nothing
    w = torch.randn(3, requires_grad=True)
    w0 = w.detach().clone()
    opt = optim.ScheduleFreeAdamW([w])
    assert opt.param_groups[0]["train_mode"] is True
    opt.eval()
    assert torch.equal(w.detach(), w0)
    opt.train()
    assert torch.equal(w.detach(), w0)


def test_a_step_in_eval_mode_raises_and_changes_nothing():
    model, opt = trained()
    opt.eval()
    before, state = weights(model), {k: v.clone() for k, v in opt.state_dict()["state"][0].items()
                                     if torch.is_tensor(v)}  # fmt: skip
    calls = []
    message = "ScheduleFreeAdamW.step() in eval mode: the parameters hold the average x"
    with pytest.raises(RuntimeError, match=re.escape(message)):
        opt.step(lambda: calls.append(1))
    assert not calls  # the closure was not evaluated either
    assert all(torch.equal(a, b) for a, b in zip(weights(model), before))
    assert all(torch.equal(opt.state_dict()["state"][0][k], v) for k, v in state.items())


def test_a_group_added_in_eval_mode_joins_in_eval_mode():
    _, opt = trained()
    opt.eval()
    opt.add_param_group(dict(params=[torch.zeros(2, requires_grad=True)], train_mode=True))
    assert [g["train_mode"] for g in opt.param_groups] == [False, False]
    opt.train()
    assert [g["train_mode"] for g in opt.param_groups] == [True, True]


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_state_dict_resumes_bit_for_bit_with_its_mode(mode):
    whole, _ = trained(steps=8, weight_decay=0.1, warmup_steps=3)
    half, half_opt = trained(steps=4, weight_decay=0.1, warmup_steps=3)
    getattr(half_opt, mode)()  # the reference saves in eval mode: the weights are then x
    buffer = io.BytesIO()
    torch.save(dict(model=half.state_dict(), opt=half_opt.state_dict()), buffer)
    buffer.seek(0)
    saved = torch.load(buffer)  # weights_only: tensors, numbers, bools
    resumed, opt = trained(steps=0, seed=1, lr=1.0)  # other weights and hyperparameters
    resumed.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    assert opt.param_groups[0]["train_mode"] is (mode == "train")
    assert opt.param_groups[0]["lr"] == 1e-2 and opt.param_groups[0]["warmup_steps"] == 3
    opt.train()
    gen = torch.Generator().manual_seed(0)
    for t in range(8):  # the same batches as trained(): the first four drawn and dropped
        x = torch.randn(16, 6, generator=gen, dtype=torch.float64)
        y = torch.randint(0, 3, (16,), generator=gen)
        if t < 4:
            continue
        opt.zero_grad()
        F.cross_entropy(resumed(x), y).backward()
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(weights(resumed), weights(whole)))


def test_compile_warns_once_and_runs_the_eager_update():
    def run(compile):
        w = torch.zeros(5, requires_grad=True)
        opt = optim.ScheduleFreeAdamW([w], lr=0.1, compile=compile)
        for t in range(4):
            w.grad = torch.arange(5.0) - t
            opt.step()
        return w

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = run(True)
    messages = [str(w.message) for w in caught if issubclass(w.category, CompileWarning)]
    assert len(messages) == 1 and "ScheduleFreeAdamW(compile=True)" in messages[0]
    assert torch.equal(compiled, run(False))


# -- the authors' package, where it is installed ---------------------------------------------


def test_matches_the_authors_adamw_schedulefree():
    schedulefree = pytest.importorskip("schedulefree")  # not a dependency: not installed here
    w0 = torch.randn(4, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    ours_w, their_w = w0.clone().requires_grad_(), w0.clone().requires_grad_()
    options = dict(lr=0.05, betas=(0.9, 0.99), weight_decay=0.1, warmup_steps=3)
    ours = optim.ScheduleFreeAdamW([ours_w], **options)
    theirs = schedulefree.AdamWScheduleFree([their_w], **options)
    theirs.train()
    gen = torch.Generator().manual_seed(1)
    for _ in range(10):
        g = torch.randn(4, 3, generator=gen, dtype=torch.float64)
        ours_w.grad, their_w.grad = g.clone(), g.clone()
        ours.step()
        theirs.step()
        torch.testing.assert_close(ours_w, their_w, **CLOSE)
    ours.eval()
    theirs.eval()
    torch.testing.assert_close(ours_w, their_w, **CLOSE)


# -- bad input -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        (dict(lr=-0.1), ValueError, "Invalid learning rate: -0.1 (expected a finite number >= 0)"),
        (dict(betas=(0.0, 0.999)), ValueError,
         "Invalid beta parameter at index 0: 0.0 (expected a finite number in (0, 1))"),
        (dict(betas=(0.9, 1.0)), ValueError,
         "Invalid beta parameter at index 1: 1.0 (expected a finite number in [0, 1))"),
        (dict(warmup_steps=-1), ValueError, "Invalid warmup_steps: -1 (expected an int >= 0)"),
        (dict(warmup_steps=10.0), TypeError,
         "Invalid warmup_steps: 10.0 (expected an int >= 0)"),
        (dict(r=-1.0), ValueError, "Invalid r: -1.0 (expected a finite number >= 0)"),
        (dict(weight_lr_power=float("inf")), ValueError,
         "Invalid weight_lr_power: inf (expected a finite number >= 0)"),
        (dict(weight_decay=-0.1), ValueError,
         "Invalid weight_decay value: -0.1 (expected a finite number >= 0)"),
    ],
)  # fmt: skip
def test_bad_hyperparameters_name_the_argument_and_its_range(options, error, message):
    with pytest.raises(error, match=f"^{re.escape(message)}$"):
        optim.ScheduleFreeAdamW([torch.zeros(3, requires_grad=True)], **options)
    opt = optim.ScheduleFreeAdamW([torch.zeros(3, requires_grad=True)])
    with pytest.raises(TypeError, match=r"^Invalid train_mode: 1 \(expected True or False\)$"):
        optim.ScheduleFreeAdamW([dict(params=[torch.zeros(2, requires_grad=True)],
                                      train_mode=1)])  # fmt: skip
    assert len(opt.param_groups) == 1
