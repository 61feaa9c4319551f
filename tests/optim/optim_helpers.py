"""What the optimizer tests share: a real model trained step by step on fixed batches, the
bit-for-bit comparison of two runs, each optimizer's hyperparameters as the tests draw them
(``HYPER``, ``FULL``: tests/optim/test_common.py runs them through the torch.optim reference
and the common properties), and explicit gradient sequences for the property tests.

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

import torch
import torch.nn.functional as F
from hypothesis import Phase
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


# Each optimizer's hyperparameters as hypothesis draws them (HYPER) where lsdl_lab's agree
# with their reference (torch.optim's namesake, bit for bit; for Adafactor, to rounding; for
# SM3, pytorch-optimizer's), and an option set with every option on (FULL).
_ADAM = st.fixed_dictionaries(
    dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=st.booleans())
)
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
    # torch.optim.Adam has the decoupled_weight_decay flag too
    "Adam": st.one_of(_ADAM, _ADAM.map(lambda kw: kw | dict(decoupled_weight_decay=True))),
    "AdamW": _ADAM,
    "Adamax": st.fixed_dictionaries(
        dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    ),
    "NAdam": st.fixed_dictionaries(
        dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
             momentum_decay=st.sampled_from([0.0, 4e-3, 0.05]),
             decoupled_weight_decay=st.booleans())
    ),
    # where our settings coincide with torch.optim.Adafactor's (beta1=None, relative_step,
    # scale_parameter, d >= 1); eps1 = 1e-30 would square to 0 in float32 (see
    # lsdl_lab.optim.adafactor)
    "Adafactor": st.fixed_dictionaries(
        dict(lr=st.floats(1e-3, 3e-2), beta2_decay=st.floats(-1.0, -0.3),
             eps1=st.sampled_from([None, 1e-10, 1e-6]), eps2=st.sampled_from([1e-3, 1e-2, 0.1]),
             d=st.floats(1.0, 3.0), weight_decay=weight_decay)
    ),
    "SM3": st.fixed_dictionaries(
        dict(lr=st.floats(1e-3, 0.2), momentum=st.sampled_from([0.0, 0.5, 0.9]),
             eps=st.sampled_from([1e-30, 1e-8]))
    ),
}  # fmt: skip
# Options the reference lacks, drawn beside HYPER where the reference plays no part
BEYOND_REFERENCE = {
    "Adafactor": st.fixed_dictionaries(
        dict(beta1=st.sampled_from([None, 0.9]), relative_step=st.booleans(),
             scale_parameter=st.booleans())
    ),
}  # fmt: skip
FULL = {
    "SGD": dict(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=1e-3),
    "Adagrad": dict(lr=0.1, lr_decay=0.01, weight_decay=1e-3, initial_accumulator_value=0.1,
                    eps=1e-8),
    "RMSprop": dict(lr=1e-3, alpha=0.9, eps=1e-6, weight_decay=1e-3, momentum=0.5, centered=True),
    "Adadelta": dict(lr=0.5, rho=0.8, eps=1e-5, weight_decay=1e-3),
    "Adam": dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=1e-2, amsgrad=True),
    "AdamW": dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1, amsgrad=True),
    "Adamax": dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=1e-3),
    "NAdam": dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=1e-2, momentum_decay=1e-2,
                  decoupled_weight_decay=True),
    "Adafactor": dict(lr=1e-2, beta2_decay=-0.6, eps1=1e-8, eps2=1e-2, d=1.5, weight_decay=0.01),
    "SM3": dict(lr=0.05, momentum=0.9),
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
