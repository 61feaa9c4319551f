"""Every lab's module in lsdl_lab.exercises registers its own checkers when imported, and
every checker accepts the reference solution that sits beside it.

The labs call ``check.checker("labNN.name")(name)``; the reference ``name`` lives in
``lsdl_lab.exercises.labNN``. Running each checker on its reference catches a checker
that cannot pass (or cannot import what it needs) before a student meets it.
"""

import importlib
import pkgutil

import pytest
import torch

from lsdl_lab import check, exercises

LABS = sorted(info.name for info in pkgutil.iter_modules(exercises.__path__))
for _lab in LABS:
    importlib.import_module(f"lsdl_lab.exercises.{_lab}")
NAMES = check.registered()


def test_every_lab_module_registers_checkers_under_its_own_name():
    assert {"lab01", "lab02", "lab03", "lab04a", "lab04b", "lab05"} <= set(LABS), LABS
    for lab in LABS:
        assert any(name.startswith(f"{lab}.") for name in NAMES), lab
    assert {name.split(".")[0] for name in NAMES} <= set(LABS), NAMES


@pytest.mark.parametrize("name", NAMES)
def test_checker_accepts_its_reference(name, capsys):
    torch.set_num_threads(1)
    lab, fn = name.split(".")
    reference = getattr(importlib.import_module(f"lsdl_lab.exercises.{lab}"), fn)
    check.checker(name)(reference)
    assert "✔" in capsys.readouterr().out
