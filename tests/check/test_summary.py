"""Tests of lsdl_lab.check.summary: values and calls summarised in one short line."""

from __future__ import annotations

import numpy as np
import torch

from lsdl_lab.check.summary import plural, preview, summarise_call, summary


def test_tensors_and_arrays_show_shape_dtype_and_first_values():
    x = torch.arange(10.0).reshape(2, 5).requires_grad_()
    assert summary(x) == (
        "Tensor(shape=(2, 5), dtype=float32, requires_grad=True, [0, 1, 2, 3, 4, 5, ...])"
    )
    assert summary(np.arange(3)) == "ndarray(shape=(3,), dtype=int64, [0, 1, 2])"
    assert preview(torch.tensor([0.5, 1e-9])) == "[0.5, 1e-09]"


def test_containers_show_their_first_items_two_levels_deep():
    assert summary([1, 2, 3, 4, 5, 6]) == "[1, 2, 3, 4, ... (6 items)]"
    assert summary((1.0,)) == "(1,)"
    assert summary({"a": [[[1]]]}) == "{'a': [[[1]]]}"
    assert summary([[[1, 2]]]) == "[[[1, 2]]]"
    long = "x" * 100
    assert summary(long) == repr(long)[:57] + "..."


def test_calls_are_summarised_by_parameter_name():
    def step(w, lr, *rest, beta=0.9, **extra):
        pass

    args = (torch.zeros(2), 0.1, 7)
    assert summarise_call(step, args, {"beta": 0.5, "nesterov": True}) == (
        "w=Tensor(shape=(2,), dtype=float32, [0, 0]), lr=0.1, 7, beta=0.5, nesterov=True"
    )
    # arguments that do not fit the signature are still shown
    assert summarise_call(step, (), {"nope": 1}) == "nope=1"
    assert summarise_call(lambda: None, (), {}) == "no arguments"


def test_plural():
    assert plural(1, "value") == "1 value" and plural(3, "value") == "3 values"
