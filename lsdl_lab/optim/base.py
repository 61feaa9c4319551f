"""What every optimizer of the book shares, written once.

An optimizer here is a :class:`torch.optim.Optimizer` subclass that adds only two things:
its hyperparameters (with their valid ranges) and an ``update`` method holding its
mathematics. ``update`` works on *lists* of tensors with ``torch._foreach_*`` operations,
the multi-tensor form of torch.optim's fast path, so the readable code is the fast code.

The base class does the rest:

* validation of every parameter group, at construction and in ``add_param_group``, with
  torch.optim's messages (``Invalid learning rate: -1.0``);
* the per-parameter state: named buffers created on first use (:meth:`buffers`) and a
  per-parameter step count (:meth:`count_steps`), all in ``state_dict``;
* the loop over parameter groups, ``closure`` handling, and the choice between one
  multi-tensor call per group (``foreach=True``, the default) and one call per parameter
  (``foreach=False``: the same ``update`` on lists of length one, which lowers peak memory
  because no temporary spans all parameters at once). There is no second, slow copy of
  the mathematics.

Sparse gradients and complex parameters are refused with a clear error: none of the
book's models has them, and supporting them would double every update rule.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

__all__ = ["Optimizer", "check_beta", "check_betas", "check_nonnegative"]


def check_nonnegative(what: str, value) -> None:
    """``value`` must be a finite real number >= 0 (NaN and infinity are refused too)."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not (math.isfinite(value) and value >= 0.0)
    ):
        raise ValueError(f"Invalid {what}: {value!r} (expected a finite number >= 0)")


def check_beta(what: str, value, upper_inclusive: bool = False) -> None:
    """``value`` must lie in [0, 1) (or [0, 1] with ``upper_inclusive``)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    ok = ok and 0.0 <= value and (value <= 1.0 if upper_inclusive else value < 1.0)
    if not ok:
        bound = "1]" if upper_inclusive else "1)"
        raise ValueError(f"Invalid {what}: {value!r} (expected a number in [0, {bound})")


def check_betas(betas) -> None:
    if not isinstance(betas, Sequence) or len(betas) != 2:
        raise ValueError(f"Invalid betas: {betas!r} (expected a pair (beta1, beta2))")
    for i, beta in enumerate(betas):
        check_beta(f"beta parameter at index {i}", beta)


class Optimizer(torch.optim.Optimizer):
    """Base of the book's optimizers; a subclass defines ``check`` and ``update``."""

    def __init__(self, params: Iterable, defaults: dict, foreach: bool = True):
        if not isinstance(foreach, bool):
            raise TypeError(f"Invalid foreach: {foreach!r} (expected True or False)")
        self.foreach = foreach
        self._check_group(defaults)
        super().__init__(params, defaults)

    # -- what a subclass provides ---------------------------------------------------------

    def check(self, group: dict) -> None:
        """Raise ValueError for hyperparameters outside their valid range."""

    def update(self, group: dict, params: list[Tensor], grads: list[Tensor]) -> None:
        """Update ``params`` in place from ``grads`` (lists of tensors of one group)."""
        raise NotImplementedError

    # -- what the base provides -----------------------------------------------------------

    def _check_group(self, group: dict) -> None:
        """The hyperparameters many optimizers share, checked once here; then ``check``."""
        check_nonnegative("learning rate", group.get("lr", 0.0))
        if "betas" in group:
            check_betas(group["betas"])
        for key, what in (("eps", "epsilon value"), ("weight_decay", "weight_decay value")):
            if key in group:
                check_nonnegative(what, group[key])
        self.check(group)

    def add_param_group(self, param_group: dict) -> None:
        params = param_group["params"]
        # A generator ({"params": model.parameters()}) can be read once: keep it as a list
        params = [params] if isinstance(params, Tensor) else list(params)
        param_group = {**param_group, "params": params}
        for p in params:
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
        except ValueError:
            self.param_groups.pop()  # an invalid group must not stay behind
            raise

    def buffers(
        self, params: list[Tensor], *names: str, like: list[Tensor] | None = None, fill: float = 0.0
    ) -> list[list[Tensor]] | list[Tensor]:
        """The state tensors ``names`` of each parameter, created on first use as
        ``fill`` (or as a copy of ``like``, e.g. the first gradient). One list per name."""
        lists = []
        for name in names:
            out = []
            for i, p in enumerate(params):
                state = self.state[p]
                if name not in state:
                    if like is not None:
                        state[name] = like[i].detach().clone(memory_format=torch.preserve_format)
                    else:
                        state[name] = torch.full_like(p, fill, memory_format=torch.preserve_format)
                out.append(state[name])
            lists.append(out)
        return lists[0] if len(names) == 1 else lists

    def has_state(self, params: list[Tensor], name: str) -> bool:
        return all(name in self.state[p] for p in params)

    def count_steps(self, params: list[Tensor]) -> list[int]:
        """Add one to each parameter's step count t and return the counts (t = 1 first)."""
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
            for p in params:
                if p.grad.is_sparse:
                    raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
            if not params:
                continue
            if self.foreach:
                self.update(group, params, [p.grad for p in params])
            else:
                for p in params:
                    self.update(group, [p], [p.grad])
        return loss

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self.__dict__.setdefault("foreach", True)
