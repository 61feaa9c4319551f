r"""The generalized Gauss-Newton and the Fisher: curvature through the network's outputs.

Write the loss of a batch as :math:`L(w) = \ell(f(w))`, :math:`f` the network's outputs
(logits) and :math:`\ell` the loss of the outputs. Its Hessian splits in two,

.. math:: \nabla^2 L = J^\top (\nabla^2_f \ell)\, J + \sum_k (\nabla_f \ell)_k\,\nabla^2 f_k,

:math:`J = \partial f / \partial w`. Dropping the second term, which carries the network's
own curvature and makes the Hessian indefinite, leaves the **generalized Gauss-Newton**
:math:`G = J^\top H_\ell J` (Schraudolph, 2002; Martens, 2010): positive semi-definite
whenever :math:`\ell` is convex in :math:`f` (cross-entropy on logits, squared error), and
its product costs one forward-mode and one reverse-mode pass,
:math:`Gv = J^\top\big(H_\ell\,(Jv)\big)`.

For a loss that is a negative log-likelihood, :math:`\ell_n(f) = -\log q(y_n\mid f_n)`,
the **Fisher** :math:`F = \sum_n J_n^\top\,\mathbb E_{\tilde y\sim q(\cdot\mid f_n)}
[\nabla\ell_n(\tilde y)\nabla\ell_n(\tilde y)^\top]\,J_n` replaces :math:`H_\ell` by the
expected outer product of the loss's gradient under the *model's* predictive distribution;
for cross-entropy and squared error (exponential families in their natural parameters)
that expectation is :math:`H_\ell` itself, so the Fisher is the GGN (Martens, 2020, Sec. 9.2).
The **empirical Fisher** puts the data's labels :math:`y_n` in place of samples
:math:`\tilde y`. It is not the Fisher: its outer products vanish where the model fits the
labels and are largest on the examples it gets wrong, so it is not the curvature, and its
preconditioned step can point far from Newton's (Kunstner, Balles & Hennig, 2019).

Both are :class:`~lsdl_lab.curvature.operators.ParameterOperator`\ s, so every probe and
:func:`~lsdl_lab.curvature.conjugate_gradient.cg` take them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, jvp, vjp, vmap

from .._util import LossFn, check_bool, check_int, eval_mode
from .operators import ParameterOperator, affine_batchnorm

__all__ = ["FisherOperator", "GGNOperator"]


class _OutputSpaceOperator(ParameterOperator):
    r""":math:`v \mapsto \sum_b w_b\,J_b^\top \Lambda_b J_b v`: what the GGN and the Fisher share.

    A subclass gives :math:`\Lambda_b`, a product in the outputs' space
    (``_output_product(b, out, u)``). Like :class:`HessianOperator`, the model is in
    evaluation mode and BatchNorm is its affine map, so the operator is a fixed matrix.
    """

    def _outputs(self, x, *params):
        return functional_call(self.model, dict(zip(self.names, params)), (x,))

    def _output_product(self, b: int, out: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _product(self, v: list[torch.Tensor]) -> list[torch.Tensor]:
        primals = tuple(p.detach() for p in self.params)
        total = [torch.zeros_like(p) for p in primals]
        with eval_mode(self.model), affine_batchnorm(self.model):
            for b, ((x, _), w) in enumerate(zip(self.batches, self.weights)):
                f = partial(self._outputs, x)
                out, Jv = jvp(f, primals, tuple(v))  # J v, forward mode
                _, vjp_fn = vjp(f, *primals)
                JtLJv = vjp_fn(self._output_product(b, out.detach(), Jv))  # J^T (Lambda J v)
                torch._foreach_add_(total, JtLJv, alpha=w)
        return total


class GGNOperator(_OutputSpaceOperator):
    r"""The generalized Gauss-Newton :math:`G = \sum_b w_b J_b^\top H_{\ell,b} J_b` of the
    mean loss over ``batches`` (Schraudolph, 2002; Martens, 2010), as an operator.

    :math:`H_{\ell,b} = \nabla^2_f\,\texttt{loss\_fn}(f, y_b)` is the Hessian of the loss with
    respect to the outputs, taken by automatic differentiation, so any ``loss_fn`` works
    (``F.cross_entropy``, ``F.mse_loss``, ``nn.CrossEntropyLoss(reduction="sum")``...) with
    the batch weights of :class:`ParameterOperator` (:math:`w_b = n_b/N`; with a summed
    loss give one batch). :math:`G` is positive semi-definite when ``loss_fn`` is convex in
    the outputs. A product: :math:`Jv` forward mode, :math:`H_\ell(Jv)` in the outputs'
    space, then :math:`J^\top(\cdot)` reverse mode; the Hessian of the network is never
    formed.
    """

    def _output_product(self, b, out, u):
        y = self.batches[b][1]
        # reverse over reverse: H_l is symmetric, so u^T H_l = (H_l u)^T (forward over
        # reverse fails inside cross-entropy's backward on torch 2.13)
        _, hvp = vjp(grad(lambda f: self.loss_fn(f, y)), out)
        return hvp(u)[0]

    def __repr__(self) -> str:
        return f"GGNOperator(num_parameters={self.dim}, batches={len(self.batches)})"


def _likelihood(loss_fn) -> tuple[str, str]:
    """(family, reduction) of a supported loss, or a clear error."""
    if loss_fn is F.cross_entropy:
        return "cross_entropy", "mean"
    if loss_fn is F.mse_loss:
        return "mse", "mean"
    if isinstance(loss_fn, nn.CrossEntropyLoss) and (
        loss_fn.weight is None and loss_fn.label_smoothing == 0.0
    ):
        family = "cross_entropy"
    elif isinstance(loss_fn, nn.MSELoss):
        family = "mse"
    else:
        family = None
    if family is None or loss_fn.reduction not in ("mean", "sum"):
        raise ValueError(
            f"Invalid loss_fn: {loss_fn!r} (expected F.cross_entropy, F.mse_loss, or "
            "nn.CrossEntropyLoss (no weight, no label smoothing) or nn.MSELoss with "
            'reduction "mean" or "sum": a negative log-likelihood whose distribution is known)'
        )
    return family, loss_fn.reduction


class FisherOperator(_OutputSpaceOperator):
    r"""The Fisher :math:`F = \sum_b w_b \frac{R_b}{M}\sum_{n,m} J_n^\top g_{nm} g_{nm}^\top
    J_n`, Monte-Carlo over ``samples`` targets per example drawn from the model's predictive
    distribution (the "true" Fisher), or with the data's labels (``empirical=True``).

    :math:`g_{nm} = \nabla_{f_n}\texttt{loss\_fn}(f, \tilde y_m)` is the gradient of the
    batch's loss with respect to example :math:`n`'s outputs, and :math:`R_b` undoes the
    loss's reduction (:math:`N_b` for cross-entropy's mean, :math:`N_b C` for squared error's
    mean over :math:`C` outputs, 1 for a sum), so that :math:`F` uses the per-example loss
    :math:`\ell_n` and :math:`L = \frac1{R}\sum_n \ell_n`. The predictive distributions,
    :math:`q \propto e^{-\ell_n}`: cross-entropy, a categorical over ``softmax(f_n)``;
    squared error :math:`\ell_n = \|f_n - y_n\|^2`, a Gaussian of mean :math:`f_n` and
    variance 1/2 per output. Then :math:`\mathbb E[g g^\top] = H_\ell` and the true Fisher is
    the GGN in expectation (:class:`GGNOperator`), a positive semi-definite estimate of it of
    rank at most ``samples`` per example. The conventions are curvlinops' (Dangel et al.):
    the same ``seed`` and ``samples`` draw the same targets as its
    ``FisherMCLinearOperator``, and ``empirical=True`` is its ``EFLinearOperator``.

    The targets are drawn once, when the operator is built (one forward pass per batch,
    from a generator seeded with ``seed`` on the operator's device): every product uses the
    same draws, so the operator is one fixed symmetric matrix, as Lanczos and CG need.
    Why the empirical Fisher differs from the Fisher (Kunstner et al., 2019): its outer
    products use the observed labels, so they measure how wrong the model is, not how
    curved its loss is; near a minimum where the model fits the labels they shrink to zero
    while the Fisher and the GGN do not.
    """

    def __init__(
        self,
        model: nn.Module,
        loss_fn: LossFn,
        batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
        *,
        params: Sequence[torch.Tensor] | None = None,
        samples: int = 1,
        seed: int = 0,
        empirical: bool = False,
    ):
        self.family, self.reduction = _likelihood(loss_fn)
        self.samples = check_int("samples", samples, 1)
        self.empirical = check_bool("empirical", empirical)
        check_int("seed", seed, 0)
        super().__init__(model, loss_fn, batches, params)
        gen = torch.Generator(device=self.device).manual_seed(seed)
        with torch.no_grad(), eval_mode(model), affine_batchnorm(model):
            self._targets = [self._draw(model(x), y, gen) for x, y in self.batches]

    def _draw(self, out: torch.Tensor, y: torch.Tensor, gen) -> torch.Tensor:
        """The targets of one batch, stacked: ``samples`` draws from q(. | f), or the labels."""
        if out.ndim != 2:
            raise ValueError(
                f"Invalid model: outputs of shape {tuple(out.shape)} (expected (batch, outputs))"
            )
        if self.empirical:
            return y[None]
        if self.family == "cross_entropy":
            draws = out.softmax(1).multinomial(self.samples, replacement=True, generator=gen)
            return draws.T
        noise = torch.normal(
            torch.zeros(self.samples, *out.shape, dtype=out.dtype, device=out.device),
            torch.tensor(math.sqrt(0.5), device=out.device),
            generator=gen,
        )
        return out - noise  # the gradient of ||f - (f - e)||^2 is 2 e

    def _reduction_factor(self, out: torch.Tensor) -> float:
        if self.reduction == "sum":
            return 1.0
        return out.shape[0] * (1 if self.family == "cross_entropy" else out.shape[1])

    def _output_product(self, b, out, u):
        targets = self._targets[b]
        g = vmap(grad(self.loss_fn), in_dims=(None, 0))(out, targets)  # (M, N, C): g_nm
        scale = self._reduction_factor(out) / len(targets)
        return scale * (g * (g * u).sum(2, keepdim=True)).sum(0)

    def __repr__(self) -> str:
        kind = "empirical" if self.empirical else f"samples={self.samples}"
        return f"FisherOperator(num_parameters={self.dim}, {kind}, loss={self.family})"
