"""The contract every optimizer of lsdl_lab.optim keeps, run over ONE list of optimizers and
their option sets (the pattern of torch's ``common_optimizers.py``).

* ``foreach=False`` (one update per parameter) equals ``foreach=True``, bit for bit;
* exact resume: k steps, ``state_dict`` through ``torch.save``, a fresh optimizer built with
  other hyperparameters loads it and continues: bit for bit the uninterrupted run;
* parameter groups keep their own hyperparameters (a group's update depends on its own
  hyperparameters only; a group with lr = 0 does not move);
* bad hyperparameters raise ValueError (a bad value) or TypeError (a wrong type, a flag
  that is not a bool) naming the argument, at construction and in ``add_param_group``,
  which then keeps no half-added group;
* a hyperparameter at an edge of its range (``Spec.edges``) is accepted: kept as given in
  ``defaults`` and in the groups, and a step with it leaves finite parameters;
* ``compile`` (the compiled path, tests/optim/test_compiled.py) is a keyword-only flag
  that needs ``foreach=True``;
* sparse gradients and complex parameters are refused; parameters without a gradient are
  skipped; ``step(closure)`` returns the closure's loss.

A new optimizer joins by one entry in ``OPTIMIZERS``; the first test fails until it has.
The tests that train run on every device of the ``device`` fixture (the model made on the
CPU from its seed and moved there, the batches too); the bad-input tests stay on the CPU.
"""

from __future__ import annotations

import inspect
import io
import math
import re
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_same_tree

from lsdl_lab import optim
from lsdl_lab.models import MLP

nan, inf = float("nan"), float("inf")


def backward_closure(model, opt, x, y):
    """The first-order closure: the gradient into ``.grad``, the loss returned."""

    def closure():
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        return loss

    return closure


def loss_closure(model, opt, x, y):
    """Newton's closure: the loss with its graph (it differentiates the loss twice itself)."""
    return lambda: F.cross_entropy(model(x), y)


def outputs_closure(model, opt, x, y):
    """HessianFree's closure: the loss and the model's outputs, with their graph."""

    def closure():
        out = model(x)
        return F.cross_entropy(out, y), out

    return closure


def muon_by_shape(params, **options):
    """Muon on the contract's parameters split as Muon needs them (optim.muon_param_groups on
    a list): each group's matrices in a group with ``use_muon=True``, its other parameters
    (biases, the bad-input tests' vectors) in one with ``use_muon=False``, with the group's
    hyperparameters. The Muon parts of all groups come first, in the groups' order, so the
    groups test finds the groups it made at the indices it made them (their biases after)."""
    items = list(params)
    groups = items if items and isinstance(items[0], dict) else [dict(params=items)]
    muon, adamw = [], []
    for group in groups:
        tensors = group["params"]
        for part in optim.muon_param_groups([tensors] if torch.is_tensor(tensors) else tensors):
            (muon if part["use_muon"] else adamw).append({**group, **part})
    return optim.Muon(muon + adamw, **options)


@dataclass(frozen=True)
class Spec:
    """An optimizer in the contract: its class, the option sets (hyperparameters) to run it
    with, its arguments that are not hyperparameters (``fixed``), the bad values proper to
    it as (arguments, error, words of the message), the values at the edges of their ranges
    that it accepts (``edges``: one hyperparameter each, the others left at their defaults),
    and whether a group's update depends on that group's parameters alone (``separable``;
    SAM's perturbation has a global norm)."""

    cls: type
    options: tuple[dict, ...]
    bad: tuple[tuple[dict, type, str], ...] = ()
    edges: tuple[dict, ...] = ()
    fixed: dict = field(default_factory=dict)
    separable: bool = True
    closure: Callable = backward_closure  # (model, opt, x, y) -> the closure step takes
    factory: Callable | None = None  # (params, **options) -> optimizer, when not cls itself

    def make(self, params, **options):
        return (self.factory or self.cls)(params, **self.fixed, **options)

    def __str__(self):
        return self.cls.__name__


BETAS_BAD = tuple(
    (dict(betas=b), ValueError, f"Invalid beta parameter at index {i}: {b[i]!r}")
    for i, b in [(0, (1.0, 0.999)), (0, (-0.1, 0.999)), (1, (0.9, 1.0)), (1, (0.9, nan))]
) + ((dict(betas=(0.9,)), ValueError, "Invalid betas: (0.9,)"),)
# the edges of the Adam family's shared ranges: betas in [0, 1), eps and weight decay >= 0
ADAM_EDGES = (dict(lr=0.0), dict(betas=(0.0, 0.0)), dict(betas=(0.999, 0.9999)), dict(eps=0.0),
              dict(weight_decay=0.0))  # fmt: skip
# Adam8bit's own ranges: blocks of at least one value; any size may take 8-bit states
ADAM8BIT_BAD = (
    (dict(block_size=0), ValueError, "Invalid block_size: 0 (expected an int >= 1)"),
    (dict(min_8bit_size=-1), ValueError, "Invalid min_8bit_size: -1 (expected an int >= 0)"),
)
ADAM8BIT_EDGES = (dict(block_size=1), dict(min_8bit_size=0))
MOMENTUM_BAD = (
    (dict(momentum=1.0), ValueError,
     "Invalid momentum value: 1.0 (expected a finite number in [0, 1))"),
    (dict(momentum=-0.1), ValueError, "Invalid momentum value: -0.1"),
)  # fmt: skip

OPTIMIZERS = [
    Spec(optim.SGD, (dict(lr=0.1), dict(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=1e-3),
                     dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3)),
         MOMENTUM_BAD + ((dict(dampening=-0.1), ValueError, "Invalid dampening value: -0.1"),
                         (dict(nesterov=True), ValueError, "Nesterov momentum requires a momentum"),
                         (dict(momentum=0.9, dampening=0.1, nesterov=True), ValueError,
                          "zero dampening")),
         edges=(dict(lr=0.0), dict(momentum=0.0), dict(momentum=0.999), dict(dampening=0.0),
                dict(dampening=1.0), dict(weight_decay=0.0))),
    Spec(optim.Adagrad, (dict(lr=0.1), dict(lr=0.1, lr_decay=0.01, weight_decay=1e-3,
                                            initial_accumulator_value=0.1, eps=1e-8)),
         ((dict(lr_decay=-0.1), ValueError, "Invalid lr_decay value: -0.1"),
          (dict(initial_accumulator_value=-1.0), ValueError,
           "Invalid initial_accumulator_value value: -1.0")),
         edges=(dict(lr=0.0), dict(lr_decay=0.0), dict(weight_decay=0.0),
                dict(initial_accumulator_value=0.0), dict(eps=0.0))),
    Spec(optim.RMSprop, (dict(lr=1e-3), dict(lr=1e-3, alpha=0.9, eps=1e-6, weight_decay=1e-3,
                                             momentum=0.5, centered=True)),
         MOMENTUM_BAD + ((dict(alpha=-0.1), ValueError, "Invalid alpha value: -0.1"),
                         (dict(alpha=1.5), ValueError, "Invalid alpha value: 1.5")),
         edges=(dict(lr=0.0), dict(alpha=0.0), dict(alpha=1.0), dict(eps=0.0), dict(momentum=0.0),
                dict(weight_decay=0.0))),
    Spec(optim.Adadelta, (dict(lr=1.0), dict(lr=0.5, rho=0.8, eps=1e-5, weight_decay=1e-3)),
         ((dict(rho=-0.1), ValueError, "Invalid rho value: -0.1"),
          (dict(rho=1.1), ValueError, "Invalid rho value: 1.1")),
         edges=(dict(lr=0.0), dict(rho=0.0), dict(rho=1.0), dict(eps=0.0),
                dict(weight_decay=0.0))),
    Spec(optim.Adam, (dict(lr=1e-2), dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=1e-2,
                                          amsgrad=True),
                      dict(lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True)), BETAS_BAD,
         edges=ADAM_EDGES),
    Spec(optim.AdamW, (dict(lr=1e-2), dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1,
                                           amsgrad=True)), BETAS_BAD, edges=ADAM_EDGES),
    Spec(optim.Adamax, (dict(lr=1e-2), dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-6,
                                            weight_decay=1e-3)), BETAS_BAD, edges=ADAM_EDGES),
    Spec(optim.NAdam, (dict(lr=1e-2), dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=1e-2,
                                           momentum_decay=1e-2, decoupled_weight_decay=True)),
         BETAS_BAD + ((dict(momentum_decay=-1e-3), ValueError,
                       "Invalid momentum_decay value: -0.001"),),
         edges=ADAM_EDGES + (dict(momentum_decay=0.0),)),
    Spec(optim.LARS, (dict(lr=2.0), dict(lr=2.0, momentum=0.9, weight_decay=1e-3, nesterov=True),
                      dict(lr=0.5, momentum=0.0, trust=False, weight_decay=1e-3)),
         MOMENTUM_BAD + ((dict(trust_coefficient=0.0), ValueError,
                          "Invalid trust_coefficient value: 0.0 (expected a finite number > 0)"),
                         (dict(trust_coefficient=inf), ValueError,
                          "Invalid trust_coefficient value: inf"),
                         (dict(momentum=0.0, nesterov=True), ValueError,
                          "Nesterov momentum requires a momentum"))),
    Spec(optim.LAMB, (dict(lr=1e-2), dict(lr=1e-2, betas=(0.8, 0.99), weight_decay=0.01,
                                          clamp=(0.0, 10.0)),
                      dict(lr=1e-2, weight_decay=0.01, bias_correction=False),
                      dict(lr=1e-2, weight_decay=0.01, trust=False)),
         BETAS_BAD + tuple((dict(clamp=c), ValueError, f"Invalid clamp: {c!r} (expected None or")
                           for c in [(1.0, 0.5), (-1.0, 2.0), (1.0,), (inf, inf), (0.0, nan)])
         + ((dict(clamp=10.0), TypeError, "Invalid clamp: 10.0"),
            (dict(clamp=("0", 1)), TypeError, "Invalid clamp: ('0', 1)"))),
    Spec(optim.SAM, (dict(lr=0.1), dict(lr=0.1, momentum=0.9, rho=0.1, adaptive=True)),
         ((dict(rho=-1.0), ValueError, "Invalid rho: -1.0"),
          (dict(rho=nan), ValueError, "Invalid rho: nan")),
         fixed=dict(base_optimizer=optim.SGD), separable=False),
    Spec(optim.Adafactor, (dict(lr=1e-2), dict(lr=1e-2, beta2_decay=-0.5, eps1=1e-6, eps2=1e-2,
                                               d=2.0, weight_decay=0.01, beta1=0.9),
                           dict(lr=1e-3, relative_step=False, scale_parameter=False, d=inf)),
         ((dict(beta2_decay=0.0), ValueError,
           "Invalid beta2_decay value: 0.0 (expected a finite number in [-1, 0))"),
          (dict(beta2_decay=-1.5), ValueError, "Invalid beta2_decay value: -1.5"),
          (dict(d=0.0), ValueError, "Invalid d value: 0.0 (expected a number > 0)"),
          (dict(d=nan), ValueError, "Invalid d value: nan"),
          (dict(eps1=-1e-30), ValueError, "Invalid eps1 value: -1e-30"),
          (dict(eps1="1"), TypeError, "Invalid eps1 value: '1'"),
          (dict(beta1=1.0), ValueError,
           "Invalid beta1 value: 1.0 (expected a finite number in [0, 1))"),
          (dict(beta1=-0.1), ValueError, "Invalid beta1 value: -0.1"),
          (dict(beta1="0.9"), TypeError, "Invalid beta1 value: '0.9'")),
         edges=(dict(lr=0.0), dict(beta2_decay=-1.0), dict(beta2_decay=-1e-9), dict(eps1=0.0),
                dict(eps2=0.0), dict(d=1e-3), dict(d=inf), dict(weight_decay=0.0),
                dict(beta1=0.0), dict(beta1=0.999))),
    Spec(optim.SM3, (dict(lr=0.1), dict(lr=0.05, momentum=0.9, eps=1e-8)), MOMENTUM_BAD,
         edges=(dict(lr=0.0), dict(momentum=0.0), dict(momentum=0.999), dict(eps=0.0))),
    Spec(optim.KFAC, (dict(lr=0.05, fisher="empirical"),
                      dict(lr=0.05, fisher="empirical", damping=1e-2, update_freq=3,
                           factor_decay=0.9, kl_clip=None, momentum=0.5, weight_decay=1e-3)),
         ((dict(damping=-1.0), ValueError, "Invalid damping: -1.0"),
          (dict(update_freq=0), ValueError, "Invalid update_freq: 0 (expected an int >= 1)"),
          (dict(kl_clip=0.0), ValueError, "Invalid kl_clip: 0.0")),
         factory=lambda params, **options: kfac_on_owner(params, **options)),
    Spec(optim.Shampoo, (dict(lr=0.1), dict(lr=0.1, epsilon=1e-4, update_freq=3, momentum=0.9,
                                            weight_decay=1e-3, max_block_size=5, grafting="sgd"),
                         dict(lr=0.01, grafting="none", max_block_size=7)),
         ((dict(update_freq=0), ValueError, "Invalid update_freq: 0 (expected an int >= 1)"),
          (dict(max_block_size=0), ValueError, "Invalid max_block_size: 0"),
          (dict(grafting="adam"), ValueError, "Invalid grafting: 'adam'"),
          (dict(epsilon=0.0), ValueError, "Invalid epsilon (with Adagrad grafting): 0.0"))),
    Spec(optim.Newton, (dict(lr=1.0, damping=1.0),
                        dict(lr=1.0, damping=0.1, method="cg", cg_iters=20, line_search=True),
                        dict(lr=0.5, damping=0.5)),
         ((dict(damping=-1.0), ValueError, "Invalid damping: -1.0"),
          (dict(method="newton"), ValueError, "Invalid method: 'newton'"),
          (dict(cg_iters=0), ValueError, "Invalid cg_iters: 0 (expected an int >= 1)"),
          (dict(max_params=1), ValueError, "parameters, more than max_params=1")),
         separable=False, closure=loss_closure),
    Spec(optim.HessianFree, (dict(lr=1.0, damping=1.0),
                             dict(lr=1.0, damping=0.5, cg_iters=10, cg_tol=1e-3,
                                  warm_start_decay=0.0, line_search=True, adapt_damping=False,
                                  cg_backtracking=True),
                             dict(lr=0.8, damping=2.0)),
         ((dict(damping=-1.0), ValueError, "Invalid damping: -1.0"),
          (dict(cg_iters=0), ValueError, "Invalid cg_iters: 0 (expected an int >= 1)"),
          (dict(warm_start_decay=1.5), ValueError, "Invalid warm_start_decay: 1.5"),
          (dict(cg_tol=-1.0), ValueError, "Invalid cg_tol: -1.0"),
          (dict(max_bytes=0), ValueError, "Invalid max_bytes: 0"),
          (dict(max_bytes=8), ValueError, "parameters: HessianFree would hold")),
         separable=False, closure=outputs_closure),
    Spec(optim.Muon, (dict(lr=0.02),
                      dict(lr=0.02, momentum=0.9, nesterov=False, weight_decay=0.1, ns_steps=3,
                           adjust_lr_fn="original", betas=(0.8, 0.99), adamw_eps=1e-6),
                      dict(lr=0.01, weight_decay=0.01, eps=1e-6, ns_dtype=torch.float32,
                           ns_coefficients=(2.0, -1.5, 0.5))),
         MOMENTUM_BAD + BETAS_BAD
         + ((dict(ns_steps=0), ValueError, "Invalid ns_steps: 0 (expected an int >= 1)"),
            (dict(ns_steps=2.0), TypeError, "Invalid ns_steps: 2.0"),
            (dict(ns_coefficients=(1.0, 2.0)), ValueError, "Invalid ns_coefficients: (1.0, 2.0)"),
            (dict(ns_coefficients=(1.0, nan, 2.0)), ValueError, "Invalid ns_coefficients"),
            (dict(adjust_lr_fn="adamw"), ValueError, "Invalid adjust_lr_fn: 'adamw' (expected"),
            (dict(ns_dtype=torch.int8), TypeError, "Invalid ns_dtype: torch.int8"),
            (dict(adamw_eps=-1.0), ValueError, "Invalid adamw_eps value: -1.0")),
         edges=(dict(lr=0.0), dict(momentum=0.0), dict(momentum=0.999), dict(weight_decay=0.0),
                dict(eps=0.0), dict(ns_steps=1), dict(adamw_eps=0.0), dict(betas=(0.0, 0.0)),
                dict(adjust_lr_fn=None), dict(ns_dtype=None)),
         factory=lambda params, **options: muon_by_shape(params, **options)),
    # max_precond_dim=8 on the MLP's (12, 6), (12, 12) and (3, 12) matrices: one rotated
    # dimension, none (plain AdamW), one
    Spec(optim.SOAP, (dict(lr=3e-3),
                      dict(lr=1e-2, betas=(0.9, 0.99), shampoo_beta=0.9, eps=1e-6,
                           weight_decay=0.1, precondition_frequency=2, max_precond_dim=8),
                      dict(lr=1e-2, weight_decay=0.0, precondition_frequency=1)),
         BETAS_BAD
         + ((dict(shampoo_beta=1.0), ValueError,
             "Invalid shampoo_beta value: 1.0 (expected a finite number in [0, 1))"),
            (dict(shampoo_beta="0.9"), TypeError, "Invalid shampoo_beta value: '0.9'"),
            (dict(precondition_frequency=0), ValueError,
             "Invalid precondition_frequency: 0 (expected an int >= 1)"),
            (dict(precondition_frequency=2.0), TypeError, "Invalid precondition_frequency: 2.0"),
            (dict(max_precond_dim=0), ValueError,
             "Invalid max_precond_dim: 0 (expected an int >= 1)")),
         edges=ADAM_EDGES + (dict(shampoo_beta=0.0), dict(shampoo_beta=0.999),
                             dict(precondition_frequency=1), dict(max_precond_dim=1))),
    Spec(optim.ScheduleFreeAdamW,
         (dict(lr=1e-2),
          dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1, warmup_steps=3, r=1.0,
               weight_lr_power=1.0),
          dict(lr=2e-2, weight_decay=1e-3, weight_lr_power=0.0)),
         BETAS_BAD
         + ((dict(betas=(0.0, 0.999)), ValueError,
             "Invalid beta parameter at index 0: 0.0 (expected a finite number in (0, 1))"),
            (dict(warmup_steps=-1), ValueError, "Invalid warmup_steps: -1 (expected an int >= 0)"),
            (dict(warmup_steps=1.5), TypeError, "Invalid warmup_steps: 1.5"),
            (dict(r=-1.0), ValueError, "Invalid r: -1.0 (expected a finite number >= 0)"),
            (dict(weight_lr_power=nan), ValueError, "Invalid weight_lr_power: nan")),
         edges=(dict(lr=0.0), dict(betas=(1e-3, 0.0)), dict(betas=(0.999, 0.9999)), dict(eps=0.0),
                dict(weight_decay=0.0), dict(warmup_steps=0), dict(r=0.0),
                dict(weight_lr_power=0.0))),
    Spec(optim.Adam8bit, (dict(lr=1e-2),
                          dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=1e-2,
                               min_8bit_size=16, block_size=32),
                          dict(lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True,
                               min_8bit_size=0, block_size=5)),
         BETAS_BAD + ADAM8BIT_BAD, edges=ADAM_EDGES + ADAM8BIT_EDGES),
    Spec(optim.AdamW8bit, (dict(lr=1e-2, min_8bit_size=0),
                           dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1,
                                min_8bit_size=16, block_size=7)),
         BETAS_BAD + ADAM8BIT_BAD, edges=ADAM_EDGES + ADAM8BIT_EDGES),
]  # fmt: skip

CASES = [(spec, options) for spec in OPTIMIZERS for options in spec.options]
CASE_IDS = [f"{spec}-{i}" for spec in OPTIMIZERS for i in range(len(spec.options))]


def test_every_optimizer_is_in_the_contract():
    exported = {
        obj
        for obj in vars(optim).values()
        if isinstance(obj, type)
        and issubclass(obj, torch.optim.Optimizer)
        and obj is not optim.Optimizer
    }
    assert exported == {spec.cls for spec in OPTIMIZERS}


# -- training --------------------------------------------------------------------------------


def batch(t: int, device="cpu"):
    g = torch.Generator().manual_seed(1000 + t)
    x, y = torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)
    return x.to(device), y.to(device)


MODELS = weakref.WeakSet()  # the models of make_model, for KFAC, which takes its model


def make_model(seed=0, device="cpu"):
    torch.manual_seed(seed)  # the same weights on every device: made on the CPU, then moved
    model = MLP(6, 3, hidden=12, depth=2).to(device)
    MODELS.add(model)
    return model


def kfac_on_owner(params, **options):
    """KFAC on the model of make_model that owns ``params`` (or on a stand-in Linear layer
    for loose tensors, whose parameters then all take K-FAC's first-order fallback)."""
    params = list(params)
    tensors = [q for g in params for q in (g["params"] if isinstance(g, dict) else [g])]
    owner = next((m for m in MODELS if any(p is tensors[0] for p in m.parameters())), None)
    return optim.KFAC(owner or torch.nn.Linear(1, 1), params=params, **options)


def train(model, opt, steps):
    """Steps that suit every optimizer: the closure called once (the gradient at w in
    ``.grad``), then ``step(closure)`` (SAM needs both; the others recompute the same
    gradient in the closure; Newton's and HessianFree's closures return the loss's graph)."""
    make_closure = next(spec.closure for spec in OPTIMIZERS if type(opt) is spec.cls)
    device = next(model.parameters()).device
    for t in steps:
        closure = make_closure(model, opt, *batch(t, device))
        closure()
        opt.step(closure)
    return model, opt


def assert_same_run(a, b):
    (model_a, opt_a), (model_b, opt_b) = a, b
    for pa, pb in zip(model_a.parameters(), model_b.parameters(), strict=True):
        assert torch.equal(pa, pb)
    assert_same_tree(opt_a.state_dict()["state"], opt_b.state_dict()["state"])  # bit for bit


STEPS = 8


@pytest.mark.parametrize(("spec", "options"), CASES, ids=CASE_IDS)
def test_foreach_false_equals_foreach_true(spec, options, device):
    runs = []
    for foreach in (True, False):
        model = make_model(device=device)
        runs.append(train(model, spec.make(model.parameters(), **options, foreach=foreach),
                          range(STEPS)))  # fmt: skip
    assert_same_run(*runs)


@pytest.mark.parametrize(("spec", "options"), CASES, ids=CASE_IDS)
def test_resume_through_state_dict_is_exact(spec, options, device):
    model = make_model(device=device)
    uninterrupted = train(model, spec.make(model.parameters(), **options), range(STEPS))

    model = make_model(device=device)
    opt = spec.make(model.parameters(), **options)
    train(model, opt, range(STEPS // 2))
    buffer = io.BytesIO()
    torch.save(dict(model=model.state_dict(), opt=opt.state_dict()), buffer)
    buffer.seek(0)
    saved = torch.load(buffer)  # weights_only: the state is plain tensors and numbers
    del model, opt

    model = make_model(seed=123, device=device)  # other weights, overwritten by the checkpoint
    model.load_state_dict(saved["model"])
    opt = spec.make(model.parameters(), **{**options, "lr": 123.0})  # restored below
    opt.load_state_dict(saved["opt"])
    assert opt.param_groups[0]["lr"] == options["lr"]
    assert_same_run(train(model, opt, range(STEPS // 2, STEPS)), uninterrupted)


@pytest.mark.parametrize("spec", OPTIMIZERS, ids=str)
def test_param_groups_keep_their_own_hyperparameters(spec, device):
    full, plain = spec.options[-1], spec.options[0]
    model = make_model(device=device)
    params = list(model.parameters())
    frozen = {**plain, "lr": 0.0}  # this group must not move
    groups = [dict(params=params[:2], **full), dict(params=params[2:4], **frozen),
              dict(params=params[4:])]  # fmt: skip
    opt = spec.make(groups, **plain)
    assert all(opt.param_groups[0][k] == v for k, v in full.items())
    assert opt.param_groups[1]["lr"] == 0.0 and opt.param_groups[2]["lr"] == plain["lr"]
    before = [p.detach().clone() for p in params]
    train(model, opt, range(3))
    assert all(torch.equal(p, b) for p, b in zip(params[2:4], before[2:4]))
    moving = [i for i in range(len(params)) if i not in (2, 3)]
    assert all(not torch.equal(params[i], before[i]) for i in moving)
    if not spec.separable:
        return
    # a group's update depends on its own hyperparameters and parameters only: the same as
    # one optimizer per group
    alone = make_model(device=device)
    parts = list(alone.parameters())
    opts = [spec.make(parts[:2], **full), spec.make(parts[2:4], **frozen),
            spec.make(parts[4:], **plain)]  # fmt: skip
    for t in range(3):
        x, y = batch(t, device)
        for o in opts:
            o.zero_grad()
        F.cross_entropy(alone(x), y).backward()
        for o in opts:
            o.step()
    for p, q in zip(params, parts, strict=True):
        assert torch.equal(p, q)


# -- bad input ---------------------------------------------------------------------------------

WORDING = {"lr": "learning rate", "eps": "epsilon value"}  # torch.optim's names


def wrong_types(spec):
    """A string for every number, "yes" for every flag: each a TypeError naming the argument
    (with torch.optim's wording for lr and eps, "<name> value" for most others)."""
    cases = [(dict(lr="0.1"), TypeError, "Invalid learning rate: '0.1'")]
    for name, p in inspect.signature(spec.cls).parameters.items():
        if name in ("params", "lr") or name in spec.fixed or p.kind is p.VAR_KEYWORD:
            continue
        words = WORDING.get(name, rf"{name}( value)?")
        if isinstance(p.default, bool):
            cases.append((dict({name: "yes"}), TypeError, rf"Invalid {words}: 'yes'"))
        elif isinstance(p.default, (int, float, tuple)):
            cases.append((dict({name: "1"}), TypeError, rf"Invalid {words}: '1'"))
    return cases


BAD = [
    (spec, kw, error, re.escape(message))
    for spec in OPTIMIZERS
    for kw, error, message in [
        (dict(lr=-1.0), ValueError, "Invalid learning rate: -1.0"),
        (dict(lr=nan), ValueError, "Invalid learning rate: nan"),
        (dict(lr=inf), ValueError, "Invalid learning rate: inf"),
        *[(dict(weight_decay=-0.1), ValueError, "Invalid weight_decay value: -0.1")]
        * ("weight_decay" in inspect.signature(spec.cls).parameters),
        *[(dict(eps=-1e-8), ValueError, "Invalid epsilon value: -1e-08")]
        * ("eps" in inspect.signature(spec.cls).parameters),
        *spec.bad,
    ]
] + [(spec, kw, error, pattern) for spec in OPTIMIZERS for kw, error, pattern in wrong_types(spec)]


@pytest.mark.parametrize(("spec", "kw", "error", "pattern"), BAD, ids=lambda x: str(x)[:40])
def test_bad_hyperparameters_are_refused_by_name(spec, kw, error, pattern):
    p, q = torch.zeros(2, requires_grad=True), torch.zeros(3, requires_grad=True)
    options = {**spec.options[0], **kw}
    with pytest.raises(error, match=pattern):
        spec.make([p], **options)
    if kw.keys() == {"foreach"}:
        return  # a constructor argument, not a hyperparameter of a group
    opt = spec.make([p], **spec.options[0])
    with pytest.raises(error, match=pattern):
        opt.add_param_group(dict(params=[q], **kw))
    assert len(opt.param_groups) == 1  # the invalid group did not stay behind


EDGES = [(spec, edge) for spec in OPTIMIZERS for edge in spec.edges]


def _edge_id(x) -> str:
    return str(x) if isinstance(x, Spec) else ",".join(f"{k}={v}" for k, v in x.items())


@pytest.mark.parametrize(("spec", "edge"), EDGES, ids=_edge_id)
def test_edges_of_the_ranges_are_accepted(spec, edge, device):
    """At an edge of its range a hyperparameter is kept as given, in ``defaults`` and in the
    groups (one added later too), and a step with it leaves finite parameters (on gradients
    without zeros: an eps of 0 divides a zero gradient by zero, in torch.optim too)."""
    gen = torch.Generator().manual_seed(0)
    p, q = (torch.randn(3, 4, generator=gen).to(device).requires_grad_() for _ in range(2))
    opt = spec.make([p], **edge)
    opt.add_param_group(dict(params=[q], **edge))
    for key, value in edge.items():
        for where in (opt.defaults, *opt.param_groups):
            assert type(where[key]) is type(value) and where[key] == value, (key, where[key])
    p.grad, q.grad = (torch.randn(3, 4, generator=gen).to(device) for _ in range(2))
    opt.step()
    assert torch.isfinite(p).all() and torch.isfinite(q).all()


def test_the_flags_are_checked_alike():
    # once, SAM raised TypeError and LARS ValueError for a flag that is not a bool, and
    # SGD and Adam did not check nesterov and amsgrad at all
    w = [torch.zeros(2, requires_grad=True)]
    for make, flag in [(lambda: optim.SGD(w, momentum=0.9, nesterov="yes"), "nesterov"),
                       (lambda: optim.Adam(w, amsgrad=1), "amsgrad"),
                       (lambda: optim.LARS(w, lr=0.1, trust="yes"), "trust"),
                       (lambda: optim.SAM(w, optim.SGD, adaptive="yes", lr=0.1), "adaptive"),
                       (lambda: optim.Adam(w, foreach=None), "foreach")]:  # fmt: skip
        with pytest.raises(TypeError, match=f"Invalid {flag}: .* \\(expected True or False\\)"):
            make()


@pytest.mark.parametrize(
    "spec", [s for s in OPTIMIZERS if "compile" in inspect.signature(s.cls).parameters], ids=str
)
def test_compile_is_a_keyword_that_needs_foreach(spec):
    # compile=True (lsdl_lab/optim/compiled.py; tests/optim/test_compiled.py) compiles one
    # graph per group: the per-parameter path (foreach=False) is refused by name
    w = [torch.zeros(2, requires_grad=True)]
    assert inspect.signature(spec.cls).parameters["compile"].kind is inspect.Parameter.KEYWORD_ONLY
    with pytest.raises(ValueError, match=r"Invalid foreach: False with compile=True \(expected"):
        spec.make(w, **spec.options[0], foreach=False, compile=True)


def test_momentum_is_in_zero_one_everywhere():
    # SGD accepted any momentum >= 0, LARS only [0, 1): now both (and RMSprop) refuse 1
    w = [torch.zeros(2, requires_grad=True)]
    for cls in (optim.SGD, optim.RMSprop, optim.LARS):
        with pytest.raises(ValueError, match=r"Invalid momentum value: 1.5 .*\[0, 1\)"):
            cls(w, lr=0.1, momentum=1.5)
        cls(w, lr=0.1, momentum=0.99)


@pytest.mark.parametrize("spec", OPTIMIZERS, ids=str)
def test_sparse_gradients_are_refused_by_name(spec):
    emb = torch.nn.Embedding(5, 3, sparse=True)
    opt = spec.make(emb.parameters(), **spec.options[0])
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match=f"{spec} does not support sparse gradients"):
        opt.step(lambda: None)


@pytest.mark.parametrize("spec", OPTIMIZERS, ids=str)
def test_complex_parameters_are_refused(spec):
    z = torch.zeros(2, dtype=torch.complex64, requires_grad=True)
    with pytest.raises(ValueError, match="complex"):
        spec.make([z], **spec.options[0])
    opt = spec.make([torch.zeros(2, requires_grad=True)], **spec.options[0])
    with pytest.raises(ValueError, match="complex"):
        opt.add_param_group(dict(params=[z]))


# -- closure, parameters without gradient ----------------------------------------------------


@pytest.mark.parametrize(("spec", "options"), CASES, ids=CASE_IDS)
def test_step_returns_the_closures_loss(spec, options, device):
    model = make_model(device=device)
    opt = spec.make(model.parameters(), **options)
    inner = spec.closure(model, opt, *batch(0, device))
    losses = []

    def closure():
        result = inner()
        losses.append(result[0] if isinstance(result, tuple) else result)
        return result

    closure()
    # the loss at the weights the step started from: the first the step computed (a line
    # search or Hessian-free's reduction ratio evaluates more)
    assert opt.step(closure) is losses[1] and math.isfinite(losses[1].item())


@pytest.mark.parametrize(("spec", "options"), CASES, ids=CASE_IDS)
def test_parameters_without_gradient_are_skipped(spec, options, device):
    model = make_model(device=device)
    unused = torch.nn.Parameter(torch.ones(4, device=device))  # in the optimizer, not the loss
    frozen = model.net[1].bias  # a layer frozen for the whole run
    frozen.requires_grad_(False)
    before = frozen.detach().clone()
    opt = spec.make([*model.parameters(), unused], **options)
    train(model, opt, range(3))
    assert torch.equal(unused, torch.ones(4, device=device)) and torch.equal(frozen, before)
    assert unused not in opt.state and frozen not in opt.state
    trained = [p for p in model.parameters() if p.requires_grad]
    with_state = [p for p in trained if opt.state.get(p)]
    assert len(with_state) in (0, len(trained))  # stateless (plain SGD), or state for each
    opt.load_state_dict(opt.state_dict())  # and state_dict works with the stateless ones
