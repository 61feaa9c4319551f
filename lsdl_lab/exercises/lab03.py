"""Checkers of Lab 3, gradient-descent optimizers."""

from __future__ import annotations

import torch

from ..check import CheckFailed, check_function, exercise


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
    from ..optim import SGD

    check_function(student_fn, momentum_step, _momentum_cases(31))

    def step(w, g, buf, t):
        return student_fn(w, g, buf, 0.05, 0.9)

    _rollout_against(step, lambda params: SGD(params, lr=0.05, momentum=0.9), "momentum_step")
    print("✔ momentum_step: 6 steps equal lsdl_lab.optim.SGD(momentum=0.9)")


@exercise("lab03.nesterov_step")
def check_nesterov_step(student_fn) -> None:
    from ..optim import SGD

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
    from ..optim import Adam

    check_function(student_fn, adam_step, _adam_cases(), rtol=1e-5, atol=1e-7)

    def step(w, g, state, t):
        m, v = state if state is not None else (torch.zeros_like(w), torch.zeros_like(w))
        w, m, v = student_fn(w, g, m, v, t, 0.1, 0.9, 0.999, 1e-8)
        return w, (m, v)

    _rollout_against(step, lambda params: Adam(params, lr=0.1), "adam_step")
    print("✔ adam_step: 6 steps equal lsdl_lab.optim.Adam(lr=0.1)")
