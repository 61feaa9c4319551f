"""Tests of lsdl_lab.optim.base: the shared validation (one message format, TypeError for a
wrong type, every flag a bool, found from the constructor), the state helpers, parameter
groups (that every optimizer with a torch.optim namesake has its reference tests:
test_common.py)."""

from __future__ import annotations

import re

import pytest
import torch

from lsdl_lab import optim
from lsdl_lab.optim.base import Optimizer, check_betas


class Toy(Optimizer):
    """A minimal optimizer: w -= lr * g, or + with ``flip``."""

    def __init__(self, params, lr=0.1, flip: bool = False, *, foreach=True):
        super().__init__(params, dict(lr=lr, flip=flip), foreach)

    def update(self, group, params, grads):
        torch._foreach_add_(params, grads, alpha=group["lr"] * (1 if group["flip"] else -1))


def test_a_new_flag_is_checked_without_a_line_of_its_own():
    w = [torch.zeros(2, requires_grad=True)]
    assert Toy.flags() == ["flip", "foreach"]
    with pytest.raises(TypeError, match=r"Invalid flip: 1 \(expected True or False\)"):
        Toy(w, flip=1)
    opt = Toy(w)
    with pytest.raises(TypeError, match="Invalid flip: 'no'"):
        opt.add_param_group(dict(params=[torch.zeros(1, requires_grad=True)], flip="no"))
    assert len(opt.param_groups) == 1


def test_a_flag_of_a_base_class_is_checked_too():
    opt = optim.AdamW([torch.zeros(2, requires_grad=True)])
    assert "decoupled_weight_decay" in optim.AdamW.flags()
    with pytest.raises(TypeError, match="Invalid decoupled_weight_decay: 'yes'"):
        opt.add_param_group(
            dict(params=[torch.zeros(1, requires_grad=True)], decoupled_weight_decay="yes")
        )


def test_messages_say_what_was_expected():
    w = [torch.zeros(2, requires_grad=True)]
    with pytest.raises(TypeError, match=re.escape(
            "Invalid learning rate: '0.1' (expected a finite number >= 0)")):  # fmt: skip
        optim.SGD(w, lr="0.1")
    with pytest.raises(ValueError, match=re.escape(
            "Invalid epsilon value: -1.0 (expected a finite number >= 0)")):  # fmt: skip
        optim.Adam(w, eps=-1.0)
    with pytest.raises(TypeError, match="Invalid betas: 0.9"):
        check_betas(0.9)
    assert check_betas([0.5, 0.0]) == (0.5, 0.0)
    assert optim.Adam(w, betas=[0.8, 0.9]).param_groups[0]["betas"] == (0.8, 0.9)


def test_buffer_returns_one_list_created_once(device):
    p, q = (torch.ones(n, device=device, requires_grad=True) for n in (2, 3))
    opt = Toy([p, q])
    like = [torch.full((2,), 5.0, device=device), torch.full((3,), 6.0, device=device)]
    first = opt.buffer([p, q], "b", like=like)
    assert [x.tolist() for x in first] == [[5.0] * 2, [6.0] * 3]
    like[0].zero_()  # a copy, not the tensor given
    again = opt.buffer([p, q], "b", fill=9.0)
    assert all(a is b for a, b in zip(first, again, strict=True))
    c = opt.buffer([p], "c", fill=2.0)[0]
    assert c.tolist() == [2.0, 2.0] and c.device == p.device  # state lives with its parameter
    assert opt.has_state([p, q], "b") and not opt.has_state([p, q], "c")
    assert opt.count_steps([p]) == [1] and opt.count_steps([p, q]) == [2, 1]


def test_an_invalid_param_group_is_not_kept():
    w = torch.nn.Parameter(torch.zeros(2))
    opt = optim.SGD([w], lr=0.1)
    with pytest.raises(ValueError, match="Invalid learning rate"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(1))], "lr": -1.0})
    with pytest.raises(TypeError, match="Invalid learning rate"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(1))], "lr": "1"})
    assert len(opt.param_groups) == 1


def test_param_group_given_as_a_generator_keeps_its_parameters():
    # {"params": model.parameters()} is a generator, readable once (torch.optim accepts it)
    model = torch.nn.Linear(3, 2)
    opt = optim.Adam([{"params": model.parameters(), "lr": 0.1}])
    assert len(opt.param_groups[0]["params"]) == 2
    opt.add_param_group({"params": (p for p in [torch.zeros(2, requires_grad=True)])})
    assert len(opt.param_groups[1]["params"]) == 1


def test_named_parameters_are_accepted_and_complex_ones_refused():
    model = torch.nn.Linear(3, 2)
    opt = optim.SGD(model.named_parameters(), lr=0.1)
    assert opt.param_groups[0]["param_names"] == ["weight", "bias"]
    z = torch.zeros(2, dtype=torch.complex64, requires_grad=True)
    with pytest.raises(ValueError, match="complex"):
        optim.SGD([("z", z)], lr=0.1)
