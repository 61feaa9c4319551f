r"""Curvature operators: a network's curvature as a linear map :math:`v \mapsto Av`.

A network with :math:`P` parameters has a :math:`P\times P` Hessian
:math:`H = \nabla^2 L(w)`, far too large to form, but the product :math:`Hv` costs about two
gradients (Pearlmutter, 1994). Every probe of :mod:`lsdl_lab.curvature.probes` is a short
function of such a product, so it takes any operator of one small protocol,
:class:`CurvatureOperator`: ``A.matvec(v)`` (or ``A @ v``) of a flat vector of ``A.dim``
entries, with ``A.dtype``, ``A.device`` and ``A.products`` (the number of products made so
far, the unit of a probe's cost).

- :class:`HessianOperator`: the Hessian of a model's mean loss over batches;
- :class:`DenseOperator`: an explicit symmetric matrix (a small model's exact Hessian from
  :func:`hessian_matrix`, or any test matrix);
- :class:`ParameterOperator`: what every operator on a model's parameters shares (the
  model, the loss, the weighted batches, vectors given as flat tensors or as lists shaped
  like the parameters); the Hessian is one, the Gauss-Newton and Fisher matrices of
  Chapter 6 are others.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator, Sequence
from functools import partial

import torch
from torch import nn
from torch.func import functional_call, grad, jacrev, jvp
from torch.nn.modules.batchnorm import _BatchNorm

from .._util import (
    LossFn,
    check_choice,
    check_tensor,
    eval_mode,
    flatten,
    unflatten,
    weighted_batches,
)

__all__ = [
    "CurvatureOperator",
    "DenseOperator",
    "HessianOperator",
    "ParameterOperator",
    "affine_batchnorm",
    "hessian_matrix",
]

METHODS = ("double_backward", "forward_over_reverse")


class CurvatureOperator:
    r"""A symmetric linear operator :math:`v \mapsto Av` on vectors of ``dim`` entries.

    The protocol every probe relies on: ``matvec(v)`` (also ``A @ v``) of a flat vector,
    ``dim`` and ``shape = (dim, dim)``, ``dtype`` and ``device`` (the probes draw their
    random vectors in them), and ``products``, the number of products made so far.
    A subclass sets ``dim``, ``dtype`` and ``device`` and implements ``_matvec`` (as in
    SciPy's ``LinearOperator``); ``matvec`` checks the vector and counts the product.
    """

    dim: int
    dtype: torch.dtype
    device: torch.device
    products: int = 0

    @property
    def shape(self) -> tuple[int, int]:
        return (self.dim, self.dim)

    def _matvec(self, v: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} does not implement _matvec")

    def matvec(self, v: torch.Tensor) -> torch.Tensor:
        """A v for a flat vector ``v`` of ``dim`` entries."""
        check_tensor("v", v)
        if v.shape != (self.dim,):
            raise ValueError(f"Invalid v: shape {tuple(v.shape)} (expected ({self.dim},))")
        self.products += 1
        return self._matvec(v)

    def __matmul__(self, v):
        return self.matvec(v)


class DenseOperator(CurvatureOperator):
    r"""An explicit symmetric ``(dim, dim)`` matrix as an operator: the exact Hessian of a small
    model (:func:`hessian_matrix`), or a test matrix whose spectrum is known.

    The probes assume symmetry, so a matrix that is not symmetric up to rounding
    (:math:`\|A - A^\top\|_F > \sqrt{\epsilon}\,\|A\|_F`, :math:`\epsilon` the dtype's
    machine epsilon) is refused.
    """

    def __init__(self, matrix: torch.Tensor):
        check_tensor("matrix", matrix, ndim=2)
        if matrix.shape[0] != matrix.shape[1] or not matrix.is_floating_point():
            raise ValueError(
                f"Invalid matrix: a {matrix.dtype} tensor of shape {tuple(matrix.shape)} "
                "(expected a square floating-point matrix)"
            )
        tolerance = math.sqrt(torch.finfo(matrix.dtype).eps) * matrix.norm()
        if (matrix - matrix.mT).norm() > tolerance:
            raise ValueError("Invalid matrix: not symmetric (the probes assume A = A^T)")
        self.matrix = matrix
        self.dim, self.dtype, self.device = matrix.shape[0], matrix.dtype, matrix.device

    def _matvec(self, v: torch.Tensor) -> torch.Tensor:
        return self.matrix @ v

    def __repr__(self) -> str:
        return f"DenseOperator(dim={self.dim}, dtype={self.dtype})"


def _batchnorm_as_affine(bn: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    r"""Forward hook: a BatchNorm in evaluation mode computed as the affine map it is,
    :math:`y = x\,s + (\beta - \mu s)` with :math:`s = \gamma/\sqrt{\sigma^2 + \epsilon}`
    (running mean :math:`\mu` and variance :math:`\sigma^2`; Ioffe & Szegedy, 2015, Alg. 2).

    The same function of the input and the weights, up to rounding; but a product and a sum
    are cheap to differentiate twice, where torch's batch-norm double backward, written for
    the batch statistics of training mode, made a Hessian-vector product of a small ResNet
    about 1.2x slower (benchmarks/README.md).
    """
    x = args[0]
    s = torch.rsqrt(bn.running_var + bn.eps)
    if bn.weight is not None:
        s = s * bn.weight
    shift = -bn.running_mean * s
    if bn.bias is not None:
        shift = shift + bn.bias
    shape = (1, -1) + (1,) * (x.dim() - 2)  # per channel: dimension 1 of (N, C, ...)
    return x * s.view(shape) + shift.view(shape)


@contextlib.contextmanager
def affine_batchnorm(model: nn.Module) -> Iterator[nn.Module]:
    """Inside the block, every BatchNorm of ``model`` that keeps running statistics computes
    its evaluation-mode output as an explicit affine map (:func:`_batchnorm_as_affine`); use
    it inside :func:`lsdl_lab._util.eval_mode`. The hooks are removed afterwards, also when
    the block raises."""
    hooks = [
        m.register_forward_hook(_batchnorm_as_affine)
        for m in model.modules()
        if isinstance(m, _BatchNorm) and m.running_mean is not None
    ]
    try:
        yield model
    finally:
        for h in hooks:
            h.remove()


def _trainable(model: nn.Module, params: Sequence[torch.Tensor] | None) -> list[torch.Tensor]:
    params = [p for p in model.parameters() if p.requires_grad] if params is None else params
    params = list(params)
    if not params:
        raise ValueError("Invalid params: no parameter requires a gradient")
    return params


def _names_of(model: nn.Module, params: Sequence[torch.Tensor]) -> list[str]:
    by_id = {id(p): name for name, p in model.named_parameters()}
    if any(id(p) not in by_id for p in params):
        raise ValueError("Invalid params: every tensor must be a parameter of the model")
    return [by_id[id(p)] for p in params]


class ParameterOperator(CurvatureOperator):
    r"""A curvature operator on a model's parameters, of the mean loss over ``batches``.

    ``batches`` is one ``(x, y)`` pair or an iterable of them (a list, a DataLoader's
    batches). The loss is the average over all examples,
    :math:`L = \sum_b \frac{n_b}{N}\,\texttt{loss\_fn}(\texttt{model}(x_b), y_b)`, assuming
    ``loss_fn`` averages over its batch (PyTorch's default ``reduction="mean"``). ``params``
    (default: every parameter that requires a gradient) are the coordinates; ``dim`` (also
    ``num_parameters``) counts their entries.

    ``matvec(v)`` takes a flat vector of ``dim`` entries, or a list of tensors shaped like
    ``params``, and returns the same kind. ``names`` are the parameters' names in the model
    (for ``torch.func.functional_call``). A subclass implements ``_product``, the product
    on such a list.
    """

    def __init__(
        self,
        model: nn.Module,
        loss_fn: LossFn,
        batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
        params: Sequence[torch.Tensor] | None = None,
    ):
        self.model, self.loss_fn = model, loss_fn
        self.batches, self.weights = weighted_batches(batches)
        self.params = _trainable(model, params)
        self.names = _names_of(model, self.params)
        self.dim = sum(p.numel() for p in self.params)
        self.dtype, self.device = self.params[0].dtype, self.params[0].device

    @property
    def num_parameters(self) -> int:
        return self.dim

    def _product(self, v: list[torch.Tensor]) -> list[torch.Tensor]:
        raise NotImplementedError(f"{type(self).__name__} does not implement _product")

    def _matvec(self, v: torch.Tensor) -> torch.Tensor:
        return flatten(self._product(unflatten(v, self.params)))

    def matvec(self, v):
        """A v, for a flat vector (returns a flat vector) or a list of tensors shaped like
        ``params`` (returns a list)."""
        if isinstance(v, torch.Tensor):
            return super().matvec(v)
        v = list(v)
        if [tuple(t.shape) for t in v] != [tuple(p.shape) for p in self.params]:
            raise ValueError(
                f"Invalid v: a list of {len(v)} tensors (expected {len(self.params)} tensors "
                "shaped like params, or a flat vector)"
            )
        self.products += 1
        return self._product(v)


class HessianOperator(ParameterOperator):
    r"""The Hessian of the mean loss over ``batches`` as a linear operator :math:`v \mapsto Hv`
    (the conventions of :class:`ParameterOperator`).

    The model is in **evaluation mode** while the loss is computed: BatchNorm uses its running
    statistics and dropout is off, so :math:`L` is a fixed function of the weights (the
    Hessian of a training-mode loss would change with every draw of dropout and would couple
    the examples of a batch through BatchNorm). Every submodule's mode is restored
    afterwards. While the operator builds its graphs, each such BatchNorm is computed as the
    affine map it is in evaluation mode, whose double backward is cheaper
    (:func:`affine_batchnorm`).

    ``method``:

    - ``"double_backward"`` (default, fastest): one ``create_graph`` gradient per batch is
      computed once and kept; each product is a backward pass through it,
      :math:`Hv = \nabla_w (g^\top v)`. Memory: the graphs of all batches. The operator is
      the Hessian at the weights it was built at: after a training step, build a new one.
    - ``"forward_over_reverse"``: ``torch.func.jvp`` of ``torch.func.grad``, recomputed for
      every product, one batch at a time. Memory: one batch.

    Unlike PyHessian 0.1 (Yao et al., 2020) the operator keeps the gradient graph it can
    reuse for every batch (not only for a single batch), restores the model's mode, runs on
    any device and works in the parameters' dtype (``model.double()`` for float64).
    """

    def __init__(
        self,
        model: nn.Module,
        loss_fn: LossFn,
        batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
        *,
        params: Sequence[torch.Tensor] | None = None,
        method: str = "double_backward",
    ):
        self.method = check_choice("method", method, METHODS)
        super().__init__(model, loss_fn, batches, params)
        if method == "double_backward":
            self._grads = self._gradient_graph()
            self._versions = [p._version for p in self.params]
        else:
            self._grad_fn = grad(self._batch_loss)

    def _gradient_graph(self) -> list[torch.Tensor]:
        """g = sum_b w_b grad L_b, kept with its graph so that every product reuses it."""
        total = None
        # enable_grad: the operator is often built inside an evaluation's torch.no_grad().
        with torch.enable_grad(), eval_mode(self.model), affine_batchnorm(self.model):
            for (x, y), w in zip(self.batches, self.weights):
                loss = w * self.loss_fn(self.model(x), y)
                g = torch.autograd.grad(
                    loss, self.params, create_graph=True, allow_unused=True, materialize_grads=True
                )
                total = list(g) if total is None else [t + gi for t, gi in zip(total, g)]
        return total

    def _batch_loss(self, params: tuple[torch.Tensor, ...], x, y) -> torch.Tensor:
        out = functional_call(self.model, dict(zip(self.names, params)), (x,))
        return self.loss_fn(out, y)

    def _product(self, v: list[torch.Tensor]) -> list[torch.Tensor]:
        if self.method == "double_backward":
            if [p._version for p in self.params] != self._versions:
                raise RuntimeError(
                    "The parameters changed after this HessianOperator was built; its kept "
                    "gradient graph belongs to the old weights: build a new operator"
                )
            # A gradient that does not depend on the weights (a linear loss) has no graph.
            pairs = [(g, vi) for g, vi in zip(self._grads, v) if g.requires_grad]
            if not pairs:
                return [torch.zeros_like(p) for p in self.params]
            return list(
                torch.autograd.grad(
                    [g for g, _ in pairs],
                    self.params,
                    grad_outputs=[vi for _, vi in pairs],
                    retain_graph=True,
                    allow_unused=True,
                    materialize_grads=True,
                )
            )
        primals = tuple(p.detach() for p in self.params)
        hv = [torch.zeros_like(p) for p in primals]
        with eval_mode(self.model), affine_batchnorm(self.model):
            for (x, y), w in zip(self.batches, self.weights):
                _, hv_b = jvp(partial(self._grad_fn, x=x, y=y), (primals,), (tuple(v),))
                torch._foreach_add_(hv, hv_b, alpha=w)
        return hv

    def __repr__(self) -> str:
        return (
            f"HessianOperator(num_parameters={self.dim}, method={self.method!r}, "
            f"batches={len(self.batches)}, dtype={self.dtype})"
        )


def hessian_matrix(
    model: nn.Module,
    loss_fn: LossFn,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    *,
    params: Sequence[torch.Tensor] | None = None,
) -> torch.Tensor:
    """The exact (P, P) Hessian of the same loss as :class:`HessianOperator` (small models).

    Computed independently of the operator, by ``torch.func.jacrev`` of ``torch.func.grad``
    of a function of the flat parameter vector (P products at once, vectorized).
    """
    batches, weights = weighted_batches(batches)
    params = _trainable(model, params)
    names = _names_of(model, params)

    def loss(flat, x, y):
        return loss_fn(functional_call(model, dict(zip(names, unflatten(flat, params))), (x,)), y)

    flat = flatten([p.detach() for p in params])
    with eval_mode(model):
        return sum(
            w * jacrev(grad(loss), chunk_size=256)(flat, x, y)
            for (x, y), w in zip(batches, weights)
        )
