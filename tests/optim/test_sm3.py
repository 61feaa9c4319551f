"""Tests of lsdl_lab.optim.sm3: bit for bit pytorch-optimizer's SM3 (with its beta = 0, the
paper's SM3-II); state of n + m numbers for an n x m matrix (against Adam's 2nm); the
accumulators bound the sum of squared gradients (so the step is never larger than
Adagrad's); a vector's SM3 is Adagrad (lr = 0 and power-of-two scaling: test_common.py)."""

from __future__ import annotations

import inspect

import pytorch_optimizer
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from optim_helpers import (
    EXACT,
    FULL,
    HYPER,
    NO_SHRINK,
    gradient_sequences,
    optimizer,
    ours,
    run,
    single,
    steps,
)
from state_size import state_bytes, state_shapes, stepped

from lsdl_lab import optim


def assert_same_as_reference(a, b):
    """Same parameters and accumulators, bit for bit (pytorch-optimizer keeps a momentum
    buffer even without momentum, so that one is compared only with momentum)."""
    (model_a, opt_a), (model_b, opt_b) = a, b
    for pa, pb in zip(model_a.parameters(), model_b.parameters(), strict=True):
        torch.testing.assert_close(pa, pb, **EXACT)
        for key, value in opt_a.state[pa].items():
            torch.testing.assert_close(value, opt_b.state[pb][key], **EXACT)


def test_same_defaults_as_pytorch_optimizer():
    ours_ = inspect.signature(optim.SM3).parameters
    theirs = inspect.signature(pytorch_optimizer.SM3).parameters
    for arg in ("lr", "momentum", "eps"):
        assert ours_[arg].default == theirs[arg].default, arg
    assert theirs["beta"].default == 0.0  # the paper's SM3-II, the only variant here


@settings(max_examples=6, deadline=None, phases=NO_SHRINK)
@given(data=st.data())
def test_matches_pytorch_optimizer(data, device):
    # pytorch-optimizer's SM3 runs on any device, with the same operations (rsqrt included)
    kw = data.draw(HYPER["SM3"], label="hyperparameters")
    dtype = data.draw(st.sampled_from([torch.float32, torch.float64]), label="dtype")
    foreach = data.draw(st.booleans(), label="foreach")
    a = run(ours("SM3", **kw, foreach=foreach), dtype=dtype, device=device)
    b = run(optimizer(pytorch_optimizer, "SM3", **kw), dtype=dtype, device=device)
    assert_same_as_reference(a, b)


def test_matches_pytorch_optimizer_on_a_resnet(device):
    # order-4 conv weights (four accumulators each), BatchNorm vectors, linear matrices
    kw = FULL["SM3"]
    a = run(ours("SM3", **kw), "resnet", steps=25, device=device)
    b = run(optimizer(pytorch_optimizer, "SM3", **kw), "resnet", steps=25, device=device)
    assert_same_as_reference(a, b)


# -- memory: n + m numbers for an n x m matrix -------------------------------------------------


def test_state_of_an_n_by_m_matrix_is_n_plus_m_numbers(device):
    w = torch.zeros(1000, 500, device=device, requires_grad=True)
    b = torch.zeros(500, device=device, requires_grad=True)
    conv = torch.zeros(4, 30, 20, device=device, requires_grad=True)
    opt = stepped(optim.SM3([w, b, conv]), [w, b, conv])
    assert state_shapes(opt, w) == {"accumulator_0": (1000, 1), "accumulator_1": (1, 500)}
    assert state_bytes(opt, w) == (1000 + 500) * 4  # 6 kB ...
    adam = stepped(optim.Adam([w]), [w])
    assert state_bytes(adam, w) == 2 * 1000 * 500 * 4  # ... against Adam's 4 MB
    assert state_shapes(opt, conv) == {"accumulator_0": (4, 1, 1), "accumulator_1": (1, 30, 1),
                                       "accumulator_2": (1, 1, 20)}  # fmt: skip
    assert state_shapes(opt, b) == {"accumulator_0": (500,)}  # a vector: Adagrad's sum
    # momentum costs the full nm
    opt = stepped(optim.SM3([w], momentum=0.9), [w])
    assert state_bytes(opt, w) == (1000 * 500 + 1000 + 500) * 4


# -- the paper's bound -----------------------------------------------------------------------

shapes = st.sampled_from([(3, 4), (5, 1), (2, 3, 4), (2, 1, 3, 2)])


@settings(max_examples=30, deadline=None)
@given(shape=shapes, steps_=st.integers(1, 12), seed=st.integers(0, 2**16),
       sparse=st.booleans())  # fmt: skip
def test_accumulators_bound_the_sum_of_squared_gradients(shape, steps_, seed, sparse, device):
    # nu_t >= sum_s g_s^2 coordinatewise, exactly in floating point (rounding is monotonic),
    # so |dw| <= lr |g| / sqrt(sum_s g_s^2), Adagrad's step; `sparse` zeroes most entries,
    # where the covers' bound is loosest
    gen = torch.Generator().manual_seed(seed)
    w = torch.zeros(shape, dtype=torch.float64, device=device, requires_grad=True)
    opt = optim.SM3([w], lr=1.0, eps=1e-300)  # a gradient always 0 so far: a step of 0, not 0/0
    total = torch.zeros(shape, dtype=torch.float64, device=device)
    for _ in range(steps_):
        g = torch.randn(shape, generator=gen, dtype=torch.float64)
        if sparse:
            g = g * (torch.rand(shape, generator=gen, dtype=torch.float64) < 0.3)
        g[(0,) * len(shape)] = 1.0  # never all zero
        g = g.to(device)
        total.addcmul_(g, g)
        with torch.no_grad():
            w.zero_()
        w.grad = g
        opt.step()
        accumulators = list(opt.state[w].values())
        bound = accumulators[0]
        for acc in accumulators[1:]:
            bound = torch.minimum(bound, acc)
        assert torch.all(bound >= total)
        adagrad = g.abs() / total.sqrt().clamp_min(1e-300)
        assert torch.all(w.detach().abs() <= adagrad * (1 + 1e-12))


@settings(max_examples=20, deadline=None)
@given(gradients=gradient_sequences)
def test_sm3_of_a_vector_is_adagrad(gradients, device):
    # singletons cover a vector: SM3 is Adagrad (which adds eps outside the square root;
    # with eps = 0 the two differ by rsqrt's rounding only)
    p, opt = single("SM3", device=device, lr=0.1, eps=0.0)
    q, adagrad = single("Adagrad", device=device, lr=0.1, eps=0.0)
    for (_, _, _, dw), (_, _, _, dw_adagrad) in zip(
        steps(opt, p, gradients, torch.float64), steps(adagrad, q, gradients, torch.float64)
    ):
        torch.testing.assert_close(dw, dw_adagrad, rtol=1e-14, atol=0)


def test_matrix_accumulators_are_the_row_and_column_maxima(device):
    g = torch.tensor([[1.0, 2.0, 0.0], [0.5, 0.0, 3.0]], dtype=torch.float64, device=device)
    w = torch.zeros(2, 3, dtype=torch.float64, device=device, requires_grad=True)
    opt = optim.SM3([w], lr=1.0, eps=0.0)
    w.grad = g
    opt.step()  # nu_1 = g^2 (the accumulators start at 0)
    state = opt.state[w]
    assert state["accumulator_0"].flatten().tolist() == [4.0, 9.0]
    assert state["accumulator_1"].flatten().tolist() == [1.0, 4.0, 9.0]
    w.grad = torch.ones(2, 3, dtype=torch.float64, device=device)
    opt.step()  # nu_2 = min(row, col) + 1
    assert state["accumulator_0"].flatten().tolist() == [5.0, 10.0]
    assert state["accumulator_1"].flatten().tolist() == [2.0, 5.0, 10.0]
