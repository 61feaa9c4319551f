r"""Hessian probes: what a network's curvature looks like, from Hessian-vector products alone.

A network with :math:`P` parameters has a :math:`P\times P` Hessian
:math:`H = \nabla^2 L(w)`, far too large to form, but the product :math:`Hv` costs about two
gradients (Pearlmutter, 1994). Every probe here is a short function of that product, as in
PyHessian (Yao et al., 2020):

- :func:`top_eigenvalues`: power iteration with deflation, the sharpness :math:`\lambda_1`;
- :func:`lanczos` and :func:`lanczos_eigenvalues`: the Lanczos (1950) tridiagonalization and
  its Ritz values;
- :func:`trace`: Hutchinson's (1989) estimator :math:`\operatorname{tr}H = \mathbb E[v^\top Hv]`;
- :func:`spectral_density`: stochastic Lanczos quadrature (Golub & Meurant, 2010; Ghorbani,
  Krishnan & Xiao, 2019), the whole eigenvalue density.

Unlike PyHessian 0.1 the operator keeps the gradient graph it can reuse for every batch
(not only for a single batch), restores the model's mode, runs on any device, draws every
random vector from a seeded ``torch.Generator``, diagonalizes the tridiagonal matrix with
``eigh`` (real nodes and weights), and works in the parameters' dtype (``model.double()``
for float64).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from contextlib import contextmanager
from functools import partial
from typing import NamedTuple

import torch
from torch import nn
from torch.func import functional_call, grad, jacrev, jvp
from torch.nn.modules.batchnorm import _BatchNorm

__all__ = [
    "HessianOperator",
    "SpectralDensity",
    "hessian_matrix",
    "lanczos",
    "lanczos_eigenvalues",
    "spectral_density",
    "top_eigenvalues",
    "trace",
]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
METHODS = ("double_backward", "forward_over_reverse")


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


@contextmanager
def _eval_mode(model: nn.Module, affine_batchnorm: bool = False):
    """Evaluation mode inside the block; every submodule's own mode restored after it.

    With ``affine_batchnorm``, every BatchNorm that keeps running statistics computes its
    evaluation-mode function as an explicit affine map (:func:`_batchnorm_as_affine`).
    """
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    hooks = [
        m.register_forward_hook(_batchnorm_as_affine)
        for m in model.modules()
        if affine_batchnorm and isinstance(m, _BatchNorm) and m.running_mean is not None
    ]
    try:
        yield
    finally:
        for h in hooks:
            h.remove()
        for m, training in modes:
            m.training = training


def _check_int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"Invalid {name}: {value!r} (expected an int >= {minimum})")
    return value


def _batches_and_weights(batches) -> tuple[list, list[float]]:
    """``batches`` (one ``(x, y)`` pair, or an iterable of them) as a list, with the
    weight ``n_b / N`` of each in the mean loss."""
    if isinstance(batches, (tuple, list)) and len(batches) == 2 and torch.is_tensor(batches[0]):
        batches = [batches]  # a single (x, y) pair
    batches = list(batches)
    if not batches:
        raise ValueError("Invalid batches: empty (expected at least one (x, y) pair)")
    sizes = [len(x) for x, _ in batches]
    return batches, [n / sum(sizes) for n in sizes]


def _names_of(model: nn.Module, params: Sequence[torch.Tensor]) -> list[str]:
    by_id = {id(p): name for name, p in model.named_parameters()}
    if any(id(p) not in by_id for p in params):
        raise ValueError("Invalid params: every tensor must be a parameter of the model")
    return [by_id[id(p)] for p in params]


class HessianOperator:
    r"""The Hessian of the loss over ``batches`` as a linear operator :math:`v \mapsto Hv`.

    ``batches`` is one ``(x, y)`` pair or an iterable of them (a list, a DataLoader's
    batches). The loss is the average over all examples,
    :math:`L = \sum_b \frac{n_b}{N}\,\texttt{loss\_fn}(\texttt{model}(x_b), y_b)`, assuming
    ``loss_fn`` averages over its batch (PyTorch's default ``reduction="mean"``).

    The model is in **evaluation mode** while the loss is computed: BatchNorm uses its running
    statistics and dropout is off, so :math:`L` is a fixed function of the weights (the
    Hessian of a training-mode loss would change with every draw of dropout and would couple
    the examples of a batch through BatchNorm). The caller's mode is restored afterwards.
    While the operator builds its graphs, each such BatchNorm is computed as the affine map
    it is in evaluation mode, whose double backward is cheaper (:func:`_batchnorm_as_affine`).

    ``method``:

    - ``"double_backward"`` (default, fastest): one ``create_graph`` gradient per batch is
      computed once and kept; each product is a backward pass through it,
      :math:`Hv = \nabla_w (g^\top v)`. Memory: the graphs of all batches. The operator is
      the Hessian at the weights it was built at: after a training step, build a new one.
    - ``"forward_over_reverse"``: ``torch.func.jvp`` of ``torch.func.grad``, recomputed for
      every product, one batch at a time. Memory: one batch.

    ``H.matvec(v)`` (or ``H @ v``) takes a flat vector of ``num_parameters`` entries, or a
    list of tensors shaped like ``params``, and returns the same kind.
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
        if method not in METHODS:
            raise ValueError(f"Invalid method: {method!r} (expected one of {METHODS})")
        self.model, self.loss_fn, self.method = model, loss_fn, method
        self.batches, self.weights = _batches_and_weights(batches)
        if params is None:
            params = [p for p in model.parameters() if p.requires_grad]
        self.params = list(params)
        if not self.params:
            raise ValueError("Invalid params: no parameter requires a gradient")
        self.shapes = [p.shape for p in self.params]
        self.numels = [p.numel() for p in self.params]
        if method == "double_backward":
            self._grads = self._gradient_graph()
            self._versions = [p._version for p in self.params]
        else:
            self._names = _names_of(model, self.params)
            self._grad_fn = grad(self._batch_loss)

    @property
    def num_parameters(self) -> int:
        return sum(self.numels)

    @property
    def dtype(self) -> torch.dtype:
        return self.params[0].dtype

    @property
    def device(self) -> torch.device:
        return self.params[0].device

    def _gradient_graph(self) -> list[torch.Tensor]:
        """g = sum_b w_b grad L_b, kept with its graph so that every product reuses it."""
        total = None
        # enable_grad: the operator is often built inside an evaluation's torch.no_grad().
        with torch.enable_grad(), _eval_mode(self.model, affine_batchnorm=True):
            for (x, y), w in zip(self.batches, self.weights):
                loss = w * self.loss_fn(self.model(x), y)
                g = torch.autograd.grad(
                    loss, self.params, create_graph=True, allow_unused=True, materialize_grads=True
                )
                total = list(g) if total is None else [t + gi for t, gi in zip(total, g)]
        return total

    def _batch_loss(self, params: tuple[torch.Tensor, ...], x, y) -> torch.Tensor:
        out = functional_call(self.model, dict(zip(self._names, params)), (x,))
        return self.loss_fn(out, y)

    def _hvp(self, v: list[torch.Tensor]) -> list[torch.Tensor]:
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
        with _eval_mode(self.model, affine_batchnorm=True):
            for (x, y), w in zip(self.batches, self.weights):
                _, hv_b = jvp(partial(self._grad_fn, x=x, y=y), (primals,), (tuple(v),))
                torch._foreach_add_(hv, hv_b, alpha=w)
        return hv

    def matvec(self, v):
        """H v, for a flat vector (returns a flat vector) or a list of tensors (returns a list)."""
        if isinstance(v, torch.Tensor):
            if v.shape != (self.num_parameters,):
                raise ValueError(
                    f"Invalid v: shape {tuple(v.shape)} (expected ({self.num_parameters},))"
                )
            parts = [t.view(s) for t, s in zip(v.split(self.numels), self.shapes)]
            return torch.cat([h.reshape(-1) for h in self._hvp(parts)])
        return self._hvp(list(v))

    def __matmul__(self, v):
        return self.matvec(v)

    def __repr__(self) -> str:
        return (
            f"HessianOperator(num_parameters={self.num_parameters}, method={self.method!r}, "
            f"batches={len(self.batches)}, dtype={self.dtype})"
        )


def _generator(H: HessianOperator, seed: int) -> torch.Generator:
    return torch.Generator(device=H.device).manual_seed(seed)


def _rademacher(H: HessianOperator, gen: torch.Generator) -> torch.Tensor:
    v = torch.randint(0, 2, (H.num_parameters,), generator=gen, device=H.device)
    return (2 * v - 1).to(H.dtype)


def top_eigenvalues(
    H: HessianOperator, k: int = 1, iters: int = 100, tol: float = 1e-6, seed: int = 0
) -> tuple[list[float], list[torch.Tensor]]:
    r"""The k eigenvalues of largest magnitude by power iteration with deflation (as PyHessian).

    Repeat :math:`v \leftarrow Hv/\|Hv\|` (with :math:`v` kept orthogonal to the eigenvectors
    already found) until the Rayleigh quotient :math:`\lambda = v^\top Hv` changes by less than
    ``tol`` relative to itself, or for ``iters`` products. The error shrinks like
    :math:`|\lambda_{i+1}/\lambda_i|^{t}`, so close eigenvalues need many iterations; PyHessian's
    default ``tol=1e-3`` stops well before convergence. Returns eigenvalues and unit
    eigenvectors (flat).
    """
    _check_int("k", k, 1)
    _check_int("iters", iters, 1)
    if k > H.num_parameters:
        raise ValueError(f"Invalid k: {k} (the Hessian has only {H.num_parameters} eigenvalues)")
    gen = _generator(H, seed)
    values, vectors = [], []
    for _ in range(k):
        v = torch.randn(H.num_parameters, generator=gen, device=H.device, dtype=H.dtype)
        v /= v.norm()
        lam = None
        for _ in range(iters):
            for u in vectors:  # deflation: stay orthogonal to the eigenvectors found
                v -= (u @ v) * u
            v /= v.norm()
            Hv = H @ v
            lam_new = (v @ Hv).item()
            norm = Hv.norm()
            if norm == 0:  # v lies in the null space: eigenvalue 0
                lam = lam_new
                break
            v = Hv / norm
            converged = lam is not None and abs(lam_new - lam) <= tol * (abs(lam) + 1e-12)
            lam = lam_new
            if converged:
                break
        values.append(lam)
        vectors.append(v)
    return values, vectors


def _lanczos(H: HessianOperator, m: int, gen: torch.Generator):
    """Lanczos with full reorthogonalization from a Rademacher start; (alpha, beta, Q)."""
    m = min(m, H.num_parameters)
    Q = torch.zeros(m, H.num_parameters, dtype=H.dtype, device=H.device)
    q = _rademacher(H, gen)
    Q[0] = q / q.norm()
    alpha, beta = [], []
    for j in range(m):
        w = H @ Q[j]
        alpha.append((w @ Q[j]).item())
        if j == m - 1:
            break
        Hq_norm = w.norm()
        # Gram-Schmidt against every Lanczos vector, twice ("twice is enough"): in floating
        # point the three-term recurrence alone loses orthogonality and repeats Ritz values.
        for _ in range(2):
            w -= Q[: j + 1].T @ (Q[: j + 1] @ w)
        b = w.norm()
        if b <= torch.finfo(H.dtype).eps ** 0.5 * Hq_norm:
            # The Krylov space is invariant (exhausted): T splits into blocks. Go on from a
            # random direction orthogonal to it, with beta = 0 (the quadrature weights of the
            # new block are 0, its Ritz values are still eigenvalue estimates).
            b, w = torch.zeros(()), _rademacher(H, gen)
            for _ in range(2):
                w -= Q[: j + 1].T @ (Q[: j + 1] @ w)
        beta.append(b.item())
        Q[j + 1] = w / w.norm()
    return torch.tensor(alpha, dtype=torch.float64), torch.tensor(beta, dtype=torch.float64), Q


def lanczos(H: HessianOperator, m: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    r"""m steps of Lanczos (1950): the tridiagonal :math:`T = Q^\top H Q` of the Krylov space.

    From a random unit :math:`q_1` (Rademacher, normalized), :math:`\beta_j q_{j+1} =
    Hq_j - \alpha_j q_j - \beta_{j-1}q_{j-1}` with :math:`\alpha_j = q_j^\top Hq_j`; every new
    vector is reorthogonalized against all previous ones. Returns ``alpha`` (diagonal, length
    m) and ``beta`` (off-diagonal, length m - 1) in float64. ``m`` is capped at the number of
    parameters. If the Krylov space closes (an invariant subspace), Lanczos goes on from a
    new random direction with a zero ``beta``.
    """
    _check_int("m", m, 1)
    alpha, beta, _ = _lanczos(H, m, _generator(H, seed))
    return alpha, beta


def _tridiagonal(alpha: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    return torch.diag(alpha) + torch.diag(beta, 1) + torch.diag(beta, -1)


def lanczos_eigenvalues(
    H: HessianOperator, k: int = 1, m: int | None = None, seed: int = 0
) -> list[float]:
    """The k largest eigenvalues, approximated by the largest Ritz values of m Lanczos steps.

    Extreme eigenvalues converge first, in far fewer products than power iteration needs
    when the top eigenvalues are close. ``m`` defaults to ``max(40, 2 k)``.
    """
    _check_int("k", k, 1)
    m = max(40, 2 * k) if m is None else _check_int("m", m, 1)
    if k > min(m, H.num_parameters):
        raise ValueError(f"Invalid k: {k} (at most min(m, num_parameters) Ritz values)")
    alpha, beta = lanczos(H, m, seed)
    ritz = torch.linalg.eigvalsh(_tridiagonal(alpha, beta))
    return ritz.flip(0)[:k].tolist()


def trace(
    H: HessianOperator, samples: int = 100, seed: int = 0, distribution: str = "rademacher"
) -> tuple[float, float]:
    r"""Hutchinson's (1989) estimate of :math:`\operatorname{tr}H` and its standard error.

    For random :math:`v` with :math:`\mathbb E[vv^\top] = I`,
    :math:`\mathbb E[v^\top Hv] = \operatorname{tr}(H\,\mathbb E[vv^\top]) = \operatorname{tr}H`.
    Rademacher entries (:math:`\pm1`) give the smallest variance,
    :math:`2\sum_{i\ne j}H_{ij}^2`; Gaussian ones add :math:`2\sum_i H_{ii}^2`. Returns
    the mean of ``samples`` draws and the standard error of that mean.
    """
    _check_int("samples", samples, 2)
    if distribution not in ("rademacher", "gaussian"):
        raise ValueError(
            f"Invalid distribution: {distribution!r} (expected 'rademacher' or 'gaussian')"
        )
    gen = _generator(H, seed)
    vhv = []
    for _ in range(samples):
        if distribution == "rademacher":
            v = _rademacher(H, gen)
        else:
            v = torch.randn(H.num_parameters, generator=gen, device=H.device, dtype=H.dtype)
        vhv.append((v @ (H @ v)).item())
    vhv = torch.tensor(vhv, dtype=torch.float64)
    return vhv.mean().item(), (vhv.std() / math.sqrt(samples)).item()


class SpectralDensity(NamedTuple):
    """A smoothed eigenvalue density on a grid, and the quadrature it was smoothed from."""

    grid: torch.Tensor  # eigenvalue axis
    density: torch.Tensor  # integrates to 1 over grid (trapezoid rule)
    nodes: torch.Tensor  # Ritz values of every run, concatenated
    weights: torch.Tensor  # their quadrature weights, divided by runs: they sum to 1


def _gaussian(t: torch.Tensor, mean: torch.Tensor, sigma: float) -> torch.Tensor:
    return torch.exp(-0.5 * ((t - mean) / sigma) ** 2) / (sigma * math.sqrt(2 * math.pi))


def spectral_density(
    H: HessianOperator,
    runs: int = 1,
    m: int = 80,
    seed: int = 0,
    grid: torch.Tensor | None = None,
    sigma: float | None = None,
) -> SpectralDensity:
    r"""The eigenvalue density by stochastic Lanczos quadrature (Ghorbani et al., 2019).

    The density :math:`\phi(t) = \frac1P\sum_i\delta(t-\lambda_i)` is approached by
    :math:`v^\top f(H)v` for random unit :math:`v` (Hutchinson again). Lanczos started at
    :math:`v` gives :math:`T = U\Theta U^\top`; the Gauss quadrature of :math:`v`'s spectral
    measure (Golub & Meurant, 2010) has nodes :math:`\theta_j` and weights
    :math:`\tau_j = U_{1j}^2`, exact for polynomials of degree :math:`< 2m`. Averaging ``runs``
    quadratures and replacing each delta by a Gaussian of width ``sigma``,

    .. math:: \phi_\sigma(t) = \frac{1}{\text{runs}}\sum_{r}\sum_{j}\tau_{rj}\,
              \mathcal N(t;\,\theta_{rj},\sigma^2).

    ``sigma`` defaults to PyHessian's :math:`\sqrt{10^{-5}\max(1, \theta_{\max}-\theta_{\min})}`;
    the default grid reaches 5 sigma beyond the extreme nodes with a spacing of sigma / 4.
    The density is normalized to integrate to 1 over ``grid``.
    """
    _check_int("runs", runs, 1)
    _check_int("m", m, 1)
    gen = _generator(H, seed)
    nodes, weights = [], []
    for _ in range(runs):
        alpha, beta, _ = _lanczos(H, m, gen)
        theta, U = torch.linalg.eigh(_tridiagonal(alpha, beta))
        nodes.append(theta)
        weights.append(U[0].square() / runs)
    nodes, weights = torch.cat(nodes), torch.cat(weights)
    lo, hi = nodes.min().item(), nodes.max().item()
    if sigma is None:
        sigma = math.sqrt(1e-5 * max(1.0, hi - lo))
    elif not sigma > 0:
        raise ValueError(f"Invalid sigma: {sigma!r} (expected > 0)")
    if grid is None:
        points = min(100_000, max(1_000, math.ceil((hi - lo + 10 * sigma) / (sigma / 4))))
        grid = torch.linspace(lo - 5 * sigma, hi + 5 * sigma, points, dtype=torch.float64)
    grid = torch.as_tensor(grid, dtype=torch.float64)
    density = sum(  # a block of nodes at a time: the grid can be long
        _gaussian(grid[:, None], th, sigma) @ w
        for th, w in zip(nodes.split(256), weights.split(256))
    )
    density /= torch.trapezoid(density, grid)
    return SpectralDensity(grid, density, nodes, weights)


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
    batches, weights = _batches_and_weights(batches)
    if params is None:
        params = [p for p in model.parameters() if p.requires_grad]
    params = list(params)
    names, shapes = _names_of(model, params), [p.shape for p in params]
    numels = [p.numel() for p in params]

    def loss(flat, x, y):
        ps = [t.view(s) for t, s in zip(flat.split(numels), shapes)]
        return loss_fn(functional_call(model, dict(zip(names, ps)), (x,)), y)

    flat = torch.cat([p.detach().reshape(-1) for p in params])
    with _eval_mode(model):
        return sum(
            w * jacrev(grad(loss), chunk_size=256)(flat, x, y)
            for (x, y), w in zip(batches, weights)
        )
