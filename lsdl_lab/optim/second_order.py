r"""What Newton and Hessian-free share: the closure that gives the loss with its graph, one
system over all parameter groups, and the backtracking line search.

A second-order step solves one linear system over every parameter at once (the curvature
couples them), so it cannot be written as the first-order ``update`` on each group's lists
of tensors: :class:`SecondOrderOptimizer` replaces ``step`` and keeps the rest of
:class:`~lsdl_lab.optim.base.Optimizer` (validation, groups, ``state_dict``). The
hyperparameters that define the system (a method, an iteration budget, a line search) must
then be the same in every group; ``lr`` and ``damping`` may differ per group, as the
learning rate of the group's part of the step and the damping of its diagonal block.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from .base import Optimizer

__all__ = ["SecondOrderOptimizer", "backtracking_line_search", "loss_of"]

ARMIJO_C = 1e-4  # sufficient-decrease constant c_1 (Nocedal & Wright, Sec. 3.1: "quite small")
SHRINK = 0.5  # the contraction factor rho of Nocedal & Wright's Alg. 3.1
MAX_BACKTRACKS = 20  # 2^-20 of the step: beyond that the direction is not worth taking


def backtracking_line_search(
    f: Callable[[float], float], f0: float, slope: float, max_backtracks: int = MAX_BACKTRACKS
) -> tuple[float, float]:
    r"""Backtracking with the Armijo condition (Nocedal & Wright, *Numerical Optimization*,
    2006, Alg. 3.1): the first :math:`\alpha \in \{1, \rho, \rho^2, \dots\}` with

    .. math:: f(\alpha) \le f(0) + c_1\,\alpha\,f'(0),

    :math:`f(\alpha)` the loss at :math:`w + \alpha d` and :math:`f'(0) = g^\top d` (``slope``,
    negative for a descent direction); :math:`c_1 = 10^{-4}`, :math:`\rho = 1/2`. Returns
    :math:`(\alpha, f(\alpha))`, or :math:`(0, f(0))` when none of the first
    ``max_backtracks + 1`` trials decreases the loss enough (then no step is taken, as
    Martens & Sutskever, 2012, Sec. 8.8, do)."""
    alpha = 1.0
    for _ in range(max_backtracks + 1):
        f_alpha = f(alpha)
        if f_alpha <= f0 + ARMIJO_C * alpha * slope:
            return alpha, f_alpha
        alpha *= SHRINK
    return 0.0, f0


def loss_of(result) -> Tensor:
    """The loss a closure returned: the loss, or the first item of ``(loss, outputs)``."""
    loss = result[0] if isinstance(result, tuple) else result
    if not isinstance(loss, Tensor) or loss.numel() != 1:
        raise TypeError(
            f"Invalid closure: it returned a {type(result).__name__} (expected the loss, a "
            "scalar tensor with its graph)"
        )
    return loss


class SecondOrderOptimizer(Optimizer):
    """A base for the optimizers that solve one system over all groups; a subclass names the
    hyperparameters that must agree across groups (``shared``) and writes ``step``."""

    shared: tuple[str, ...] = ()
    not_compilable = (
        "its step solves one system over all parameters, with a closure, autograd and a line "
        "search: there is no per-group update to compile"
    )

    def check_shared(self, group: dict) -> None:
        """A new group must agree with the first on the hyperparameters of the system."""
        if "params" not in group or group is self.param_groups[0]:
            return
        for key in self.shared:
            if group[key] != self.param_groups[0][key]:
                raise ValueError(
                    f"Invalid {key}: {group[key]!r} (expected {self.param_groups[0][key]!r}, as "
                    f"in the first group: {type(self).__name__} solves one system for all groups)"
                )

    def trainable(self) -> tuple[list[Tensor], list[dict]]:
        """The parameters that may move (they require a gradient), each with its group."""
        params, groups = [], []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None and p.grad.is_sparse:
                    raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
                if p.requires_grad:
                    params.append(p)
                    groups.append(group)
        return params, groups

    def evaluate(self, closure):
        """The closure's result (with its graph) and its loss; a clear error without one."""
        if closure is None:
            raise RuntimeError(
                f"{type(self).__name__} needs a closure that returns the loss with its graph "
                "(and does not call backward): opt.step(lambda: loss_fn(model(x), y))"
            )
        with torch.enable_grad():
            result = closure()
        loss = loss_of(result)
        if not loss.requires_grad:
            raise RuntimeError(
                f"{type(self).__name__}'s closure returned a loss without a graph: compute it "
                "with gradients enabled and do not call backward in the closure"
            )
        return result, loss

    @staticmethod
    def gradient(loss: Tensor, params: list[Tensor], groups: list[dict], create_graph: bool):
        """The gradient of ``loss``, for the parameters it depends on (the others dropped):
        (params, their groups, gradients)."""
        try:
            with torch.enable_grad():  # step runs under no_grad, where no graph would be built
                grads = torch.autograd.grad(
                    loss, params, create_graph=create_graph, retain_graph=True, allow_unused=True
                )
        except RuntimeError as error:
            if "second time" not in str(error):
                raise
            raise RuntimeError(
                "The closure's loss has no graph left: a second-order optimizer differentiates "
                "the loss itself, so the closure must not call backward"
            ) from error
        kept = [i for i, g in enumerate(grads) if g is not None]
        return [params[i] for i in kept], [groups[i] for i in kept], [grads[i] for i in kept]

    @staticmethod
    def per_coordinate(params: list[Tensor], groups: list[dict], key: str) -> Tensor:
        """A group hyperparameter spread over the coordinates of the flat parameter vector."""
        return torch.cat(
            [torch.full((p.numel(),), float(g[key]), dtype=p.dtype, device=p.device)
             for p, g in zip(params, groups)]
        )  # fmt: skip

    def move(self, params: list[Tensor], start: list[Tensor], step: list[Tensor], alpha: float):
        """Set the parameters to ``start + alpha * step``."""
        if self.foreach:
            torch._foreach_copy_(params, torch._foreach_add(start, step, alpha=alpha))
        else:
            for p, w, d in zip(params, start, step):
                p.copy_(w.add(d, alpha=alpha))

    def take_step(self, closure, params, step, f0: float, slope: float, line_search: bool):
        """Move the parameters along ``step`` (tensors shaped like them), the whole step or
        the Armijo line search's; returns (alpha, the loss there, or None if not measured)."""
        start = [p.detach().clone() for p in params]
        if not line_search:
            self.move(params, start, step, 1.0)
            return 1.0, None

        def f(alpha):
            self.move(params, start, step, alpha)
            return loss_of(closure()).item()

        alpha, f_alpha = backtracking_line_search(f, f0, slope)
        if alpha:
            self.move(params, start, step, alpha)
        else:  # start exactly, even where the step is not finite
            torch._foreach_copy_(params, start)
        return alpha, f_alpha
