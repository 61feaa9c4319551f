r"""DiLoCo: local steps with an inner optimizer, an outer Nesterov step every H steps.

DiLoCo (Douillard et al. 2023, "DiLoCo: Distributed Low-Communication Training of
Language Models", arXiv 2311.08105, Algorithm 1) is local SGD
(:class:`~lsdl_lab.distributed.local_sgd.PeriodicAverager`) with two optimizers. Every
worker :math:`w` of the :math:`W` starts outer step :math:`t` from the shared parameters
:math:`\theta^{(t-1)}` and takes :math:`H` steps of its *inner* optimizer (AdamW in the
paper) on its own data. The workers then average their *pseudo-gradient*, how far the
inner steps moved them, with one all-reduce,

.. math:: \Delta^{(t)} = \frac1W \sum_{w=1}^{W}
    \bigl(\theta^{(t-1)} - \theta_w^{(t)}\bigr),

and an *outer* optimizer treats it as a gradient: SGD with Nesterov momentum, in
torch.optim's form (:class:`lsdl_lab.optim.SGD`, Sutskever et al. 2013),

.. math::
    b_t = \mu\, b_{t-1} + \Delta^{(t)} \quad (b_1 = \Delta^{(1)}), \qquad
    \theta^{(t)} = \theta^{(t-1)} - \eta\,\bigl(\Delta^{(t)} + \mu\, b_t\bigr),

after which every worker starts again from :math:`\theta^{(t)}`. The sign is that of a
gradient: :math:`\Delta` points from where the workers went back to where they started,
so a step *against* it moves :math:`\theta` the way they went. With :math:`\eta = 1` and
:math:`\mu = 0`, :math:`\theta^{(t)} = \frac1W\sum_w \theta_w^{(t)}`: plain local SGD,
the average of the models; the outer learning rate and momentum extrapolate past it.

**The paper's settings**: :math:`W = 8` workers, :math:`H = 500` inner steps, AdamW
inside, outer learning rate :math:`\eta = 0.7` and momentum :math:`\mu = 0.9` with
Nesterov (the defaults here). OpenDiLoCo, Prime Intellect's open reproduction (Jaghouar
et al. 2024; ``open_diloco/train_pure_fsdp.py``, and ``pure_torch_diloco.py`` of their
``diloco_simple``), sets the kept copy's ``grad = offloaded - param``, averages it over
the workers and steps ``torch.optim.SGD(lr=0.7, momentum=0.9, nesterov=True)`` on it: the
same sign and the same Nesterov form as here.

**Where this departs.** The kept copy :math:`\theta` stays on the parameters' device and
in their dtype (the reference moves it to the CPU to save accelerator memory); the
pseudo-gradient goes to the all-reduce as one flat tensor (the reference makes one call
per parameter: the same bytes, fewer rounds); the inner optimizer's state (AdamW's
moments) stays local and is never reset, as in the paper and its reference code.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

from .._util import check_int, check_positive, check_real
from ..optim.sgd import SGD

__all__ = ["DiLoCo"]


class DiLoCo:
    r"""DiLoCo's outer loop (Douillard et al. 2023): every ``period`` (:math:`H`) inner
    steps, one all-reduce of the pseudo-gradient :math:`\Delta` and a step of Nesterov SGD
    (``outer_lr`` :math:`\eta`, ``outer_momentum`` :math:`\mu`) on the shared parameters,
    which every rank's ``parameters`` then take (the module's docstring has the
    equations). Used like :class:`~lsdl_lab.distributed.local_sgd.PeriodicAverager`::

        diloco = DiLoCo(model.parameters(), period=H)
        for batch in batches:
            inner.zero_grad(); loss(model, batch).backward(); inner.step()
            diloco.after_step()

    The ranks must start from the same ``parameters`` (seed the model alike, or broadcast
    it): they are the first shared copy. ``rounds`` counts the all-reduces, one per outer
    step, each of one model's worth of bytes. :meth:`state_dict` holds the shared copy, the
    outer momentum and the step count, so a checkpoint that also holds the model and the
    inner optimizer resumes exactly; as with torch's, its tensors are the live ones (save
    them, or clone them).
    """

    def __init__(
        self,
        parameters: Iterable[torch.Tensor],
        period: int,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        group=None,
    ):
        self.parameters = list(parameters)
        self.period = check_int("period", period, 1)
        outer_lr = check_positive("outer_lr", outer_lr)
        outer_momentum = check_real("outer_momentum", outer_momentum, 0.0, 1.0, high_open=True)
        self.group = group
        self.outer = [p.detach().clone() for p in self.parameters]  # theta, the shared copy
        self.optimizer = SGD(
            self.outer, lr=outer_lr, momentum=outer_momentum, nesterov=outer_momentum > 0
        )
        self.step_count = 0
        self.rounds = 0

    def after_step(self) -> bool:
        """Count an inner step; take the outer step if it ends a period. Returns whether it
        did."""
        self.step_count += 1
        if self.step_count % self.period != 0:
            return False
        self.outer_step()
        return True

    def pseudo_gradient(self) -> torch.Tensor:
        r""":math:`\Delta = \frac1W \sum_w (\theta - \theta_w)`, flat, by one all-reduce."""
        pairs = zip(self.outer, self.parameters, strict=True)
        with torch.no_grad():
            delta = torch.cat([(theta - p).reshape(-1) for theta, p in pairs])
            dist.all_reduce(delta, group=self.group)
            return delta.div_(dist.get_world_size(self.group))

    def outer_step(self) -> None:
        r""":math:`\theta \leftarrow \theta - \eta(\Delta + \mu b)` (Nesterov SGD on
        :math:`\Delta`), then every rank's parameters :math:`\theta_w \leftarrow \theta`."""
        delta = self.pseudo_gradient()
        for theta, d in zip(self.outer, delta.split([t.numel() for t in self.outer]), strict=True):
            theta.grad = d.view_as(theta)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            torch._foreach_copy_(self.parameters, self.outer)
        self.rounds += 1

    def state_dict(self) -> dict:
        """The shared copy, the outer optimizer's state (its momentum buffers) and the
        counts: what a checkpoint needs beside the model and the inner optimizer."""
        return {
            "period": self.period,
            "step_count": self.step_count,
            "rounds": self.rounds,
            "outer": self.outer,
            "optimizer": self.optimizer.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from :meth:`state_dict`'s ``state``: the same period, the same shapes."""
        if state["period"] != self.period:
            raise ValueError(
                f"Invalid state: period {state['period']} (expected this DiLoCo's period "
                f"{self.period}; resume with the period that wrote the checkpoint)"
            )
        shapes = [tuple(t.shape) for t in state["outer"]]
        if shapes != [tuple(t.shape) for t in self.outer]:
            raise ValueError(
                f"Invalid state: parameters of shapes {shapes} (expected those of this "
                f"DiLoCo's parameters, {[tuple(t.shape) for t in self.outer]})"
            )
        with torch.no_grad():
            for theta, saved in zip(self.outer, state["outer"], strict=True):
                theta.copy_(saved)
        self.optimizer.load_state_dict(state["optimizer"])
        self.step_count, self.rounds = state["step_count"], state["rounds"]
