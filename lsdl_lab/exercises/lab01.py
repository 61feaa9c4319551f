"""Checkers of Lab 1, getting started."""

from __future__ import annotations

import torch
from torch import nn

from ..check import check_function, exercise


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
