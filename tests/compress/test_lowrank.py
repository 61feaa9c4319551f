import pytest
import torch

from lsdl_lab.compress import PowerSGD
from lsdl_lab.compress.lowrank import as_matrix, orthogonalize, worth_compressing


@pytest.mark.parametrize(("n", "m", "r"), [(20, 30, 1), (20, 30, 3), (8, 5, 5), (50, 4, 2)])
def test_exact_on_rank_r_matrices(n, m, r, device):
    a, b = torch.randn(n, r, dtype=torch.float64), torch.randn(r, m, dtype=torch.float64)
    matrix = (a @ b).to(device)
    powersgd = PowerSGD(r, seed=1)
    out = powersgd.decompress(powersgd.compress(matrix))
    assert torch.allclose(out, matrix, rtol=0, atol=1e-10 * matrix.abs().max())


def test_not_exact_above_its_rank_and_warm_start_reaches_the_best_approximation(device):
    torch.manual_seed(3)
    u, _ = torch.linalg.qr(torch.randn(30, 30, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(20, 20, dtype=torch.float64))
    sigma = torch.tensor([10.0, 5.0] + [0.5] * 18, dtype=torch.float64)
    matrix = (u[:, :20] @ torch.diag(sigma) @ v.T).to(device)
    best = sigma[2:].square().sum().sqrt()  # Eckart-Young: the rank-2 truncation's error
    powersgd = PowerSGD(2, seed=0)
    errors = [(powersgd.decompress(powersgd.compress(matrix)) - matrix).norm() for _ in range(8)]
    assert errors[0] > best * 1.001
    assert abs(errors[-1] - best) < 1e-6 * best  # the warm-started power iteration converged


def test_shapes_and_the_conv_weight_view(device):
    weight = torch.randn(8, 3, 3, 3).to(device)
    assert as_matrix(weight).shape == (8, 27)
    payload = PowerSGD(2).compress(weight)
    assert payload.p.shape == (8, 2) and payload.q.shape == (27, 2)
    assert payload.p.device.type == payload.q.device.type == device.type
    assert PowerSGD(2).decompress(payload).shape == weight.shape
    assert torch.allclose(payload.p.T @ payload.p, torch.eye(2, device=device), atol=1e-5)


def test_orthogonalize_a_zero_matrix_without_nan(device):
    q = orthogonalize(torch.zeros(5, 2, device=device))
    assert torch.allclose(q.T @ q, torch.eye(2, device=device))


def test_worth_compressing():
    assert worth_compressing(torch.Size([30, 20]), 2)
    assert not worth_compressing(torch.Size([30]), 1)
    assert not worth_compressing(torch.Size([1, 30]), 1)  # (1 + 30) * 1 > 30
    assert not worth_compressing(torch.Size([4, 4]), 2)  # (4 + 4) * 2 = 16, not < 16
