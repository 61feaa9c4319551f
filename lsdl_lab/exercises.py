"""The labs' exercise checkers: a reference solution and test cases for each exercise.

A lab calls ``check.checker("lab01.top_k_accuracy")(top_k_accuracy)``; the checker runs
the student's function beside the reference below on every case and explains any
difference (:func:`lsdl_lab.check.check_function`). Cases are built from fixed seeds, so
every student sees the same ones.
"""

from __future__ import annotations

import torch
from torch import nn

from .check import check_function, exercise

# ---------------------------------------------------------------------------------------
# Lab 1, getting started


def top_k_accuracy(logits: torch.Tensor, labels: torch.Tensor, k: int = 1) -> float:
    """Fraction of rows whose label is among the k largest logits."""
    top = logits.topk(k, dim=1).indices
    return (top == labels[:, None]).any(dim=1).float().mean().item()


def _logit_cases():
    gen = torch.Generator().manual_seed(1)
    cases = []
    for n, classes, k in [(8, 10, 1), (50, 10, 3), (7, 4, 2), (32, 100, 5), (5, 3, 3)]:
        logits = torch.randn(n, classes, generator=gen)
        labels = torch.randint(classes, (n,), generator=gen)
        cases.append({"logits": logits, "labels": labels, "k": k})
    return cases


@exercise("lab01.top_k_accuracy")
def check_top_k_accuracy(student_fn) -> None:
    check_function(student_fn, top_k_accuracy, _logit_cases())


def training_state_bytes(model: nn.Module, states_per_parameter: int) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state (``states_per_parameter``
    tensors the size of each parameter, e.g. 1 for momentum SGD, 2 for Adam)."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return {
        "parameters": params,
        "gradients": params,
        "optimizer_state": states_per_parameter * params,
    }


@exercise("lab01.training_state_bytes")
def check_training_state_bytes(student_fn) -> None:
    torch.manual_seed(0)
    cases = [
        (nn.Linear(10, 3), 1),
        (nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)), 2),
        (nn.Conv2d(3, 16, 3).double(), 2),
        (nn.Linear(5, 5).half(), 0),
    ]
    check_function(student_fn, training_state_bytes, cases)


# ---------------------------------------------------------------------------------------
# Lab 2, gradient noise


def trace_covariance(per_example_grads: torch.Tensor) -> float:
    r"""tr Σ of the rows of an (N, P) matrix of per-example gradients:
    :math:`\frac1N \sum_i \|G_i - \bar G\|^2`, the data set's own covariance (divided by N)."""
    G = per_example_grads
    return (G - G.mean(dim=0)).square().sum(dim=1).mean().item()


def _gradient_matrices():
    gen = torch.Generator().manual_seed(2)
    cases = []
    # (N, P, spread, offset): a gradient-like matrix has rows spread widely around a small
    # mean; one row (nothing to spread), identical rows, and a float64 case are edge cases.
    for n, p, spread, offset in [
        (16, 10, 1.0, 0.1),
        (100, 7, 0.3, 0.5),
        (7, 300, 2.0, 0.0),
        (2, 3, 1.0, 1.0),
        (1, 5, 1.0, 0.2),
        (64, 33, 1e-3, 0.0),
    ]:
        mean = offset * torch.randn(p, generator=gen)
        cases.append((mean + spread * torch.randn(n, p, generator=gen),))
    cases.append((torch.ones(5, 4) * torch.arange(4.0),))  # every row the same: tr Σ = 0
    cases.append((torch.randn(40, 6, generator=gen, dtype=torch.float64),))
    return cases


@exercise("lab02.trace_covariance")
def check_trace_covariance(student_fn) -> None:
    check_function(student_fn, trace_covariance, _gradient_matrices(), rtol=1e-4, atol=1e-7)


def predicted_variance(
    trace_cov: float, batch_size: int, n: int, replacement: bool = True
) -> float:
    """E||g_B - g||² for batches of ``batch_size`` of ``n`` (>= 2) examples: tr Σ / B, times
    the finite-population correction (n - B) / (n - 1) when drawn without replacement."""
    variance = trace_cov / batch_size
    if not replacement:
        variance *= (n - batch_size) / (n - 1)
    return variance


@exercise("lab02.predicted_variance")
def check_predicted_variance(student_fn) -> None:
    gen = torch.Generator().manual_seed(3)
    trace = [round(1 + 9 * torch.rand(1, generator=gen).item(), 3) for _ in range(4)]
    cases = [
        (trace[0], 1, 256, True),
        (trace[0], 1, 256, False),  # one example: the correction is 1
        (trace[0], 256, 256, True),
        (trace[0], 256, 256, False),  # the whole data set: no noise
        (trace[1], 64, 100, False),
        (trace[1], 64, 100, True),
        (trace[2], 1, 2, False),
        (trace[2], 2, 2, False),
        (trace[3], 3, 1000, False),
        (0.0, 4, 10, False),
        {"trace_cov": trace[3], "batch_size": 16, "n": 50},  # replacement by default
    ]
    check_function(student_fn, predicted_variance, cases)


# ---------------------------------------------------------------------------------------
# Lab 3, gradient-descent optimizers


def momentum_step(
    w: torch.Tensor, g: torch.Tensor, buf: torch.Tensor | None, lr: float, momentum: float
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Heavy-ball momentum in torch.optim's form: :math:`b \leftarrow \mu b + g`,
    :math:`w \leftarrow w - \eta b`; ``buf`` is None on the first step (then :math:`b = g`)."""
    buf = g.clone() if buf is None else momentum * buf + g
    return w - lr * buf, buf


def nesterov_step(
    w: torch.Tensor, g: torch.Tensor, buf: torch.Tensor | None, lr: float, momentum: float
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Nesterov momentum in torch.optim's form: :math:`b \leftarrow \mu b + g`,
    :math:`w \leftarrow w - \eta (g + \mu b)`; ``buf`` is None on the first step."""
    buf = g.clone() if buf is None else momentum * buf + g
    return w - lr * (g + momentum * buf), buf


def adam_step(
    w: torch.Tensor,
    g: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    t: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    r"""Adam's step t (t = 1 first, m and v zero before it), with bias correction:
    :math:`w \leftarrow w - \eta\, \hat m / (\sqrt{\hat v} + \epsilon)`."""
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    m_hat = m / (1 - beta1**t)
    v_hat = v / (1 - beta2**t)
    return w - lr * m_hat / (v_hat.sqrt() + eps), m, v


def _momentum_cases(seed: int) -> list:
    gen = torch.Generator().manual_seed(seed)
    cases = []
    # (shape, lr, momentum, first step?): first steps (buf None), a scalar, a matrix, zero
    # momentum (plain SGD), large momentum, and a float64 case.
    for shape, lr, mu, first, dtype in [
        ((5,), 0.1, 0.9, True, torch.float32),
        ((5,), 0.1, 0.9, False, torch.float32),
        ((), 0.5, 0.5, False, torch.float32),
        ((3, 4), 0.01, 0.99, True, torch.float32),
        ((3, 4), 0.01, 0.99, False, torch.float32),
        ((7,), 0.3, 0.0, False, torch.float32),
        ((2, 3), 1e-3, 0.9, False, torch.float64),
    ]:
        w = torch.randn(shape, generator=gen, dtype=dtype)
        g = torch.randn(shape, generator=gen, dtype=dtype)
        buf = None if first else torch.randn(shape, generator=gen, dtype=dtype)
        cases.append((w, g, buf, lr, mu))
    return cases


def _rollout_against(student_fn, make_optimizer, name: str, steps: int = 6) -> None:
    """Run the student's step function and the library's optimizer on the same gradients
    (those of a fixed quadratic at the current weights) and compare the weights."""
    from .check import CheckFailed

    gen = torch.Generator().manual_seed(30)
    A = torch.randn(4, 4, generator=gen, dtype=torch.float64)
    A = A @ A.T / 4 + torch.eye(4, dtype=torch.float64)
    w0 = torch.randn(4, generator=gen, dtype=torch.float64)
    p = w0.clone().requires_grad_()
    opt = make_optimizer([p])
    w, state = w0.clone(), None
    for step in range(1, steps + 1):
        g = A @ w
        w, state = student_fn(w, g, state, step)
        p.grad = A @ p.detach()
        opt.step()
        if not torch.allclose(w, p.detach(), rtol=1e-9, atol=1e-12):
            raise CheckFailed(
                f"{name} matches the reference case by case, but {steps} steps of it differ "
                f"from {type(opt).__name__} at step {step}: weights {w.tolist()} instead of "
                f"{p.detach().tolist()}\n  hint: return the new buffer and pass it back in"
            )


@exercise("lab03.momentum_step")
def check_momentum_step(student_fn) -> None:
    from .optim import SGD

    check_function(student_fn, momentum_step, _momentum_cases(31))

    def step(w, g, buf, t):
        return student_fn(w, g, buf, 0.05, 0.9)

    _rollout_against(step, lambda params: SGD(params, lr=0.05, momentum=0.9), "momentum_step")
    print("✔ momentum_step: 6 steps equal lsdl_lab.optim.SGD(momentum=0.9)")


@exercise("lab03.nesterov_step")
def check_nesterov_step(student_fn) -> None:
    from .optim import SGD

    check_function(student_fn, nesterov_step, _momentum_cases(32))

    def step(w, g, buf, t):
        return student_fn(w, g, buf, 0.05, 0.9)

    _rollout_against(
        step, lambda params: SGD(params, lr=0.05, momentum=0.9, nesterov=True), "nesterov_step"
    )
    print("✔ nesterov_step: 6 steps equal lsdl_lab.optim.SGD(momentum=0.9, nesterov=True)")


def _adam_cases() -> list:
    gen = torch.Generator().manual_seed(33)
    cases = []
    # (shape, t, lr, beta1, beta2, eps): the first step (m = v = 0, where bias correction
    # matters most), later steps, beta2 = 0.99, a tiny gradient next to eps, and float64.
    for shape, t, lr, b1, b2, eps, scale, dtype in [
        ((5,), 1, 1e-3, 0.9, 0.999, 1e-8, 1.0, torch.float32),
        ((3, 4), 1, 0.1, 0.9, 0.99, 1e-8, 1.0, torch.float32),
        ((5,), 2, 1e-3, 0.9, 0.999, 1e-8, 1.0, torch.float32),
        ((6,), 10, 0.01, 0.8, 0.99, 1e-6, 1.0, torch.float32),
        ((2, 2), 1000, 3e-4, 0.9, 0.95, 1e-8, 1.0, torch.float32),
        ((4,), 3, 0.01, 0.9, 0.999, 1e-3, 1e-4, torch.float32),
        ((3,), 5, 0.02, 0.0, 0.999, 1e-8, 1.0, torch.float64),
    ]:
        w = torch.randn(shape, generator=gen, dtype=dtype)
        g = scale * torch.randn(shape, generator=gen, dtype=dtype)
        if t == 1:
            m, v = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
        else:
            m = scale * torch.randn(shape, generator=gen, dtype=dtype)
            v = (scale * torch.randn(shape, generator=gen, dtype=dtype)) ** 2
        cases.append((w, g, m, v, t, lr, b1, b2, eps))
    return cases


@exercise("lab03.adam_step")
def check_adam_step(student_fn) -> None:
    from .optim import Adam

    check_function(student_fn, adam_step, _adam_cases(), rtol=1e-5, atol=1e-7)

    def step(w, g, state, t):
        m, v = state if state is not None else (torch.zeros_like(w), torch.zeros_like(w))
        w, m, v = student_fn(w, g, m, v, t, 0.1, 0.9, 0.999, 1e-8)
        return w, (m, v)

    _rollout_against(step, lambda params: Adam(params, lr=0.1), "adam_step")
    print("✔ adam_step: 6 steps equal lsdl_lab.optim.Adam(lr=0.1)")
