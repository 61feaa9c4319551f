r"""Sharpness-aware minimization (Foret et al., 2021), wrapping any base optimizer.

SAM minimizes the worst loss in a ball of radius :math:`\rho` around the weights,
:math:`\min_w \max_{\|\epsilon\|_2\le\rho} L(w+\epsilon)`. A first-order Taylor expansion
gives the inner maximizer in closed form, and the update is the base optimizer's step
taken with the gradient *at the perturbed point* (Foret et al., 2021, Algorithm 1,
Eqs. 2-3):

.. math::
    \hat\epsilon(w) &= \rho\,\frac{g}{\|g\|_2}, \qquad g = \nabla L_B(w) \\
    w &\leftarrow \text{base step}\big(w,\ \nabla L_B(w)\big|_{w+\hat\epsilon(w)}\big)

(the Hessian term of the exact gradient of :math:`L_B(w+\hat\epsilon(w))` is dropped,
as in the paper). The norm :math:`\|g\|_2` is global, over every parameter of every group;
each group may have its own :math:`\rho`.

With ``adaptive=True`` this is ASAM (Kwon et al., 2021, Eq. 9, elementwise operator
:math:`T_w = |w|`), an optional variant whose ball is scaled by the weights so that
rescaling a layer does not change it: :math:`\hat\epsilon = \rho\,T_w^2 g/\|T_w g\|_2`.
Kwon et al. recommend a larger :math:`\rho` (for example 0.5 or 2) for ASAM.

Use: compute the gradient at :math:`w` as usual, then ``step`` with a closure that
recomputes the loss and its gradient (it will be called at :math:`w+\hat\epsilon`)::

    def closure():
        loss = loss_fn(model(x), y)
        loss.backward()
        return loss

    loss = loss_fn(model(x), y)
    loss.backward()
    optimizer.step(closure)
    optimizer.zero_grad()

or the two halves by hand: ``first_step(zero_grad=True)``, forward and backward,
``second_step(zero_grad=True)``. Each SAM step costs two forward-backward passes. With
BatchNorm in training mode the second pass also updates the running statistics; a lab
that minds can set the BatchNorm momentum to 0 for that pass. The structure (a wrapper
whose ``param_groups`` are its base optimizer's) follows David Samuel's ``davda54/sam``;
unlike it, ``state_dict`` here holds the base optimizer's state, so a run resumes exactly.
"""

from __future__ import annotations

import torch

from .._util import check_bool, check_nonnegative

__all__ = ["SAM"]


def _check_group(group: dict) -> None:
    check_nonnegative("rho", group["rho"])
    check_bool("adaptive", group["adaptive"])


class SAM(torch.optim.Optimizer):
    r"""SAM around ``base_optimizer`` (a class: ``torch.optim.SGD``, ``lsdl_lab.optim.Adam``,
    ...), constructed here with ``base_kwargs`` on the same parameter groups.

    ``param_groups`` are shared with the base optimizer, so learning-rate schedulers and
    per-group hyperparameters work as usual. ``state`` holds, per parameter, ``e_w`` (the
    last perturbation :math:`\hat\epsilon(w)`) and, between ``first_step`` and
    ``second_step`` only, ``w`` (the weights to return to); ``state_dict`` adds the base
    optimizer's own state under ``"base_optimizer"``.
    """

    def __init__(
        self, params, base_optimizer, rho: float = 0.05, adaptive: bool = False, **base_kwargs
    ):
        is_class = isinstance(base_optimizer, type)
        if not (is_class and issubclass(base_optimizer, torch.optim.Optimizer)):
            raise TypeError(
                f"Invalid base_optimizer: {base_optimizer!r} (expected an optimizer class such "
                "as torch.optim.SGD, not an instance; its arguments go in base_kwargs)"
            )
        _check_group(dict(rho=rho, adaptive=adaptive))
        super().__init__(params, dict(rho=rho, adaptive=adaptive))
        self.base_optimizer = base_optimizer(self.param_groups, **base_kwargs)
        self.param_groups = self.base_optimizer.param_groups  # one list, shared
        self.defaults.update(self.base_optimizer.defaults)

    def add_param_group(self, param_group: dict) -> None:
        base = getattr(self, "base_optimizer", None)
        if base is None:  # during __init__, before the base optimizer exists
            super().add_param_group(param_group)
            _check_group(self.param_groups[-1])
            return
        param_group = dict(param_group)
        for key in ("rho", "adaptive"):
            param_group.setdefault(key, self.defaults[key])
        _check_group(param_group)
        base.add_param_group(param_group)  # appends to the shared list

    @torch.no_grad()
    def _grad_norm(self) -> torch.Tensor:
        r""":math:`\|T_w g\|_2` over all parameters with a gradient (:math:`T_w = I` for
        SAM, :math:`|w|` for ASAM)."""
        norms = []
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            grads = [p.grad for p in params]
            if any(g.is_sparse for g in grads):
                raise RuntimeError("SAM does not support sparse gradients")
            if group["adaptive"]:
                grads = torch._foreach_mul(grads, torch._foreach_abs(params))
            norms += torch._foreach_norm(grads) if grads else []
        if not norms:
            raise RuntimeError(
                "SAM found no gradient: compute the loss and call backward() at the current "
                "weights before first_step() or step(closure)"
            )
        device = norms[0].device
        return torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms]))

    @torch.no_grad()
    def first_step(self, zero_grad: bool = False) -> None:
        r"""Move to :math:`w + \hat\epsilon(w)`, :math:`\hat\epsilon = \rho\,g/\|g\|_2`
        (:math:`\rho\,T_w^2 g/\|T_w g\|_2` with ``adaptive``), from the gradients in
        ``.grad``. A zero gradient gives :math:`\hat\epsilon = 0`."""
        norm = self._grad_norm()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            # rho / 0 would be inf and 0 * inf NaN: where() keeps a zero gradient in place.
            scale = torch.where(norm > 0, group["rho"] / norm, torch.zeros_like(norm))
            e_w = torch._foreach_mul([p.grad for p in params], scale.to(params[0].device))
            if group["adaptive"]:
                torch._foreach_mul_(e_w, torch._foreach_mul(params, params))
            for p, e in zip(params, e_w):
                self.state[p]["w"] = p.detach().clone()
                self.state[p]["e_w"] = e
            torch._foreach_add_(params, e_w)
        if zero_grad:
            self.zero_grad()

    @torch.no_grad()
    def second_step(self, zero_grad: bool = False) -> None:
        """Return to :math:`w` (the saved copy, exactly) and take the base optimizer's step
        with the gradient now in ``.grad``, the one computed at :math:`w+\\hat\\epsilon`."""
        for group in self.param_groups:
            for p in group["params"]:
                w = self.state[p].pop("w", None) if p in self.state else None
                if w is not None:
                    p.copy_(w)
        self.base_optimizer.step()
        if zero_grad:
            self.zero_grad()

    def step(self, closure=None):
        """``first_step``, then ``closure()`` (which must recompute the loss and call
        ``backward``; its gradients are zeroed first), then ``second_step``.

        The gradient at the current weights must already be in ``.grad``. Returns what
        the closure returned: the loss at the perturbed weights.
        """
        if closure is None:
            raise TypeError(
                "SAM.step() needs a closure that recomputes the loss and calls backward() "
                "(it is evaluated at the perturbed weights); or call first_step() and "
                "second_step() yourself"
            )
        self.first_step(zero_grad=True)
        with torch.enable_grad():
            loss = closure()
        self.second_step()
        return loss

    def state_dict(self) -> dict:
        state = super().state_dict()
        state["base_optimizer"] = self.base_optimizer.state_dict()
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        if "base_optimizer" not in state_dict:
            raise ValueError("Invalid state_dict: it has no 'base_optimizer' entry (not SAM's)")
        super().load_state_dict(state_dict)  # replaces self.param_groups with new dicts
        self.base_optimizer.load_state_dict(state_dict["base_optimizer"])
        self.base_optimizer.param_groups = self.param_groups  # shared again
