"""Tests of lsdl_lab.check.compare, through the checkers: what differs, where, and the hints
that name the common mistakes."""

from __future__ import annotations

import dataclasses
from collections import namedtuple

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lsdl_lab.check import CheckFailed, check_function, check_value
from lsdl_lab.check.compare import difference


def diff(got, expected, rtol=1e-5, atol=1e-6, equal_nan=False):
    return difference(got, expected, "output", rtol, atol, equal_nan)


def momentum_outputs():
    """The (w, v) pair a momentum step returns, as the reference would."""
    gen = torch.Generator().manual_seed(0)
    return torch.randn(5, generator=gen), torch.randn(5, generator=gen)


# --- what differs, and where ----------------------------------------------------------------


def test_equal_values_have_no_difference():
    w, v = momentum_outputs()
    assert diff((w.clone(), v.clone()), (w, v)) is None
    assert diff({"a": [1, 2.0], "b": None}, {"a": [1, 2.0 + 1e-9], "b": None}) is None


def test_shape_mismatch():
    w, v = momentum_outputs()
    found = diff((w[None] + 1, v), (w, v))
    assert found == "output[0]: shape (1, 5) instead of the expected (5,)"


def test_transpose_and_layout_hints():
    x = torch.arange(6.0).reshape(2, 3)
    assert "transpose of the reference" in diff(x, x.T)
    assert "laid out in another shape" in diff(x.reshape(6), x)
    with pytest.raises(CheckFailed, match="transpose of the reference"):
        check_function(lambda x: x, lambda x: x.T, [(x,)])


def test_dtype_mismatch():
    w, v = momentum_outputs()
    found = diff((w.double(), v), (w, v))
    assert found == "output[0]: dtype float64 instead of the expected float32"


def test_value_mismatch_names_the_output_and_index():
    w, v = momentum_outputs()
    wrong = w.clone()
    wrong[3] += 0.5
    found = diff((wrong, v), (w, v))
    assert found.startswith("output[0]: 1 of 5 values differ")
    assert "is at index (3,)" in found
    assert "expected:" in found and "got:" in found
    assert "hint" not in found


def test_sign_flip_hint():
    w, v = momentum_outputs()
    # The first output is checked first: w alone is wrong, but not a sign flip.
    found = diff((w + 1, -v), (w, v))
    assert found.startswith("output[0]") and "opposite sign" not in found
    found = diff((w, -v), (w, v))
    assert found.startswith("output[1]")
    assert "exactly the reference with the opposite sign" in found


def test_scale_factor_hint():
    w, v = momentum_outputs()
    found = diff((w, 0.5 * v), (w, v))
    assert found.startswith("output[1]") and "the reference times 0.5" in found


def test_scalar_sign_hint():
    with pytest.raises(CheckFailed, match="opposite sign"):
        check_value("loss", -2.5, 2.5)


def test_wrong_tuple_length_and_missing_return():
    w, v = momentum_outputs()
    assert diff((w,), (w, v)) == "output: a tuple of 1 value instead of 2"
    assert diff(w, (w, v)).startswith("output: expected a tuple of 2 values, got Tensor(shape=(5,)")
    found = diff(None, (w, v))
    assert "got None" in found and "missing `return`" in found


def test_dataclass_fields_and_named_tuples():
    @dataclasses.dataclass
    class State:
        m: torch.Tensor
        t: int

    Pair = namedtuple("Pair", "lo hi")
    assert diff(State(torch.ones(2), 3), State(torch.ones(2), 4)).startswith("output.t: got 3")
    assert "expected a State" in diff((torch.ones(2), 3), State(torch.ones(2), 3))
    assert diff(Pair(1, 2), Pair(1, 3)).startswith("output.hi: got 2, expected 3")


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


def test_nan_handling():
    nan = torch.tensor([1.0, float("nan")])
    with pytest.raises(CheckFailed):
        check_value("x", nan.clone(), nan)
    check_value("x", nan.clone(), nan, equal_nan=True)


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
