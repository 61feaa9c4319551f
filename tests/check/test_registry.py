"""Tests of lsdl_lab.check.registry: checkers register themselves by name, and a name not
registered says which module to import."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from lsdl_lab import check
from lsdl_lab.check import CheckFailed, check_function
from lsdl_lab.check import registry as registry_module

# --- the registry of named checkers -------------------------------------------------------


@pytest.fixture
def registry(monkeypatch):
    """An empty registry for the test (the module's own dict, so check.exercise fills it)."""
    monkeypatch.setattr(registry_module, "_CHECKERS", {})


def test_registered_softmax_checker(registry, capsys):
    @check.exercise("softmax")
    def check_softmax(student_fn):
        gen = torch.Generator().manual_seed(0)
        cases = [(torch.randn(4, 3, generator=gen) * scale,) for scale in (1.0, 10.0, 100.0)]
        check_function(student_fn, lambda x: torch.softmax(x, dim=-1), cases, name="softmax")

    def stable_softmax(x):
        z = (x - x.max(dim=-1, keepdim=True).values).exp()
        return z / z.sum(dim=-1, keepdim=True)

    def naive_softmax(x):  # overflows for large logits: exp(100 * x) is inf
        return x.exp() / x.exp().sum(dim=-1, keepdim=True)

    assert check.checker("softmax") is check_softmax
    check.checker("softmax")(stable_softmax)
    assert "✔ softmax: all 3 cases match the reference" in capsys.readouterr().out
    with pytest.raises(CheckFailed, match="case 3 of 3"):
        check.checker("softmax")(naive_softmax)


def test_an_unregistered_checker_names_the_module_to_import(registry):
    with pytest.raises(
        LookupError,
        match=r"^no checker 'lab01.top_k_accuracy' is registered; "
        r"import lsdl_lab.exercises.lab01 first \(registered now: none\)$",
    ):
        check.checker("lab01.top_k_accuracy")

    @check.exercise("lab02.other")
    def other(student_fn):
        pass

    with pytest.raises(LookupError, match="import the module that defines it first") as info:
        check.checker("nope")
    assert "registered now: lab02.other" in str(info.value)
    assert check.registered() == ["lab02.other"]


def test_registry_errors(registry):
    for bad in ("", None, 3):
        with pytest.raises(TypeError, match="Invalid name"):
            check.exercise(bad)
        with pytest.raises(TypeError, match="Invalid name"):
            check.checker(bad)
    with pytest.raises(TypeError, match="must decorate a function"):
        check.exercise("x")(42)

    @check.exercise("twice")
    def first(student_fn):
        pass

    # Running the defining cell again redefines the same checker: allowed.
    @check.exercise("twice")
    def first(student_fn):  # noqa: F811
        pass

    with pytest.raises(ValueError, match="already has a checker"):

        @check.exercise("twice")
        def second(student_fn):
            pass


def test_check_imports_no_exercises_and_a_lab_module_registers_its_own():
    """Importing lsdl_lab.check registers nothing; importing a lab's module registers that
    lab's checkers and no other lab's (checked in a fresh interpreter)."""
    code = (
        "import sys\n"
        "from lsdl_lab import check\n"
        "assert not any(m.startswith('lsdl_lab.exercises') for m in sys.modules), sys.modules\n"
        "assert check.registered() == []\n"
        "from lsdl_lab.exercises import lab01\n"
        "print(' '.join(check.registered()))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    ).stdout.split()
    assert out == ["lab01.top_k_accuracy", "lab01.training_state_bytes"]
