"""What every optimizer of the book shares, written once.

An optimizer here is a :class:`torch.optim.Optimizer` subclass that adds only two things:
its hyperparameters (with their valid ranges) and an ``update`` method holding its
mathematics. ``update`` works on *lists* of tensors with ``torch._foreach_*`` operations,
the multi-tensor form of torch.optim's fast path, so the readable code is the fast code.
The pieces several updates share (momentum, Adam's moments and denominator, weight decay)
are functions in :mod:`lsdl_lab.optim.pieces`.

The base class does the rest:

* validation of every parameter group, at construction and in ``add_param_group``, with
  the library's checks and torch.optim's names (``Invalid learning rate: -1.0 (expected
  ...)``): ``TypeError`` for a wrong type, ``ValueError`` for a value out of range; every
  flag (a constructor argument whose default is ``True`` or ``False``) must be a bool;
* the per-parameter state: a named buffer created on first use (:meth:`buffer`) and a
  per-parameter step count (:meth:`count_steps`), all in ``state_dict``;
* the loop over parameter groups, ``closure`` handling, and the choice between one
  multi-tensor call per group (``foreach=True``, the default) and one call per parameter
  (``foreach=False``: the same ``update`` on lists of length one, which lowers peak memory
  because no temporary spans all parameters at once). There is no second, slow copy of
  the mathematics;
* the compiled path (``compile=True``, :mod:`lsdl_lab.optim.compiled`): the same ``update``
  through ``torch.compile``, each parameter's operations fused into one pass over memory.

Sparse gradients and complex parameters are refused with a clear error: none of the
book's models has them, and supporting them would double every update rule.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

from .._util import check_bool, check_nonnegative, check_real
from .compiled import CompiledUpdate

__all__ = ["Optimizer", "check_betas"]


def check_betas(betas) -> tuple[float, float]:
    """A pair ``(beta1, beta2)``, each in [0, 1) (torch.optim's names for the two)."""
    if isinstance(betas, (str, bytes)) or not isinstance(betas, Sequence):
        raise TypeError(f"Invalid betas: {betas!r} (expected a pair (beta1, beta2))")
    if len(betas) != 2:
        raise ValueError(f"Invalid betas: {betas!r} (expected a pair (beta1, beta2))")
    return tuple(
        check_real(f"beta parameter at index {i}", beta, 0.0, 1.0, high_open=True)
        for i, beta in enumerate(betas)
    )


class Optimizer(torch.optim.Optimizer):
    """Base of the book's optimizers; a subclass defines ``check`` and ``update``.

    ``compile=True`` runs ``update`` through ``torch.compile`` (:mod:`.compiled`); it needs
    ``foreach=True`` (the compiled update is one graph per group, with no temporary the size
    of the model to save). ``compiled`` is then the :class:`~.compiled.CompiledUpdate`
    (its ``compiles``, ``compile_seconds`` and ``failure``), else None.
    """

    #: Why ``update`` cannot run through ``torch.compile(fullgraph=True)``, for a subclass
    #: that knows it cannot (it then warns once and runs eagerly); empty when it can.
    not_compilable: str = ""

    def __init__(
        self, params: Iterable, defaults: dict, foreach: bool = True, compile: bool = False
    ):
        self.foreach = check_bool("foreach", foreach)
        self.compile = check_bool("compile", compile)
        if compile and not foreach:
            raise ValueError(
                "Invalid foreach: False with compile=True (expected True: the compiled update "
                "fuses each parameter's operations, with no model-sized temporary to save)"
            )
        self._check_group(defaults)
        super().__init__(params, defaults)
        self.step_counts: Tensor | None = None  # the compiled path's counts, during a step
        self.compiled = CompiledUpdate(self) if compile else None

    # -- what a subclass provides ---------------------------------------------------------

    def check(self, group: dict) -> None:
        """Raise ValueError (TypeError) for a hyperparameter outside its range (of a wrong
        type), beyond those :meth:`_check_group` checks for every optimizer."""

    def update(self, group: dict, params: list[Tensor], grads: list[Tensor]) -> None:
        """Update ``params`` in place from ``grads`` (lists of tensors of one group)."""
        raise NotImplementedError

    # -- what the base provides -----------------------------------------------------------

    @classmethod
    def flags(cls) -> list[str]:
        """The names of the flags: the constructors' arguments with a bool default, this
        class's and its bases' (``AdamW`` fixes ``Adam``'s ``decoupled_weight_decay``)."""
        names = {}
        for klass in cls.__mro__:
            if issubclass(klass, Optimizer) and klass is not Optimizer:
                for p in inspect.signature(klass.__init__).parameters.values():
                    if isinstance(p.default, bool):
                        names.setdefault(p.name, None)
        return list(names)

    def _check_group(self, group: dict) -> None:
        """The hyperparameters many optimizers share, checked once here; then ``check``."""
        check_nonnegative("learning rate", group.get("lr", 0.0))
        if "betas" in group:
            check_betas(group["betas"])
        for key, what in (("eps", "epsilon value"), ("weight_decay", "weight_decay value")):
            if key in group:
                check_nonnegative(what, group[key])
        for key in self.flags():  # nesterov, amsgrad, trust, ...
            if key in group:
                check_bool(key, group[key])
        self.check(group)

    def add_param_group(self, param_group: dict) -> None:
        params = param_group["params"]
        # A generator ({"params": model.parameters()}) can be read once: keep it as a list
        params = [params] if isinstance(params, Tensor) else list(params)
        param_group = {**param_group, "params": params}
        for p in params:
            p = p[1] if isinstance(p, tuple) else p  # a (name, parameter) pair
            if isinstance(p, Tensor) and p.is_complex():
                raise ValueError(
                    f"{type(self).__name__} does not support complex parameters "
                    "(optimize torch.view_as_real(p) instead)"
                )
        super().add_param_group(param_group)  # fills in the defaults, so check afterwards
        group = self.param_groups[-1]
        if isinstance(group.get("betas"), list):
            group["betas"] = tuple(group["betas"])  # a pair, whichever sequence was given
        try:
            self._check_group(group)
        except (TypeError, ValueError):
            self.param_groups.pop()  # an invalid group must not stay behind
            raise

    def buffer(
        self, params: list[Tensor], name: str, like: list[Tensor] | None = None, fill: float = 0.0
    ) -> list[Tensor]:
        """The state tensor ``name`` of each parameter, created on first use as ``fill``
        (or as a copy of ``like``, e.g. the first gradient)."""
        out = []
        for i, p in enumerate(params):
            state = self.state[p]
            if name not in state:
                if like is not None:
                    state[name] = like[i].detach().clone(memory_format=torch.preserve_format)
                else:
                    state[name] = torch.full_like(p, fill, memory_format=torch.preserve_format)
            out.append(state[name])
        return out

    def has_state(self, params: list[Tensor], name: str) -> bool:
        return all(name in self.state[p] for p in params)

    def count_steps(self, params: list[Tensor]) -> list[int] | Tensor:
        """Add one to each parameter's step count t and return the counts (t = 1 first).

        On the compiled path the counts were added before the graph (they stay Python ints
        in the state, as eagerly) and come back as one float64 tensor, whose elements are
        0-d tensors: a new count is a new input, not a new graph. What the graph computes
        from them alone (bias corrections) is computed once per step, before its loops
        (:func:`~lsdl_lab.optim.compiled.compute_once`)."""
        if torch.compiler.is_compiling():
            return self.step_counts
        steps = []
        for p in params:
            state = self.state[p]
            state["step"] = state.get("step", 0) + 1
            steps.append(state["step"])
        return steps

    @torch.no_grad()
    def step(self, closure=None):
        """One optimization step; ``closure`` re-evaluates the loss when given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            grads = [p.grad for p in params]
            if any(g.is_sparse for g in grads):
                raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
            if not params:
                continue
            if self.compiled is not None:
                self.compiled(group, params, grads)
            elif self.foreach:
                self.update(group, params, grads)
            else:
                for p in params:
                    self.update(group, [p], [p.grad])
        return loss

    def __getstate__(self) -> dict:
        return {**super().__getstate__(), "foreach": self.foreach, "compile": self.compile}

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self.__dict__.setdefault("foreach", True)
        self.__dict__.setdefault("compile", False)
        self.step_counts = None
        self.compiled = CompiledUpdate(self) if self.compile else None
