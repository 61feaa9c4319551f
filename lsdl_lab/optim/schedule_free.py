r"""Schedule-free AdamW (Defazio et al., 2024): no learning-rate schedule, an average instead.

Defazio, Yang, Mehta, Mishchenko, Khaled and Cutkosky (2024, "The Road Less Scheduled",
NeurIPS 2024, arXiv:2405.15682; the entry that won AlgoPerf's self-tuning track) replace
the schedule by two sequences: a base sequence :math:`z_t` that takes AdamW's steps with a
constant learning rate, and its weighted average :math:`x_t`, the weights that are
evaluated; gradients are taken at an interpolation :math:`y_t` between them. With
:math:`z_1 = x_1 = w_0` and :math:`v_0 = 0`, step :math:`t` is

.. math::
    y_t &= (1-\beta_1)\, z_t + \beta_1 x_t, \qquad g_t = \nabla f(y_t) \\
    v_t &= \beta_2 v_{t-1} + (1-\beta_2)\, g_t^2, \qquad
    \gamma_t = \eta \min(1, t / T_{\text{warmup}}) \\
    z_{t+1} &= z_t - \gamma_t \left(\frac{g_t}{\sqrt{v_t / (1-\beta_2^t)} + \epsilon}
               + \lambda\, y_t\right) \\
    x_{t+1} &= (1 - c_{t+1})\, x_t + c_{t+1} z_{t+1}, \qquad
    c_{t+1} = \frac{w_t}{\sum_{i=1}^t w_i}, \qquad
    w_t = t^r \left(\max_{i \le t} \gamma_i\right)^{p}

so :math:`x_{t+1}` is the average of :math:`z_2, \dots, z_{t+1}` with weights :math:`w_t`:
equal weights after warmup (:math:`r = 0`), and during warmup weights growing as
:math:`\gamma_t^p` (``weight_lr_power`` :math:`p = 2`, the paper's :math:`\gamma_t^2`), so
the small early steps count little. :math:`\beta_1` plays momentum's part: it sets how
far from the average the gradient is taken. The average is what the theory bounds and what
is evaluated; no schedule's length has to be known in advance.

**The variant**: the authors' ``adamw_schedulefree.py`` (facebookresearch/schedule_free,
read and not copied), its defaults (``lr=0.0025``, ``betas=(0.9, 0.999)``, ``eps=1e-8``,
``weight_decay=0``, ``warmup_steps=0``, ``r=0``, ``weight_lr_power=2``) and its memory:
the parameters hold :math:`y_t` and the state :math:`z_t` and :math:`v_t` only, AdamW's
8 bytes per float32 parameter; :math:`x_t` is never stored, and the step updates
:math:`y` in place from

.. math::
    e_t = z_{t+1} - z_t, \qquad
    y_{t+1} = (1 - c_{t+1})\, y_t + c_{t+1} z_{t+1} + (1-\beta_1)(1 - c_{t+1})\, e_t

(substitute :math:`x_t = (y_t - (1-\beta_1) z_t)/\beta_1` into the two lines above).
Departures: ``eval()`` keeps :math:`y` (one more buffer per parameter, until ``train()``
frees it) so that ``eval()`` then ``train()`` gives back the training point bit for bit
(the reference recomputes :math:`y` from :math:`x` and :math:`z`, with rounding);
:math:`\beta_1` must be in (0, 1), because :math:`x = (y - (1-\beta_1) z)/\beta_1` divides
by it (the reference fails there with a ZeroDivisionError); the optimizer starts in train
mode (the reference starts in eval mode and insists on ``train()`` first; at the start
:math:`x_1 = y_1 = z_1 = w_0`, so the two modes place the parameters alike); the mode is a
group's ``train_mode`` (as in the reference), so ``state_dict`` records it; the step counts
and the weights' running sum :math:`\sum_i w_i` are per parameter (the reference keeps them
per group), as every optimizer of the library counts, so ``foreach=False`` equals
``foreach=True``; the reference's ``inner_momentum`` (an extra first moment) is not offered.
As in the reference, the weights use the largest :math:`\gamma_i` so far, so a learning
rate lowered by hand does not lower them.

**Modes.** ``train()`` puts the parameters at :math:`y_t`, where gradients are taken;
``eval()`` at :math:`x_t`, the average, for evaluation and for the weights one keeps. A
``step()`` in eval mode is an error. Layers with batch statistics (BatchNorm) hold running
averages gathered at :math:`y`: the reference recomputes them at :math:`x` before
evaluating.
"""

from __future__ import annotations

import torch

from .._util import check_bool, check_int, check_nonnegative, check_real
from .base import Optimizer
from .pieces import adam_denominator

__all__ = ["ScheduleFreeAdamW"]


class ScheduleFreeAdamW(Optimizer):
    r"""Schedule-free AdamW: the parameters hold :math:`y` in train mode (:meth:`train`,
    the mode it starts in) and the average :math:`x` in eval mode (:meth:`eval`).

    ``warmup_steps`` (an int >= 0) ramps :math:`\gamma_t` linearly over the first steps;
    ``r`` and ``weight_lr_power`` (numbers >= 0) set the averaging weights
    :math:`w_t = t^r (\max_{i \le t} \gamma_i)^p`; ``betas[0]`` must lie in (0, 1).
    """

    not_compilable = (
        "its averaging weight c = w_t / sum(w_i) comes from a running sum kept per "
        "parameter on the host, a new constant every step that one graph cannot take"
    )

    def __init__(
        self,
        params,
        lr: float = 0.0025,
        betas=(0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        warmup_steps: int = 0,
        r: float = 0.0,
        weight_lr_power: float = 2.0,
        *,
        foreach: bool = True,
        compile: bool = False,
    ):
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            warmup_steps=warmup_steps,
            r=r,
            weight_lr_power=weight_lr_power,
            train_mode=True,
        )
        super().__init__(params, defaults, foreach, compile)

    def check(self, group):
        check_real(
            "beta parameter at index 0", group["betas"][0], 0.0, 1.0, low_open=True,
            high_open=True,
        )  # fmt: skip
        check_int("warmup_steps", group["warmup_steps"], 0)
        check_nonnegative("r", group["r"])
        check_nonnegative("weight_lr_power", group["weight_lr_power"])
        check_bool("train_mode", group["train_mode"])

    def add_param_group(self, param_group: dict) -> None:
        if self.param_groups:  # a new group joins in the optimizer's mode
            param_group = {**param_group, "train_mode": self.param_groups[0]["train_mode"]}
        super().add_param_group(param_group)

    @torch.no_grad()
    def eval(self) -> None:
        r"""Put the parameters at the average :math:`x = (y - (1-\beta_1) z)/\beta_1`,
        keeping :math:`y` for :meth:`train` (a no-op in eval mode)."""
        for group in self.param_groups:
            if group["train_mode"]:
                params = [p for p in group["params"] if "z" in self.state[p]]
                for p in params:
                    self.state[p]["y"] = p.detach().clone()
                if params:
                    z = [self.state[p]["z"] for p in params]
                    torch._foreach_lerp_(params, z, 1 - 1 / group["betas"][0])
                group["train_mode"] = False

    @torch.no_grad()
    def train(self) -> None:
        """Put the parameters back at :math:`y`, bit for bit the point :meth:`eval` left
        (a no-op in train mode)."""
        for group in self.param_groups:
            if not group["train_mode"]:
                for p in group["params"]:
                    if "y" in self.state[p]:
                        p.copy_(self.state[p].pop("y"))
                group["train_mode"] = True

    def step(self, closure=None):
        """One step at :math:`y`; an error in eval mode, where the parameters hold
        :math:`x`."""
        if not all(group["train_mode"] for group in self.param_groups):
            raise RuntimeError(
                f"{type(self).__name__}.step() in eval mode: the parameters hold the average "
                "x, not the point y where gradients are taken (call .train() before training "
                "and .eval() before evaluating)"
            )
        return super().step(closure)

    def update(self, group, params, grads):
        r"""One schedule-free AdamW step (Defazio et al., 2024) on the parameters, which
        hold :math:`y_t`:

        .. math::
            \gamma_t &= \eta \min(1, t/T_{\text{warmup}}), \qquad
            w_t = t^r \left(\max_{i \le t} \gamma_i\right)^p, \qquad
            c_{t+1} = w_t \Big/ \sum_{i=1}^t w_i \\
            v_t &= \beta_2 v_{t-1} + (1-\beta_2)\, g_t^2 \\
            e_t &= -\gamma_t \left(\frac{g_t}{\sqrt{v_t/(1-\beta_2^t)} + \epsilon}
                   + \lambda\, y_t\right), \qquad z_{t+1} = z_t + e_t \\
            y_{t+1} &= (1 - c_{t+1})\, y_t + c_{t+1} z_{t+1}
                       + (1-\beta_1)(1-c_{t+1})\, e_t
        """
        (beta1, beta2), lr, lam = group["betas"], group["lr"], group["weight_decay"]
        warmup, r, power = group["warmup_steps"], group["r"], group["weight_lr_power"]
        z = self.buffer(params, "z", like=params)  # z_1 = y_1 = x_1 = w_0
        v = self.buffer(params, "exp_avg_sq")
        t = self.count_steps(params)
        gamma = [lr * min(1.0, k / warmup) if warmup else lr for k in t]
        c = []
        for p, k, g_k in zip(params, t, gamma):
            state = self.state[p]
            state["lr_max"] = max(state.get("lr_max", g_k), g_k)
            w = k**r * state["lr_max"] ** power
            state["weight_sum"] = state.get("weight_sum", 0.0) + w
            c.append(w / state["weight_sum"] if state["weight_sum"] > 0 else 0.0)
        torch._foreach_mul_(v, beta2)
        torch._foreach_addcmul_(v, grads, grads, 1 - beta2)
        e = torch._foreach_div(grads, adam_denominator(v, [1 - beta2**k for k in t],
                                                       group["eps"]))  # fmt: skip
        if lam:
            torch._foreach_add_(e, params, alpha=lam)  # the decay, taken at y
        torch._foreach_mul_(e, [-g_k for g_k in gamma])
        torch._foreach_add_(z, e)
        torch._foreach_lerp_(params, z, c)
        torch._foreach_mul_(e, [(1 - beta1) * (1 - c_k) for c_k in c])
        torch._foreach_add_(params, e)
