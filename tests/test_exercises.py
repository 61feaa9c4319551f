"""Every registered checker accepts the reference solution that sits beside it.

The labs call ``check.checker("labNN.name")(name)``; the reference ``name`` lives in
``lsdl_lab.exercises.labNN``. Running each checker on its reference catches a checker
that cannot pass (or cannot import what it needs) before a student meets it.
"""

import importlib

import pytest
import torch

from lsdl_lab import check

check.checker("lab01.top_k_accuracy")  # imports lsdl_lab.exercises: registers every checker
NAMES = sorted(check._CHECKERS)


def test_every_lab_module_registers_checkers():
    labs = {name.split(".")[0] for name in NAMES}
    assert {"lab01", "lab02", "lab03", "lab04a", "lab04b", "lab05"} <= labs, labs


@pytest.mark.parametrize("name", NAMES)
def test_checker_accepts_its_reference(name):
    torch.set_num_threads(1)
    lab, fn = name.split(".")
    reference = getattr(importlib.import_module(f"lsdl_lab.exercises.{lab}"), fn)
    check.checker(name)(reference)
