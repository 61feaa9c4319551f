"""What tests in several folders share: small models with known Hessians, a tiny MLP and a
tiny CNN (the curvature and landscape tests; each made on the CPU from its seed, the same
numbers everywhere, and moved to ``device``, default the CPU), and the comparison of two
nested states (:func:`assert_same_tree`: optimizer states, checkpoints)."""

import torch
from torch import nn


class Quadratic(nn.Module):
    """L(x) = 1/2 x^T A x, whose Hessian is A wherever x is (x starts at ``x0``, else 0), on
    A's device."""

    def __init__(self, A: torch.Tensor, x0: torch.Tensor | None = None):
        super().__init__()
        self.register_buffer("A", A)
        x = torch.zeros(len(A), dtype=A.dtype) if x0 is None else x0.clone()
        self.x = nn.Parameter(x.to(A.device))

    def forward(self, inputs):
        return 0.5 * self.x @ self.A @ self.x


def symmetric(eigenvalues: torch.Tensor, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, Q): a float64 symmetric matrix A = Q diag(eigenvalues) Q^T, Q a random rotation."""
    gen = torch.Generator().manual_seed(seed)
    n = len(eigenvalues)
    Q, _ = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))
    return Q @ torch.diag(eigenvalues) @ Q.T, Q


def cnn(seed=0, dtype=torch.float64, device="cpu"):
    """A tiny CNN with BatchNorm (its running statistics set by a few batches) and dropout,
    with 24 examples of data."""
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Conv2d(1, 3, 3),
        nn.BatchNorm2d(3),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(2),
        nn.Flatten(),
        nn.Dropout(0.5),
        nn.Linear(12, 3),
    ).to(dtype)
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(24, 1, 6, 6, generator=gen, dtype=dtype)
    y = torch.randint(3, (24,), generator=gen)
    with torch.no_grad():
        for _ in range(3):
            model(1.5 * x + 0.3)
    return model.to(device), x.to(device), y.to(device)


def scaled_loss(out, y):
    """A "loss" that scales the model's output (a Quadratic's L) by the batch's mean label."""
    return y.mean() * out


def quadratic_operator(A: torch.Tensor, method: str = "double_backward"):
    """The HessianOperator of a Quadratic with matrix A (its Hessian is A), from a random x
    (drawn on the CPU), on A's device."""
    from lsdl_lab.curvature import HessianOperator

    batch = (torch.zeros(1, device=A.device), torch.ones(1, dtype=A.dtype, device=A.device))
    model = Quadratic(A, torch.randn(len(A), dtype=A.dtype))
    return HessianOperator(model, scaled_loss, [batch], method=method)


def mlp(seed=0, dtype=torch.float64, device="cpu"):
    """A 6-8-3 tanh MLP (83 parameters) with 40 examples of 3 classes."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).to(dtype)
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(40, 6, generator=gen, dtype=dtype)
    y = torch.randint(3, (40,), generator=gen)
    return model.to(device), x.to(device), y.to(device)


def assert_same_tree(a, b, where: str = "state", tolerance: dict | None = None) -> None:
    """``a`` and ``b`` are the same nested state (dicts, lists, tuples, tensors, numbers), key
    for key and type for type: tensors of one dtype and shape, equal bit for bit, or within
    ``tolerance[dtype]`` (keyword arguments of :func:`torch.testing.assert_close`) for the
    dtypes it names; other values equal. NaN equals NaN. A failure names the path
    (``where/key[i]``)."""
    assert type(a) is type(b), f"{where}: {type(a).__name__} against {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape) == (b.dtype, b.shape), (
            f"{where}: {a.dtype} {a.shape} against {b.dtype} {b.shape}"
        )
        close = (tolerance or {}).get(a.dtype, dict(rtol=0.0, atol=0.0))
        torch.testing.assert_close(a, b, **close, equal_nan=True, msg=lambda m: f"{where}: {m}")
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), f"{where}: keys {list(a)} against {list(b)}"
        for key in a:
            assert_same_tree(a[key], b[key], f"{where}/{key}", tolerance)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where}: {len(a)} items against {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_tree(x, y, f"{where}[{i}]", tolerance)
    else:
        assert a == b or (a != a and b != b), f"{where}: {a!r} against {b!r}"
