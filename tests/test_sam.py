"""Tests of lsdl_lab.optim.SAM (Foret et al., 2021) and of ghost batch normalization
(Hoffer et al., 2017, in lsdl_lab.models): the two remedies for the generalization gap
that Chapter 5 builds on.

SAM: equal to its base optimizer bit for bit when rho = 0; the perturbation has global
norm rho exactly; on a quadratic the step uses the gradient at w + rho g/||g|| (closed
form), also for ASAM; exact resume from state_dict; parameter groups; clear errors.
Ghost BN: plain BatchNorm2d when the ghost batch holds the batch, BatchNorm2d per chunk
otherwise (outputs and running statistics), BatchNorm2d in evaluation.
"""

import copy
import io

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from lsdl_lab import optim
from lsdl_lab.models import MLP, GhostBatchNorm2d, ResNet, ghost_batch_norm

EXACT = dict(rtol=0.0, atol=0.0)


def data(step, n=32, seed=0):
    gen = torch.Generator().manual_seed(seed * 1000 + step)
    x = torch.randn(n, 6, generator=gen)
    return x, (x[:, 0] + x[:, 1] > 0).long()


def make_model(seed=0):
    torch.manual_seed(seed)
    return MLP(6, 2, hidden=12, depth=2)


def sam_steps(model, opt, steps, start=0):
    """Steps of SAM's usual loop: gradient at w, then step(closure) at w + e(w)."""
    for t in range(start, start + steps):
        x, y = data(t)

        def closure(x=x, y=y):
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            return loss

        opt.zero_grad()
        closure()
        opt.step(closure)


def base_steps(model, opt, steps):
    for t in range(steps):
        x, y = data(t)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()


def assert_same_params(a, b, **tol):
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, **(tol or EXACT))


BASES = [
    (torch.optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=1e-3, foreach=True)),
    (optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True)),
    (optim.Adam, dict(lr=1e-2, weight_decay=1e-2)),
]


@pytest.mark.parametrize("base,kwargs", BASES)
def test_rho_zero_is_the_base_optimizer_bit_for_bit(base, kwargs):
    a, b = make_model(), make_model()
    sam_steps(a, optim.SAM(a.parameters(), base, rho=0.0, **kwargs), 10)
    base_steps(b, base(b.parameters(), **kwargs), 10)
    assert_same_params(a, b)


def test_parameter_groups_with_their_own_lr_pass_through():
    a, b = make_model(), make_model()

    def groups(m):
        return [
            {"params": list(m.net[1].parameters()), "lr": 0.3},
            {"params": list(m.net[3].parameters())},
            {"params": list(m.net[5].parameters()), "lr": 0.01, "momentum": 0.5},
        ]

    sam = optim.SAM(groups(a), optim.SGD, rho=0.0, lr=0.1, momentum=0.9)
    assert sam.base_optimizer.param_groups is sam.param_groups
    assert [g["lr"] for g in sam.param_groups] == [0.3, 0.1, 0.01]
    assert all(g["rho"] == 0.0 and g["adaptive"] is False for g in sam.param_groups)
    scheduler = torch.optim.lr_scheduler.StepLR(sam, step_size=1, gamma=0.5)
    sam_steps(a, sam, 5)
    base_steps(b, optim.SGD(groups(b), lr=0.1, momentum=0.9), 5)
    assert_same_params(a, b)
    scheduler.step()  # acting on SAM's groups, it acts on the base optimizer's
    assert sam.base_optimizer.param_groups[0]["lr"] == 0.15


@settings(max_examples=25, deadline=None)
@given(rho=st.floats(1e-4, 10.0), seed=st.integers(0, 2**16))
def test_first_step_moves_by_rho_in_global_norm_along_the_gradient(rho, seed):
    model = make_model(seed).double()  # float64: (w + e) - w is e to ~1e-16
    params = list(model.parameters())
    sam = optim.SAM(
        [{"params": params[:2]}, {"params": params[2:]}], torch.optim.SGD, rho=rho, lr=0.1
    )
    x, y = data(seed)
    x = x.double()
    F.cross_entropy(model(x), y).backward()
    w = [p.detach().clone() for p in params]
    g = torch.cat([p.grad.reshape(-1) for p in params])
    sam.first_step()
    moved = torch.cat([(p.detach() - wi).reshape(-1) for p, wi in zip(params, w)])
    e = torch.cat([sam.state[p]["e_w"].reshape(-1) for p in params])
    torch.testing.assert_close(e, rho * g / g.norm())
    assert e.norm().item() == pytest.approx(rho, rel=1e-12)
    torch.testing.assert_close(moved, e, rtol=1e-9, atol=1e-15)
    F.cross_entropy(model(x), y).backward()
    sam.second_step()
    assert all("w" not in sam.state[p] for p in params)


def quadratic(seed=0, n=5):
    gen = torch.Generator().manual_seed(seed)
    Q, _ = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))
    A = Q @ torch.diag(torch.linspace(0.5, 4.0, n, dtype=torch.float64)) @ Q.T
    w = nn.Parameter(torch.randn(n, generator=gen, dtype=torch.float64))
    return A, w


@pytest.mark.parametrize("adaptive", [False, True])
def test_on_a_quadratic_the_step_uses_the_gradient_at_the_perturbed_point(adaptive):
    A, w = quadratic()
    rho, lr = 0.3, 0.05
    w0 = w.detach().clone()
    g = A @ w0
    T = w0.abs() if adaptive else torch.ones_like(w0)
    e = rho * T**2 * g / (T * g).norm()  # Foret et al. Eq. 2; Kwon et al. Eq. 9
    expected = w0 - lr * (A @ (w0 + e))

    def closure():
        loss = 0.5 * w @ A @ w
        loss.backward()
        return loss

    sam = optim.SAM([w], optim.SGD, rho=rho, adaptive=adaptive, lr=lr)
    closure()
    loss = sam.step(closure)
    torch.testing.assert_close(w.detach(), expected, rtol=1e-13, atol=1e-14)
    # step returns the closure's loss: the loss at the perturbed weights
    assert loss.item() == pytest.approx((0.5 * (w0 + e) @ A @ (w0 + e)).item(), rel=1e-13)


def test_a_zero_gradient_leaves_the_weights_in_place():
    model = make_model()
    sam = optim.SAM(model.parameters(), torch.optim.SGD, lr=0.1)
    x, y = data(0)

    def closure():
        loss = 0.0 * model(x).sum()
        loss.backward()
        return loss

    before = [p.detach().clone() for p in model.parameters()]
    closure()
    sam.first_step()
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p, b) and torch.count_nonzero(sam.state[p]["e_w"]) == 0
    sam.second_step()
    closure()
    sam.step(closure)
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p, b)  # no NaN anywhere


@pytest.mark.parametrize("base,kwargs", BASES)
def test_state_dict_resume_is_exact(base, kwargs):
    straight = make_model()
    sam_steps(straight, optim.SAM(straight.parameters(), base, rho=0.05, **kwargs), 10)

    first = make_model()
    opt = optim.SAM(first.parameters(), base, rho=0.05, **kwargs)
    sam_steps(first, opt, 5)
    buffer = io.BytesIO()
    torch.save({"model": first.state_dict(), "optimizer": opt.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer)

    resumed = make_model(seed=1)  # different initial weights, overwritten by the checkpoint
    opt2 = optim.SAM(resumed.parameters(), base, rho=0.5, **kwargs)
    resumed.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["optimizer"])
    assert opt2.param_groups[0]["rho"] == 0.05
    assert opt2.base_optimizer.param_groups is opt2.param_groups
    sam_steps(resumed, opt2, 5, start=5)
    assert_same_params(resumed, straight)


def test_sam_trains():
    # SAM is an optimizer: a few dozen steps lower the training loss.
    model = make_model()
    x, y = data(0, n=256)
    before = F.cross_entropy(model(x), y).item()
    opt = optim.SAM(model.parameters(), torch.optim.SGD, rho=0.05, lr=0.2, momentum=0.9)
    for _ in range(40):

        def closure():
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            return loss

        opt.zero_grad()
        closure()
        opt.step(closure)
    assert F.cross_entropy(model(x), y).item() < 0.5 * before


def test_bad_arguments():
    params = list(make_model().parameters())
    with pytest.raises(ValueError, match="Invalid rho: -1"):
        optim.SAM(params, torch.optim.SGD, rho=-1, lr=0.1)
    with pytest.raises(ValueError, match="Invalid rho"):
        optim.SAM([{"params": params, "rho": float("nan")}], torch.optim.SGD, lr=0.1)
    with pytest.raises(TypeError, match="Invalid adaptive"):
        optim.SAM(params, torch.optim.SGD, adaptive=1, lr=0.1)
    with pytest.raises(TypeError, match="Invalid base_optimizer"):
        optim.SAM(params, torch.optim.SGD(params, lr=0.1))
    with pytest.raises(ValueError, match="Invalid learning rate"):
        optim.SAM(params, optim.Adam, lr=-1.0)  # the base optimizer's own validation
    sam = optim.SAM(params[:2], torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match="Invalid rho"):
        sam.add_param_group({"params": params[2:], "rho": -0.1})
    assert len(sam.param_groups) == 1 and len(sam.base_optimizer.param_groups) == 1
    sam.add_param_group({"params": params[2:], "lr": 0.2})
    assert sam.param_groups[1]["rho"] == 0.05 and sam.param_groups[1]["momentum"] == 0
    with pytest.raises(TypeError, match="needs a closure"):
        sam.step()
    with pytest.raises(RuntimeError, match="no gradient"):
        sam.first_step()
    with pytest.raises(ValueError, match="base_optimizer"):
        sam.load_state_dict(torch.optim.SGD(params, lr=0.1).state_dict())


# -- ghost batch normalization (Hoffer et al., 2017) ------------------------------------------


def bn_pair(ghost_batch_size, seed=0, **kwargs):
    torch.manual_seed(seed)
    bn = nn.BatchNorm2d(3, **kwargs).double()
    with torch.no_grad():
        if bn.affine:
            bn.weight.uniform_(0.5, 2.0)
            bn.bias.uniform_(-1.0, 1.0)
    ghost = GhostBatchNorm2d(3, ghost_batch_size, **kwargs).double()
    ghost.load_state_dict(bn.state_dict())
    return bn, ghost


def images(n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return 2 * torch.randn(n, 3, 4, 4, generator=gen, dtype=torch.float64) + 1


def assert_same_state(a, b):
    for (k, u), v in zip(a.state_dict().items(), b.state_dict().values()):
        torch.testing.assert_close(u, v, rtol=1e-12, atol=1e-12, msg=k)


@pytest.mark.parametrize("ghost_batch_size", [16, 100])
def test_ghost_batch_holding_the_whole_batch_is_batchnorm(ghost_batch_size):
    bn, ghost = bn_pair(ghost_batch_size)
    x = images(16)
    torch.testing.assert_close(ghost(x), bn(x), **EXACT)
    assert_same_state(ghost, bn)


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(2, 40),
    ghost_batch_size=st.integers(2, 12),
    momentum=st.sampled_from([0.1, 0.5, None]),
)
def test_each_ghost_batch_is_normalized_with_its_own_statistics(n, ghost_batch_size, momentum):
    # x.split(ghost_batch_size): when n is not a multiple, the last ghost batch is smaller.
    bn, ghost = bn_pair(ghost_batch_size, momentum=momentum)
    x = images(n)
    chunks = x.split(ghost_batch_size)
    expected = torch.cat([bn(c) for c in chunks])  # running statistics: one update a chunk
    torch.testing.assert_close(ghost(x), expected, rtol=1e-12, atol=1e-12)
    assert_same_state(ghost, bn)
    assert ghost.num_batches_tracked.item() == len(chunks)


def test_ghost_batch_norm_differs_from_batchnorm_and_matches_it_in_eval():
    bn, ghost = bn_pair(4)
    x = images(16)
    assert not torch.allclose(ghost(x), bn(x))  # four ghost batches, not one batch
    ghost.load_state_dict(bn.state_dict())  # their running statistics moved differently
    bn.eval(), ghost.eval()
    torch.testing.assert_close(ghost(x), bn(x), **EXACT)


def test_ghost_batch_norm_replaces_every_batchnorm_in_place():
    torch.manual_seed(0)
    model = ResNet(depth=8, width=4, num_classes=10, in_channels=1)
    x = torch.randn(8, 1, 8, 8)
    model(x)  # training mode: running statistics move away from their initial values
    model.eval()
    reference = copy.deepcopy(model)
    assert ghost_batch_norm(model, 2) is model
    kinds = [type(m) for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    assert len(kinds) == 9 and set(kinds) == {GhostBatchNorm2d}  # stem, 3 x 2, 2 shortcuts
    assert not model.training and "ghost_batch_size=2" in repr(model.stem[1])
    torch.testing.assert_close(model(x), reference(x), **EXACT)  # same parameters and buffers
    model.train()
    assert model(x).shape == (8, 10)
    assert ghost_batch_norm(model, 4).stem[1].ghost_batch_size == 4
    single = ghost_batch_norm(nn.BatchNorm2d(3), 2)
    assert isinstance(single, GhostBatchNorm2d)


@pytest.mark.parametrize("bad", [0, -2, 2.0, True, None])
def test_ghost_batch_size_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match="Invalid ghost_batch_size"):
        GhostBatchNorm2d(3, bad)
    with pytest.raises(ValueError, match="Invalid ghost_batch_size"):
        ghost_batch_norm(MLP(4, 2), bad)
