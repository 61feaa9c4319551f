"""What the memory tests of the factored optimizers (Adafactor, SM3) share: the shapes and
bytes of one parameter's state after one step."""

from __future__ import annotations

import torch


def stepped(opt: torch.optim.Optimizer, params: list[torch.Tensor]) -> torch.optim.Optimizer:
    """``opt`` after one step on fixed random gradients (drawn on the CPU, moved to each
    parameter's device; its state then exists)."""
    for p in params:
        gen = torch.Generator().manual_seed(p.numel())
        p.grad = torch.randn(p.shape, generator=gen).to(p.device)
    opt.step()
    return opt


def state_shapes(opt: torch.optim.Optimizer, p: torch.Tensor) -> dict[str, tuple[int, ...]]:
    """The shape of each state tensor of ``p`` (the step count excluded)."""
    return {
        k: tuple(v.shape) for k, v in opt.state[p].items() if torch.is_tensor(v) and k != "step"
    }


def state_bytes(opt: torch.optim.Optimizer, p: torch.Tensor) -> int:
    """The bytes of ``p``'s state tensors (the step count excluded)."""
    return sum(
        v.numel() * v.element_size()
        for k, v in opt.state[p].items()
        if torch.is_tensor(v) and k != "step"
    )
