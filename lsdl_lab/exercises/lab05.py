"""Checkers of Lab 5, the generalization gap: the Hessian probes and Li et al.'s directions."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ..check import CheckFailed, check_function, exercise

HVP = Callable[[torch.Tensor], torch.Tensor]


def hutchinson_trace(hvp: HVP, num_params: int, samples: int, generator: torch.Generator) -> float:
    r"""Hutchinson's (1989) estimate of :math:`\operatorname{tr}H` from ``samples`` products:
    the mean of :math:`v^\top Hv` over Rademacher vectors :math:`v` (entries :math:`\pm1`
    with probability 1/2 each, so :math:`\mathbb E[vv^\top] = I`), drawn from ``generator``
    as ``2 * torch.randint(0, 2, (num_params,)) - 1`` in float32, the convention of
    :func:`lsdl_lab.curvature.trace` for a float32 network."""
    total = 0.0
    for _ in range(samples):
        v = (2 * torch.randint(0, 2, (num_params,), generator=generator) - 1).float()
        total += float(v @ hvp(v))
    return total / samples


def power_iteration_step(hvp: HVP, v: torch.Tensor) -> tuple[torch.Tensor, float]:
    r"""One step of power iteration from the unit vector ``v``: the Rayleigh quotient
    :math:`\lambda = v^\top Hv` and the next vector :math:`Hv / \|Hv\|`, as in
    :func:`lsdl_lab.curvature.top_eigenvalues`."""
    Hv = hvp(v)
    return Hv / Hv.norm(), float(v @ Hv)


def filter_normalize(direction: list[torch.Tensor], weights: list[torch.Tensor]) -> list:
    r"""Li et al.'s (2018, Section 4) filter normalization: each filter :math:`d_i` (a slice
    along dimension 0) of a tensor with two or more dimensions becomes
    :math:`d_i\,\|\theta_i\|/\|d_i\|`; tensors with fewer dimensions (biases, BatchNorm's
    parameters) become zero, as in :func:`lsdl_lab.landscape.random_direction`."""
    out = []
    for d, w in zip(direction, weights):
        if w.dim() <= 1:
            out.append(torch.zeros_like(d))
            continue
        shape = (-1,) + (1,) * (w.dim() - 1)
        out.append(d * (w.flatten(1).norm(dim=1) / d.flatten(1).norm(dim=1)).view(shape))
    return out


# -- cases --------------------------------------------------------------------------------


def _symmetric(n: int, gen: torch.Generator, shift: float = 0.0) -> torch.Tensor:
    A = torch.randn(n, n, generator=gen, dtype=torch.float64)
    return (A + A.T) / 2 + shift * torch.eye(n, dtype=torch.float64)


class _CountingHVP:
    """v -> A v (computed in A's dtype, returned in v's) that records every vector it is
    given, so that a checker can see what the student probes with."""

    def __init__(self, A: torch.Tensor):
        self.A, self.vectors = A, []

    def __call__(self, v: torch.Tensor) -> torch.Tensor:
        self.vectors.append(v.detach().clone())
        return (self.A @ v.to(self.A.dtype)).to(v.dtype)


def _call_hutchinson(student_fn, A: torch.Tensor, samples: int, seed: int):
    hvp = _CountingHVP(A)
    gen = torch.Generator().manual_seed(seed)
    try:
        value = student_fn(hvp, A.shape[0], samples, gen)
    except NotImplementedError:
        raise
    except Exception as exc:
        raise CheckFailed(
            f"hutchinson_trace raised {type(exc).__name__}: {exc} (on a {A.shape[0]}x"
            f"{A.shape[0]} matrix with samples={samples})"
        ) from exc
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise CheckFailed(
                f"hutchinson_trace returned a tensor of shape {tuple(value.shape)}; expected "
                "one number, the mean of v^T H v over the samples"
            )
        value = value.item()
    return float(value), hvp.vectors


def _check_probes(vectors: list[torch.Tensor], samples: int, n: int) -> None:
    if len(vectors) != samples:
        raise CheckFailed(
            f"hutchinson_trace called hvp {len(vectors)} times with samples={samples}\n"
            "  hint: one Hessian-vector product per sample, no more (each costs two gradients)"
        )
    for v in vectors:
        if v.shape != (n,):
            raise CheckFailed(f"hvp got a vector of shape {tuple(v.shape)}, expected ({n},)")
        if not bool((v.abs() == 1).all()):
            raise CheckFailed(
                "the probe vectors are not Rademacher: an entry is "
                f"{v[(v.abs() != 1).nonzero()[0]].item():.4g}\n"
                "  hint: entries +1 or -1 with probability 1/2, e.g. "
                "2 * torch.randint(0, 2, (n,), generator=generator) - 1; Gaussian vectors are "
                "also unbiased but have a larger variance (exact only for Rademacher on a "
                "diagonal matrix)"
            )
    if samples >= 8 and len({tuple(v.tolist()) for v in vectors}) == 1:
        raise CheckFailed(
            "every probe vector is the same\n  hint: draw a new v for each sample, from generator"
        )


@exercise("lab05.hutchinson_trace")
def check_hutchinson_trace(student_fn) -> None:
    gen = torch.Generator().manual_seed(51)
    # Diagonal matrices: v^T D v = sum_i D_ii v_i^2 = tr D for every Rademacher v, so each
    # sample, and the mean, is exact (negative entries: a Hessian away from a minimum).
    for n, samples in [(5, 3), (40, 10), (1, 4), (200, 2)]:
        D = torch.diag(torch.randn(n, generator=gen, dtype=torch.float64) * 3 + 1)
        value, vectors = _call_hutchinson(student_fn, D, samples, seed=n)
        _check_probes(vectors, samples, n)
        exact = torch.trace(D).item()
        tol = 1e-5 * D.abs().sum().item()  # float32 probes round at about 1e-7
        if abs(value - exact) > tol:
            hint = ""
            if abs(value - samples * exact) <= samples * tol:
                hint = "\n  hint: that is samples times the trace: the mean, not the sum"
            elif abs(value - exact / n) <= tol:
                hint = "\n  hint: that is the trace divided by the dimension: no 1/n here"
            raise CheckFailed(
                f"on a diagonal {n}x{n} matrix with trace {exact:.6g}, where every Rademacher "
                f"sample is exact, hutchinson_trace returned {value:.6g}{hint}"
            )
    # A dense matrix: the estimate is random, with variance 2 sum_{i != j} A_ij^2 / samples.
    A = _symmetric(30, gen, shift=2.0)
    samples = 400
    value, vectors = _call_hutchinson(student_fn, A, samples, seed=52)
    _check_probes(vectors, samples, 30)
    off = A - torch.diag(torch.diag(A))
    stderr = math.sqrt(2 * off.square().sum().item() / samples)
    exact = torch.trace(A).item()
    if abs(value - exact) > 5 * stderr:
        raise CheckFailed(
            f"on a dense 30x30 matrix with trace {exact:.4g}, {samples} samples gave "
            f"{value:.4g}, {abs(value - exact) / stderr:.1f} standard errors away (the "
            "estimator's standard error is sqrt(2 sum_(i!=j) A_ij^2 / samples) = "
            f"{stderr:.3g})\n  hint: average v @ hvp(v) over the samples"
        )
    # The same generator convention as lsdl_lab.curvature.trace gives the same numbers.
    same = _call_hutchinson(student_fn, A, 50, seed=53)[0]
    reference = hutchinson_trace(_CountingHVP(A), 30, 50, torch.Generator().manual_seed(53))
    note = (
        "the same draws as lsdl_lab.curvature.trace"
        if math.isclose(same, reference, rel_tol=1e-9, abs_tol=1e-9)
        else "other draws than lsdl_lab.curvature.trace (fine: the estimate is still right)"
    )
    print(
        f"✔ hutchinson_trace: exact on 4 diagonal matrices; {value:.4g} vs trace {exact:.4g} "
        f"(±{stderr:.2g}) on a dense one; {note}"
    )


def _power_cases() -> list:
    gen = torch.Generator().manual_seed(54)
    cases = []
    for A in [
        torch.diag(torch.tensor([5.0, 2.0, 1.0, 0.5], dtype=torch.float64)),
        _symmetric(6, gen),  # indefinite: negative eigenvalues too
        _symmetric(12, gen, shift=4.0),
        torch.diag(torch.tensor([-3.0, 1.0], dtype=torch.float64)),
    ]:
        for _ in range(2):
            v = torch.randn(A.shape[0], generator=gen, dtype=torch.float64)
            cases.append((_CountingHVP(A), v / v.norm()))
    return cases


@exercise("lab05.power_iteration_step")
def check_power_iteration_step(student_fn) -> None:
    cases = _power_cases()
    try:
        check_function(student_fn, power_iteration_step, cases, rtol=1e-6, atol=1e-9)
    except CheckFailed as failure:
        hint = ""
        try:
            hvp, v = cases[0]
            vector = student_fn(hvp, v.clone())[0]
            if abs(float(torch.as_tensor(vector).norm()) - 1) > 1e-6:
                hint = "\n  hint: the next vector must be a unit vector, Hv / ||Hv||"
        except Exception:  # the diagnosis is a courtesy: the failure above is the message
            pass
        raise CheckFailed(str(failure) + hint) from None
    # Iterated, the step converges to the eigenvalue of largest magnitude.
    gen = torch.Generator().manual_seed(55)
    Q, _ = torch.linalg.qr(torch.randn(20, 20, generator=gen, dtype=torch.float64))
    eigenvalues = torch.cat([torch.tensor([10.0, -4.0, 3.0]), torch.rand(17, generator=gen)])
    A = Q @ torch.diag(eigenvalues.double()) @ Q.T
    v = torch.randn(20, generator=gen, dtype=torch.float64)
    v = v / v.norm()
    for _ in range(60):
        v, lam = student_fn(_CountingHVP(A), v)
    if not math.isclose(float(lam), 10.0, rel_tol=1e-6):
        raise CheckFailed(
            f"60 steps on a matrix whose largest eigenvalue is 10 (next -4) ended at "
            f"{float(lam):.6g}\n  hint: return Hv / ||Hv|| as the next vector"
        )
    print("✔ power_iteration_step: all cases match; 60 steps converge to λ_max = 10")


def _directions() -> list:
    gen = torch.Generator().manual_seed(56)
    shapes = [(4, 3, 3, 3), (4,), (4,), (10, 4), (10,), (6, 2, 1, 1)]
    weights = [torch.randn(s, generator=gen) for s in shapes]
    weights[0][1] *= 5  # filters of very different norms: normalization must be per filter
    weights[3][2] *= 0.01
    cases = []
    for scale in (1.0, 100.0):
        direction = [scale * torch.randn(s, generator=gen) for s in shapes]
        cases.append((direction, weights))
    return cases


def _diagnose_filter_normalize(student_fn) -> str:
    direction, weights = _directions()[0]
    got = student_fn([d.clone() for d in direction], [w.clone() for w in weights])
    d, w, g = direction[0], weights[0], got[0]
    if g.shape == d.shape and torch.allclose(g.norm(), w.norm(), rtol=1e-4):
        per_filter = g.flatten(1).norm(dim=1)
        if not torch.allclose(per_filter, w.flatten(1).norm(dim=1), rtol=1e-4):
            return (
                "\n  hint: the whole tensor has the weights' norm, but each filter (each slice "
                "d[i] along dimension 0) should have the norm of the weights' filter w[i]"
            )
    if len(got) > 1 and got[1].abs().sum() > 0:
        return (
            "\n  hint: one-dimensional tensors (biases, BatchNorm weights) are set to zero, "
            "as Li et al. do with ignore='biasbn'"
        )
    return ""


@exercise("lab05.filter_normalize")
def check_filter_normalize(student_fn) -> None:
    try:
        check_function(student_fn, filter_normalize, _directions(), rtol=1e-5, atol=1e-6)
    except CheckFailed as failure:
        try:
            hint = _diagnose_filter_normalize(student_fn)
        except Exception:  # the diagnosis is a courtesy: the failure above is the message
            hint = ""
        raise CheckFailed(str(failure) + hint) from None
    # Against the library: random_direction's raw Gaussian, normalized by the student's
    # function, is random_direction's filter-normalized direction for the same seed.
    from ..landscape import random_direction
    from ..models import ResNet

    torch.manual_seed(57)
    model = ResNet(8, 4, 10, 1)
    weights = [p.detach() for p in model.parameters()]
    raw = random_direction(model, seed=3, filter_normalize=False)
    mine = student_fn(raw, weights)
    check_function(
        lambda: list(mine),
        lambda: random_direction(model, seed=3),
        [()],
        name="filter_normalize on a ResNet's parameters",
        rtol=1e-5,
        atol=1e-6,
    )
    print("✔ filter_normalize: all cases match, and so does landscape.random_direction")
