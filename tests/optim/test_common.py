"""The tests common to the optimizers of optim_helpers.HYPER, over that one table (the
pattern of torch's ``common_optimizers.py``), each case named by its optimizer:

* bit for bit torch.optim where it has the namesake: the same arguments and defaults; the
  same parameters and state after STEPS steps on an MLP for drawn hyperparameters (float32
  or float64, one or two parameter groups, foreach or not); the same after 25 steps on a
  ResNet with every option on (FULL);
* a learning rate of 0 never moves the weights, whatever the other hyperparameters and
  gradients;
* scaling every gradient by 2^k, with the hyperparameters rescaled as SCALING says, gives
  the same trajectory bit for bit.

Adafactor agrees with torch.optim.Adafactor to rounding only (tests/optim/test_adafactor.py
says why and tests it there), SM3 with pytorch-optimizer's (tests/optim/test_sm3.py).
"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from optim_helpers import (
    BEYOND_REFERENCE,
    FULL,
    HYPER,
    NO_SHRINK,
    assert_same,
    gradient_sequences,
    ours,
    run,
    single,
    torchs,
)

from lsdl_lab import optim

# name -> the hyperparameters torch.optim reads from its constructor only, never from a
# group (its Adagrad fills every accumulator with the constructor's initial value; ours
# reads the group's, tests/optim/test_adagrad.py)
BIT_FOR_BIT = {
    "SGD": (),
    "Adagrad": ("initial_accumulator_value",),
    "RMSprop": (),
    "Adadelta": (),
    "Adam": (),
    "AdamW": (),
    "Adamax": (),
    "NAdam": (),
}
# Namesakes whose reference tests are in their own test file: Adafactor agrees with
# torch.optim to a stated tolerance, not bit for bit; Muon bit for bit with the arguments
# passed alike, but its defaults differ from torch's (its scaling, its weight decay)
TO_A_TOLERANCE = {"Adafactor": "test_adafactor.py", "Muon": "test_muon.py"}


def test_every_optimizer_with_a_torch_namesake_has_its_reference_tests():
    with_namesake = {n for n in optim.__all__ if n != "Optimizer" and hasattr(torch.optim, n)}
    assert with_namesake == set(BIT_FOR_BIT) | set(TO_A_TOLERANCE)
    for file in TO_A_TOLERANCE.values():
        assert "def test_matches_torch_optim(" in (Path(__file__).parent / file).read_text()
    assert set(BIT_FOR_BIT) <= set(HYPER) and set(HYPER) <= set(FULL)


# -- reference: torch.optim ------------------------------------------------------------------


@pytest.mark.parametrize("name", BIT_FOR_BIT)
def test_same_arguments_and_defaults_as_torch(name):
    ours_ = inspect.signature(getattr(optim, name)).parameters
    theirs = inspect.signature(getattr(torch.optim, name)).parameters
    for arg, p in ours_.items():
        if arg not in ("foreach", "compile"):  # compile: lsdl_lab's compiled path
            assert arg in theirs and p.default == theirs[arg].default, arg
            assert p.kind == theirs[arg].kind, arg
    assert ours_["foreach"].kind is inspect.Parameter.KEYWORD_ONLY
    assert ours_["compile"].kind is inspect.Parameter.KEYWORD_ONLY


@pytest.mark.parametrize("name", BIT_FOR_BIT)
@settings(max_examples=5, deadline=None, phases=NO_SHRINK)
@given(data=st.data())
def test_matches_torch_optim(name, data, device):
    hyper = HYPER[name]
    kw = data.draw(hyper, label="hyperparameters")
    second = data.draw(st.none() | hyper, label="second parameter group")
    dtype = data.draw(st.sampled_from([torch.float32, torch.float64]), label="dtype")
    # foreach=False must equal foreach=True; both are compared with torch's foreach path.
    foreach = data.draw(st.booleans(), label="foreach")
    split = None
    if second is not None:  # the first layer with kw, the others with `second`
        second.pop("lr")  # the constructor's default, in both
        split, kw = (kw, second), {}
        for key in BIT_FOR_BIT[name]:
            second.pop(key)
            kw[key] = split[0].pop(key)
    a = run(ours(name, split, **kw, foreach=foreach), dtype=dtype, device=device)
    assert_same(a, run(torchs(name, split, **kw), dtype=dtype, device=device))


@pytest.mark.parametrize("name", BIT_FOR_BIT)
def test_matches_torch_optim_on_a_resnet(name, device):
    # conv, BatchNorm and linear parameters of many shapes in one multi-tensor call; a
    # ResNet step costs ten MLP steps, so 25 steps here (the MLP tests run 100)
    a = run(ours(name, **FULL[name]), "resnet", steps=25, device=device)
    assert_same(a, run(torchs(name, **FULL[name]), "resnet", steps=25, device=device))


# -- properties ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", HYPER)
@settings(max_examples=15, deadline=None)
@given(data=st.data(), gradients=gradient_sequences)
def test_zero_learning_rate_leaves_parameters_unchanged(name, data, gradients, device):
    kw = data.draw(HYPER[name], label="hyperparameters")
    kw |= data.draw(BEYOND_REFERENCE.get(name, st.just({})), label="more") | dict(lr=0.0)
    p, opt = single(name, device=device, **kw)
    w0 = torch.randn(4, dtype=torch.float64).to(device)
    with torch.no_grad():
        p.copy_(w0)
    for g in gradients:
        p.grad = torch.tensor(g, dtype=torch.float64, device=device)
        opt.step()
        assert torch.equal(p.detach(), w0)


# name -> (hyperparameters, and their change when every gradient is scaled by c = 2^k) under
# which the trajectories agree bit for bit: scaling by 2^k is exact in floating point, and so
# is every operation of the update on scaled inputs (IEEE arithmetic, square roots and fused
# multiply-adds, on any device)
SCALING = {
    "SGD": (dict(lr=0.01, momentum=0.9, dampening=0.1), lambda c: dict(lr=0.01 / c)),
    "Adagrad": (dict(lr=0.1, eps=0.0, lr_decay=0.1), lambda c: {}),
    "RMSprop": (dict(lr=1e-3, eps=0.0, momentum=0.5, centered=True), lambda c: {}),
    "Adadelta": (dict(lr=1.0, eps=1e-4), lambda c: dict(lr=1.0 / c, eps=1e-4 * c * c)),
    "Adam": (dict(lr=1e-3, eps=0.0, amsgrad=True), lambda c: {}),
    "AdamW": (dict(lr=1e-3, eps=0.0, weight_decay=0.1), lambda c: {}),
    "Adamax": (dict(lr=1e-3, eps=0.0), lambda c: {}),
    "NAdam": (dict(lr=1e-3, eps=0.0, weight_decay=0.1, decoupled_weight_decay=True),
              lambda c: {}),
    # Adafactor's update does not depend on the gradient's scale: with eps1 = 0, nothing
    # changes
    "Adafactor": (dict(lr=1e-2, eps1=0.0, beta1=0.9), lambda c: {}),
    # SM3's g / sqrt(nu) does not depend on the gradient's scale: with eps = 0, nothing changes
    "SM3": (dict(lr=0.1, eps=0.0, momentum=0.9), lambda c: {}),
}  # fmt: skip


@pytest.mark.parametrize("name", SCALING)
@settings(max_examples=15, deadline=None)
@given(
    gradients=gradient_sequences, k=st.integers(-3, 3).filter(bool),
    dtype=st.sampled_from([torch.float32, torch.float64]),
)  # fmt: skip
def test_power_of_two_gradient_scaling_is_exact(name, gradients, k, dtype, device):
    kw, rescale = SCALING[name]
    c = 2.0**k
    p, opt = single(name, dtype, device, **kw)
    q, opt_scaled = single(name, dtype, device, **(kw | rescale(c)))
    for g in gradients:
        g = torch.tensor(g, dtype=dtype, device=device)
        p.grad, q.grad = g, c * g
        opt.step()
        opt_scaled.step()
        assert torch.equal(p, q)
