"""Tests of lsdl_lab.curvature.operators: the operator protocol, HessianOperator on quadratics
and small networks against their exact Hessian, DenseOperator, the affine BatchNorm, and
bad input. The operators run on every device of the ``device`` fixture (matrices, models and
data made on the CPU from their seeds, then moved there); the bad-input tests stay on the
CPU."""

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers import Quadratic, cnn, mlp, quadratic_operator, scaled_loss, symmetric
from torch import nn

from lsdl_lab import curvature
from lsdl_lab.curvature import DenseOperator, HessianOperator, hessian_matrix

pytestmark = pytest.mark.filterwarnings(
    "ignore:`torch.jit.script` is deprecated:DeprecationWarning"  # inside torch.func.jvp
)
METHODS = ["double_backward", "forward_over_reverse"]
SPECTRUM = torch.tensor([12.0, 7.0, 4.0, 2.0, 1.0, 0.5, -0.25, -0.5], dtype=torch.float64)


# --- the protocol ---------------------------------------------------------------------------


def test_the_package_exports_its_modules_public_names():
    from lsdl_lab.curvature import conjugate_gradient, gauss_newton, operators, probes

    modules = (conjugate_gradient, gauss_newton, operators, probes)
    assert set(curvature.__all__) == set().union(*(m.__all__ for m in modules))
    assert all(hasattr(curvature, name) for name in curvature.__all__)


def test_dense_operator_is_its_matrix_and_counts_its_products(device):
    A = symmetric(SPECTRUM)[0].to(device)
    op = DenseOperator(A)
    assert isinstance(op, curvature.CurvatureOperator)
    assert (op.dim, op.shape, op.dtype, op.device) == (8, (8, 8), A.dtype, A.device)
    assert op.products == 0
    v = torch.randn(8, dtype=torch.float64).to(device)
    torch.testing.assert_close(op.matvec(v), A @ v)
    torch.testing.assert_close(op @ v, A @ v)
    assert op.products == 2
    assert "dim=8" in repr(op)


@pytest.mark.parametrize(
    "matrix, error, match",
    [
        ([[1.0, 0.0], [0.0, 1.0]], TypeError, "Invalid matrix: a list"),
        (torch.ones(3), ValueError, "Invalid matrix: a tensor of shape"),
        (torch.ones(2, 3), ValueError, "expected a square"),
        (torch.eye(3, dtype=torch.int64), ValueError, "expected a square floating-point"),
        (torch.tensor([[1.0, 2.0], [0.0, 1.0]]), ValueError, "not symmetric"),
    ],
)
def test_dense_operator_refuses_what_is_not_a_symmetric_matrix(matrix, error, match):
    with pytest.raises(error, match=match):
        DenseOperator(matrix)


def test_matvec_checks_its_vector():
    op = DenseOperator(torch.eye(4, dtype=torch.float64))
    with pytest.raises(TypeError, match="Invalid v: a list"):
        op.matvec([1.0, 2.0, 3.0, 4.0])
    with pytest.raises(ValueError, match=r"Invalid v: shape \(3,\) \(expected \(4,\)\)"):
        op @ torch.zeros(3, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"Invalid v: shape \(4, 1\)"):
        op @ torch.zeros(4, 1, dtype=torch.float64)
    assert op.products == 0  # refused vectors are not products


def test_a_subclass_needs_only_its_product(device):
    class Diagonal(curvature.CurvatureOperator):
        def __init__(self, d):
            self.d, self.dim, self.dtype, self.device = d, len(d), d.dtype, d.device

        def _matvec(self, v):
            return self.d * v

    op = Diagonal(torch.arange(1.0, 5.0, device=device))
    torch.testing.assert_close(
        op @ torch.ones(4, device=device), torch.arange(1.0, 5.0, device=device)
    )
    assert op.products == 1

    class Unfinished(curvature.CurvatureOperator):
        dim, dtype, device = 2, torch.float32, torch.device("cpu")

    with pytest.raises(NotImplementedError, match="Unfinished does not implement _matvec"):
        Unfinished() @ torch.ones(2)


# --- a quadratic with a known Hessian -------------------------------------------------------


@pytest.mark.parametrize("method", METHODS)
def test_quadratic_matvec_is_A_v_for_flat_and_list_vectors(method, device):
    A = symmetric(SPECTRUM)[0].to(device)
    H = quadratic_operator(A, method)
    assert (H.num_parameters, H.dim, H.dtype, H.device) == (8, 8, A.dtype, A.device)
    v = torch.randn(8, dtype=torch.float64).to(device)
    torch.testing.assert_close(H.matvec(v), A @ v)
    torch.testing.assert_close(H @ v, A @ v)
    (hv,) = H.matvec([v])
    torch.testing.assert_close(hv, A @ v)
    assert H.products == 3
    with pytest.raises(ValueError, match="Invalid v: a list of 2 tensors"):
        H.matvec([v, v])
    with pytest.raises(ValueError, match="Invalid v: a list of 1 tensors"):
        H.matvec([v[:3]])
    assert H.products == 3


@pytest.mark.parametrize("method", METHODS)
def test_batches_are_weighted_by_size(method, device):
    """Batches of 1 and 3 examples scaling the loss by 1 and 2: H = (1/4 + 3/4 * 2) A."""
    A = symmetric(SPECTRUM)[0].to(device)
    batches = [(torch.zeros(n, device=device), torch.full((n,), c, device=device))
               for n, c in ((1, 1.0), (3, 2.0))]  # fmt: skip
    H = HessianOperator(
        Quadratic(A, torch.randn(len(A), dtype=A.dtype)), scaled_loss, batches, method=method
    )
    v = torch.randn(8, dtype=torch.float64).to(device)
    torch.testing.assert_close(H @ v, 1.75 * (A @ v))


@pytest.mark.parametrize("method", METHODS)
def test_one_pair_is_one_batch_and_no_grad_around_the_operator_is_harmless(method, device):
    """A bare (x, y) pair means [(x, y)]; an operator built and used inside torch.no_grad()
    (as in an evaluation loop) still differentiates."""
    model, x, y = mlp(device=device)
    v = torch.randn(sum(p.numel() for p in model.parameters()), dtype=torch.float64).to(device)
    expected = HessianOperator(model, F.cross_entropy, [(x, y)], method=method) @ v
    with torch.no_grad():
        H = HessianOperator(model, F.cross_entropy, (x, y), method=method)
        hv = H @ v
    assert len(H.batches) == 1
    torch.testing.assert_close(hv, expected)
    torch.testing.assert_close(hv, hessian_matrix(model, F.cross_entropy, (x, y)) @ v)


def test_a_linear_loss_has_a_zero_hessian(device):
    """The kept gradient does not depend on the weights (no graph): H v = 0."""
    model = nn.Linear(3, 1, bias=False).to(device, torch.float64)
    x = torch.randn(5, 3, dtype=torch.float64).to(device)
    H = HessianOperator(model, lambda out, y: out.mean(), [(x, x)])
    ones, zeros = (f(3, dtype=torch.float64, device=device) for f in (torch.ones, torch.zeros))
    assert torch.equal(H @ ones, zeros)


# --- small networks against their exact Hessian ---------------------------------------------


@pytest.mark.parametrize("make", [mlp, cnn], ids=["mlp", "cnn"])
def test_network_matvec_matches_exact_hessian_and_methods_agree(make, device):
    model, x, y = make(device=device)
    model.train()
    state = copy.deepcopy(model.state_dict())
    batches = [(x[:10], y[:10]), (x[10:], y[10:])]  # uneven sizes
    exact = hessian_matrix(model, F.cross_entropy, batches)
    assert model.training
    one_batch = hessian_matrix(model, F.cross_entropy, [(x, y)])
    torch.testing.assert_close(exact, one_batch)
    torch.testing.assert_close(exact, exact.T)
    gen = torch.Generator().manual_seed(0)
    V = torch.randn(3, len(exact), generator=gen, dtype=torch.float64).to(device)
    for method in METHODS:
        H = HessianOperator(model, F.cross_entropy, batches, method=method)
        for v in V:
            torch.testing.assert_close(H @ v, exact @ v)
        assert model.training and all(m.training for m in model.modules())
    # eval mode did not touch BatchNorm's running statistics
    for k, t in model.state_dict().items():
        torch.testing.assert_close(t, state[k], msg=k)
    # the exact Hessian as an operator gives the same products
    torch.testing.assert_close(DenseOperator(exact) @ V[0], exact @ V[0])


def test_mixed_modes_are_restored_and_params_select_a_block(device):
    model, x, y = cnn(device=device)
    model.train()
    model[1].eval()
    last = list(model[6].parameters())
    H = HessianOperator(model, F.cross_entropy, [(x, y)], params=last)
    assert H.num_parameters == 39
    exact = hessian_matrix(model, F.cross_entropy, [(x, y)])
    block = hessian_matrix(model, F.cross_entropy, [(x, y)], params=last)
    torch.testing.assert_close(block, exact[-39:, -39:])
    v = torch.randn(39, dtype=torch.float64).to(device)
    torch.testing.assert_close(H @ v, exact[-39:, -39:] @ v)
    H2 = HessianOperator(
        model, F.cross_entropy, [(x, y)], params=last, method="forward_over_reverse"
    )
    torch.testing.assert_close(H2 @ v, H @ v)
    assert model.training and model[0].training and not model[1].training


@pytest.mark.parametrize("method", METHODS)
def test_modes_and_hooks_are_restored_when_the_loss_raises(method, device):
    model, x, y = cnn(device=device)
    model.train()
    model[1].eval()

    def failing(out, y):
        raise RuntimeError("a broken loss")

    with pytest.raises(RuntimeError, match="a broken loss"):
        if method == "double_backward":
            HessianOperator(model, failing, [(x, y)])
        else:
            HessianOperator(model, failing, [(x, y)], method=method) @ torch.zeros(
                sum(p.numel() for p in model.parameters()), dtype=torch.float64, device=device
            )
    assert model.training and model[0].training and not model[1].training
    assert not any(m._forward_hooks for m in model.modules())


def test_a_training_step_makes_a_kept_graph_stale_but_not_a_recomputed_one(device):
    model, x, y = mlp(device=device)
    H = HessianOperator(model, F.cross_entropy, [(x, y)])
    H_func = HessianOperator(model, F.cross_entropy, [(x, y)], method="forward_over_reverse")
    F.cross_entropy(model(x), y).backward()
    torch.optim.SGD(model.parameters(), lr=0.5).step()
    v = torch.randn(H.num_parameters, dtype=torch.float64).to(device)
    with pytest.raises(RuntimeError, match="build a new operator"):
        H @ v
    exact = hessian_matrix(model, F.cross_entropy, [(x, y)])
    torch.testing.assert_close(H_func @ v, exact @ v)


# Evaluation-mode BatchNorm computed as an explicit affine map (a speed change) must keep the
# operator equal to the exact Hessian for every kind of BatchNorm, and leave no hook.
@pytest.mark.parametrize(
    "layers,shape",
    [
        (lambda: [nn.Linear(5, 6), nn.BatchNorm1d(6, affine=False)], (20, 5)),
        (lambda: [nn.Linear(5, 6), nn.BatchNorm1d(6, track_running_stats=False)], (20, 5)),
        (lambda: [nn.Conv1d(2, 6, 3), nn.BatchNorm1d(6), nn.Flatten()], (20, 2, 3)),
        (lambda: [nn.Conv3d(1, 6, 2), nn.BatchNorm3d(6), nn.Flatten()], (20, 1, 2, 2, 2)),
    ],
    ids=["no-affine", "batch-statistics", "bn1d-on-sequences", "bn3d"],
)
def test_affine_batchnorm_keeps_the_exact_hessian(layers, shape, device):
    torch.manual_seed(0)
    model = nn.Sequential(*layers(), nn.Tanh(), nn.Linear(6, 3)).to(device, torch.float64)
    x, y = torch.randn(shape, dtype=torch.float64), torch.randint(3, (shape[0],))
    x, y = x.to(device), y.to(device)
    with torch.no_grad():
        for _ in range(3):
            model(1.3 * x + 0.2)  # running statistics that differ from the batch's
    exact = hessian_matrix(model, F.cross_entropy, [(x, y)])
    v = torch.randn(len(exact), dtype=torch.float64).to(device)
    for method in METHODS:
        H = HessianOperator(model, F.cross_entropy, [(x, y)], method=method)
        torch.testing.assert_close(H @ v, exact @ v)
    assert not any(m._forward_hooks for m in model.modules())
    assert model.training


def test_affine_batchnorm_is_the_evaluation_mode_function(device):
    model, x, _ = cnn(device=device)
    model.eval()
    with torch.no_grad():
        expected = model(x)
        with curvature.affine_batchnorm(model):
            assert len(model[1]._forward_hooks) == 1
            torch.testing.assert_close(model(x), expected)
    assert not model[1]._forward_hooks


# --- bad input -------------------------------------------------------------------------------


def test_bad_operator_arguments_are_named():
    model, x, y = mlp()
    with pytest.raises(ValueError, match="Invalid method:"):
        HessianOperator(model, F.cross_entropy, [(x, y)], method="finite_differences")
    with pytest.raises(ValueError, match="Invalid batches:"):
        HessianOperator(model, F.cross_entropy, [])
    with pytest.raises(ValueError, match="Invalid batches:"):
        hessian_matrix(model, F.cross_entropy, iter([]))
    with pytest.raises(ValueError, match="Invalid params:"):
        HessianOperator(
            model,
            F.cross_entropy,
            [(x, y)],
            params=[torch.zeros(2, requires_grad=True)],
            method="forward_over_reverse",
        )
    with pytest.raises(ValueError, match="Invalid params:"):
        HessianOperator(model, F.cross_entropy, [(x, y)], params=[])
    with pytest.raises(ValueError, match="Invalid params:"):
        hessian_matrix(model, F.cross_entropy, [(x, y)], params=[])
