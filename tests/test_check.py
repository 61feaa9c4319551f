"""Tests of lsdl_lab.check: what passes, what fails, and what the failure says."""

from __future__ import annotations

import re
from collections import namedtuple

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

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


# --- failing: what differs -----------------------------------------------------------------


def test_shape_mismatch():
    message = failure(lambda w, g, v, lr, beta: (w[None], v), name="momentum_step")
    assert "momentum_step does not match the reference on case 1 of 4" in message
    assert "output[0]: shape (1, 5) instead of the expected (5,)" in message


def test_transpose_hint():
    x = torch.arange(6.0).reshape(2, 3)
    with pytest.raises(CheckFailed, match="transpose of the reference"):
        check_function(lambda x: x, lambda x: x.T, [(x,)])


def test_dtype_mismatch():
    message = failure(lambda w, g, v, lr, beta: reference_momentum_step(w.double(), g, v, lr, beta))
    assert "output[0]: dtype float64 instead of the expected float32" in message


def test_value_mismatch_names_case_output_and_index():
    def student(w, g, v, lr, beta):
        w, v = reference_momentum_step(w, g, v, lr, beta)
        w = w.clone()
        w[3] += 0.5
        return w, v

    message = failure(student, name="momentum_step")
    assert "on case 1 of 4" in message
    # The arguments are summarised compactly, with their names and a few values.
    assert re.search(r"w=Tensor\(shape=\(5,\), dtype=float32, \[[-0-9.e, ]+\]\)", message)
    assert "lr=0.1, beta=0.9" in message
    assert "output[0]: 1 of 5 values differ" in message
    assert "is at index (3,)" in message
    assert "expected:" in message and "got:" in message
    assert "hint" not in message


def test_sign_flip_hint():
    message = failure(lambda w, g, v, lr, beta: (w, -reference_momentum_step(w, g, v, lr, beta)[1]))
    # The first output is checked first: w alone is wrong, but not a sign flip.
    assert "output[0]" in message and "opposite sign" not in message

    message = failure(
        lambda w, g, v, lr, beta: (reference_momentum_step(w, g, v, lr, beta)[0], -(beta * v + g))
    )
    assert "output[1]" in message
    assert "exactly the reference with the opposite sign" in message


def test_scale_factor_hint():
    def student(w, g, v, lr, beta):
        v = beta * v + g
        return w - lr * v, 0.5 * v

    message = failure(student)
    assert "output[1]" in message
    assert "the reference times 0.5" in message


def test_scalar_sign_hint():
    with pytest.raises(CheckFailed, match="opposite sign"):
        check_value("loss", -2.5, 2.5)


def test_wrong_tuple_length_and_missing_return():
    message = failure(lambda w, g, v, lr, beta: (w - lr * (beta * v + g),))
    assert "output: a tuple of 1 value instead of 2" in message

    message = failure(lambda w, g, v, lr, beta: reference_momentum_step(w, g, v, lr, beta)[0])
    assert "output: expected a tuple of 2 values, got Tensor(shape=(5,)" in message

    message = failure(lambda w, g, v, lr, beta: None)
    assert "got None" in message and "missing `return`" in message


def test_dict_keys():
    def ref(x):
        return {"m": x, "v": x * x}

    def student(x):
        return {"m": x, "s": x * x}

    with pytest.raises(CheckFailed, match="the keys differ: missing 'v'; unexpected 's'"):
        check_function(student, ref, [(torch.ones(2),)])

    with pytest.raises(CheckFailed, match=r"output\['v'\]: "):
        check_function(lambda x: {"m": x, "v": x}, ref, [(torch.full((2,), 3.0),)])


def test_number_and_array_mismatches():
    with pytest.raises(CheckFailed, match=r"acc: got 0\.8, expected 0\.9 \(difference 0\.1"):
        check_value("acc", 0.8, 0.9)
    with pytest.raises(CheckFailed, match=r"hint: use \.item\(\)"):
        check_value("acc", torch.tensor(0.9), 0.9)
    with pytest.raises(CheckFailed, match="expected a Tensor, got 0.9"):
        check_value("acc", 0.9, torch.tensor(0.9))
    with pytest.raises(CheckFailed, match=r"shape \(3,\) instead of the expected \(2,\)"):
        check_value("a", np.zeros(3), np.zeros(2))
    with pytest.raises(CheckFailed, match="dtype int64 instead of the expected float64"):
        check_value("a", np.zeros(2, dtype=np.int64), np.zeros(2))
    with pytest.raises(CheckFailed, match=r"1 of 2 values differ.*index \(1,\)"):
        check_value("a", np.array([1, 2]), np.array([1, 3]))
    with pytest.raises(CheckFailed, match=r"1 of 3 values differ"):
        check_value("mask", torch.tensor([True, False, True]), torch.tensor([True, True, True]))


def test_check_value_passes(capsys):
    check_value("accuracy", 0.9 + 1e-9, 0.9)
    check_value("norms", torch.ones(3), torch.ones(3))
    assert capsys.readouterr().out.splitlines() == [
        "✔ accuracy matches the expected value",
        "✔ norms matches the expected value",
    ]


def test_nan_handling():
    nan = torch.tensor([1.0, float("nan")])
    with pytest.raises(CheckFailed):
        check_value("x", nan.clone(), nan)
    check_value("x", nan.clone(), nan, equal_nan=True)


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


# --- tolerance ------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    values=st.lists(st.floats(-1e3, 1e3), min_size=1, max_size=8),
    index=st.integers(0, 7),
    sign=st.sampled_from([-1.0, 1.0]),
    rtol=st.sampled_from([1e-5, 1e-3, 0.0]),
    atol=st.sampled_from([1e-6, 1e-3]),
)
def test_tolerance_is_respected(values, index, sign, rtol, atol):
    expected = torch.tensor(values, dtype=torch.float64)
    index %= len(values)
    tolerance = atol + rtol * abs(values[index])

    within = expected.clone()
    within[index] += sign * 0.9 * tolerance
    check_value("x", within, expected, rtol=rtol, atol=atol)

    beyond = expected.clone()
    beyond[index] += sign * 1.1 * tolerance
    with pytest.raises(CheckFailed, match=rf"at index \({index},\)|got "):
        check_value("x", beyond, expected, rtol=rtol, atol=atol)


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


# --- the registry of named checkers -------------------------------------------------------


@pytest.fixture
def registry(monkeypatch):
    monkeypatch.setattr(check, "_CHECKERS", {})


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


def test_registry_errors(registry):
    with pytest.raises(KeyError, match="no checker for exercise 'nope'"):
        check.checker("nope")
    with pytest.raises(TypeError, match="name"):
        check.exercise("")

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


def test_placeholder_message_matches_the_student_tool():
    from lsdl_lab.student import PLACEHOLDER

    assert PLACEHOLDER == f'raise NotImplementedError("{check.PLACEHOLDER_MESSAGE}")'
