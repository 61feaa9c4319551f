"""Tests of lsdl_lab.optim.

* Reference: every optimizer gives the same parameters and state as its torch.optim
  namesake (``foreach=True``) after 100 steps on a real model, in float32 and float64,
  over many hyperparameter combinations drawn by hypothesis, with several parameter
  groups, and with ``foreach=False``. Equality is asserted *bit for bit*: each update
  performs torch's ``_multi_tensor_*`` operations in the same order, and on CPU that was
  observed exact for every optimizer, dtype and model tried (torch 2.13).
* Resume from ``state_dict`` (directly and through ``torch.save``) continues bit for bit.
* Bad hyperparameters, sparse gradients, complex parameters: clear errors.
* Properties any correct implementation has (step bounds, monotone accumulators, exact
  invariance under power-of-two gradient scaling), on explicit gradient sequences.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import io
import math
import re

import pytest
import torch
import torch.nn.functional as F
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from lsdl_lab import optim
from lsdl_lab.models import MLP, ResNet

NAMES = ["SGD", "Adam", "AdamW", "Adagrad", "RMSprop", "Adadelta", "Adamax", "NAdam"]
STEPS = 100
# Model-training examples cost ~0.2 s each: on failure, report the example as found
# rather than spend minutes shrinking it.
NO_SHRINK = [Phase.explicit, Phase.reuse, Phase.generate]
# Bit for bit (NaN equal to NaN, in case a drawn combination diverges in both).
EXACT = dict(rtol=0.0, atol=0.0, equal_nan=True)

# -- hyperparameters ------------------------------------------------------------------------

lr = st.floats(1e-4, 3e-2)
weight_decay = st.sampled_from([0.0, 0.0, 1e-4, 1e-2, 0.1])
eps = st.sampled_from([1e-10, 1e-8, 1e-6, 1e-3, 0.1])
betas = st.tuples(st.floats(0.0, 0.99), st.floats(0.0, 0.9999))
maybe = lambda strategy: st.one_of(st.just(0.0), strategy)  # noqa: E731

HYPER = {
    "SGD": st.one_of(
        st.fixed_dictionaries(
            dict(lr=st.floats(0.0, 0.1), momentum=maybe(st.floats(0.0, 0.99)),
                 dampening=maybe(st.floats(0.0, 1.0)), weight_decay=weight_decay)
        ),
        st.fixed_dictionaries(
            dict(lr=st.floats(0.0, 0.1), momentum=st.floats(0.01, 0.99),
                 nesterov=st.just(True), weight_decay=weight_decay)
        ),
    ),
    "Adam": st.fixed_dictionaries(
        dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=st.booleans())
    ),
    "AdamW": st.fixed_dictionaries(
        dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=st.booleans())
    ),
    "Adagrad": st.fixed_dictionaries(
        dict(lr=st.floats(1e-3, 0.3), lr_decay=maybe(st.floats(0.0, 0.1)),
             weight_decay=weight_decay, initial_accumulator_value=maybe(st.floats(0.0, 1.0)),
             eps=eps)
    ),
    "RMSprop": st.fixed_dictionaries(
        dict(lr=st.floats(1e-4, 1e-2), alpha=st.floats(0.5, 0.999), eps=eps,
             weight_decay=weight_decay, momentum=maybe(st.floats(0.0, 0.95)),
             centered=st.booleans())
    ),
    "Adadelta": st.fixed_dictionaries(
        dict(lr=st.floats(0.01, 1.0), rho=st.floats(0.0, 1.0),
             eps=st.sampled_from([1e-8, 1e-6, 1e-4]), weight_decay=weight_decay)
    ),
    "Adamax": st.fixed_dictionaries(
        dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    ),
    "NAdam": st.fixed_dictionaries(
        dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
             momentum_decay=st.sampled_from([0.0, 4e-3, 0.05]),
             decoupled_weight_decay=st.booleans())
    ),
}  # fmt: skip

# One combination per optimizer with every option switched on.
FULL = {
    "SGD": dict(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=1e-3),
    "Adam": dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=1e-2, amsgrad=True),
    "AdamW": dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1, amsgrad=True),
    "Adagrad": dict(lr=0.1, lr_decay=0.01, weight_decay=1e-3, initial_accumulator_value=0.1,
                    eps=1e-8),
    "RMSprop": dict(lr=1e-3, alpha=0.9, eps=1e-6, weight_decay=1e-3, momentum=0.5,
                    centered=True),
    "Adadelta": dict(lr=0.5, rho=0.8, eps=1e-5, weight_decay=1e-3),
    "Adamax": dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=1e-3),
    "NAdam": dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=1e-2,
                  momentum_decay=1e-2, decoupled_weight_decay=True),
}  # fmt: skip

# -- training a real model ------------------------------------------------------------------


@contextlib.contextmanager
def default_dtype(dtype):
    # torch.optim keeps scalar state (the step, NAdam's running mu product) in the default
    # dtype; a float64 run is a float64 run throughout (see test_nadam_under_float32_default).
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def make_model(kind: str, dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    model = MLP(6, 3, hidden=12, depth=2) if kind == "mlp" else ResNet(8, 4, 10, 1)
    return model.to(dtype)


@functools.cache
def batch(t: int, kind: str, dtype):
    """The fixed random batch of step ``t``: new data every step, the same in every run."""
    g = torch.Generator().manual_seed(1000 + t)
    shape, classes = ((16, 6), 3) if kind == "mlp" else ((2, 1, 8, 8), 10)
    x = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    return x, torch.randint(0, classes, shape[:1], generator=g)


def train(model, opt, kind, dtype, steps=range(STEPS), scalar_dtype=None):
    with default_dtype(scalar_dtype or dtype):
        for t in steps:
            x, y = batch(t, kind, dtype)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()


def run(make_opt, kind="mlp", dtype=torch.float32, scalar_dtype=None, steps=STEPS):
    """Train a fresh model for ``steps`` steps with the optimizer ``make_opt(model)``."""
    with default_dtype(scalar_dtype or dtype):
        model = make_model(kind, dtype)
        opt = make_opt(model)
    train(model, opt, kind, dtype, range(steps), scalar_dtype)
    return model, opt


def assert_same(a, b):
    """Same parameters, and the same state under the same names, bit for bit."""
    (model_a, opt_a), (model_b, opt_b) = a, b
    for pa, pb in zip(model_a.parameters(), model_b.parameters(), strict=True):
        torch.testing.assert_close(pa, pb, **EXACT)
        sa, sb = opt_a.state.get(pa, {}), opt_b.state.get(pb, {})
        assert sa.keys() == sb.keys()
        for key in sa:
            if key == "step":  # a Python int here, a float tensor in torch.optim
                assert float(sa[key]) == float(sb[key])
            else:
                torch.testing.assert_close(sa[key], sb[key], **EXACT)


def optimizer(module, name, split=None, **kw):
    """A factory ``model -> module.name(model's parameters, **kw)``. With ``split=(first,
    rest)``, two parameter groups: the first layer with ``first``, the others with ``rest``."""

    def make(model):
        params = list(model.parameters())
        if split is not None:
            params = [dict(params=params[:2], **split[0]), dict(params=params[2:], **split[1])]
        return getattr(module, name)(params, **kw)

    return make


@functools.cache
def uninterrupted(name):
    """STEPS steps of ``name`` with FULL hyperparameters and foreach=True (never modified)."""
    return run(ours(name, **FULL[name]))


def ours(name, split=None, **kw):
    return optimizer(optim, name, split, **kw)


def torchs(name, split=None, **kw):
    return optimizer(torch.optim, name, split, **kw, foreach=True)


# -- reference: torch.optim -----------------------------------------------------------------


def test_every_optimizer_with_a_torch_namesake_is_tested():
    with_namesake = {n for n in optim.__all__ if n != "Optimizer" and hasattr(torch.optim, n)}
    assert with_namesake == set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_same_arguments_and_defaults_as_torch(name):
    ours_ = inspect.signature(getattr(optim, name)).parameters
    theirs = inspect.signature(getattr(torch.optim, name)).parameters
    for arg, p in ours_.items():
        if arg != "foreach":
            assert arg in theirs and p.default == theirs[arg].default, arg
    assert ours_["foreach"].kind is inspect.Parameter.KEYWORD_ONLY


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=5, deadline=None, phases=NO_SHRINK)
@given(data=st.data())
def test_matches_torch_optim(name, data):
    kw = data.draw(HYPER[name], label="hyperparameters")
    second = data.draw(st.none() | HYPER[name], label="second parameter group")
    dtype = data.draw(st.sampled_from([torch.float32, torch.float64]), label="dtype")
    # foreach=False must equal foreach=True; both are compared with torch's foreach path.
    foreach = data.draw(st.booleans(), label="foreach")
    split = None
    if second is not None:  # the first layer with kw, the others with `second`
        second.pop("lr")  # the constructor's default, in both
        split, kw = (kw, second), {}
        if name == "Adagrad":  # torch.optim reads it from the constructor only (test below)
            second.pop("initial_accumulator_value")
            kw = dict(initial_accumulator_value=split[0].pop("initial_accumulator_value"))
    assert_same(run(ours(name, split, **kw, foreach=foreach), dtype=dtype),
                run(torchs(name, split, **kw), dtype=dtype))  # fmt: skip


def test_adagrad_initial_accumulator_value_per_group():
    # torch.optim's Adagrad fills every accumulator with the constructor's value, whatever
    # a group says, at construction (so a group added later has none); ours reads the group's.
    p, q, r = (torch.zeros(2, requires_grad=True) for _ in range(3))
    opt = optim.Adagrad([dict(params=[p]), dict(params=[q], initial_accumulator_value=3.0)],
                        initial_accumulator_value=1.0)  # fmt: skip
    opt.add_param_group(dict(params=[r], initial_accumulator_value=5.0))
    for x in (p, q, r):
        x.grad = torch.ones(2)
    opt.step()
    assert [opt.state[x]["sum"].tolist() for x in (p, q, r)] == [[2.0] * 2, [4.0] * 2, [6.0] * 2]


@pytest.mark.parametrize("name", NAMES)
def test_matches_torch_optim_on_a_resnet(name):
    # conv, BatchNorm and linear parameters of many shapes in one multi-tensor call; a
    # ResNet step costs ten MLP steps, so 25 steps here (the MLP tests run 100)
    a = run(ours(name, **FULL[name]), "resnet", steps=25)
    assert_same(a, run(torchs(name, **FULL[name]), "resnet", steps=25))


@pytest.mark.parametrize("name", NAMES)
def test_foreach_false_equals_foreach_true(name):
    # (float64 too, through torch, in test_matches_torch_optim)
    assert_same(run(ours(name, **FULL[name], foreach=False)), uninterrupted(name))


def test_adam_bias_correction_rounds_like_torch():
    # sqrt(1 - 0.5**53) correctly rounded is one ulp away from torch's (1 - 0.5**53) ** 0.5
    kw = dict(lr=2**-6, betas=(0.0, 0.5))
    assert_same(run(ours("Adam", **kw), dtype=torch.float64),
                run(torchs("Adam", **kw), dtype=torch.float64))  # fmt: skip


def test_nadam_under_float32_default():
    # With float32 as the default dtype, torch.optim keeps NAdam's running product of mu_t
    # in float32 even for float64 parameters (until a load_state_dict casts it to float64);
    # ours keeps it in the parameter's dtype, so float64 results differ by that rounding only.
    a, _ = run(ours("NAdam", **FULL["NAdam"]), dtype=torch.float64, scalar_dtype=torch.float32)
    b, opt = run(torchs("NAdam", **FULL["NAdam"]), dtype=torch.float64, scalar_dtype=torch.float32)
    assert opt.state[next(b.parameters())]["mu_product"].dtype == torch.float32
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-8)


# -- resume ---------------------------------------------------------------------------------


@pytest.mark.parametrize("through_file", [False, True])
@pytest.mark.parametrize("name", NAMES)
def test_resume_from_state_dict_is_exact(name, through_file):
    cls = getattr(optim, name)

    model = make_model("mlp", torch.float32)
    opt = cls(model.parameters(), **FULL[name])
    train(model, opt, "mlp", torch.float32, range(STEPS // 2))
    saved = dict(model=model.state_dict(), opt=opt.state_dict())
    if through_file:
        buffer = io.BytesIO()
        torch.save(saved, buffer)
        buffer.seek(0)
        saved = torch.load(buffer)  # weights_only: the state is plain tensors and numbers
    del model, opt

    torch.manual_seed(123)  # a different initialization, overwritten by the checkpoint
    model = MLP(6, 3, hidden=12, depth=2)
    model.load_state_dict(saved["model"])
    opt = cls(model.parameters())  # default hyperparameters, restored from the checkpoint
    opt.load_state_dict(saved["opt"])
    assert opt.param_groups[0]["lr"] == FULL[name]["lr"]
    train(model, opt, "mlp", torch.float32, range(STEPS // 2, STEPS))
    assert_same((model, opt), uninterrupted(name))


# -- bad input ------------------------------------------------------------------------------

WITH_EPS = [n for n in NAMES if n != "SGD"]
WITH_BETAS = ["Adam", "AdamW", "Adamax", "NAdam"]
nan, inf = float("nan"), float("inf")

BAD = [
    *[(n, dict(lr=-1.0), "Invalid learning rate: -1.0") for n in NAMES],
    *[(n, dict(lr=nan), "Invalid learning rate: nan") for n in NAMES],
    *[(n, dict(lr=inf), "Invalid learning rate: inf") for n in NAMES],
    *[(n, dict(weight_decay=-0.1), "Invalid weight_decay value: -0.1") for n in NAMES],
    *[(n, dict(eps=-1e-8), "Invalid epsilon value: -1e-08") for n in WITH_EPS],
    *[(n, dict(eps=nan), "Invalid epsilon value: nan") for n in WITH_EPS],
    *[(n, dict(betas=betas), f"Invalid beta parameter at index {i}: {betas[i]!r}")
      for n in WITH_BETAS
      for i, betas in [(0, (1.0, 0.999)), (0, (-0.1, 0.999)), (1, (0.9, 1.0)), (1, (0.9, -0.5)),
                       (1, (0.9, nan))]],
    *[(n, dict(betas=(0.9,)), "Invalid betas: (0.9,)") for n in WITH_BETAS],
    ("SGD", dict(momentum=-0.1), "Invalid momentum value: -0.1"),
    ("SGD", dict(dampening=-0.1), "Invalid dampening value: -0.1"),
    ("SGD", dict(nesterov=True), "Nesterov momentum requires a momentum"),
    ("SGD", dict(nesterov=True, momentum=0.9, dampening=0.1), "zero dampening"),
    ("Adagrad", dict(lr_decay=-0.1), "Invalid lr_decay value: -0.1"),
    ("Adagrad", dict(initial_accumulator_value=-1.0),
     "Invalid initial_accumulator_value value: -1.0"),
    ("RMSprop", dict(momentum=-0.1), "Invalid momentum value: -0.1"),
    ("RMSprop", dict(alpha=-0.1), "Invalid alpha value: -0.1"),
    ("RMSprop", dict(alpha=1.5), "Invalid alpha value: 1.5"),
    ("Adadelta", dict(rho=-0.1), "Invalid rho value: -0.1"),
    ("Adadelta", dict(rho=1.1), "Invalid rho value: 1.1"),
    ("NAdam", dict(momentum_decay=-1e-3), "Invalid momentum_decay value: -0.001"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "kw", "message"), BAD)
def test_bad_hyperparameters_are_refused(name, kw, message):
    cls = getattr(optim, name)
    p, q = torch.zeros(2, requires_grad=True), torch.zeros(3, requires_grad=True)
    with pytest.raises(ValueError, match=re.escape(message)):
        cls([p], **kw)
    opt = cls([p])
    with pytest.raises(ValueError, match=re.escape(message)):
        opt.add_param_group(dict(params=[q], **kw))


EDGES = {
    "SGD": dict(momentum=0.0, dampening=0.0),
    "Adagrad": dict(lr_decay=0.0, initial_accumulator_value=0.0, eps=0.0),
    "RMSprop": dict(alpha=1.0, eps=0.0, momentum=0.0),
    "Adadelta": dict(rho=1.0, eps=0.0),
    **{n: dict(betas=(0.0, 0.0), eps=0.0) for n in WITH_BETAS},
}


@pytest.mark.parametrize("name", NAMES)
def test_edges_of_the_ranges_are_accepted(name):
    p = torch.zeros(2, requires_grad=True)
    edges = dict(lr=0.0, weight_decay=0.0) | EDGES.get(name, {})
    getattr(optim, name)([p], **edges)


@pytest.mark.parametrize("name", NAMES)
def test_sparse_gradients_are_refused_by_name(name):
    emb = torch.nn.Embedding(5, 3, sparse=True)
    opt = getattr(optim, name)(emb.parameters(), lr=0.1)
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match=f"{name} does not support sparse gradients"):
        opt.step()


@pytest.mark.parametrize("name", NAMES)
def test_complex_parameters_are_refused(name):
    z = torch.zeros(2, dtype=torch.complex64, requires_grad=True)
    with pytest.raises(ValueError, match="complex"):
        getattr(optim, name)([z])
    opt = getattr(optim, name)([torch.zeros(2, requires_grad=True)])
    with pytest.raises(ValueError, match="complex"):
        opt.add_param_group(dict(params=[z]))


# -- closure, parameters without gradient ----------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_closure_returns_the_loss_and_steps_as_without(name):
    with_closure, plain = make_model("mlp", torch.float32), make_model("mlp", torch.float32)
    opt_c = getattr(optim, name)(with_closure.parameters(), **FULL[name])
    opt_p = getattr(optim, name)(plain.parameters(), **FULL[name])
    for t in range(3):
        x, y = batch(t, "mlp", torch.float32)

        def closure(x=x, y=y):
            opt_c.zero_grad()
            loss = F.cross_entropy(with_closure(x), y)
            loss.backward()
            return loss

        loss = opt_c.step(closure)
        opt_p.zero_grad()
        expected = F.cross_entropy(plain(x), y)
        expected.backward()
        opt_p.step()
        assert isinstance(loss, torch.Tensor) and loss.item() == expected.item()
    assert_same((with_closure, opt_c), (plain, opt_p))


@pytest.mark.parametrize("name", NAMES)
def test_parameters_without_gradient_are_skipped(name):
    model = make_model("mlp", torch.float32)
    unused = torch.nn.Parameter(torch.ones(4))  # in the optimizer, never in the loss
    frozen = model.net[1].bias  # a layer frozen for the whole run
    frozen.requires_grad_(False)
    before = frozen.detach().clone()
    opt = getattr(optim, name)([*model.parameters(), unused], **FULL[name])
    train(model, opt, "mlp", torch.float32, range(3))
    assert torch.equal(unused, torch.ones(4)) and torch.equal(frozen, before)
    assert unused not in opt.state and frozen not in opt.state
    assert all(len(opt.state[p]) > 0 for p in model.parameters() if p.requires_grad)
    opt.load_state_dict(opt.state_dict())  # and state_dict works with the stateless ones


# -- properties -----------------------------------------------------------------------------

magnitude = st.floats(1e-2, 1e2)
nonzero = st.builds(lambda m, negative: -m if negative else m, magnitude, st.booleans())
gradient_sequences = st.integers(1, 25).flatmap(
    lambda steps: st.lists(
        st.lists(nonzero, min_size=4, max_size=4), min_size=steps, max_size=steps
    )  # fmt: skip
)


def steps(opt, p, gradients, dtype):
    """Feed ``gradients`` to ``opt`` one step at a time; yield (t, g_t, state before, Δw).

    Without weight decay the weights do not enter an update, so each step starts from
    w = 0 and Δw is the computed update itself, free of the rounding of w + Δw - w.
    """
    for t, g in enumerate(gradients, start=1):
        before = {k: v.clone() if torch.is_tensor(v) else v for k, v in opt.state[p].items()}
        with torch.no_grad():
            p.zero_()
        p.grad = torch.tensor(g, dtype=dtype)
        opt.step()
        yield t, p.grad, before, p.detach().clone()


def single(name, dtype=torch.float64, **kw):
    p = torch.zeros(4, dtype=dtype, requires_grad=True)
    return p, getattr(optim, name)([p], **kw)


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=15, deadline=None)
@given(data=st.data(), gradients=gradient_sequences)
def test_zero_learning_rate_leaves_parameters_unchanged(name, data, gradients):
    kw = data.draw(HYPER[name], label="hyperparameters") | dict(lr=0.0)
    p, opt = single(name, **kw)
    w0 = torch.randn(4, dtype=torch.float64)
    with torch.no_grad():
        p.copy_(w0)
    for g in gradients:
        p.grad = torch.tensor(g, dtype=torch.float64)
        opt.step()
        assert torch.equal(p.detach(), w0)


def adam_bound(t, beta1, beta2):
    """Cauchy–Schwarz bound on Adam's |Δw_t| / lr, for any gradients and ε >= 0:
    |m_t| <= sqrt(Σ_k (1-β1)² β1^{2(t-k)} / ((1-β2) β2^{t-k})) · sqrt(v_t). It is 1 at t = 1;
    Adam's "|Δw| <= lr" holds only there, not in general (see the next test)."""
    s = sum((beta1**2 / beta2) ** j for j in range(t))
    return (1 - beta1) / (1 - beta1**t) * math.sqrt((1 - beta2**t) / (1 - beta2) * s)


@settings(max_examples=40, deadline=None)
@given(
    gradients=gradient_sequences, beta1=st.floats(0.0, 0.95), beta2=st.floats(0.5, 0.9999),
    eps=st.sampled_from([0.0, 1e-12, 1e-8]), amsgrad=st.booleans(),
)  # fmt: skip
def test_adam_step_bound(gradients, beta1, beta2, eps, amsgrad):
    lr = 1e-3
    p, opt = single("Adam", lr=lr, betas=(beta1, beta2), eps=eps, amsgrad=amsgrad)
    for t, g, _, dw in steps(opt, p, gradients, torch.float64):
        if t == 1:  # the first step is lr · g / (|g| + ε): about lr · sign(g)
            torch.testing.assert_close(dw, -lr * g / (g.abs() + eps), rtol=1e-12, atol=0)
            assert torch.all(dw.abs() <= lr * (1 + 1e-12)) and torch.all(dw * g < 0)
        assert torch.all(dw.abs() <= lr * adam_bound(t, beta1, beta2) * (1 + 1e-9))


def test_adam_step_can_exceed_lr():
    # Small gradients, then a large one: v_t has not caught up, and |Δw| is ~3.3 lr.
    p, opt = single("Adam", lr=1e-3, betas=(0.0, 0.999))
    *_, (t, _, _, dw) = steps(opt, p, [[1e-3] * 4] * 10 + [[1.0] * 4], torch.float64)
    assert torch.all(dw.abs() > 3 * 1e-3) and torch.all(dw.abs() <= 1e-3 * adam_bound(t, 0, 0.999))


@settings(max_examples=30, deadline=None)
@given(gradients=gradient_sequences, beta1=st.floats(0.0, 0.95), beta2=st.floats(0.5, 0.9999))
def test_amsgrad_keeps_the_running_maximum_of_the_raw_second_moment(gradients, beta1, beta2):
    p, opt = single("Adam", lr=1e-3, betas=(beta1, beta2), amsgrad=True)
    running_max = torch.zeros(4, dtype=torch.float64)
    for _ in steps(opt, p, gradients, torch.float64):
        state = opt.state[p]
        running_max = torch.maximum(running_max, state["exp_avg_sq"])
        assert torch.equal(state["max_exp_avg_sq"], running_max)  # never decreases


@settings(max_examples=40, deadline=None)
@given(
    gradients=gradient_sequences, lr_decay=st.sampled_from([0.0, 0.01, 1.0]),
    init=st.sampled_from([0.0, 0.1, 10.0]), eps=st.sampled_from([0.0, 1e-10, 1e-3]),
)  # fmt: skip
def test_adagrad_effective_step_never_increases(gradients, lr_decay, init, eps):
    p, opt = single("Adagrad", lr=0.1, lr_decay=lr_decay, initial_accumulator_value=init,
                    eps=eps)  # fmt: skip
    previous = torch.full((4,), math.inf, dtype=torch.float64)
    for _, g, before, dw in steps(opt, p, gradients, torch.float64):
        rate = -dw / g  # eta_t / (sqrt(s_t) + eps) per coordinate: positive, nonincreasing
        assert torch.all(rate > 0) and torch.all(rate <= previous * (1 + 1e-12))
        assert torch.all(opt.state[p]["sum"] >= before.get("sum", init))
        previous = rate


@settings(max_examples=40, deadline=None)
@given(gradients=gradient_sequences, alpha=st.floats(0.5, 0.999), eps=st.sampled_from([0, 1e-8]))
def test_rmsprop_step_bound(gradients, alpha, eps):
    # v_t >= (1 - alpha) g_t^2, so |Δw_t| = lr |g_t| / (sqrt(v_t) + eps) <= lr / sqrt(1 - alpha)
    p, opt = single("RMSprop", lr=1e-3, alpha=alpha, eps=eps)
    for _, g, _, dw in steps(opt, p, gradients, torch.float64):
        assert torch.all(dw * g < 0)
        assert torch.all(dw.abs() <= 1e-3 / math.sqrt(1 - alpha) * (1 + 1e-9))


@settings(max_examples=40, deadline=None)
@given(gradients=gradient_sequences, rho=st.floats(0.0, 0.99), eps=st.sampled_from([1e-6, 1e-2]))
def test_adadelta_step_bound(gradients, rho, eps):
    # v_t >= (1 - rho) g_t^2, so |Δw_t| <= lr sqrt((u_{t-1} + eps) / (1 - rho))
    p, opt = single("Adadelta", lr=0.5, rho=rho, eps=eps)
    for _, g, before, dw in steps(opt, p, gradients, torch.float64):
        u = before.get("acc_delta", torch.zeros(4, dtype=torch.float64))
        assert torch.all(dw * g < 0)
        assert torch.all(dw.abs() <= 0.5 * ((u + eps) / (1 - rho)).sqrt() * (1 + 1e-9))


@settings(max_examples=30, deadline=None)
@given(gradients=gradient_sequences, beta1=st.floats(0.0, 0.95), beta2=st.floats(0.5, 0.9999))
def test_adamax_step_bound(gradients, beta1, beta2):
    # u_t >= beta2^(t-k) |g_k|, so |m_t| <= u_t Σ_j (1-beta1) (beta1/beta2)^j; at beta1 = 0,
    # |Δw| <= lr exactly as the paper says
    p, opt = single("Adamax", lr=1e-3, betas=(beta1, beta2))
    for t, g, before, dw in steps(opt, p, gradients, torch.float64):
        bound = sum((1 - beta1) * (beta1 / beta2) ** j for j in range(t)) / (1 - beta1**t)
        assert torch.all(dw.abs() <= 1e-3 * bound * (1 + 1e-9))
        u = opt.state[p]["exp_inf"]
        assert torch.all(u >= g.abs()) and torch.all(u >= beta2 * before.get("exp_inf", 0 * u))


# Scaling every gradient by 2^k is exact in floating point, and so is every operation of
# these updates on scaled inputs: the trajectories must agree bit for bit.
SCALE_INVARIANT = {
    # name: (hyperparameters, how they change with the gradient scale c)
    "SGD": (dict(lr=0.01, momentum=0.9, dampening=0.1), lambda c: dict(lr=0.01 / c)),
    "Adam": (dict(lr=1e-3, eps=0.0, amsgrad=True), lambda c: {}),
    "AdamW": (dict(lr=1e-3, eps=0.0, weight_decay=0.1), lambda c: {}),
    "Adagrad": (dict(lr=0.1, eps=0.0, lr_decay=0.1), lambda c: {}),
    "RMSprop": (dict(lr=1e-3, eps=0.0, momentum=0.5, centered=True), lambda c: {}),
    "Adadelta": (dict(lr=1.0, eps=1e-4), lambda c: dict(lr=1.0 / c, eps=1e-4 * c * c)),
    "Adamax": (dict(lr=1e-3, eps=0.0), lambda c: {}),
    "NAdam": (dict(lr=1e-3, eps=0.0, weight_decay=0.1, decoupled_weight_decay=True),
              lambda c: {}),
}  # fmt: skip


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=15, deadline=None)
@given(
    gradients=gradient_sequences, k=st.integers(-3, 3).filter(bool),
    dtype=st.sampled_from([torch.float32, torch.float64]),
)  # fmt: skip
def test_power_of_two_gradient_scaling_is_exact(name, gradients, k, dtype):
    kw, rescale = SCALE_INVARIANT[name]
    c = 2.0**k
    p, opt = single(name, dtype, **kw)
    q, opt_scaled = single(name, dtype, **(kw | rescale(c)))
    for g in gradients:
        p.grad, q.grad = torch.tensor(g, dtype=dtype), c * torch.tensor(g, dtype=dtype)
        opt.step()
        opt_scaled.step()
        assert torch.equal(p, q)


def test_an_invalid_param_group_is_not_kept():
    w = torch.nn.Parameter(torch.zeros(2))
    opt = optim.SGD([w], lr=0.1)
    with pytest.raises(ValueError, match="Invalid learning rate"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(1))], "lr": -1.0})
    assert len(opt.param_groups) == 1


def test_param_group_given_as_a_generator_keeps_its_parameters():
    # {"params": model.parameters()} is a generator, readable once (torch.optim accepts it)
    model = torch.nn.Linear(3, 2)
    opt = optim.Adam([{"params": model.parameters(), "lr": 0.1}])
    assert len(opt.param_groups[0]["params"]) == 2
    opt.add_param_group({"params": (p for p in [torch.zeros(2, requires_grad=True)])})
    assert len(opt.param_groups[1]["params"]) == 1
