"""Checkers a lab calls: a student's function beside the reference, or a value beside the
expected one, with any difference explained.

A lab marks each exercise's solution the way nbgrader does (``### BEGIN SOLUTION`` …
``### END SOLUTION``); the student version (:mod:`lsdl_lab.student`) replaces it with
``raise NotImplementedError(...)``. The cell that follows calls a checker::

    check.check_function(momentum_step, reference_momentum_step, cases)
    # ✔ momentum_step: all 5 cases match the reference

When the outputs differ, :class:`CheckFailed` says on which case (its arguments,
summarised by :mod:`.summary`), and where and how the output differs
(:mod:`.compare`).
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from .._util import check_nonnegative
from .compare import difference
from .summary import summarise_call

__all__ = [
    "PLACEHOLDER_MESSAGE",
    "CheckFailed",
    "answer_or_none",
    "check_function",
    "check_value",
    "with_hints",
]

# The message lsdl_lab.student writes into each exercise (kept equal by a test).
PLACEHOLDER_MESSAGE = "Exercise: write your solution here"


class CheckFailed(AssertionError):
    """A student's result differs from the reference; the message says where and how."""


def with_hints(failure: CheckFailed, hints: list[str]) -> CheckFailed:
    """``failure`` with a line per hint: what a diagnosis of the student's answers found."""
    return CheckFailed(str(failure) + "".join(f"\n  hint: {h}" for h in hints))


def answer_or_none(fn: Callable, *args):
    """``fn``'s answer, or None when it raises: diagnostics must never mask the failure."""
    try:
        return fn(*args)
    except Exception:
        return None


# ---------------------------------------------------------------------------------------
# Public checkers


def check_function(
    student: Callable,
    reference: Callable,
    cases: Iterable[Any],
    *,
    name: str | None = None,
    rtol: float = 1e-5,
    atol: float = 1e-6,
    equal_nan: bool = False,
) -> None:
    """Call ``student`` and ``reference`` on every case and compare their outputs.

    Each case is a tuple of positional arguments, a dict of keyword arguments, or an
    ``(args_tuple, kwargs_dict)`` pair. Each function gets its own deep copy of the case
    (tensors cloned, ``requires_grad`` kept), so a function that changes its inputs in
    place affects neither the other call nor the caller's cases; both calls start from
    the same random-number state, so functions that draw random numbers can be compared.

    Outputs are compared recursively: tensors and numpy arrays by type, shape, dtype and
    then values (``|got - expected| <= atol + rtol * |expected|``, as ``torch.allclose``);
    numbers the same way; tuples and lists by length, dicts by keys, then item by item.

    Raises :class:`CheckFailed` on the first case that differs or on which the student's
    function raises, and :class:`NotImplementedError` while the exercise still holds
    nbgrader's ``raise NotImplementedError`` stub. Prints one line when all cases match.
    """
    if not callable(student):
        raise TypeError(f"student must be a function, got {type(student).__name__}")
    if not callable(reference):
        raise TypeError(f"reference must be a function, got {type(reference).__name__}")
    if isinstance(cases, (str, bytes, Mapping)) or not isinstance(cases, Iterable):
        raise TypeError(
            f"cases must be a list of cases (tuples of arguments or dicts of keyword "
            f"arguments), got {type(cases).__name__}"
        )
    cases = list(cases)
    if not cases:
        raise ValueError("cases must hold at least one case, got none")
    calls = [_as_call(case, i) for i, case in enumerate(cases)]
    _check_tolerances(rtol, atol)
    name = name or _name_of(student) or _name_of(reference) or "the function"

    for i, (args, kwargs) in enumerate(calls):
        where = f"case {i + 1} of {len(calls)}"
        # fork_rng restores the random state afterwards, so the student's call draws
        # the same random numbers as the reference's did. CUDA's generators only when
        # CUDA is in use: touching them would initialise it (and break forked workers).
        cuda = range(torch.cuda.device_count()) if torch.cuda.is_initialized() else []
        with torch.random.fork_rng(devices=cuda):
            ref_args, ref_kwargs = _fresh_copy((args, kwargs))
            try:
                expected = reference(*ref_args, **ref_kwargs)
            except Exception as exc:
                raise RuntimeError(
                    f"the reference for {name} raised {type(exc).__name__} on {where}; "
                    f"the case is wrong, not the student's code"
                ) from exc

        st_args, st_kwargs = _fresh_copy((args, kwargs))
        try:
            got = student(*st_args, **st_kwargs)
        except NotImplementedError as exc:
            stub = _stub_name(exc, student, name)
            if stub is None:
                raise _failure(name, where, reference, args, kwargs, _raised(exc)) from exc
            # A clean traceback: the student needs the instruction, not the stack.
            raise NotImplementedError(
                f"{stub} is not implemented yet: replace the `raise NotImplementedError` "
                f"line with your solution"
            ) from None
        except Exception as exc:
            raise _failure(name, where, reference, args, kwargs, _raised(exc)) from exc

        found = difference(got, expected, "output", rtol, atol, equal_nan)
        if found is not None:
            raise _failure(name, where, reference, args, kwargs, found) from None

    if len(calls) == 1:
        print(f"✔ {name}: the 1 case matches the reference")
    else:
        print(f"✔ {name}: all {len(calls)} cases match the reference")


def check_value(
    name: str,
    got: Any,
    expected: Any,
    *,
    rtol: float = 1e-5,
    atol: float = 1e-6,
    equal_nan: bool = False,
) -> None:
    """Compare a value a student computed (an accuracy, a tensor of norms…) with the
    expected one, with the same rules and messages as :func:`check_function`."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty string, got {name!r}")
    _check_tolerances(rtol, atol)
    found = difference(got, expected, name, rtol, atol, equal_nan)
    if found is not None:
        raise CheckFailed(f"{name} differs from the expected value\n  {found}")
    print(f"✔ {name} matches the expected value")


# ---------------------------------------------------------------------------------------
# Cases and calls


def _as_call(case: Any, i: int) -> tuple[tuple, dict]:
    if isinstance(case, Mapping):
        return (), dict(case)
    if (
        isinstance(case, tuple)
        and len(case) == 2
        and isinstance(case[0], tuple)
        and isinstance(case[1], Mapping)
    ):
        return case[0], dict(case[1])
    if isinstance(case, tuple):
        return case, {}
    raise TypeError(
        f"cases[{i}] must be a tuple of positional arguments, a dict of keyword arguments "
        f"or an (args, kwargs) pair, got {type(case).__name__}; "
        f"for a single argument x write (x,)"
    )


def _check_tolerances(rtol: float, atol: float) -> None:
    check_nonnegative("rtol", rtol)
    check_nonnegative("atol", atol)


def _fresh_copy(obj: Any, memo: dict | None = None) -> Any:
    """A deep copy in which every tensor is a fresh clone.

    ``copy.deepcopy`` refuses tensors that are not graph leaves, so those are detached
    and cloned here (staying ``requires_grad``); a tensor passed twice stays one tensor.
    """
    memo = {} if memo is None else memo
    if id(obj) in memo:
        return memo[id(obj)]
    if isinstance(obj, torch.Tensor) and not obj.is_leaf:
        memo[id(obj)] = obj.detach().clone().requires_grad_()
        return memo[id(obj)]
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        items = [_fresh_copy(item, memo) for item in obj]
        return type(obj)(items)
    if type(obj) is dict:
        return {key: _fresh_copy(value, memo) for key, value in obj.items()}
    return copy.deepcopy(obj, memo)


def _stub_name(exc: NotImplementedError, student: Callable, name: str) -> str | None:
    """Which function still holds the exercise's stub, or None when ``exc`` comes from
    elsewhere (torch raises NotImplementedError for operators missing for a dtype)."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    code = getattr(inspect.unwrap(getattr(student, "__func__", student)), "__code__", None)
    if tb is not None and tb.tb_frame.f_code is code:
        return name
    if str(exc) == PLACEHOLDER_MESSAGE:
        # The stub of another exercise that the student's function calls.
        helper = tb.tb_frame.f_code.co_name if tb is not None else "a function it calls"
        return f"{helper} (called by {name})"
    return None


def _name_of(fn: Callable) -> str | None:
    return getattr(fn, "__name__", None) or getattr(getattr(fn, "func", None), "__name__", None)


def _raised(exc: BaseException) -> str:
    return f"it raised {type(exc).__name__}: {exc}"


def _failure(
    name: str, where: str, reference: Callable, args: tuple, kwargs: dict, what: str
) -> CheckFailed:
    return CheckFailed(
        f"{name} does not match the reference on {where}\n"
        f"  called with: {summarise_call(reference, args, kwargs)}\n"
        f"  {what}"
    )
