"""Tests of lsdl_lab.optim.layerwise: the one trust ratio (LAMB's, LARS's and the Lab 4b
checker's) against its formula tensor by tensor, its zero conventions and clamp; the
layer-wise parameter groups from a module, named parameters or a parameter list."""

from __future__ import annotations

import io
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from layerwise_helpers import tensors
from optim_helpers import make_model, train

from lsdl_lab import optim
from lsdl_lab.exercises import lab04b
from lsdl_lab.models import ResNet
from lsdl_lab.optim import param_groups_for_layerwise, trust_ratio


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**16), eta=st.floats(1e-3, 10.0), lam=st.sampled_from([0.0, 0.1]),
    eps=st.sampled_from([0.0, 1e-8]),
    clamp=st.sampled_from([None, (0.5, 2.0), (0.0, math.inf)]),
)  # fmt: skip
def test_trust_ratio_is_its_formula_tensor_by_tensor(seed, eta, lam, eps, clamp, device):
    w, u = tensors(seed, device=device), tensors(seed + 1, device=device)
    got = trust_ratio(w, u, clamp, trust_coefficient=eta, weight_decay=lam, eps=eps)
    assert isinstance(got, list) and all(isinstance(x, float) for x in got)
    for wi, ui, tau in zip(w, u, got, strict=True):
        phi = min(max(wi.norm().item(), clamp[0]), clamp[1]) if clamp else wi.norm().item()
        expected = eta * phi / (ui.norm().item() + lam * wi.norm().item() + eps)
        assert tau == pytest.approx(expected, rel=1e-12)


def test_zero_weights_or_a_zero_step_give_one(device):
    zero, ones = torch.zeros(3, 3, device=device), torch.ones(3, 3, device=device)
    assert trust_ratio([zero, ones, zero], [ones, zero, zero], (0.5, 2.0)) == [1.0, 1.0, 1.0]
    # LARS's denominator ||g|| + lam ||w||: zero only when both are
    assert trust_ratio([ones], [zero], weight_decay=0.1) == [pytest.approx(1 / 0.1)]


def test_lab04b_checker_and_lars_use_the_same_trust_ratio(device):
    w, u = tensors(0, device=device), tensors(1, device=device)
    for clamp in (None, (0.5, 2.0)):
        assert [lab04b.trust_ratio(a, b, clamp) for a, b in zip(w, u)] == trust_ratio(w, u, clamp)
    # LARS's first step without momentum is -lr tau g, with tau this function's
    params = [x.clone().requires_grad_() for x in w]
    opt = optim.LARS(params, lr=1.0, momentum=0.0, trust_coefficient=0.01, eps=0.0)
    for p, g in zip(params, u):
        p.grad = g.clone()
    opt.step()
    taus = trust_ratio(w, u, trust_coefficient=0.01)
    for p, a, g, tau in zip(params, w, u, taus):
        torch.testing.assert_close(p.detach(), a - tau * g, rtol=0, atol=0)


def test_param_groups_for_layerwise_from_a_module():
    model = ResNet(8, 4, 10, 1)
    next(model.parameters()).requires_grad_(False)  # frozen parameters are left out
    decayed, excluded = param_groups_for_layerwise(model, 5e-4)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    assert len(decayed["params"]) + len(excluded["params"]) == len(named)
    assert {id(p) for _, p in decayed["params"] + excluded["params"]} == {id(p) for _, p in named}
    assert all(p.ndim >= 2 for _, p in decayed["params"]) and decayed["weight_decay"] == 5e-4
    assert "trust" not in decayed  # the optimizer's default
    assert all(p.ndim == 1 for _, p in excluded["params"])
    assert excluded["weight_decay"] == 0.0 and excluded["trust"] is False
    assert len(param_groups_for_layerwise(torch.nn.Linear(3, 2, bias=False))) == 1


def test_param_groups_for_layerwise_from_pairs_or_a_list():
    model = make_model()
    from_module = param_groups_for_layerwise(model, 0.01)
    from_pairs = param_groups_for_layerwise(list(model.named_parameters()), 0.01)
    from_list = param_groups_for_layerwise(list(model.parameters()), 0.01)
    assert from_module == from_pairs
    assert [[p for _, p in g["params"]] for g in from_pairs] == [g["params"] for g in from_list]
    # named groups reach the optimizer's state_dict as torch.optim's param_names
    opt = optim.LAMB(from_pairs, lr=0.01)
    assert opt.state_dict()["param_groups"][0]["param_names"] == [
        n for n, p in model.named_parameters() if p.ndim >= 2
    ]
    with pytest.raises(ValueError, match="Invalid weight_decay value: -1.0"):
        param_groups_for_layerwise(model, -1.0)


@pytest.mark.parametrize("name", ["LARS", "LAMB"])
def test_resume_with_named_layerwise_groups_is_exact(name, device):
    kw = dict(lr=2.0, nesterov=True) if name == "LARS" else dict(lr=1e-2, clamp=(0.0, 10.0))

    def make(model):
        return getattr(optim, name)(param_groups_for_layerwise(model, 1e-3), **kw)

    model = make_model(device=device)
    straight = train(model, make(model), steps=range(20))
    model = make_model(device=device)
    opt = train(model, make(model), steps=range(10))[1]
    buffer = io.BytesIO()
    torch.save(dict(model=model.state_dict(), opt=opt.state_dict()), buffer)
    buffer.seek(0)
    saved = torch.load(buffer)
    model = make_model(device=device)
    model.load_state_dict(saved["model"])
    opt = make(model)
    opt.load_state_dict(saved["opt"])
    assert opt.param_groups[1]["trust"] is False
    train(model, opt, steps=range(10, 20))
    for p, q in zip(model.parameters(), straight[0].parameters(), strict=True):
        assert torch.equal(p, q)
