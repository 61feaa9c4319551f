"""Tests of lsdl_lab.check.checkers: what passes, how a student's raising function is
reported, that inputs are copied, and bad arguments."""

from __future__ import annotations

from collections import namedtuple

import pytest
import torch

from lsdl_lab import check
from lsdl_lab.check import CheckFailed, check_function, check_value


def reference_momentum_step(w, g, v, lr, beta):
    v = beta * v + g
    return w - lr * v, v


def momentum_cases(n=4, size=5):
    gen = torch.Generator().manual_seed(0)
    return [
        dict(
            w=torch.randn(size, generator=gen),
            g=torch.randn(size, generator=gen),
            v=torch.randn(size, generator=gen),
            lr=0.1,
            beta=0.9,
        )
        for _ in range(n)
    ]


def failure(student, reference=reference_momentum_step, cases=None, **kwargs) -> str:
    with pytest.raises(CheckFailed) as info:
        check_function(student, reference, momentum_cases() if cases is None else cases, **kwargs)
    return str(info.value)


# --- passing -----------------------------------------------------------------------------


def test_equal_functions_pass_and_say_so(capsys):
    def student(w, g, v, lr, beta):
        v = v.mul(beta).add(g)
        return w.sub(v, alpha=lr), v

    check_function(student, reference_momentum_step, momentum_cases(), name="momentum_step")
    assert capsys.readouterr().out.strip() == "✔ momentum_step: all 4 cases match the reference"


def test_case_forms_positional_keyword_and_pair(capsys):
    def ref(x, scale=1.0):
        return x * scale

    cases = [
        (torch.ones(2),),
        {"x": torch.ones(2), "scale": 3.0},
        ((torch.ones(2),), {"scale": 2.0}),
    ]
    check_function(ref, ref, cases)
    assert "all 3 cases" in capsys.readouterr().out


def test_single_case_message(capsys):
    check_function(abs, abs, [(-1,)])
    assert capsys.readouterr().out.strip() == "✔ abs: the 1 case matches the reference"


def test_structured_outputs_pass():
    def ref(x):
        Pair = namedtuple("Pair", "lo hi")
        return {"n": x.numel(), "pair": Pair(x.min(), x.max()), "list": [x.numpy(), None, "s"]}

    check_function(ref, ref, [(torch.arange(5.0),)])


def test_check_value_passes(capsys):
    check_value("accuracy", 0.9 + 1e-9, 0.9)
    check_value("norms", torch.ones(3), torch.ones(3))
    assert capsys.readouterr().out.splitlines() == [
        "✔ accuracy matches the expected value",
        "✔ norms matches the expected value",
    ]


# --- the student's function raising ---------------------------------------------------------


def test_stub_raises_not_implemented_with_instructions():
    def momentum_step(w, g, v, lr, beta):
        raise NotImplementedError("Exercise: write your solution here")

    with pytest.raises(NotImplementedError) as info:
        check_function(momentum_step, reference_momentum_step, momentum_cases())
    assert str(info.value) == (
        "momentum_step is not implemented yet: replace the `raise NotImplementedError` "
        "line with your solution"
    )
    assert not isinstance(info.value, CheckFailed)


def test_bare_stub_and_stub_in_a_helper():
    def helper(x):
        raise NotImplementedError("Exercise: write your solution here")

    def uses_helper(x):
        return helper(x) + 1

    def bare(x):
        raise NotImplementedError

    with pytest.raises(NotImplementedError, match="^bare is not implemented yet"):
        check_function(bare, abs, [(1,)])
    with pytest.raises(NotImplementedError, match=r"^helper \(called by uses_helper\) is not"):
        check_function(uses_helper, abs, [(1,)])


def test_not_implemented_from_elsewhere_is_a_failure():
    def deep():
        raise NotImplementedError("operator not supported for this dtype")

    def student(x):
        return deep()

    with pytest.raises(CheckFailed, match="it raised NotImplementedError: operator not"):
        check_function(student, abs, [(1,)])


def test_other_exceptions_are_chained():
    def student(w, g, v, lr, beta):
        return w @ torch.ones(7), v

    with pytest.raises(CheckFailed) as info:
        check_function(student, reference_momentum_step, momentum_cases())
    assert "on case 1 of 4" in str(info.value)
    assert "it raised RuntimeError" in str(info.value)
    assert isinstance(info.value.__cause__, RuntimeError)


def test_a_failing_reference_is_the_lab_s_fault():
    with pytest.raises(RuntimeError, match="the case is wrong") as info:
        check_function(abs, abs, [("text",)])
    assert isinstance(info.value.__cause__, TypeError)


# --- inputs are copied --------------------------------------------------------------------------


def test_mutating_student_does_not_affect_reference_or_cases():
    def student(w, g, v, lr, beta):
        v.mul_(beta).add_(g)
        w.sub_(lr * v)
        g.zero_()  # corrupt an input the reference also reads
        return w, v

    cases = momentum_cases()
    originals = [{k: (t.clone() if torch.is_tensor(t) else t) for k, t in c.items()} for c in cases]
    check_function(student, reference_momentum_step, cases)  # the in-place student is right
    for case, original in zip(cases, originals, strict=True):
        for key in ("w", "g", "v"):
            assert torch.equal(case[key], original[key])


def test_reference_mutating_does_not_affect_student():
    def reference(x):
        x.add_(1)
        return x

    def student(x):
        return x + 1

    check_function(student, reference, [(torch.zeros(3),)])


def test_non_leaf_and_requires_grad_inputs_are_copied():
    leaf = torch.ones(3, requires_grad=True)
    non_leaf = leaf * 2

    def ref(x, y):
        assert x.requires_grad and y.requires_grad
        (g,) = torch.autograd.grad((x * y).sum(), x)
        return g

    check_function(ref, ref, [(leaf, non_leaf)])
    assert leaf.grad is None


def test_same_random_numbers_for_both_calls():
    def noisy(x):
        return x + torch.randn_like(x)

    check_function(noisy, noisy, [(torch.zeros(4),)] * 3)


# --- bad arguments --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "named"),
    [
        (("not callable", abs, [(1,)]), {}, TypeError, "student"),
        ((abs, None, [(1,)]), {}, TypeError, "reference"),
        ((abs, abs, []), {}, ValueError, "cases"),
        ((abs, abs, 5), {}, TypeError, "cases"),
        ((abs, abs, [(1,), [1]]), {}, TypeError, r"cases\[1\]"),
        ((abs, abs, [(1,)]), {"rtol": -1.0}, ValueError, "rtol"),
        ((abs, abs, [(1,)]), {"atol": float("nan")}, ValueError, "atol"),
    ],
)
def test_bad_arguments(args, kwargs, error, named):
    with pytest.raises(error, match=named):
        check_function(*args, **kwargs)


def test_placeholder_message_matches_the_student_tool():
    from lsdl_lab.student import PLACEHOLDER

    assert PLACEHOLDER == f'raise NotImplementedError("{check.PLACEHOLDER_MESSAGE}")'


def test_with_hints_appends_one_line_per_hint_and_keeps_the_failure():
    from lsdl_lab.check import with_hints

    failure = with_hints(CheckFailed("case 1: got 3, expected 4"), ["off by one", "a sign"])
    assert isinstance(failure, CheckFailed)
    assert str(failure) == "case 1: got 3, expected 4\n  hint: off by one\n  hint: a sign"
    assert str(with_hints(CheckFailed("x"), [])) == "x"


def test_answer_or_none_returns_the_answer_or_none_when_it_raises():
    from lsdl_lab.check import answer_or_none

    assert answer_or_none(lambda a, b: a + b, 2, 3) == 5
    assert answer_or_none(lambda: 1 / 0) is None
