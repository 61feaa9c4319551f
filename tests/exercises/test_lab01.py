"""The checkers of Lab 1 reject the usual wrong answers, naming where they differ."""

from __future__ import annotations

import pytest
import torch

from lsdl_lab import check
from lsdl_lab.exercises import lab01


def top_1_whatever_k(logits, labels, k=1):
    return (logits.argmax(dim=1) == labels).float().mean().item()


def count_not_fraction(logits, labels, k=1):
    top = logits.topk(k, dim=1).indices
    return float((top == labels[:, None]).any(dim=1).sum())


def smallest_logits(logits, labels, k=1):
    top = logits.topk(k, dim=1, largest=False).indices
    return (top == labels[:, None]).any(dim=1).float().mean().item()


def as_tensor(logits, labels, k=1):
    top = logits.topk(k, dim=1).indices
    return (top == labels[:, None]).any(dim=1).float().mean()


@pytest.mark.parametrize(
    "wrong,message",
    [
        (top_1_whatever_k, "case 2 of 5"),
        (count_not_fraction, "case 2 of 5"),
        (smallest_logits, "output: got"),
        (as_tensor, r"use \.item\(\)"),
    ],
)
def test_top_k_accuracy_mistakes_are_caught(wrong, message):
    with pytest.raises(check.CheckFailed, match=message):
        check.checker("lab01.top_k_accuracy")(wrong)


def numel_not_bytes(model, states_per_parameter):
    n = sum(p.numel() for p in model.parameters())
    return {"parameters": n, "gradients": n, "optimizer_state": states_per_parameter * n}


def four_bytes_always(model, states_per_parameter):
    n = 4 * sum(p.numel() for p in model.parameters())
    return {"parameters": n, "gradients": n, "optimizer_state": states_per_parameter * n}


def no_gradients(model, states_per_parameter):
    result = lab01.training_state_bytes(model, states_per_parameter)
    del result["gradients"]
    return result


@pytest.mark.parametrize(
    "wrong,message",
    [
        (numel_not_bytes, r"output\['parameters'\]: got 33, expected 132"),
        (four_bytes_always, "case 3 of 4"),  # the float64 convolution
        (no_gradients, "missing 'gradients'"),
    ],
)
def test_training_state_bytes_mistakes_are_caught(wrong, message):
    with pytest.raises(check.CheckFailed, match=message):
        check.checker("lab01.training_state_bytes")(wrong)


def test_training_state_bytes_counts_each_dtype_s_bytes():
    model = torch.nn.Linear(5, 5).half()  # 30 parameters of 2 bytes
    assert lab01.training_state_bytes(model, 2) == {
        "parameters": 60,
        "gradients": 60,
        "optimizer_state": 120,
    }
