"""What the optimizer tests share: a real model trained step by step on fixed batches, the
bit-for-bit comparison of two runs, the torch.optim reference tests (one factory, used by
each optimizer's file), and explicit gradient sequences for the property tests.

Equality with torch.optim is asserted *bit for bit*: each update performs torch's
``_multi_tensor_*`` operations in the same order, and on CPU that was observed exact for
every optimizer, dtype and model tried (torch 2.13). The runs take a ``device`` (the
``device`` fixture of tests/conftest.py): the model is made on the CPU from its seed and
moved there, and so is every batch, so both optimizers meet the same numbers on the same
device, and their foreach kernels agree bit for bit there too.
"""

from __future__ import annotations

import contextlib
import functools
import inspect

import torch
import torch.nn.functional as F
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from lsdl_lab import optim
from lsdl_lab.models import MLP, ResNet

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


def maybe(strategy):
    """Zero half of the time or so (the option off), else ``strategy``."""
    return st.one_of(st.just(0.0), strategy)


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


@contextlib.contextmanager
def deterministic_backward():
    # Two runs see the same gradients only if the backward pass is deterministic: on CUDA,
    # cuDNN may otherwise pick a convolution algorithm that accumulates with atomics (the
    # ResNet's); on the CPU this changes nothing
    old = torch.backends.cudnn.deterministic
    torch.backends.cudnn.deterministic = True
    try:
        yield
    finally:
        torch.backends.cudnn.deterministic = old


def make_model(kind: str = "mlp", dtype=torch.float32, device="cpu") -> torch.nn.Module:
    torch.manual_seed(0)  # the same weights on every device: made on the CPU, then moved
    model = MLP(6, 3, hidden=12, depth=2) if kind == "mlp" else ResNet(8, 4, 10, 1)
    return model.to(device, dtype)


@functools.cache
def batch(t: int, kind: str = "mlp", dtype=torch.float32):
    """The fixed random batch of step ``t``: new data every step, the same in every run (on
    the CPU; :func:`train` moves it to the model's device)."""
    g = torch.Generator().manual_seed(1000 + t)
    shape, classes = ((16, 6), 3) if kind == "mlp" else ((2, 1, 8, 8), 10)
    x = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    return x, torch.randint(0, classes, shape[:1], generator=g)


def train(model, opt, kind="mlp", dtype=torch.float32, steps=range(STEPS), scalar_dtype=None):
    device = next(model.parameters()).device
    with default_dtype(scalar_dtype or dtype), deterministic_backward():
        for t in steps:
            x, y = (v.to(device) for v in batch(t, kind, dtype))
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
    return model, opt


def run(make_opt, kind="mlp", dtype=torch.float32, scalar_dtype=None, steps=STEPS, device="cpu"):
    """Train a fresh model on ``device`` for ``steps`` steps with the optimizer
    ``make_opt(model)``."""
    with default_dtype(scalar_dtype or dtype):
        model = make_model(kind, dtype, device)
        opt = make_opt(model)
    return train(model, opt, kind, dtype, range(steps), scalar_dtype)


def assert_same(a, b, state=True):
    """Same parameters, and the same state under the same names, bit for bit; ``a``'s state
    (lsdl_lab's) on its parameter's device."""
    (model_a, opt_a), (model_b, opt_b) = a, b
    for pa, pb in zip(model_a.parameters(), model_b.parameters(), strict=True):
        torch.testing.assert_close(pa, pb, **EXACT)
        if not state:
            continue
        sa, sb = opt_a.state.get(pa, {}), opt_b.state.get(pb, {})
        assert sa.keys() == sb.keys()
        for key in sa:
            if key == "step":  # a Python int here, a float tensor in torch.optim
                assert float(sa[key]) == float(sb[key])
            else:
                assert sa[key].device == pa.device, key
                # torch.optim keeps NAdam's mu_product on the CPU (unless capturable)
                torch.testing.assert_close(sa[key], sb[key].to(pa.device), **EXACT)


def optimizer(module, name, split=None, **kw):
    """A factory ``model -> module.name(model's parameters, **kw)``. With ``split=(first,
    rest)``, two parameter groups: the first layer with ``first``, the others with ``rest``."""

    def make(model):
        params = list(model.parameters())
        if split is not None:
            params = [dict(params=params[:2], **split[0]), dict(params=params[2:], **split[1])]
        return getattr(module, name)(params, **kw)

    return make


def ours(name, split=None, **kw):
    return optimizer(optim, name, split, **kw)


def torchs(name, split=None, **kw):
    return optimizer(torch.optim, name, split, **kw, foreach=True)


# -- reference: torch.optim -----------------------------------------------------------------


def torch_reference_tests(name: str, hyper, full: dict, constructor_only=()):
    """The three torch.optim reference tests of optimizer ``name``: the same arguments and
    defaults; the same parameters and state after STEPS steps on an MLP for hyperparameters
    drawn from ``hyper`` (float32 or float64, one or two parameter groups, foreach or not);
    the same after 25 steps on a ResNet with ``full``. ``constructor_only``: hyperparameters
    that torch.optim reads from its constructor only, never from a group."""

    def test_same_arguments_and_defaults_as_torch():
        ours_ = inspect.signature(getattr(optim, name)).parameters
        theirs = inspect.signature(getattr(torch.optim, name)).parameters
        for arg, p in ours_.items():
            if arg not in ("foreach", "compile"):  # compile: lsdl_lab's compiled path
                assert arg in theirs and p.default == theirs[arg].default, arg
                assert p.kind == theirs[arg].kind, arg
        assert ours_["foreach"].kind is inspect.Parameter.KEYWORD_ONLY
        assert ours_["compile"].kind is inspect.Parameter.KEYWORD_ONLY

    @settings(max_examples=5, deadline=None, phases=NO_SHRINK)
    @given(data=st.data())
    def test_matches_torch_optim(data, device):
        kw = data.draw(hyper, label="hyperparameters")
        second = data.draw(st.none() | hyper, label="second parameter group")
        dtype = data.draw(st.sampled_from([torch.float32, torch.float64]), label="dtype")
        # foreach=False must equal foreach=True; both are compared with torch's foreach path.
        foreach = data.draw(st.booleans(), label="foreach")
        split = None
        if second is not None:  # the first layer with kw, the others with `second`
            second.pop("lr")  # the constructor's default, in both
            split, kw = (kw, second), {}
            for key in constructor_only:
                second.pop(key)
                kw[key] = split[0].pop(key)
        a = run(ours(name, split, **kw, foreach=foreach), dtype=dtype, device=device)
        assert_same(a, run(torchs(name, split, **kw), dtype=dtype, device=device))

    def test_matches_torch_optim_on_a_resnet(device):
        # conv, BatchNorm and linear parameters of many shapes in one multi-tensor call; a
        # ResNet step costs ten MLP steps, so 25 steps here (the MLP tests run 100)
        a = run(ours(name, **full), "resnet", steps=25, device=device)
        assert_same(a, run(torchs(name, **full), "resnet", steps=25, device=device))

    return (
        test_same_arguments_and_defaults_as_torch,
        test_matches_torch_optim,
        test_matches_torch_optim_on_a_resnet,
    )


# -- explicit gradient sequences, for the properties -----------------------------------------

magnitude = st.floats(1e-2, 1e2)
nonzero = st.builds(lambda m, negative: -m if negative else m, magnitude, st.booleans())
gradient_sequences = st.integers(1, 25).flatmap(
    lambda steps: st.lists(
        st.lists(nonzero, min_size=4, max_size=4), min_size=steps, max_size=steps
    )  # fmt: skip
)


def steps(opt, p, gradients, dtype):
    """Feed ``gradients`` to ``opt`` one step at a time (on ``p``'s device); yield (t, g_t,
    state before, Δw).

    Without weight decay the weights do not enter an update, so each step starts from
    w = 0 and Δw is the computed update itself, free of the rounding of w + Δw - w.
    """
    for t, g in enumerate(gradients, start=1):
        before = {k: v.clone() if torch.is_tensor(v) else v for k, v in opt.state[p].items()}
        with torch.no_grad():
            p.zero_()
        p.grad = torch.tensor(g, dtype=dtype, device=p.device)
        opt.step()
        yield t, p.grad, before, p.detach().clone()


def single(name, dtype=torch.float64, device="cpu", **kw):
    p = torch.zeros(4, dtype=dtype, device=device, requires_grad=True)
    return p, getattr(optim, name)([p], **kw)


def power_of_two_scaling_test(name: str, kw: dict, rescale):
    """Scaling every gradient by 2^k is exact in floating point, and so is every operation of
    the update on scaled inputs when the hyperparameters change by ``rescale(2^k)``: the
    trajectories must agree bit for bit (on any device: the updates' operations are IEEE
    arithmetic, square roots and fused multiply-adds, exact under scaling by 2^k)."""

    @settings(max_examples=15, deadline=None)
    @given(
        gradients=gradient_sequences, k=st.integers(-3, 3).filter(bool),
        dtype=st.sampled_from([torch.float32, torch.float64]),
    )  # fmt: skip
    def test_power_of_two_gradient_scaling_is_exact(gradients, k, dtype, device):
        c = 2.0**k
        p, opt = single(name, dtype, device, **kw)
        q, opt_scaled = single(name, dtype, device, **(kw | rescale(c)))
        for g in gradients:
            g = torch.tensor(g, dtype=dtype, device=device)
            p.grad, q.grad = g, c * g
            opt.step()
            opt_scaled.step()
            assert torch.equal(p, q)

    return test_power_of_two_gradient_scaling_is_exact


def zero_learning_rate_test(name: str, hyper):
    """With lr = 0 the weights never move, whatever the other hyperparameters and
    gradients."""

    @settings(max_examples=15, deadline=None)
    @given(data=st.data(), gradients=gradient_sequences)
    def test_zero_learning_rate_leaves_parameters_unchanged(data, gradients, device):
        kw = data.draw(hyper, label="hyperparameters") | dict(lr=0.0)
        p, opt = single(name, device=device, **kw)
        w0 = torch.randn(4, dtype=torch.float64).to(device)
        with torch.no_grad():
            p.copy_(w0)
        for g in gradients:
            p.grad = torch.tensor(g, dtype=torch.float64, device=device)
            opt.step()
            assert torch.equal(p.detach(), w0)

    return test_zero_learning_rate_leaves_parameters_unchanged
