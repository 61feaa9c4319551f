"""The checkers of Lab 5 accept the reference solutions and reject the usual mistakes,
naming them."""

from __future__ import annotations

import pytest
import torch

from lsdl_lab import check
from lsdl_lab.exercises import lab05


@pytest.mark.parametrize("name", ["hutchinson_trace", "power_iteration_step", "filter_normalize"])
def test_reference_passes(name, capsys):
    check.checker(f"lab05.{name}")(getattr(lab05, name))
    assert "✔" in capsys.readouterr().out


def _rademacher(n, generator):
    return (2 * torch.randint(0, 2, (n,), generator=generator) - 1).float()


def gaussian_probes(hvp, num_params, samples, generator):
    vs = [torch.randn(num_params, generator=generator) for _ in range(samples)]
    return sum(float(v @ hvp(v)) for v in vs) / samples


def sum_not_mean(hvp, num_params, samples, generator):
    vs = [_rademacher(num_params, generator) for _ in range(samples)]
    return sum(float(v @ hvp(v)) for v in vs)


def one_probe_reused(hvp, num_params, samples, generator):
    v = _rademacher(num_params, generator)
    return sum(float(v @ hvp(v)) for _ in range(samples)) / samples


def too_many_products(hvp, num_params, samples, generator):
    vs = [_rademacher(num_params, generator) for _ in range(samples)]
    return sum(float(v @ hvp(v)) + 0 * hvp(v).sum().item() for v in vs) / samples


def unnormalized_step(hvp, v):
    Hv = hvp(v)
    return Hv, float(v @ Hv)


def quotient_of_new_vector(hvp, v):
    Hv = hvp(v)
    u = Hv / Hv.norm()
    return u, float(u @ hvp(u))


def whole_tensor_norm(direction, weights):
    return [
        torch.zeros_like(d) if w.dim() <= 1 else d * w.norm() / d.norm()
        for d, w in zip(direction, weights)
    ]


def biases_kept(direction, weights):
    out = lab05.filter_normalize(direction, weights)
    return [d.clone() if w.dim() <= 1 else o for d, w, o in zip(direction, weights, out)]


def columns_not_rows(direction, weights):
    out = []
    for d, w in zip(direction, weights):
        if w.dim() <= 1:
            out.append(torch.zeros_like(d))
        else:
            dims = tuple(range(w.dim() - 1))  # norms over all but the last dimension
            out.append(d * w.norm(dim=dims, keepdim=True) / d.norm(dim=dims, keepdim=True))
    return out


@pytest.mark.parametrize(
    "name, wrong, message",
    [
        ("hutchinson_trace", gaussian_probes, "not Rademacher"),
        ("hutchinson_trace", sum_not_mean, "the mean, not the sum"),
        ("hutchinson_trace", one_probe_reused, "every probe vector is the same"),
        ("hutchinson_trace", too_many_products, "called hvp"),
        ("power_iteration_step", unnormalized_step, "unit vector"),
        ("power_iteration_step", quotient_of_new_vector, "does not match"),
        ("filter_normalize", whole_tensor_norm, "each filter"),
        ("filter_normalize", biases_kept, "set to zero"),
        ("filter_normalize", columns_not_rows, "does not match"),
    ],
)
def test_mistakes_are_caught_and_named(name, wrong, message):
    with pytest.raises(check.CheckFailed, match=message):
        check.checker(f"lab05.{name}")(wrong)


def test_hutchinson_reference_matches_the_library():
    # The reference draws exactly what lsdl_lab.curvature.trace draws for a float32 operator.
    from lsdl_lab import curvature, models

    torch.manual_seed(0)
    model = models.MLP(4, 3, hidden=5, depth=1)
    x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
    H = curvature.HessianOperator(model, torch.nn.functional.cross_entropy, [(x, y)])
    gen = torch.Generator().manual_seed(7)
    mine = lab05.hutchinson_trace(H.matvec, H.num_parameters, 10, gen)
    assert mine == pytest.approx(curvature.trace(H, samples=10, seed=7)[0], rel=1e-6)
