"""Tests of lsdl_lab.optim.adafactor: torch.optim.Adafactor's steps where the settings coincide
(to rounding: float64 runs agree to 1e-10 after 100 steps); state of n + m numbers for an n
x m matrix (against Adam's 2nm); the factored second moment keeps the row and column means
of G^2 (and is G^2 itself when G^2 has rank one); the decay schedule, update clipping,
relative step size, parameter scale and first moment, each against its equation (lr = 0 and
power-of-two scaling: test_common.py)."""

from __future__ import annotations

import inspect
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from optim_helpers import (
    FULL,
    HYPER,
    NO_SHRINK,
    gradient_sequences,
    ours,
    run,
    single,
    steps,
)
from state_size import state_bytes, state_shapes, stepped

from lsdl_lab import optim

# where our settings coincide with torch.optim.Adafactor's (optim_helpers.HYPER says which)
HYPER_AS_TORCH, FULL_AS_TORCH = HYPER["Adafactor"], FULL["Adafactor"]


def torch_kw(kw: dict) -> dict:
    """Our hyperparameters in torch.optim.Adafactor's names: eps=(eps1, eps2)."""
    kw = dict(kw)
    if "eps1" in kw or "eps2" in kw:
        kw["eps"] = (kw.pop("eps1", None), kw.pop("eps2", 1e-3))
    return kw


def torchs(split=None, **kw):
    def make(model):
        params = list(model.parameters())
        if split is not None:
            params = [dict(params=params[:2], **torch_kw(split[0])),
                      dict(params=params[2:], **torch_kw(split[1]))]  # fmt: skip
        return torch.optim.Adafactor(params, **torch_kw(kw), foreach=True)

    return make


def test_same_defaults_as_torch():
    ours_ = inspect.signature(optim.Adafactor).parameters
    theirs = inspect.signature(torch.optim.Adafactor).parameters
    for arg in ("lr", "beta2_decay", "d", "weight_decay"):
        assert ours_[arg].default == theirs[arg].default, arg
    assert (ours_["eps1"].default, ours_["eps2"].default) == theirs["eps"].default


# The same operations in the same order, except two the library computes faster: the row
# and column means of G^2 (torch: the squared norm along the dimension, which rounds
# differently by an ulp or two) and max(1, RMS/d) (torch: Python floats; here 0-d tensors
# of the parameters' dtype, no synchronization). So the runs agree to rounding, amplified
# by training: float64 to 1e-10 after 100 steps; float32 to 2e-4 on the MLP (on the
# ResNet, BatchNorm amplifies float32's ulps to 1e-2 in 25 steps: compared in float64).
TOLERANCE = {torch.float64: dict(rtol=1e-10, atol=1e-14), torch.float32: dict(rtol=2e-4, atol=1e-7)}
# On CUDA the two formulas' reductions (a norm, a mean along a dimension) run in other
# kernels, in another order: their ulps differ otherwise than on the CPU, and training
# amplifies them alike; ten times the CPU's tolerance, still far below any real difference
CUDA_FACTOR = 10


def assert_close_run(a, b, dtype):
    """Same parameters and the same state under the same names, to ``TOLERANCE``."""
    (model_a, opt_a), (model_b, opt_b) = a, b
    factor = 1 if next(model_a.parameters()).device.type == "cpu" else CUDA_FACTOR
    tol = {k: v * factor for k, v in TOLERANCE[dtype].items()}
    for pa, pb in zip(model_a.parameters(), model_b.parameters(), strict=True):
        torch.testing.assert_close(pa, pb, **tol)
        sa, sb = opt_a.state[pa], opt_b.state[pb]
        assert sa.keys() == sb.keys()
        assert float(sa["step"]) == float(sb["step"])  # a Python int here, a tensor in torch
        for key in sa.keys() - {"step"}:
            torch.testing.assert_close(sa[key], sb[key], **tol)


@settings(max_examples=6, deadline=None, phases=NO_SHRINK)
@given(kw=HYPER_AS_TORCH, second=st.none() | HYPER_AS_TORCH,
       dtype=st.sampled_from([torch.float32, torch.float64]), foreach=st.booleans())  # fmt: skip
def test_matches_torch_optim(kw, second, dtype, foreach, device):
    # with a second group: the first layer with kw, the others with `second` and the
    # constructor's default lr; foreach=False must agree with torch's foreach path too
    split = None if second is None else (kw, {k: v for k, v in second.items() if k != "lr"})
    kw = kw if split is None else {}
    a = run(ours("Adafactor", split, **kw, foreach=foreach), dtype=dtype, device=device)
    assert_close_run(a, run(torchs(split, **kw), dtype=dtype, device=device), dtype)


def test_matches_torch_optim_on_a_resnet(device):
    # conv weights (factored over their last two dimensions, as torch does), BatchNorm and
    # linear parameters in one multi-tensor call
    a = run(ours("Adafactor", **FULL_AS_TORCH), "resnet", torch.float64, steps=25, device=device)
    b = run(torchs(**FULL_AS_TORCH), "resnet", torch.float64, steps=25, device=device)
    assert_close_run(a, b, torch.float64)


# -- memory: n + m numbers for an n x m matrix -------------------------------------------------


def test_state_of_an_n_by_m_matrix_is_n_plus_m_numbers(device):
    w = torch.zeros(1000, 500, device=device, requires_grad=True)
    b = torch.zeros(500, device=device, requires_grad=True)
    conv = torch.zeros(4, 30, 20, device=device, requires_grad=True)  # 4 matrices 30 x 20
    opt = stepped(optim.Adafactor([w, b, conv]), [w, b, conv])
    assert state_shapes(opt, w) == {"row_var": (1000, 1), "col_var": (1, 500)}
    assert state_bytes(opt, w) == (1000 + 500) * 4  # 6 kB ...
    adam = stepped(optim.Adam([w]), [w])
    assert state_bytes(adam, w) == 2 * 1000 * 500 * 4  # ... against Adam's 4 MB
    assert state_shapes(opt, conv) == {
        "row_var": (4, 30, 1), "col_var": (4, 1, 20)}  # fmt: skip
    assert state_shapes(opt, b) == {"variance": (500,)}
    # the first moment costs the full nm
    opt = stepped(optim.Adafactor([w], beta1=0.9), [w])
    assert state_bytes(opt, w) == (1000 * 500 + 1000 + 500) * 4


# -- the factored second moment ------------------------------------------------------------


def absolute(**kw):
    """A step of -G / sqrt(V_hat) exactly: lr 1, no parameter scale, no clipping."""
    return dict(lr=1.0, relative_step=False, scale_parameter=False, d=math.inf, eps1=0.0) | kw


def first_step(g: torch.Tensor, **kw) -> torch.Tensor:
    w = torch.zeros_like(g, requires_grad=True)
    w.grad = g.clone()
    optim.Adafactor([w], **absolute(**kw)).step()
    return w.detach()


@settings(max_examples=20, deadline=None)
@given(n=st.integers(2, 7), m=st.integers(2, 7), seed=st.integers(0, 2**16))
def test_factored_second_moment_keeps_row_and_column_means(n, m, seed, device):
    # At t = 1 (beta2_1 = 0), V_hat = R C / mean(R) with R, C the row and column means of
    # G^2: its own row and column means are those of G^2 (the paper's property of the factoring)
    g = torch.randn(n, m, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    g = g.to(device)
    v_hat = (g / first_step(g)) ** 2
    torch.testing.assert_close(v_hat.mean(1), (g * g).mean(1), rtol=1e-12, atol=0)
    torch.testing.assert_close(v_hat.mean(0), (g * g).mean(0), rtol=1e-12, atol=0)


def test_factored_second_moment_is_exact_for_a_rank_one_square(device):
    # G^2 = a^2 (b^2)^T has rank one: the factored V_hat is G^2 itself, the step -sign(G)
    gen = torch.Generator().manual_seed(0)
    a, b = (
        torch.randn(6, generator=gen, dtype=torch.float64).to(device),
        torch.randn(5, generator=gen, dtype=torch.float64).to(device),
    )
    g = torch.outer(a, b)
    torch.testing.assert_close(first_step(g), -torch.sign(g), rtol=1e-14, atol=0)
    v = torch.randn(5, 6, 7, generator=gen, dtype=torch.float64).exp().to(device)  # order 3
    g = v[:, :, :1] * v[:, :1, :]  # rank one
    torch.testing.assert_close(first_step(g), -torch.sign(g), rtol=1e-14, atol=0)


@settings(max_examples=20, deadline=None)
@given(gradients=gradient_sequences, c=st.floats(-1.0, -0.1))
def test_second_moment_of_a_vector_follows_the_decay_schedule(gradients, c, device):
    p, opt = single("Adafactor", device=device, beta2_decay=c)
    v = torch.zeros(4, dtype=torch.float64, device=device)
    for t, g, _, _ in steps(opt, p, gradients, torch.float64):
        beta2 = 1 - t**c  # 0 at t = 1: no bias correction needed
        v = beta2 * v + (1 - beta2) * g * g
        torch.testing.assert_close(opt.state[p]["variance"], v, rtol=1e-13, atol=0)


# -- step size, clipping, first moment -----------------------------------------------------


@settings(max_examples=20, deadline=None)
@given(gradients=gradient_sequences, d=st.floats(0.1, 2.0))
def test_update_clipping_bounds_the_rms_of_the_step(gradients, d, device):
    p, opt = single("Adafactor", device=device, **absolute(d=d))
    for t, _, _, dw in steps(opt, p, gradients, torch.float64):
        rms = dw.square().mean().sqrt().item()
        assert rms <= d * (1 + 1e-12)
        if t == 1:  # U_1 = sign(G): RMS 1, clipped to d when d < 1
            assert rms == pytest.approx(min(d, 1.0), rel=1e-12)


def test_update_clipping_stops_the_step_of_a_sudden_large_gradient(device):
    # small gradients, then a large one: V_hat lags behind and U_t is far above RMS 1
    gradients = [[1e-3] * 4] * 10 + [[1.0] * 4]
    for d, expected in ((1.0, 1.0), (math.inf, None)):
        p, opt = single("Adafactor", device=device, **absolute(d=d))
        *_, (_, _, _, dw) = steps(opt, p, gradients, torch.float64)
        rms = dw.square().mean().sqrt().item()
        assert rms == pytest.approx(expected) if expected else rms > 2.0


@pytest.mark.parametrize("lr", [1.0, 0.3])
def test_relative_step_size(lr, device):
    # a constant gradient: V_hat = G^2, U = sign(G), so the step is rho_t = min(lr, 1/sqrt t)
    # times max(eps2, RMS(w)); the helper starts each step from w = 0: RMS(w) = 0
    p, opt = single("Adafactor", device=device, lr=lr, eps2=0.25)
    for t, g, _, dw in steps(opt, p, [[2.0, -1.0, 0.5, 3.0]] * 20, torch.float64):
        expected = -0.25 * min(lr, 1 / math.sqrt(t)) * torch.sign(g)
        torch.testing.assert_close(dw, expected, rtol=1e-14, atol=0)


def test_parameter_scale_and_decoupled_weight_decay(device):
    gen = torch.Generator().manual_seed(0)
    w0 = torch.randn(3, 50, generator=gen, dtype=torch.float64)
    g = torch.outer(torch.rand(3, generator=gen, dtype=torch.float64) + 0.1,
                    torch.randn(50, generator=gen, dtype=torch.float64))  # fmt: skip
    w0, g = w0.to(device), g.to(device)
    w = w0.clone().requires_grad_()
    w.grad = g
    optim.Adafactor([w], lr=0.01, weight_decay=0.5).step()
    rms = w0.square().mean().sqrt()  # of the weights before the decay, as torch.optim
    expected = (1 - 0.01 * 0.5) * w0 - rms * 0.01 * torch.sign(g)
    torch.testing.assert_close(w.detach(), expected, rtol=1e-13, atol=1e-16)


@pytest.mark.parametrize("beta1", [0.0, 0.5, 0.9])
def test_first_moment_averages_the_clipped_update(beta1, device):
    # U_t = sign(G) for a constant gradient; clipped to d = 0.5; M_t = (1 - beta1^t) U_t / 2
    p, opt = single("Adafactor", device=device, **absolute(lr=0.1, d=0.5, beta1=beta1))
    for t, g, _, dw in steps(opt, p, [[2.0, -1.0, 0.5, 3.0]] * 10, torch.float64):
        expected = -0.1 * (1 - beta1**t) * 0.5 * torch.sign(g)
        torch.testing.assert_close(dw, expected, rtol=1e-14, atol=0)
